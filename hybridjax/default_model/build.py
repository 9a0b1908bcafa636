"""Build the embedded default model: `python -m hybridjax.default_model.build [--out DIR]`.

Same data, same seed, same result (for one Python version, whose docs are the data):
  1. the corpus (corpus.py): pydoc topics and standard-library docstrings, as text and chat
     pairs; ~3% of documents (by a hash of their name) held out;
  2. a byte-level BPE tokenizer trained on the training text with `tokenizers` (VOCAB tokens,
     Qwen's special tokens, a ChatML template);
  3. a small Qwen3.5-layout hybrid (Gated DeltaNet 3 : 1 gated attention) with an MTP head,
     trained with hybridjax.train (AdamW, warm-up + cosine) for STEPS steps;
  4. the held-out loss and bits per byte beside a unigram baseline, written to build.json;
  5. an HF-layout directory: config.json, model.safetensors, tokenizer files, build.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from hybridjax.default_model import corpus

VOCAB = 4096
SEED = 0
SEQ_LEN = 256
BATCH = 16
STEPS = 400
LR = 2e-3
MTP_WEIGHT = 0.3
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 8,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "mtp_num_hidden_layers": 1,
    "bos_token_id": None,
    "eos_token_id": 2,  # <|im_end|>
    "pad_token_id": 0,
    "dtype": "float32",
}


def train_tokenizer(texts: list[str]):
    """Byte-level BPE over the training text; ids 0, 1, 2 are the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def make_tokenizer(backend):
    from hybridjax.tokenizer import CHATML_TEMPLATE, Tokenizer

    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None}
    return Tokenizer(backend, CHATML_TEMPLATE, special, [backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")])


def _tokenizer_texts(examples: list[dict]) -> list[str]:
    return [e["text"] if "text" in e else "\n".join(m["content"] for m in e["messages"]) for e in examples]


def token_bytes(tok) -> np.ndarray:
    """UTF-8 bytes each token id stands for (special tokens: their literal text)."""
    return np.asarray([len(tok.decode([i]).encode()) for i in range(tok.vocab_size)], np.float64)


def unigram_nats(train_ids, train_flags, eval_ids, eval_flags, vocab: int) -> float:
    """Held-out nats per counted token under add-one-smoothed unigram frequencies of the training targets."""
    counts = np.bincount(train_ids[train_flags > 0], minlength=vocab) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-(logp[eval_ids] * eval_flags).sum() / eval_flags.sum())


def build(out: Path, work: Path, steps: int = STEPS, resume: bool = False, progress: bool = True) -> dict:
    import jax

    import hybridjax
    from hybridjax import train
    from hybridjax.config import config_from_dict

    t_start, cpu_start = time.time(), time.process_time()
    docs = corpus.documents()
    train_docs = [d for d in docs if not corpus.held_out(d["name"])]
    eval_docs = [d for d in docs if corpus.held_out(d["name"])]
    train_ex, eval_ex = corpus.examples(train_docs), corpus.examples(eval_docs)
    tok = make_tokenizer(train_tokenizer(_tokenizer_texts(train_ex)))
    ids, flags = train.token_stream(tok, train_ex)
    e_ids, e_flags = train.token_stream(tok, eval_ex)
    # Fixed window offsets (shift=False): the shipped weights were trained so; documents start
    # anywhere in a window, so positions vary without the shift.
    batches = train.Batches(ids, flags, BATCH, SEQ_LEN, seed=SEED, shift=False)

    cfg = config_from_dict(CONFIG)
    params = train.fresh_params(cfg, SEED, mtp=True)
    tc = train.TrainConfig(lr=LR, steps=steps, warmup=min(50, steps // 10), mtp_weight=MTP_WEIGHT)
    state = train.init_state(params, tc, seed=SEED)
    work.mkdir(parents=True, exist_ok=True)
    if resume and train.latest_step(work / "state") is not None:
        state, _ = train.restore_state(work / "state", like=state)
    elif (work / "metrics.jsonl").exists():
        (work / "metrics.jsonl").unlink()
    step_fn = train.make_train_step(cfg, tc)
    t_train = time.time()
    state, history = train.fit(step_fn, state, batches, steps, metrics_path=work / "metrics.jsonl",
                               checkpoint_dir=work / "state", save_every=50, log_every=10, progress=progress)
    train_s = time.time() - t_train

    # Ship bfloat16 weights (gates float32); evaluate exactly what ships, read back as float32.
    shipped = hybridjax.params.cast_params(hybridjax.params.cast_params(state.params, "bfloat16"), "float32")
    report = evaluate(shipped, cfg, tok, ids, flags, e_ids, e_flags)
    report.update(
        python=sys.version.split()[0], executable=sys.executable, platform=platform.platform(), corpus_sha256=corpus.fingerprint(docs),
        documents={"train": len(train_docs), "held_out": len(eval_docs)},
        tokens={"train": int(len(ids)), "held_out": int(len(e_ids)), "train_counted": int(flags.sum())},
        steps=steps, batch=BATCH, seq_len=SEQ_LEN, lr=LR, seed=SEED, mtp_weight=MTP_WEIGHT,
        params=int(sum(x.size for x in jax.tree_util.tree_leaves(state.params))),
        final_train_loss=history[-1]["loss"] if history else None,
        train_wall_s=round(train_s, 1), total_wall_s=round(time.time() - t_start, 1),
        process_cpu_s=round(time.process_time() - cpu_start, 1), load_average=os.getloadavg(),
    )
    export(hybridjax.params.cast_params(state.params, "bfloat16"), cfg, tok, out, report)
    return report


def evaluate(params, cfg, tok, ids, flags, e_ids, e_flags) -> dict:
    """Held-out loss (nats per counted token), bits per byte, and the unigram baseline's."""
    import jax

    from hybridjax import train

    b = train.Batches(e_ids, e_flags, 1, SEQ_LEN, shift=False)
    terms = jax.jit(lambda p, batch: train.loss_terms(p, batch, cfg, mtp=True))
    nats = mtp_nats = counted = nbytes = 0.0
    per_token = token_bytes(tok)
    for i in range(len(b.tokens)):  # every window once, in order
        batch = {"tokens": b.tokens[i : i + 1], "mask": b.mask[i : i + 1]}
        t = terms(params, batch)
        nats += float(t["ce"])
        mtp_nats += float(t["mtp"])
        counted += float(batch["mask"].sum())
        nbytes += float((per_token[batch["tokens"][:, 1:]] * batch["mask"]).sum())
    n_rows = len(b.tokens)
    covered = e_ids[: n_rows * SEQ_LEN + 1]
    cov_flags = e_flags[1 : n_rows * SEQ_LEN + 1]
    uni = unigram_nats(ids[1:], flags[1:], covered[1:], cov_flags, cfg.vocab_size)
    per_byte = counted / nbytes / math.log(2)
    return {
        "held_out_loss": nats / counted, "held_out_bits_per_byte": nats / counted * per_byte,
        "held_out_mtp_loss": mtp_nats / max(counted, 1.0),
        "unigram_loss": uni, "unigram_bits_per_byte": uni * per_byte,
        "held_out_counted_tokens": int(counted), "held_out_bytes": int(nbytes),
    }


def export(params, cfg, tok, out: Path, report: dict) -> None:
    """An HF-layout directory that hybridjax.load (and transformers, for the main model) read."""
    import shutil

    import hybridjax
    from hybridjax.tokenizer import save_tokenizer

    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    hybridjax.save_hf(params, cfg, tmp)
    (tmp / "config.json").write_text(json.dumps({**CONFIG, "dtype": "bfloat16"}, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "pad_token_id": 0}, indent=2) + "\n")
    save_tokenizer(tok, tmp)
    (tmp / "build.json").write_text(json.dumps(report, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "weights",
                   help="where the HF-layout model goes (default: the package's weights/)")
    p.add_argument("--work", type=Path, default=Path("default_model_build"),
                   help="training checkpoints and metrics.jsonl (default: ./default_model_build)")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --work")
    args = p.parse_args(argv)
    report = build(args.out, args.work, steps=args.steps, resume=args.resume)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
