"""What the Pallas kernels share: the precision policy, block sizes per GPU generation, masked
row access, and the interpreter-or-Triton choice.

Precision policy (README.md, "Precision policy"), one `Policy` per call:

  "fast"   matmul operands in the input dtype (bf16 / f16 inputs: 16-bit tensor-core MMAs;
           float32 inputs: TF32), float32 accumulation; w, u and the chunk states h stored in
           the input dtype. Gates, their cumsum, the triangular solve's substitution, the
           L2 norms and the running state stay float32. fla's choice; the GPU default.
  "exact"  every matmul IEEE float32 (`Precision.HIGHEST`: scalar FMAs, no tensor cores),
           intermediates float32. Agrees with the float32 reference to ~1e-6: tests, research.

Block sizes come from `TUNING`, a small table per GPU generation, chosen at trace time by
`target_arch()`: an explicit `compile_target(arch)` (the offline compile tests lower for sm_90
and sm_89 from a CPU host), else the local GPU's compute capability, else sm_90.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

f32 = jnp.float32
PRECISIONS = ("fast", "exact")
# Matches transformers' / fla's l2norm: x * rsqrt(sum(x * x) + eps).
L2NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Policy:
    """Matmul operand type and storage type of the intermediates (hashable: a static argument)."""

    exact: bool
    io_dtype: str  # dtype name of w, u, h and of the fast matmul operands

    @classmethod
    def make(cls, precision, dtype):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        exact = precision == "exact"
        return cls(exact=exact, io_dtype="float32" if exact else jnp.dtype(dtype).name)

    @property
    def dtype(self):
        return jnp.dtype(self.io_dtype)

    def dot(self, a, b, *, trans_a=False, trans_b=False):
        """Matmul of operands cast to the policy's type, float32 accumulation."""
        return self.dot_f32(a.astype(self.dtype), b.astype(self.dtype), trans_a=trans_a,
                            trans_b=trans_b)

    def dot_f32(self, a, b, *, trans_a=False, trans_b=False):
        """Matmul that keeps its operands' type: float32 operands run IEEE (exact) or TF32 (fast)."""
        dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
        precision = jax.lax.Precision.HIGHEST if self.exact else jax.lax.Precision.DEFAULT
        return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision,
                                   preferred_element_type=f32)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Block sizes and warps of every kernel for one GPU generation (K, V = 128, C = 64)."""

    intra_warps: int
    state_bv: int  # value-tile width of the sequential state pass
    state_warps: int
    output_bv: int
    output_warps: int
    decode_bv: int  # small: enough programs at batch 1 (8: 512 for a Qwen3.5 layer, as fla)
    decode_warps: int
    bwd_bv: int = 32  # the backward's state passes (backward_kernels.py)
    bwd_warps: int = 4
    block_k: int = 64  # K is walked in blocks of this many rows (fla's 64-row state blocks)
    stages: int = 2


# Chosen so every kernel fits the generation's shared memory and spills no register in the
# offline compile (tests/test_kernel_compile.py prints the table); not timed on a GPU yet.
TUNING = {
    80: Tuning(intra_warps=8, state_bv=32, state_warps=4, output_bv=64, output_warps=8,
               decode_bv=8, decode_warps=1, bwd_bv=16),
    89: Tuning(intra_warps=8, state_bv=32, state_warps=4, output_bv=64, output_warps=8,
               decode_bv=8, decode_warps=1, bwd_bv=16),
    90: Tuning(intra_warps=4, state_bv=32, state_warps=4, output_bv=64, output_warps=4,
               decode_bv=8, decode_warps=1),
}

_TARGET = contextvars.ContextVar("gdr_target_arch", default=None)


@contextlib.contextmanager
def compile_target(arch: int):
    """Trace the kernels with the block sizes of sm_<arch> (e.g. to lower for sm_89 from a CPU).

    Only traces started inside the block see it: a jitted function traced before keeps its sizes."""
    token = _TARGET.set(int(arch))
    try:
        yield
    finally:
        _TARGET.reset(token)


def _local_gpu_arch():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None
    cc = getattr(gpus[0], "compute_capability", None) if gpus else None
    return int(float(cc) * 10) if cc else None


def target_arch() -> int:
    """The table row to use: compile_target, else the local GPU (nearest row below), else 90."""
    arch = _TARGET.get() or _local_gpu_arch() or 90
    return max([a for a in TUNING if a <= arch] or [min(TUNING)])


def tuning() -> Tuning:
    return TUNING[target_arch()]


def next_pow2(n, lo=16):
    """Smallest power of two >= max(n, lo)."""
    p = lo
    while p < n:
        p *= 2
    return p


def triton_params(num_warps=4, num_stages=2):
    """Selects Pallas' Triton backend (not Mosaic GPU) when lowered for a GPU."""
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def run_on_platform(fn, interpret, *args):
    """Run fn(*args, interpret=...): None follows the lowering platform (interpreter on CPU)."""
    if interpret is not None:
        return fn(*args, interpret=interpret)
    return jax.lax.platform_dependent(
        *args,
        cpu=functools.partial(fn, interpret=True),
        default=functools.partial(fn, interpret=False),
    )


# ---- masked row access: T is never padded, the chunk past the end reads zeros -----------------


def _row_mask(start, rows, t, cols=None):
    shape = (rows,) if cols is None else (rows, cols)
    return start + jax.lax.broadcasted_iota(jnp.int32, shape, 0) < t


def load_rows(ref, start, rows, t, cols=None):
    """Rows [start, start + rows) of a [T] or [T, X] ref, zeros at rows >= t.

    cols=(c0, width) takes columns [c0, c0 + width) of a [T, X] ref (static)."""
    if len(ref.shape) == 1:
        return plt.load(ref.at[pl.ds(start, rows)], mask=_row_mask(start, rows, t), other=0)
    c0, width = cols if cols is not None else (0, ref.shape[1])
    view = ref.at[pl.ds(start, rows), pl.ds(c0, width)]
    return plt.load(view, mask=_row_mask(start, rows, t, width), other=0)


def store_rows(ref, start, t, value, c0=0):
    """Write value [rows, width] to rows [start, ...) and columns [c0, ...) of ref, rows < t only."""
    rows, width = value.shape
    view = ref.at[pl.ds(start, rows), pl.ds(c0, width)]
    plt.store(view, value.astype(ref.dtype), mask=_row_mask(start, rows, t, width))


def inv_norm(sum_sq):
    """1 / ||x|| as fla's l2norm has it: rsqrt(sum(x * x) + eps), float32."""
    return jax.lax.rsqrt(sum_sq + L2NORM_EPS)


def l2norm(x, eps=L2NORM_EPS):
    """L2-normalise over the last axis in float32: x * rsqrt(sum(x * x) + eps)."""
    x = x.astype(f32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def sum_sq(x):
    x = x.astype(f32)
    return jnp.sum(x * x, axis=-1)
