"""hybridjax Params -> a Hugging Face safetensors directory that transformers loads.

Names follow the source layout: `model.language_model.` for the multimodal Qwen3.5 wrappers
(`cfg.model_type` "qwen3_5" / "qwen3_5_moe"; the vision tower, kept verbatim in
`params.extra`, is written back as it came), `model.` otherwise, per-expert MoE weights, no `lm_head.weight` when the
embeddings are tied. Tensors come from the exact inverse transforms of `hybridjax.conversion.names`.

Streaming: the shard plan (names, dtypes, shapes, offsets) is computed first by running each
rule's `to_hf` on zero-byte arrays (a numpy dtype of itemsize 0 carries shapes through
transposes, reshapes, splits and stacks for free); then each tensor is produced, written at
its offset and dropped. From a checkpoint, params are restored one group at a time (the
top-level leaves, then each layer), so memory stays near one layer, not one model.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np

from hybridjax.conversion.checkpoint import CheckpointReader, Report, copy_aux_files, staged_dir
from hybridjax.conversion.hf import _ST_DTYPES, CheckpointError, flat_leaves, leaf_shapes
from hybridjax.conversion import fp8
from hybridjax.conversion.names import Rule, rules_for
from hybridjax.conversion.optional import SCALE_SUFFIX
from hybridjax.config import Config, read_json
from hybridjax.params import FLOAT32_LEAVES, Params

_ST_TAGS = {name: tag for tag, name in _ST_DTYPES.items()}  # numpy dtype name -> safetensors tag
_ZERO_BYTES = np.dtype([])  # itemsize 0: shape-only stand-ins for the plan
WRAPPER_TYPES = ("qwen3_5", "qwen3_5_moe")
INDEX = "model.safetensors.index.json"


def parse_size(text: str | int) -> int:
    """'5GB' -> 5e9 bytes, '500MiB' -> 500 * 2**20, '20KB', or a plain number of bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise CheckpointError(f"invalid size {text!r}: expected e.g. 5GB, 500MB, 20KB or a number of bytes")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))


def hf_root(cfg: Config) -> str:
    return "model.language_model." if cfg.model_type in WRAPPER_TYPES else "model."


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def plan(cfg: Config, params: Params, gate_dtype) -> list[tuple[Rule | str, list[Entry]]]:
    """Every HF tensor to write, grouped by the rule (or extra tensor name) producing it.
    `params` may hold arrays or jax.ShapeDtypeStruct: only leaf dtypes are read. A weight whose
    fp8 scale is kept in `params.extra` is written as fp8 again (`conversion.fp8`)."""
    mtp = params.mtp is not None
    shapes, leaves = leaf_shapes(cfg, mtp), flat_leaves(params.replace(extra={}))
    groups: list[tuple[Rule | str, list[Entry]]] = []
    for rule in rules_for(cfg, hf_root(cfg), fused_experts=False, mtp=mtp):
        probes = [np.zeros(shapes[p], _ZERO_BYTES) for p in rule.params]
        outs = rule.to_hf(*probes)
        dt = _out_dtype(rule, leaves, gate_dtype)
        groups.append((rule, [Entry(n, fp8.FP8 if n + SCALE_SUFFIX in params.extra else dt, tuple(o.shape))
                              for n, o in zip(rule.hf, outs, strict=True)]))
    for name, x in sorted(params.extra.items()):
        groups.append((name, [Entry(name, np.dtype(x.dtype), tuple(x.shape))]))
    return groups


def _out_dtype(rule: Rule, leaves: dict, gate_dtype) -> np.dtype:
    if all(p.rsplit(".", 1)[-1] in FLOAT32_LEAVES for p in rule.params):
        return np.dtype(gate_dtype)
    return np.dtype(leaves[rule.params[0]].dtype)


def group_of(path: str) -> str:
    """The restore group of a leaf path: "layers.<i>", "extra", "mtp" or "top"."""
    parts = path.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0] if parts[0] in ("extra", "mtp") else "top"


