"""Training-step throughput and peak memory: hybridjax (optax AdamW, jitted donating step)
against transformers + torch (torch.optim.AdamW), same model, same batch, float32.

    python benchmarks/bench_train.py [--hidden 256] [--layers 8] [--vocab 4096] [--batch 8]
                                     [--seq-len 256] [--steps 5] [--rounds 2]

The model is a random Qwen3.5-layout hybrid (Gated DeltaNet 3 : 1 gated attention) made by
transformers and saved once; hybridjax loads the same weights. Both sides: next-token
cross-entropy over every token, global-norm clipping at 1.0, AdamW (lr 1e-4, betas 0.9 / 0.95,
weight decay 0.1), one optimizer step per batch. torch runs its own chunked delta rule (no
flash-linear-attention on CPU); hybridjax its chunked XLA forward and custom-VJP backward.

Each side runs in its own subprocess (so its peak RSS is its own), alternating for `--rounds`
rounds; the table gives the best tokens/s of each side and the ratio hybridjax / torch.
Peak memory is the process's max RSS (weights, optimizer state, activations, runtime).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_model(out: Path, a) -> None:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    heads = max(a.hidden // 64, 1)
    cfg = Qwen3_5TextConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=64,
        linear_num_key_heads=max(heads // 2, 1), linear_num_value_heads=heads, linear_key_head_dim=64,
        linear_value_head_dim=64, tie_word_embeddings=True, max_position_embeddings=4096,
    )
    Qwen3_5ForCausalLM(cfg).save_pretrained(out)


def batch(a, vocab):
    import numpy as np

    return np.random.default_rng(0).integers(0, vocab, (a.batch, a.seq_len + 1)).astype("int32")


def run_jax(model_dir: Path, a) -> dict:
    import jax
    import numpy as np

    import hybridjax
    from hybridjax.train import TrainConfig, init_state, make_train_step

    cfg, params = hybridjax.load_hf(model_dir, dtype="float32")
    tc = TrainConfig(lr=1e-4, steps=1000, warmup=0, weight_decay=0.1, b1=0.9, b2=0.95, clip_norm=1.0)
    state = init_state(params, tc)
    del params
    step = make_train_step(cfg, tc)
    b = {"tokens": batch(a, cfg.vocab_size), "mask": np.ones((a.batch, a.seq_len), np.float32)}
    t = time.perf_counter()
    state, m = step(state, b)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        state, m = step(state, b)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    return {"side": "hybridjax", "step_s": min(times), "first_step_s": compile_s, "loss": float(m["loss"])}


def run_torch(model_dir: Path, a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95))
    tokens = torch.as_tensor(batch(a, model.config.vocab_size), dtype=torch.long)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=tokens[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss)

    t = time.perf_counter()
    step()
    first = time.perf_counter() - t
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t)
    return {"side": "torch", "step_s": min(times), "first_step_s": first, "loss": loss,
            "threads": torch.get_num_threads()}


def child(a) -> None:
    out = (run_jax if a.side == "jax" else run_torch)(Path(a.model_dir), a)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(out))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5, help="timed steps per run (after one warm-up step)")
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each side")
    p.add_argument("--side", choices=["jax", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.side:
        child(a)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        make_model(model_dir, a)
        common = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in ("hidden", "layers", "vocab", "batch", "seq_len", "steps")]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        results = {"hybridjax": [], "torch": []}
        for _ in range(a.rounds):
            for side in ("jax", "torch"):
                cmd = [sys.executable, __file__, "--side", side, "--model-dir", str(model_dir), *common]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                    return 1
                r = json.loads(line[len("RESULT "):])
                results[r["side"]].append(r)
    tokens = a.batch * a.seq_len
    best = {k: min(v, key=lambda r: r["step_s"]) for k, v in results.items()}
    print(f"train step, float32, batch {a.batch} x {a.seq_len} tokens, hidden {a.hidden}, {a.layers} layers, "
          f"vocab {a.vocab}; best of {a.steps} steps x {a.rounds} rounds; load average {os.getloadavg()[0]:.2f}")
    print(f"{'':12} {'step (s)':>9} {'tokens/s':>9} {'peak RSS (MB)':>14} {'first step (s)':>15} {'loss':>8}")
    for k in ("hybridjax", "torch"):
        r = best[k]
        peak = max(x["peak_rss_mb"] for x in results[k])
        print(f"{k:12} {r['step_s']:9.3f} {tokens / r['step_s']:9.0f} {peak:14.0f} {r['first_step_s']:15.1f} {r['loss']:8.4f}")
    ratio = best["torch"]["step_s"] / best["hybridjax"]["step_s"]
    mem = max(x["peak_rss_mb"] for x in results["hybridjax"]) / max(x["peak_rss_mb"] for x in results["torch"])
    print(f"hybridjax / torch: {ratio:.2f}x tokens/s, {mem:.2f}x peak memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
