"""Load a Hugging Face model directory (config.json + safetensors) into hybridjax Params.

Tensors are read lazily, one at a time, through memory-mapped safetensors files, transformed
by the rules of `hybridjax.conversion.names`, shape-checked, cast and placed on device, so peak host
memory stays near one tensor beyond the loaded model. Every problem with the checkpoint
(missing shard, missing / unexpected / mis-shaped tensors) is reported in one message.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  registers bfloat16 / float8 with numpy
import numpy as np
from safetensors import safe_open

from hybridjax.conversion import fp8
from hybridjax.conversion.names import MTP_PREFIX, Rule
from hybridjax.conversion.optional import Parts, split_parts
from hybridjax.conversion.progress import Progress
from hybridjax.config import Config, load_config, read_json
from hybridjax.params import FLOAT32_LEAVES, Params, is_shape, param_shapes

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensors."""


# safetensors dtype tags -> numpy dtype names (bfloat16 and float8 come from ml_dtypes).
_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}
_BYTES_ONLY = ("F8_E4M3", "F8_E5M2")  # read by mapping the file (`TensorReader._mapped`)


def _shard_map(model_dir: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, CheckpointError)
        if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        weight_map = weight_map["weight_map"]
        files = {f: model_dir / f for f in set(weight_map.values())}
        missing = sorted(f for f, p in files.items() if not p.is_file())
        if missing:
            raise CheckpointError(f"{model_dir}: shard(s) listed in {index.name} are missing: {', '.join(missing)}")
        return {name: files[f] for name, f in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files found")
    out = {}
    for f in files:
        with safe_open(f, framework="numpy") as h:
            out.update({k: f for k in h.keys()})
    return out


def read_hf_tensors(model_dir: str | Path) -> tuple[dict[str, Path], "TensorReader"]:
    model_dir = Path(model_dir)
    shards = _shard_map(model_dir)
    return shards, TensorReader(shards)


class TensorReader:
    """Reads single tensors by name from a set of safetensors shards (memory-mapped). Block-wise
    fp8 weights (`quantise`) read as their float32 dequantisation (`conversion.fp8`)."""

    def __init__(self, shards: dict[str, Path]):
        self.shards = shards
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}
        self._headers: dict[Path, tuple[dict, int]] = {}
        self.scales: dict[str, str] = {}  # fp8 weight -> its scale tensor
        self.block: tuple[int, ...] = ()

    def quantise(self, scales: dict[str, str], block: tuple[int, ...]) -> None:
        """From now on, read the fp8 weights in `scales` dequantised with `block`."""
        self.scales, self.block = scales, block

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        x = self.raw(name)
        return fp8.dequantize(x, self.raw(self.scales[name]), self.block) if name in self.scales else x

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (fp8 weights not dequantised): what `params.extra` keeps."""
        if self._by_bytes(name):
            return np.array(self._mapped(name))
        return self._handle(name).get_tensor(name)

    def _by_bytes(self, name: str) -> bool:
        # safetensors' numpy reader knows no float8 (numpy has none; ml_dtypes does): map the bytes
        return self._handle(name).get_slice(name).get_dtype() in _BYTES_ONLY

    def _mapped(self, name: str) -> np.ndarray:
        """A read-only memory map of one tensor, from the file's header (8-byte length + JSON)."""
        path = self.shards[name]
        if path not in self._headers:
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                self._headers[path] = (json.loads(f.read(n)), 8 + n)
        header, base = self._headers[path]
        entry = header[name]
        start, end = entry["data_offsets"]
        dtype = np.dtype(_ST_DTYPES[entry["dtype"]])
        if end == start:
            return np.zeros(entry["shape"], dtype)
        return np.memmap(path, np.uint8, "r", offset=base + start, shape=(end - start,)).view(dtype).reshape(entry["shape"])

    def get_slice(self, name: str, index: tuple) -> np.ndarray:
        """tensor[index] (a tuple of slices, one per axis), reading only those bytes."""
        view = self._handle(name).get_slice(name)
        full = view.get_shape()
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, full))
        cut = tuple(slice(*b) for b in bounds)
        x = np.array(self._mapped(name)[cut]) if self._by_bytes(name) else view[cut]
        if name in self.scales:
            x = fp8.dequantize_slice(x, self.raw(self.scales[name]), self.block, tuple(b[0] for b in bounds[-2:]))
        return x

    def dtype(self, name: str) -> np.dtype:
        """The dtype `get` returns (float32 for fp8 weights read dequantised)."""
        if name in self.scales:
            return np.dtype(np.float32)
        return self.stored_dtype(name)

    def stored_dtype(self, name: str) -> np.dtype:
        return np.dtype(_ST_DTYPES[self._handle(name).get_slice(name).get_dtype()])

    def nbytes(self, name: str) -> int:
        return int(np.prod(self.shape(name), dtype=np.int64)) * self.dtype(name).itemsize

    def _handle(self, name: str):
        path = self.shards[name]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(path, framework="numpy"))
        return self._handles[path]

    def close(self):
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def text_root(names) -> str:
    """'model.language_model.' for multimodal Qwen3.5 checkpoints, else 'model.'."""
    return "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."


