"""Per-token grammar mask cost on this CPU: llguidance vs xgrammar, one JSON schema, two vocabularies.

    python benchmarks/bench_grammar_mask.py [--tokenizer PATH ...] [--build-qwen-size DIR] [--repeats 5]

For each tokenizer (default: the embedded default model's 4096-token one, plus any `--tokenizer`
tokenizer.json) and each library, compiles the schema below (timed), then walks a valid instance
token by token: computes the next-token bitmask (timed) and consumes the token. Reports the
grammar compile time and the per-token mask time (median and 90th percentile over every token of
every repeat). `--build-qwen-size DIR` first trains a byte-level BPE tokenizer of Qwen's size
(151,643 tokens) on the Python sources of this environment (offline; ~10 min on 2 cores) and adds it.
This is what hybridjax.grammar's choice of llguidance rests on (README, "Structured outputs").
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"],
            "address": {"city": "London", "zip": "W1"}}


def build_qwen_size(out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files, size = [], 0
    for f in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "..", "**", "*.py"), recursive=True)):
        files.append(f)
        size += os.path.getsize(f)
        if size > 60e6:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=151643, min_frequency=1, special_tokens=["<|endoftext|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def bench_llguidance(tok_json: str, vocab: int, eos: int, ids: list[int], repeats: int):
    import llguidance as ll

    t0 = time.perf_counter()
    lt = ll.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = ll.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    m = ll.LLMatcher(lt, grammar, log_level=0)
    t_compile = time.perf_counter() - t0
    bits = np.zeros(((vocab + 31) // 32,), np.int32)
    times = []
    for _ in range(repeats):
        m = ll.LLMatcher(lt, grammar, log_level=0)
        for t in ids:
            s = time.perf_counter()
            m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            times.append(time.perf_counter() - s)
            assert (bits[t // 32] >> (t % 32)) & 1, "the instance's token is not allowed"
            assert m.consume_token(t)
    return t_tok, t_compile, times


def bench_xgrammar(tok_json: str, vocab: int, eos: int, ids: list[int], repeats: int):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok_json))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    t_compile = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for _ in range(repeats):
        m = xgr.GrammarMatcher(compiled)
        for t in ids:
            s = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - s)
            assert m.accept_token(t), "the instance's token is not accepted"
    return t_tok, t_compile, times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", action="append", default=[], help="more tokenizer.json files")
    ap.add_argument("--build-qwen-size", default=None, help="train a 151,643-token BPE tokenizer into this directory")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer

    paths = [str(Path(__file__).resolve().parents[1] / "hybridjax" / "default_model" / "weights" / "tokenizer.json")]
    if args.build_qwen_size:
        paths.append(str(build_qwen_size(Path(args.build_qwen_size))))
    paths += args.tokenizer
    text = json.dumps(INSTANCE, separators=(",", ":"))
    print(f"load average: {open('/proc/loadavg').read().strip()}")
    print("| vocabulary | library | tokenizer setup s | schema compile ms | mask per token µs (median) | p90 µs |")
    print("|---|---|---|---|---|---|")
    for p in paths:
        tok_json = Path(p).read_text()
        backend = Tokenizer.from_str(tok_json)
        vocab = backend.get_vocab_size(with_added_tokens=True)
        eos = next((backend.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>") if backend.token_to_id(t) is not None), 0)
        ids = backend.encode(text, add_special_tokens=False).ids
        for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            t_tok, t_compile, times = fn(tok_json, vocab, eos, ids, args.repeats)
            us = np.asarray(times) * 1e6
            print(f"| {vocab} | {name} | {t_tok:.2f} | {t_compile * 1e3:.1f} | {statistics.median(us):.1f} | "
                  f"{np.percentile(us, 90):.1f} |", flush=True)
    print(f"load average: {open('/proc/loadavg').read().strip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
