"""The one public entry point for the gated delta rule, with fla's argument conventions.

`chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
use_qk_l2norm_in_kernel=False, implementation=None, precision="fast", cu_seqlens=None)
-> (o, final_state)`

Shapes: q, k [B, T, Hk, K]; v [B, T, Hv, V] with Hv % Hk == 0 (value head h reads key head
h // (Hv // Hk)); g, beta [B, T, Hv]; initial_state [B, Hv, K, V] or None (zeros).
Returns o [B, T, Hv, V] in v's dtype and final_state [B, Hv, K, V] float32. With cu_seqlens
(int32 [N + 1], B = 1) the N packed sequences have states [N, Hv, K, V].

Implementations (`IMPLEMENTATIONS`):
  "reference"  token-by-token scan (reference.py), differentiated by plain autodiff;
  "xla"        chunked WY/UT form (xla.py), or the token scan for T <= RECURRENT_MAX_TOKENS;
  "pallas"     Pallas kernels: chunk.py, or recurrent.py for T <= RECURRENT_MAX_TOKENS;
               compiled Triton kernels on GPU, the Pallas interpreter on CPU;
  "mosaic"     "pallas" with the chunked forward's three kernels (intra-chunk WY solve, state
               pass, output) on Pallas Mosaic GPU (mosaic.py; JAX 0.11+, bfloat16 "fast" only;
               the GPU interpreter on CPU); decode stays Triton; not yet run on a GPU;
  None         "pallas" on GPU (CUDA / ROCm), "xla" elsewhere.
"xla", "pallas", "mosaic" and None differentiate through `backward.gated_delta_rule_with_vjp`: inputs
are the only residuals and the backward recomputes the chunk states.

`precision` ("fast", the default, or "exact") is the Pallas kernels' policy (`common.py`):
"fast" runs the matmuls on tensor cores with operands and intermediates in the input dtype
(TF32 for float32 inputs), "exact" in IEEE float32. "reference" and "xla" always compute in
float32 and ignore it. With "pallas" (and None on a GPU) `use_qk_l2norm_in_kernel` is fused
into the kernels, so normalised q and k never exist in memory.

Platform choices (None's backend, and interpreter vs compiled kernel) follow the platform the
computation is lowered for, via `jax.lax.platform_dependent`, not the machine doing the
lowering: `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` on a CPU host yields the
Triton kernels. An explicit choice never falls back: one that cannot run raises at trace time.
This module does not jit: the caller owns the jit boundary (scale, the flag and
`implementation` are python values, static under jit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..compat import targets_gpu
from .backward import gated_delta_rule_with_vjp
from .chunk import chunk_gated_delta_rule_pallas
from .common import L2NORM_EPS, PRECISIONS, l2norm  # noqa: F401  (L2NORM_EPS re-exported)
from .recurrent import recurrent_gated_delta_rule_pallas
from .reference import recurrent_gated_delta_rule_reference
from .xla import CHUNK_SIZE as XLA_CHUNK_SIZE  # tuned in xla.py
from .xla import chunk_gated_delta_rule_xla

# At or below this many tokens a token-by-token scan beats the chunked form: a chunk pads
# T up to a whole chunk and pays for C x C decay matrices and a triangular solve that a handful of tokens
# does not need. Both "xla" (reference scan) and "pallas" (recurrent.py) switch here.
RECURRENT_MAX_TOKENS = 16

IMPLEMENTATIONS = ("mosaic", "pallas", "reference", "xla")

# Backends the Pallas kernels compile for (Triton); CPU runs them in the interpreter.
_PALLAS_GPU_PLATFORMS = ("cuda", "rocm")

def _xla(q, k, v, g, beta, *, scale, initial_state, normalize=False, precision=None):
    """XLA forward: a plain scan for short inputs (decode), the chunked form otherwise.

    Always float32 (precision is the Pallas kernels' setting)."""
    del precision
    if normalize:
        q, k = l2norm(q), l2norm(k)
    if q.shape[1] <= RECURRENT_MAX_TOKENS:
        return recurrent_gated_delta_rule_reference(
            q, k, v, g, beta, scale=scale, initial_state=initial_state
        )
    return chunk_gated_delta_rule_xla(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=XLA_CHUNK_SIZE
    )


def _pallas(q, k, v, g, beta, *, scale, initial_state, normalize=False, precision="fast",
            interpret=None):
    """Pallas forward: the decode kernel for short inputs, the chunk kernels otherwise.

    interpret=None: the interpreter when lowered for CPU, the Triton kernels otherwise."""
    kw = dict(scale=scale, initial_state=initial_state, normalize=normalize, interpret=interpret)
    if q.shape[1] <= RECURRENT_MAX_TOKENS:  # exact in any policy: the reference's own order
        return recurrent_gated_delta_rule_pallas(q, k, v, g, beta, **kw)
    return chunk_gated_delta_rule_pallas(q, k, v, g, beta, precision=precision, **kw)


def _mosaic(q, k, v, g, beta, *, scale, initial_state, normalize=False, precision="fast",
            interpret=None):
    """"pallas" with the chunked forward on Mosaic GPU (mosaic.py; JAX 0.11+, bfloat16, "fast"):
    its intra-chunk, state-pass and output kernels; decode keeps the Triton kernel.
    interpret=None is decided at trace time: compiled on a GPU host or inside
    `compat.cuda_target()`, interpreted otherwise."""
    if interpret is None:
        interpret = not targets_gpu()
    kw = dict(scale=scale, initial_state=initial_state, normalize=normalize, interpret=interpret)
    if q.shape[1] <= RECURRENT_MAX_TOKENS:
        return recurrent_gated_delta_rule_pallas(q, k, v, g, beta, **kw)
    return chunk_gated_delta_rule_pallas(q, k, v, g, beta, precision=precision, kernels="mosaic", **kw)


def _check_mosaic_can_run(v, precision):
    from . import mosaic

    if not mosaic.AVAILABLE:
        raise ValueError(f"implementation='mosaic' needs Pallas Mosaic GPU as in JAX 0.11+ (this is JAX "
                         f"{jax.__version__}); use 'pallas'")
    if precision != "fast" or v.dtype != jnp.bfloat16:
        raise ValueError(f"implementation='mosaic' runs the 'fast' policy on bfloat16 inputs; got precision "
                         f"{precision!r}, v {v.dtype}")


def _auto(q, k, v, g, beta, *, scale, initial_state, normalize=False, precision="fast"):
    """implementation=None: compiled Pallas when lowered for a GPU, XLA otherwise."""
    kw = dict(scale=scale, normalize=normalize, precision=precision)
    xla = functools.partial(_xla, **kw)
    pallas = functools.partial(_pallas, interpret=False, **kw)

    def call(fn):
        return lambda q, k, v, g, beta, s: fn(q, k, v, g, beta, initial_state=s)

    branches = {p: call(pallas) for p in _PALLAS_GPU_PLATFORMS}
    return jax.lax.platform_dependent(
        q, k, v, g, beta, initial_state, **branches, default=call(xla)
    )


def _check_pallas_can_run():
    """Fail fast: the Pallas kernels are Triton kernels (GPU) or interpreted (CPU), nothing else.

    Checks the host's default backend at trace time (the lowering target is not visible here:
    `platform_dependent` traces every branch); the interpreter/Triton choice itself follows the
    platform lowered for."""
    backend = jax.default_backend()
    if backend not in ("cpu", "gpu", *_PALLAS_GPU_PLATFORMS):
        raise ValueError(
            f"implementation='pallas' cannot run on the {backend!r} backend: its kernels are "
            "Triton (GPU) kernels, interpreted on CPU. Use implementation='xla' (or None)."
        )


def _check_rank(name, x, rank):
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")


def _validate(q, k, v, g, beta, initial_state, num_states):
    """Raise ValueError naming the offending argument if shapes do not fit together."""
    for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        _check_rank(name, x, rank)
    if k.shape != q.shape:
        raise ValueError(
            f"k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)} [B, T, Hk, K]"
        )
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if v.shape[:2] != (B, T):
        raise ValueError(f"v shape {tuple(v.shape)} must start with q's (B, T) = {(B, T)}")
    if Hk == 0 or Hv % Hk != 0:
        raise ValueError(f"v heads Hv={Hv} must be a positive multiple of q/k heads Hk={Hk}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, Hv):
            raise ValueError(f"{name} shape {tuple(x.shape)} must be [B, T, Hv] = {(B, T, Hv)}")
    if initial_state is not None and initial_state.shape != (num_states, Hv, K, V):
        raise ValueError(
            f"initial_state shape {tuple(initial_state.shape)} must be "
            f"[{'N' if num_states != B else 'B'}, Hv, K, V] = {(num_states, Hv, K, V)}"
        )


def _varlen(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, normalize, precision):
    """Packed sequences: the Pallas chunk kernels (interpreted on CPU), forward only."""
    return chunk_gated_delta_rule_pallas(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, normalize=normalize,
        precision=precision, cu_seqlens=cu_seqlens,
    )


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    use_qk_l2norm_in_kernel=False,
    implementation=None,
    precision="fast",
    cu_seqlens=None,
):
    """Gated delta rule over a sequence; see the module docstring for shapes.

    Args:
      scale: multiplies q after any normalisation; None means K ** -0.5.
      use_qk_l2norm_in_kernel: L2-normalise q and k (float32, eps 1e-6) first.
      implementation: "reference", "xla", "pallas", "mosaic" ("pallas" with the chunked forward
        on Mosaic GPU: JAX 0.11+, bfloat16, "fast"), or None ("pallas" on GPU, "xla" elsewhere,
        decided by the lowering platform).
      precision: the Pallas kernels' policy, "fast" (tensor cores, input-dtype operands and
        intermediates) or "exact" (IEEE float32); "reference" and "xla" are float32 always.
      cu_seqlens: None, or int32 [N + 1] (fla's varlen): N sequences packed along T of a B = 1
        batch, sequence i at rows cu_seqlens[i]:cu_seqlens[i + 1] with its own state
        (initial_state and the final state [N, Hv, K, V]). Runs the Pallas chunk kernels for
        implementation "pallas" or None (interpreted on CPU: slow); forward only (no VJP).

    Returns:
      (o [B, T, Hv, V] in v's dtype, final_state [B (or N), Hv, K, V] float32).
    """
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"unknown implementation {implementation!r}; valid choices: {sorted(IMPLEMENTATIONS)}"
        )
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid choices: {list(PRECISIONS)}")
    if implementation in ("pallas", "mosaic") or cu_seqlens is not None:
        _check_pallas_can_run()
    if implementation == "mosaic":
        _check_mosaic_can_run(v, precision)
    num_states = q.shape[0]
    if cu_seqlens is not None:
        if implementation not in (None, "pallas"):  # (not "mosaic": its state pass takes no packing)
            raise ValueError(f"cu_seqlens needs implementation 'pallas' or None, got "
                             f"{implementation!r}")
        if q.shape[0] != 1 or cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens needs B = 1 and shape [N + 1], N >= 1; got B = "
                             f"{q.shape[0]}, cu_seqlens {tuple(cu_seqlens.shape)}")
        num_states = cu_seqlens.shape[0] - 1
    _validate(q, k, v, g, beta, initial_state, num_states)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if cu_seqlens is not None:
        return _varlen(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       cu_seqlens=cu_seqlens, normalize=use_qk_l2norm_in_kernel,
                       precision=precision)
    # The Pallas kernels (and None, which may pick them) normalise inside; the XLA paths first.
    fused_norm = use_qk_l2norm_in_kernel and implementation in (None, "pallas", "mosaic")
    if use_qk_l2norm_in_kernel and not fused_norm:
        q, k = l2norm(q), l2norm(k)
    if implementation == "reference":
        return recurrent_gated_delta_rule_reference(
            q, k, v, g, beta, scale=scale, initial_state=initial_state
        )
    B, T, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if initial_state is None:
        initial_state = jnp.zeros((B, Hv, K, V), jnp.float32)
    if T == 0:
        return jnp.zeros((B, 0, Hv, V), v.dtype), initial_state.astype(jnp.float32)
    forward = _FORWARDS[implementation]
    return gated_delta_rule_with_vjp(forward, q, k, v, g, beta, initial_state, scale=scale,
                                     normalize=fused_norm, precision=precision)


# Module-level objects, so the custom_vjp's static `forward` is the same object on every call.
_FORWARDS = {None: _auto, "xla": _xla, "pallas": _pallas, "mosaic": _mosaic}
# Where the backward's sequential state passes run (backward.gated_delta_rule_backward).
_xla.backward_kernels = "xla"
_pallas.backward_kernels = "pallas"
_mosaic.backward_kernels = "pallas"  # the backward's state passes stay Triton
_auto.backward_kernels = "auto"
