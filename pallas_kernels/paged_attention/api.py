"""The one public entry point for paged attention.

`paged_attention(q, k_pages, v_pages, page_table, q_pos, *, scale=None, implementation=None)`

Shapes: q [B, T, Hq, Dh] (T new queries per row); k_pages, v_pages [P, S, Hkv, Dh] (the pool:
P pages of S tokens, shared by every row); page_table [B, Np] int32, the pages of row b in
order (key s of row b is at page_table[b, s // S], offset s % S; entries past a row's last
page may hold anything, ids >= P included: they are never visible); q_pos [B, T] int32, each
query's absolute position: key s is visible to it iff s <= q_pos. Hq % Hkv == 0 (query head h
reads kv head h // (Hq // Hkv)). Softmax in float32. Returns [B, T, Hq, Dh] in q's dtype.

Implementations (`IMPLEMENTATIONS`):
  "reference"  gather everything, plain softmax (reference.py);
  "xla"        online softmax over blocks of pages in a fori_loop (xla.py);
  "pallas"     the Pallas kernel (pallas.py): compiled Triton on GPU, the Pallas interpreter on
               CPU; needs S and Dh powers of two >= 16, any T (tuned for decode);
  None         "pallas" when lowered for a GPU (CUDA / ROCm) with T <= MAX_DECODE_QUERIES and
               shapes the kernel takes, "xla" otherwise (CPU, prefill chunks).
The GPU/CPU choices follow the platform the computation is lowered for
(`jax.lax.platform_dependent`), so `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`
on a CPU host carries the Triton kernel. An explicit choice never falls back: "pallas" with
shapes or a backend it cannot run raises at trace time. `scale` is a Python number for
"pallas". This module does not jit: the caller owns the jit boundary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .pool import pool_values
from .pallas import MAX_DECODE_QUERIES, paged_attention_pallas, unsupported_reason
from .reference import paged_attention_reference
from .xla import paged_attention_xla

IMPLEMENTATIONS = ("pallas", "reference", "xla")

# Backends the Pallas kernel compiles for (Triton); CPU runs it in the interpreter.
_PALLAS_GPU_PLATFORMS = ("cuda", "rocm")


def _auto(q, k_pages, v_pages, page_table, q_pos, *, scale):
    """implementation=None: the compiled kernel when lowered for a GPU and the call is a decode
    step it takes, the XLA path otherwise."""
    xla = functools.partial(paged_attention_xla, scale=scale)
    if q.shape[1] > MAX_DECODE_QUERIES or unsupported_reason(q.shape, k_pages.shape):
        return xla(q, k_pages, v_pages, page_table, q_pos)
    def pallas(q, k_pages, v_pages, page_table, q_pos):
        return paged_attention_pallas(q, pool_values(k_pages), pool_values(v_pages), page_table, q_pos, scale=scale,
                                      interpret=False)

    branches = {p: pallas for p in _PALLAS_GPU_PLATFORMS}
    return jax.lax.platform_dependent(q, k_pages, v_pages, page_table, q_pos, **branches, default=xla)


def _check_pallas_can_run(q, k_pages):
    """Fail fast: the kernel is a Triton (GPU) kernel, interpreted on CPU, and its tiles need
    S and Dh to be powers of two >= 16. The backend checked is the host's default one (the
    lowering target is not visible at trace time); interpreter vs Triton follows the lowering."""
    backend = jax.default_backend()
    if backend not in ("cpu", "gpu", *_PALLAS_GPU_PLATFORMS):
        raise ValueError(
            f"implementation='pallas' cannot run on the {backend!r} backend: its kernel is a "
            "Triton (GPU) kernel, interpreted on CPU. Use implementation='xla' (or None).")
    reason = unsupported_reason(q.shape, k_pages.shape)
    if reason:
        raise ValueError(f"implementation='pallas': {reason}. Use implementation='xla' (or None).")


_FUNCTIONS = {"reference": paged_attention_reference, "xla": paged_attention_xla, "pallas": paged_attention_pallas,
              None: _auto}


def _validate(q, k_pages, v_pages, page_table, q_pos):
    if q.ndim != 4 or k_pages.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, Dh] and k_pages [P, S, Hkv, Dh]; got {q.shape}, {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} must equal k_pages shape {k_pages.shape}")
    b, t, hq, dh = q.shape
    hkv = k_pages.shape[2]
    if k_pages.shape[3] != dh or hq % hkv:
        raise ValueError(f"q heads/dim {hq}/{dh} do not fit kv heads/dim {hkv}/{k_pages.shape[3]}")
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table must be [B, Np] with B = {b}; got {page_table.shape}")
    if q_pos.shape != (b, t):
        raise ValueError(f"q_pos must be [B, T] = {(b, t)}; got {q_pos.shape}")


def paged_attention(q, k_pages, v_pages, page_table, q_pos, *, scale=None, implementation=None):
    """Causal attention of q over each row's pages; see the module docstring."""
    if implementation not in _FUNCTIONS:
        raise ValueError(f"unknown implementation {implementation!r}; valid choices: {sorted(IMPLEMENTATIONS)}")
    q, k_pages, v_pages, page_table, q_pos = map(jnp.asarray, (q, k_pages, v_pages, page_table, q_pos))
    _validate(q, k_pages, v_pages, page_table, q_pos)
    if implementation == "pallas":
        _check_pallas_can_run(q, k_pages)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if implementation in ("reference", "pallas"):  # pools of bits (`pool`) as values; the xla path gathers bits
        k_pages, v_pages = pool_values(k_pages), pool_values(v_pages)
    return _FUNCTIONS[implementation](q, k_pages, v_pages, page_table, q_pos, scale=scale)
