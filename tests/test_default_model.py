"""The shipped default model: it loads (with its MTP head) and writes real text; its tokenizer
and held-out figures are reproduced by the build's own code when this is the Python version
that built it (the training text is Python's documentation, which changes between versions).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from hybridjax.default_model import WEIGHTS_DIR, default_model
from hybridjax.default_model import build, corpus
from hybridjax.generate import generate

ROOT = Path(__file__).resolve().parent.parent
BUILD = json.loads((WEIGHTS_DIR / "build.json").read_text())
SAME_PYTHON = sys.version.split()[0] == BUILD["python"]


def test_the_shipped_model_is_the_real_layout_with_an_mtp_head():
    cfg, params, tok = default_model()
    assert cfg.family == "qwen3_5" and cfg.layer_types.count("linear_attention") == 3 * cfg.layer_types.count("full_attention")
    assert params.mtp is not None and tok.vocab_size == cfg.vocab_size == build.VOCAB
    assert sum(x.size for x in jax.tree_util.tree_leaves(params)) == BUILD["params"]
    assert (WEIGHTS_DIR / "model.safetensors").stat().st_size < 40 * 2**20
    # It learned something: held-out loss well under the unigram baseline (recorded by the build).
    assert BUILD["held_out_loss"] < 0.8 * BUILD["unigram_loss"]


def test_converted_it_loads_mapped_from_its_files(tmp_path):
    """`hybridjax convert` writes one file per array and a load maps them, no copy (on this JAX line
    too: the GPU image's): each param's buffer lies in a mapping of its own file, equal to the HF load.
    (tests/test_conversion.py has the rest, on the 3.11 line.)"""
    from hybridjax import conversion
    from hybridjax.conversion.checkpoint import CheckpointReader
    from hybridjax.conversion.hf import flat_leaves
    from hybridjax.conversion.mapped import shard_file
    from mapped_helpers import mapped_files

    conversion.convert_hf(WEIGHTS_DIR, tmp_path / "ck", dtype="float32")
    reader = CheckpointReader(tmp_path / "ck")
    leaves = flat_leaves(reader.restore())
    assert reader.counts == {"mapped": len(leaves), "restored": 0}
    for path, x in leaves.items():
        assert mapped_files(x) == {str(shard_file(reader.params_dir / path, x.ndim))}, path
    want = flat_leaves(default_model()[1])
    assert leaves.keys() == want.keys()
    for path, x in leaves.items():
        assert (np.asarray(x) == np.asarray(want[path])).all(), path


def test_it_writes_docstring_english():
    """Not a quality bar, a sanity one: the greedy answer is English made of the corpus's words
    (a random model of this vocabulary emits token soup)."""
    cfg, params, tok = default_model()
    prompt = tok.encode_chat([{"role": "user", "content": "What does json.dumps do?"}])
    out = generate(params, cfg, [prompt], max_new_tokens=40, stop_ids=tok.eos_token_ids, max_len=128)
    text = tok.decode(out.token_lists()[0], skip_special_tokens=True)
    words = re.findall(r"[A-Za-z]+", text)
    common = {"the", "a", "an", "is", "of", "to", "and", "if", "or", "return", "returns", "string", "object", "value"}
    assert len(words) >= 8 and sum(w.lower() in common for w in words) >= 3, text


def test_corpus_is_deterministic():
    docs = corpus.documents()
    assert corpus.fingerprint(docs) == corpus.fingerprint(corpus.documents())
    assert 0 < sum(corpus.held_out(d["name"]) for d in docs) < 0.1 * len(docs)


# The build's own entry point, in a fresh process: the corpus depends on the process it is
# made in (one signature's default is the repr of the live logging handlers; pytest replaces
# sys.unraisablehook and threading.excepthook), so it is reproduced the way the build made it.
REPRODUCE = """
import json, sys, jax
from hybridjax import train
from hybridjax.default_model import WEIGHTS_DIR, build, corpus, default_model
docs = corpus.documents()
# One signature's default is sys.executable (platform.architecture): put back the build's path,
# so a checkout anywhere reproduces the build's text exactly.
docs = json.loads(json.dumps(docs).replace(json.dumps(sys.executable)[1:-1], json.dumps(EXECUTABLE)[1:-1]))
train_ex = corpus.examples([d for d in docs if not corpus.held_out(d["name"])])
eval_ex = corpus.examples([d for d in docs if corpus.held_out(d["name"])])
tok = build.train_tokenizer(build._tokenizer_texts(train_ex))
shipped = json.loads((WEIGHTS_DIR / "tokenizer.json").read_text())
cfg, params, tokenizer = default_model()
e_ids, e_flags = train.token_stream(tokenizer, eval_ex)
b = train.Batches(e_ids, e_flags, 1, build.SEQ_LEN, shift=False)
terms = jax.jit(lambda p, batch: train.loss_terms(p, batch, cfg))
nats = sum(float(terms(params, {"tokens": b.tokens[i:i + 1], "mask": b.mask[i:i + 1]})["ce"]) for i in range(len(b.tokens)))
print("RESULT", json.dumps({"fingerprint": corpus.fingerprint(docs), "held_out_tokens": len(e_ids),
      "same_tokenizer": json.loads(tok.to_str())["model"] == shipped["model"], "loss": nats / float(b.mask.sum())}))
"""


@pytest.mark.skipif(not SAME_PYTHON, reason=f"the weights were built with Python {BUILD['python']}")
def test_build_reproduces_the_data_tokenizer_and_held_out_loss():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    script = f"EXECUTABLE = {BUILD['executable']!r}\n" + REPRODUCE
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=1200)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    got = json.loads(line[len("RESULT "):])
    assert got["fingerprint"] == BUILD["corpus_sha256"]
    assert got["held_out_tokens"] == BUILD["tokens"]["held_out"]
    assert got["same_tokenizer"]  # the same vocabulary and merges
    # The shipped weights' held-out loss, recomputed: deterministic float32 on the same windows.
    assert abs(got["loss"] - BUILD["held_out_loss"]) < 1e-4 * BUILD["held_out_loss"], got["loss"]
