"""The one public entry point for grouped matmuls (the expert MLPs of a routed MoE).

`grouped_matmul(x, w, group_sizes, *, transpose_rhs=False, implementation=None, tile_rows=None)`

Shapes: x [M, K], rows sorted by group; w [G, K, N] (or [G, N, K] with `transpose_rhs`, read in
place); group_sizes [G] int32, sum <= M. Row m of group g gives y[m] = x[m] @ w[g]; rows past
sum(group_sizes) give zeros (a static-shape caller parks unused rows there). Accumulates and
returns float32 [M, N]. Differentiable in x and w (a custom VJP: dx is a grouped matmul with
the other side of w, dw a per-group x^T dy), so the backward pass is as sparse as the forward.

Implementations (`IMPLEMENTATIONS`):
  "reference"   per-row gathered weights (reference.py): the oracle;
  "xla"         a loop over non-empty groups and their row tiles (xla.py);
  "pallas"      the Pallas kernel (pallas.py): compiled Triton on a GPU, the interpreter on CPU;
                needs K and N multiples of 16;
  "ragged_dot"  `jax.lax.ragged_dot`: native on backends that have a grouped kernel, but dense
                (G times the work) on CPU and CUDA in JAX 0.10, so never chosen by default;
  None          "pallas" when lowered for a GPU (CUDA / ROCm) and the shapes fit, "xla"
                otherwise (`jax.lax.platform_dependent`, so a CPU host can lower for a GPU).
The weight gradient (`tgmm`) is the XLA loop for every choice but "reference".
This module does not jit: the caller owns the jit boundary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .pallas import gmm_pallas, unsupported_reason
from .reference import gmm_reference, tgmm_reference
from .xla import gmm_xla, tgmm_xla

IMPLEMENTATIONS = ("pallas", "ragged_dot", "reference", "xla")
_PALLAS_GPU_PLATFORMS = ("cuda", "rocm")


def _gmm_auto(x, w, group_sizes, *, transpose_rhs=False, tile_rows=None):
    xla = functools.partial(gmm_xla, transpose_rhs=transpose_rhs, tile_rows=tile_rows)
    if unsupported_reason(x.shape[1], w.shape[1] if transpose_rhs else w.shape[2]):
        return xla(x, w, group_sizes)
    pallas = functools.partial(gmm_pallas, transpose_rhs=transpose_rhs, tile_rows=tile_rows, interpret=False)
    return jax.lax.platform_dependent(x, w, group_sizes, **{p: pallas for p in _PALLAS_GPU_PLATFORMS}, default=xla)


def _gmm_ragged(x, w, group_sizes, *, transpose_rhs=False, tile_rows=None):
    wk = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
    y = jax.lax.ragged_dot(x, wk, group_sizes, preferred_element_type=jnp.float32)
    live = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(live[:, None], y, 0.0)


def _tgmm_ragged(x, dy, group_sizes, num_groups, *, tile_rows=None):
    return tgmm_xla(x, dy, group_sizes, num_groups, tile_rows=tile_rows)


_GMM = {"reference": gmm_reference, "xla": gmm_xla, "ragged_dot": _gmm_ragged, "pallas": gmm_pallas,
        "auto": _gmm_auto}
_TGMM = {"reference": lambda x, dy, gs, g, tile_rows=None: tgmm_reference(x, dy, gs, g),
         "xla": tgmm_xla, "ragged_dot": _tgmm_ragged, "pallas": tgmm_xla, "auto": tgmm_xla}


def _kw(impl, tile_rows):
    return {} if impl == "reference" else {"tile_rows": tile_rows}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm(x, w, group_sizes, transpose_rhs, impl, tile_rows):
    return _GMM[impl](x, w, group_sizes, transpose_rhs=transpose_rhs, **_kw(impl, tile_rows))


def _gmm_fwd(x, w, group_sizes, transpose_rhs, impl, tile_rows):
    return _gmm(x, w, group_sizes, transpose_rhs, impl, tile_rows), (x, w, group_sizes)


def _gmm_bwd(transpose_rhs, impl, tile_rows, res, dy):
    x, w, group_sizes = res
    # y = x @ w_g: dx = dy @ w_g^T, dw_g = x_g^T dy_g.  y = x @ w_g^T: dx = dy @ w_g, dw_g = dy_g^T x_g.
    dx = _gmm(dy, w, group_sizes, not transpose_rhs, impl, tile_rows)
    tg = _TGMM[impl]
    g = w.shape[0]
    dw = tg(dy, x, group_sizes, g, **_kw(impl, tile_rows)) if transpose_rhs else tg(x, dy, group_sizes, g, **_kw(impl, tile_rows))
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def grouped_matmul(x, w, group_sizes, *, transpose_rhs: bool = False, implementation: str | None = None,
                   tile_rows: int | None = None):
    """Per-group matmul of rows sorted by group; see the module docstring. tile_rows: rows per
    tile of the "xla" loop (default: from M and G, `xla.default_tile_rows`)."""
    impl = "auto" if implementation is None else implementation
    if impl not in IMPLEMENTATIONS + ("auto",):
        raise ValueError(f"unknown implementation {implementation!r}; valid choices: {sorted(IMPLEMENTATIONS)}")
    x, w, group_sizes = jnp.asarray(x), jnp.asarray(w), jnp.asarray(group_sizes, jnp.int32)
    if x.ndim != 2 or w.ndim != 3 or group_sizes.shape != (w.shape[0],):
        raise ValueError(f"grouped_matmul: x [M, K], w [G, K, N], group_sizes [G]; got {x.shape}, {w.shape}, "
                         f"{group_sizes.shape}")
    if x.shape[1] != w.shape[2 if transpose_rhs else 1]:
        raise ValueError(f"grouped_matmul: K of x {x.shape} does not fit w {w.shape} (transpose_rhs={transpose_rhs})")
    if impl == "pallas":  # an explicit choice never falls back
        reason = unsupported_reason(x.shape[1], w.shape[1] if transpose_rhs else w.shape[2])
        if reason:
            raise ValueError(f"implementation='pallas': {reason}. Use implementation='xla' (or None).")
    return _gmm(x, w, group_sizes, transpose_rhs, impl, tile_rows)
