"""Block-wise fp8 checkpoints (Qwen's `*-FP8` releases, transformers' FineGrainedFP8 layout).

config.json carries `quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128],
"modules_to_not_convert": [...], ...}` (parsed into `Config.weight_block_size`). A quantised linear
weight `X.weight` [out, in] is stored as float8_e4m3fn beside `X.weight_scale_inv` float32
[ceil(out / bo), ceil(in / bi)]: the real weight is `q * scale_inv` block by block (the last block of
an axis is partial when the block does not divide it). Which layers are quantised is read from the
tensors themselves (a float8 weight with its scale), so `modules_to_not_convert` needs no parsing;
a float8 tensor without its scale is an error that names it.

Loading dequantises here, in float32, then casts to the requested dtype; the scales are kept
verbatim in `Params.extra`, so writing back to HF quantises with the same scales and gives the
same fp8 bytes (`quantize(dequantize(q, s), s) == q` exactly in float32 and bfloat16: their
rounding error is far below half an fp8 step).

Keeping fp8 on device for a GPU matmul later is a local change: a projection leaf becomes a
pytree `Fp8Weight(q [in, out] float8_e4m3fn, scale_inv [ceil(in/bi), ceil(out/bo)], block)` (the
linear rule's transpose applied to both), built by the reader instead of `dequantize`, and
`ops.dense` dispatches on it as it already unwraps `cpu_kernels.PackedWeight`; `dequantize` stays
the reference the kernel is tested against.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from hybridjax.conversion.optional import SCALE_SUFFIX

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def quantised_weights(names, dtype_of) -> tuple[dict[str, str], list[str]]:
    """({fp8 weight: its scale tensor}, [fp8 tensors without a scale]) among `names`."""
    pairs, orphans = {}, []
    for n in names:
        if dtype_of(n) != FP8:
            continue
        if n + SCALE_SUFFIX in names:
            pairs[n] = n + SCALE_SUFFIX
        else:
            orphans.append(n)
    return pairs, sorted(orphans)


def scale_shape(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    """The block-scale shape of a weight: ceil-div of its last two axes by the block."""
    return (*shape[:-2], *(-(-n // b) for n, b in zip(shape[-2:], block)))


def _expand(scale: np.ndarray, block: tuple[int, ...], shape: tuple[int, ...], start: tuple[int, ...] = ()) -> np.ndarray:
    """The per-element scale of a [..., rows, cols] slice starting at `start` (last two axes) of
    shape `shape`, from block scales [..., ceil(R/bo), ceil(C/bi)] covering it."""
    start = start or (0,) * 2
    out = scale
    for axis, (b, s0, n) in enumerate(zip(block, start, shape[-2:])):
        ax = scale.ndim - 2 + axis
        first = s0 // b
        out = np.take(out, np.arange(first, (s0 + n - 1) // b + 1), axis=ax)
        out = np.repeat(out, b, axis=ax)
        out = np.take(out, np.arange(s0 - first * b, s0 - first * b + n), axis=ax)
    return out


def dequantize(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 weight of an fp8 tensor [..., R, C] and its block scales."""
    return q.astype(np.float32) * _expand(scale_inv.astype(np.float32), block, q.shape)


def dequantize_slice(q_slice: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int],
                     start: tuple[int, int]) -> np.ndarray:
    """float32 of a slice of an fp8 2-D tensor that starts at row/col `start` (sharded loading)."""
    return q_slice.astype(np.float32) * _expand(scale_inv.astype(np.float32), block, q_slice.shape, start)


def quantize(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """The fp8 tensor whose dequantisation with `scale_inv` is `w` (the inverse of `dequantize`
    for weights that came from it)."""
    s = _expand(scale_inv.astype(np.float32), block, w.shape)
    return np.divide(w.astype(np.float32), s, out=np.zeros(w.shape, np.float32), where=s != 0).astype(FP8)
