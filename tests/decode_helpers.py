"""Decoding one token at a time through `hybridjax.forward`, for the CPU kernel tests (the kernel
serves the one-row decode steps; which path it takes is fixed when the forward is traced)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import hybridjax


def decode_logits(params, cfg, prompt, steps):
    """Greedy decode `steps` tokens one forward at a time; returns the [steps, vocab] logits
    (prefill of the prompt through XLA, then one-token steps: the kernel's calls)."""
    fwd = jax.jit(functools.partial(hybridjax.forward, cfg=cfg))  # fresh: traced under this env
    cache = hybridjax.init_cache(cfg, 1, 64, capacity=64)
    logits, cache = fwd(params, jnp.asarray([prompt], jnp.int32), cache)
    out = []
    tok = int(jnp.argmax(logits[0, -1]))
    for _ in range(steps):
        logits, cache = fwd(params, jnp.asarray([[tok]], jnp.int32), cache)
        out.append(np.asarray(logits[0, -1]))
        tok = int(np.argmax(out[-1]))
    return np.stack(out)
