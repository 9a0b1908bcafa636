"""`hybridjax convert`: HF safetensors <-> hybridjax checkpoints (hybridjax.conversion.cli), with
the model's own logits for --verify."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def _jitted_forward():
    import jax

    import hybridjax

    return jax.jit(hybridjax.forward, static_argnames=("cfg",))


def model_logits(cfg, params, tokens):
    """float32 logits [1, T, vocab] on tokens [1, T] from an empty cache (convert --verify)."""
    import numpy as np

    import hybridjax

    cache = hybridjax.reserve(hybridjax.init_cache(cfg, 1, tokens.shape[1]), tokens.shape[1])
    logits, _ = _jitted_forward()(params, tokens, cache, cfg)
    return np.asarray(logits, np.float32)


def add_convert(sub) -> None:
    from hybridjax.conversion import cli as convert_cli

    p = sub.add_parser("convert", help="convert HF safetensors <-> hybridjax checkpoints")
    convert_cli.add_arguments(p)
    p.set_defaults(func=functools.partial(convert_cli.run, logits_fn=model_logits))