def shard(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Greedy split in order, as transformers does: a tensor larger than the limit gets its own shard."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


class ShardWriter:
    """Writes planned safetensors shards in order, one tensor at a time."""

    def __init__(self, out_dir: Path, shards: list[list[Entry]]):
        n = len(shards)
        self.files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.out_dir, self.shards = out_dir, shards
        self.order = [(i, e) for i, s in enumerate(shards) for e in s]
        self.pos, self.current, self.handle = 0, -1, None

    def write(self, name: str, arr: np.ndarray) -> None:
        i, e = self.order[self.pos]
        if name != e.name or tuple(arr.shape) != e.shape:
            raise CheckpointError(f"{name} {tuple(arr.shape)} does not match the planned {e.name} {e.shape}")
        if i != self.current:
            self._open(i)
        arr = np.ascontiguousarray(arr.astype(e.dtype, copy=False))
        self.handle.write(arr.reshape(-1).view(np.uint8).data)
        self.pos += 1

    def _open(self, i: int) -> None:
        self.close()
        header, offset = {}, 0
        for e in self.shards[i]:
            header[e.name] = {"dtype": _ST_TAGS[e.dtype.name], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self.handle = open(self.out_dir / self.files[i], "wb")
        self.handle.write(struct.pack("<Q", len(raw)) + raw)
        self.current = i

    def close(self) -> None:
        if self.handle:
            self.handle.close()
            self.handle = None

    def weight_map(self) -> dict[str, str]:
        return {e.name: self.files[i] for i, e in self.order}


def write_hf(
    params: Params,
    cfg: Config,
    out_dir: str | Path,
    *,
    max_shard_size: str | int = "5GB",
    gate_dtype=jnp.float32,
    progress: Callable[[int, int], Callable[[int], None]] | None = None,
) -> tuple[int, int, int]:
    """Write in-memory `params` as safetensors shards (+ index when more than one) into an
    existing directory. Returns (tensors, bytes, shards). A_log / dt_bias are written in
    `gate_dtype`, extra tensors as stored."""
    leaves = {**flat_leaves(params.replace(extra={})), **{f"extra.{n}": x for n, x in params.extra.items()}}

    def fetch(key: str) -> dict[str, np.ndarray]:
        return {p: np.asarray(x) for p, x in leaves.items() if group_of(p) == key}

    return write_shards(cfg, params, fetch, out_dir, max_shard_size=max_shard_size, gate_dtype=gate_dtype, progress=progress)


def write_shards(cfg: Config, abstract: Params, fetch: Callable[[str], dict[str, np.ndarray]], out_dir, *,
                 max_shard_size, gate_dtype, progress) -> tuple[int, int, int]:
    """The streaming writer: plan from `abstract` (shapes and dtypes), then produce tensors rule by
    rule, fetching host arrays one group at a time (`fetch("top" | "layers.<i>" | "mtp" | "extra")`)."""
    out_dir = Path(out_dir)
    groups = plan(cfg, abstract, gate_dtype)
    entries = [e for _, es in groups for e in es]
    total = sum(e.nbytes for e in entries)
    shards = shard(entries, parse_size(max_shard_size))
    writer = ShardWriter(out_dir, shards)
    step = progress(len(entries), total) if progress else None
    quantised = {e.name for e in entries if e.dtype == fp8.FP8 and e.name + SCALE_SUFFIX in abstract.extra}
    scales = {n[len("extra."):]: x for n, x in fetch("extra").items() if n.endswith(SCALE_SUFFIX)} if quantised else {}
    if quantised and not cfg.weight_block_size:
        raise CheckpointError("params hold fp8 scales but the config has no quantization_config.weight_block_size")
    key, held = None, {}
    try:
        for src, es in groups:
            first = src.params[0] if isinstance(src, Rule) else f"extra.{src}"
            if group_of(first) != key:
                key, held = group_of(first), None  # drop the previous group before fetching the next
                held = fetch(key)
            if isinstance(src, Rule):
                outs = src.to_hf(*(held[p] for p in src.params))
            else:
                outs = (held[first],)
            for e, arr in zip(es, outs, strict=True):
                if e.name in quantised:  # back to the source's fp8 bytes with its own scales
                    arr = fp8.quantize(arr, scales[e.name + SCALE_SUFFIX], cfg.weight_block_size)
                writer.write(e.name, arr)
                if step:
                    step(e.nbytes)
            del outs
    finally:
        writer.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(writer.weight_map().items()))}
        (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return len(entries), total, len(shards)


def _config_json(src: Path, dst: Path, dtype: str) -> None:
    """Copy config.json, rewriting its dtype fields only when the weights' dtype changed."""
    raw = read_json(src, CheckpointError)
    changed = False
    for d in (raw, raw.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if isinstance(d.get(key), str) and d[key] != dtype:
                d[key], changed = dtype, True
    if changed:
        dst.write_text(json.dumps(raw, indent=2) + "\n")
    else:
        shutil.copyfile(src, dst)


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    *,
    max_shard_size: str | int = "5GB",
    dtype=None,
    force: bool = False,
    progress: Callable[[int, int], Callable[[int], None]] | None = None,
) -> Report:
    """Converted checkpoint -> HF directory (safetensors shards, index, config, tokenizer files)."""
    start = time.perf_counter()
    checkpoint = Path(checkpoint)
    reader = CheckpointReader(checkpoint, dtype)  # reads and checks the marker and config
    info = reader.info
    parse_size(max_shard_size)  # fail before loading anything
    with staged_dir(Path(out), force, (checkpoint,)) as tmp:
        cfg, model_dtype = reader.cfg, reader.dtype.name
        # Gates go back in the model dtype only if the source stored them so (see convert_hf).
        keep = info.get("gate_hf_dtype", "float32") == info["dtype"]
        gate_dtype = model_dtype if keep else "float32"
        n, nbytes, n_shards = write_shards(cfg, reader.target, reader.group, tmp, max_shard_size=max_shard_size,
                                           gate_dtype=gate_dtype, progress=progress)
        _config_json(checkpoint / "config.json", tmp / "config.json", model_dtype)
        copy_aux_files(checkpoint, tmp)
    notes = [f"{n_shards} shard(s)"]
    if cfg.model_type in WRAPPER_TYPES and not any(n.startswith("model.visual.") for n in info["extra"]):
        notes.append("multimodal config without its vision tower: only the text model is written")
    return Report(Path(out), model_dtype, n, nbytes, time.perf_counter() - start, notes=notes)
