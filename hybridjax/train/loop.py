"""The training loop: steps over indexed batches, a tqdm bar with loss and tokens/s, a
metrics.jsonl line per logged step, and orbax checkpoints that a resumed run continues from.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import jax

from hybridjax.train.checkpoint import save_state
from hybridjax.train.data import Batches
from hybridjax.train.step import TrainState


def fit(
    train_step: Callable,
    state: TrainState,
    batches: Batches,
    steps: int,
    *,
    metrics_path: str | Path | None = None,
    checkpoint_dir: str | Path | None = None,
    save_every: int = 0,
    log_every: int = 1,
    progress: bool = True,
    meta: dict | None = None,
) -> tuple[TrainState, list[dict]]:
    """Run until `state.step == steps`, starting from batch `state.step` (the data position).

    Returns the final state and the logged metrics (dicts with step, loss, mtp_loss, grad_norm,
    tokens, lr, tokens_per_s, elapsed_s). Checkpoints every `save_every` steps and at the end
    when `checkpoint_dir` is set.
    """
    from tqdm.auto import tqdm

    start = int(state.step)
    history = []
    out = open(metrics_path, "a") if metrics_path else None
    bar = tqdm(total=steps, initial=start, disable=not progress, unit="step", dynamic_ncols=True)
    t0 = last = time.perf_counter()
    tokens_since = 0
    try:
        for i in range(start, steps):
            state, m = train_step(state, batches[i])
            tokens_since += batches.batch_size * batches.seq_len
            step = i + 1
            if step % log_every == 0 or step == steps:
                m = {k: float(v) for k, v in jax.device_get(m).items()}  # waits for the step
                now = time.perf_counter()
                rec = {"step": step, **m, "tokens_per_s": tokens_since / max(now - last, 1e-9),
                       "elapsed_s": now - t0}
                last, tokens_since = now, 0
                history.append(rec)
                if out:
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}")
            bar.update(1)
            if checkpoint_dir and (save_every and step % save_every == 0 or step == steps):
                save_state(checkpoint_dir, state, data_position=step, meta=meta)
    finally:
        bar.close()
        if out:
            out.close()
    return state, history