def has_fused_experts(names) -> bool:
    return any(n.endswith("mlp.experts.gate_up_proj") for n in names)


def path_str(path) -> str:
    return ".".join(str(getattr(p, "name", getattr(p, "idx", getattr(p, "key", p)))) for p in path)


def has_mtp(names) -> bool:
    """Whether tensor names (HF names or param leaf paths) include the MTP head's."""
    return any(n.startswith(MTP_PREFIX) for n in names)


def leaf_shapes(cfg: Config, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Param leaf path -> expected shape (with the MTP head's leaves when `mtp`)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, mtp), is_leaf=is_shape)
    return {path_str(p): s for p, s in flat}


def _check(parts: Parts) -> None:
    """Raise CheckpointError naming every missing or unexpected text-model tensor."""
    problems = []
    for what, names in (("missing", parts.missing), ("unexpected", parts.unexpected)):
        if names:
            problems.append(f"{what} tensors ({len(names)}): {', '.join(names[:20])}" + (" ..." if len(names) > 20 else ""))
    if problems:
        raise CheckpointError("checkpoint does not match config.json: " + "; ".join(problems))


def iter_params(rules: list[Rule], reader: TensorReader, cfg: Config) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (param path, numpy array) for every rule, shape-checked, one rule at a time."""
    shapes = leaf_shapes(cfg, any(p.startswith(MTP_PREFIX) for r in rules for p in r.params))
    bad = []
    for rule in rules:
        arrays = rule.to_params(*(reader.get(n) for n in rule.hf))
        for path, arr in zip(rule.params, arrays):
            if tuple(arr.shape) != shapes[path]:
                src = ", ".join(f"{n} {reader.shape(n)}" for n in rule.hf[:2])
                bad.append(f"{src} -> {path} has shape {tuple(arr.shape)}, expected {shapes[path]}")
                continue
            yield path, arr
    if bad:
        raise CheckpointError("mis-shaped tensors: " + "; ".join(bad))


def assemble(cfg: Config, leaves: dict[str, jax.Array], extra: dict | None = None) -> Params:
    """Params from a path -> array dict (the inverse of flattening with `path_str`); an MTP head
    when the dict has its leaves."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, has_mtp(leaves)), is_leaf=is_shape)
    return jax.tree_util.tree_unflatten(treedef, [leaves[path_str(p)] for p, _ in flat]).replace(extra=extra or {})


def to_device(path: str, arr: np.ndarray, dtype) -> jax.Array:
    target = jnp.float32 if path.rsplit(".", 1)[-1] in FLOAT32_LEAVES else dtype
    if np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16":
        return jnp.asarray(arr, dtype=target)
    return jnp.asarray(arr)


@dataclasses.dataclass
class HFSource:
    """An HF directory checked against its config.json: the rules that read it, the tensors kept
    verbatim (`conversion.optional`), and an open reader (close it, or use the source as a
    context manager)."""

    cfg: Config
    rules: list[Rule]
    reader: TensorReader
    names: set[str]
    # Tensors no rule reads, carried verbatim into `params.extra` so that writing back to HF gives
    # every tensor of the source: the vision tower, an MTP head that cannot load, fp8 scales,
    # unknown tensors, a tied checkpoint's lm_head.weight copy.
    kept: list[str] = dataclasses.field(default_factory=list)
    warning: str = ""  # one line about optional parts not loaded

    @property
    def dropped(self) -> list[str]:
        """Tensors left out: none (every tensor is read by a rule or kept)."""
        return []

    def stored_dtype(self) -> np.dtype:
        """The dtype of the embedding table, taken as the checkpoint's dtype."""
        return self.reader.dtype(self.rules[0].hf[0])

    @property
    def n_leaves(self) -> int:
        """Param leaves that loading produces (a stack of experts is one), kept tensors included:
        the steps of a progress callback."""
        return sum(len(r.params) for r in self.rules) + len(self.kept)

    def nbytes(self) -> int:
        """Bytes that loading reads: every rule's tensors plus the kept ones."""
        kept = sum(int(np.prod(self.reader.shape(n), dtype=np.int64)) * self.reader.stored_dtype(n).itemsize for n in self.kept)
        return sum(self.reader.nbytes(n) for r in self.rules for n in r.hf) + kept

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.reader.close()


def _read_fp8(cfg: Config, names: set[str], reader: TensorReader) -> None:
    """Set `reader` to dequantise the checkpoint's block-wise fp8 weights (`conversion.fp8`)."""
    scales, orphans = fp8.quantised_weights(names, reader.stored_dtype)
    if orphans:
        raise CheckpointError(f"float8 tensors without their {fp8.SCALE_SUFFIX} scales ({len(orphans)}): "
                              f"{', '.join(orphans[:20])}")
    if scales and not cfg.weight_block_size:
        raise CheckpointError("the checkpoint stores fp8 weights with scales but config.json has no quantization_config "
                              '(expected {"quant_method": "fp8", "weight_block_size": [128, 128]})')
    bad = [f"{s} {reader.shape(s)} (expected {fp8.scale_shape(reader.shape(w), cfg.weight_block_size)})"
           for w, s in sorted(scales.items()) if reader.shape(s) != fp8.scale_shape(reader.shape(w), cfg.weight_block_size)]
    if bad:
        raise CheckpointError(f"fp8 scales that do not match weight_block_size {list(cfg.weight_block_size)}: "
                              + "; ".join(bad[:20]))
    reader.quantise(scales, cfg.weight_block_size)


def open_hf(model_dir: str | Path) -> HFSource:
    """Read config.json and the shard index of an HF directory and check the tensor names: the
    text model's must be complete; optional parts that cannot load are kept and warned about once."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory not found: {model_dir}")
    cfg = load_config(model_dir)
    shards, reader = read_hf_tensors(model_dir)
    names = set(shards)
    raw = read_json(model_dir / "config.json", CheckpointError)
    try:
        _read_fp8(cfg, names, reader)
    except CheckpointError:
        reader.close()
        raise
    parts = split_parts(cfg, names, text_root(names), has_fused_experts(names), reader.shape,
                        lambda mtp: leaf_shapes(cfg, mtp), raw)
    try:
        _check(parts)
    except CheckpointError:
        reader.close()
        raise
    if parts.warning:
        log.warning("%s: %s", model_dir.name, parts.warning)
    return HFSource(cfg, parts.rules, reader, names, parts.kept, parts.warning)


def load_hf(model_dir: str | Path, dtype="float32", progress: Progress | None = None,
            mesh=None) -> tuple[Config, Params]:
    """Read an HF model directory (or hub id ORG/NAME[@REVISION], `conversion.hub`) into
    (Config, Params), casting weights to `dtype` (None: the checkpoint's own dtype).

    The gate parameters (A_log, dt_bias) stay float32. A complete MTP head (`mtp.*`) loads into
    `params.mtp`; tensors the text model does not use (vision tower, a partial head) are kept
    verbatim in `params.extra` (`conversion.optional`).
    `progress(steps, total_bytes)` (`hybridjax.conversion.progress`), if given, returns a callback
    taking the bytes of each param leaf read.
    `mesh`: place each param on the mesh by `hybridjax.sharding.RULES` as it is read, each device
    receiving only its shard (see `read_params_sharded`).
    """
    from hybridjax.conversion.hub import resolve_model

    with open_hf(resolve_model(model_dir)) as src:
        step = progress(src.n_leaves, src.nbytes()) if progress else None
        if mesh is not None:
            return src.cfg, read_params_sharded(src, mesh, dtype, step)
        return src.cfg, read_params(src, dtype, step)


def _leaf_dtype(path: str, dtype) -> np.dtype:
    return np.dtype(np.float32) if path.rsplit(".", 1)[-1] in FLOAT32_LEAVES else np.dtype(dtype)


def _cast(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    floating = np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16"
    return np.ascontiguousarray(x.astype(dtype) if floating else x)


def _slice_readers(rule: Rule, reader: TensorReader):
    """[(param path, shape, index -> host array of that slice)] for rules whose param slices map
    onto slices of the HF tensors; None for layouts read whole (Qwen3-Next's fused projections)."""
    names, paths = rule.hf, rule.params
    shape = reader.shape(names[0])
    if rule.kind == "copy":
        return [(paths[0], shape, lambda idx: reader.get_slice(names[0], idx))]
    if rule.kind == "linear":  # param [in, out] = hf [out, in].T
        return [(paths[0], shape[::-1], lambda idx: reader.get_slice(names[0], idx[::-1]).T)]
    if rule.kind == "swap12":  # param [E, a, b] = hf [E, b, a] with the last two axes swapped
        return [(paths[0], (shape[0], shape[2], shape[1]),
                 lambda idx: reader.get_slice(names[0], (idx[0], idx[2], idx[1])).transpose(0, 2, 1))]
    if rule.kind == "gate_up":  # hf [E, 2I, D]: gate = [:, :I].T, up = [:, I:].T, each [E, D, I]
        e, two_i, d = shape
        i = two_i // 2

        def half(offset):
            def read(idx):
                cols = range(i)[idx[2]]
                rows = slice(offset + cols.start, offset + cols.stop)
                return reader.get_slice(names[0], (idx[0], rows, idx[1])).transpose(0, 2, 1)
            return read

        return [(paths[0], (e, d, i), half(0)), (paths[1], (e, d, i), half(i))]
    if rule.kind == "stack":  # param [E, in, out]: expert e is hf[e] [out, in].T

        def read(idx):
            experts = range(len(names))[idx[0]]
            return np.stack([reader.get_slice(names[e], idx[2:0:-1]).T for e in experts])

        return [(paths[0], (len(names), *shape[::-1]), read)]
    return None


def read_params_sharded(src: HFSource, mesh, dtype="float32", progress: Callable[[int], None] | None = None) -> Params:
    """The Params of an opened HF directory placed on `mesh` as they are read.

    Each device's shard is read on its own (`jax.make_array_from_callback`; on several hosts each
    reads only its devices' shards): copies, transposes, expert stacks and transformers' fused
    experts are read slice by slice from the memory-mapped safetensors (`get_slice`), so those
    tensors are never whole anywhere; Qwen3-Next's per-key-head fused in_proj_qkvz / in_proj_ba are
    read whole on the host, one tensor at a time, transformed, then cut. No device ever holds a
    whole model.
    """
    from hybridjax.sharding import sharding_by_path

    cfg, reader = src.cfg, src.reader
    dtype = src.stored_dtype() if dtype is None else jnp.dtype(dtype)
    mtp = any(p.startswith(MTP_PREFIX) for r in src.rules for p in r.params)
    shapes, shardings = leaf_shapes(cfg, mtp), sharding_by_path(cfg, mesh, mtp)
    leaves, bad = {}, []
    for rule in src.rules:
        pieces = _slice_readers(rule, reader)
        if pieces is None:
            arrays = rule.to_params(*(reader.get(n) for n in rule.hf))
            pieces = [(p, tuple(a.shape), (lambda a: lambda idx: a[idx])(a)) for p, a in zip(rule.params, arrays)]
        for path, shape, read in pieces:
            shape = tuple(shape)
            if shape != shapes[path]:
                src_shapes = ", ".join(f"{n} {reader.shape(n)}" for n in rule.hf[:2])
                bad.append(f"{src_shapes} -> {path} has shape {shape}, expected {shapes[path]}")
                continue
            target = _leaf_dtype(path, dtype)
            leaves[path] = jax.make_array_from_callback(shape, shardings[path], lambda idx, r=read, t=target: _cast(r(idx), t))
            if progress:
                progress(int(np.prod(shape)) * reader.dtype(rule.hf[0]).itemsize)
    if bad:
        raise CheckpointError("mis-shaped tensors: " + "; ".join(bad))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    extra = {n: jax.device_put(reader.raw(n), replicated) for n in src.kept}
    return assemble(cfg, leaves, extra).replace(mesh=mesh)


def read_params(src: HFSource, dtype="float32", progress: Callable[[int], None] | None = None) -> Params:
    """The Params of an opened HF directory (see `load_hf`), one tensor at a time."""
    cfg, reader = src.cfg, src.reader
    dtype = src.stored_dtype() if dtype is None else jnp.dtype(dtype)
    leaves = {}
    for path, arr in iter_params(src.rules, reader, cfg):
        leaves[path] = to_device(path, arr, dtype)
        if progress:
            progress(arr.nbytes)  # transforms keep size and dtype: these add up to the bytes read
    extra = {}
    for n in src.kept:
        extra[n] = jnp.asarray(reader.raw(n))
        if progress:
            progress(extra[n].nbytes)
    if extra:
        log.info("kept %d tensors outside the text model verbatim in params.extra", len(extra))
    return assemble(cfg, leaves, extra)


def flat_leaves(tree) -> dict:
    """{dotted path: leaf} of a pytree (the names of `leaf_shapes` for Params)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {path_str(p): x for p, x in flat}
