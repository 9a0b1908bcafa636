"""A converted checkpoint's arrays mapped from their files rather than read into fresh memory.

orbax (tensorstore, zarr3, no OCDBT, uncompressed: `checkpoint._checkpointer`) writes each array
as a directory: `zarr.json`, and one shard file `c/0/.../0` that holds the array's bytes (C order,
little-endian) followed by the shard's index (zarr v3 sharding: an (offset, nbytes) pair of
uint64 per inner chunk, here one, then the index's crc32c). Such an array, in the dtype wanted, is
mapped copy-on-write, and XLA:CPU takes a page-aligned mapping as the array's buffer without a copy
(`jax.device_put` aliases it). So a warm load is the page cache's pages: the 0.23B model in
0.05-0.2 s against 1.3-5.4 s through orbax, which read 870 MB into memory the process had just
allocated, slow to touch where the VM backs freed pages lazily (docs/architecture.md, Known traps;
benchmarks/README.md). A cold load reads each page when a forward first touches it, as llama.cpp's
mmap does.

Copy-on-write: a program that donates such a buffer writes private pages, never the file; and a
checkpoint replaced while mapped (`convert --force` renames a new directory into place) keeps the
old files' data alive until the model is dropped. A shard file cut short in place while mapped
would fault the process on the pages it lost, as with any mapped weights. Anything else (OCDBT
checkpoints, compressed or chunked arrays, another dtype, a mesh) is read by orbax, as before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from hybridjax.conversion.hf import CheckpointError

INDEX_BYTES = 16 + 4  # one (offset, nbytes) pair of uint64, then its crc32c
LITTLE = {"name": "bytes", "configuration": {"endian": "little"}}
# Each mapping holds a file descriptor: leave this many for everything else the process opens.
SPARE_DESCRIPTORS = 256


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as zarr's `crc32c` codec guards a shard index with."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def one_plain_shard(meta: dict, shape: tuple[int, ...]) -> np.dtype | None:
    """The stored dtype where `zarr.json`'s `meta` describes `shape` stored as one uncompressed
    shard of one inner chunk, its index at the end (the layout orbax writes for an unsharded
    array); else None."""
    try:
        stored = jnp.dtype(meta["data_type"])
        (codec,) = meta["codecs"]
        sharding = dict(codec.get("configuration", {}))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    whole = {"name": "regular", "configuration": {"chunk_shape": list(shape)}}
    keys = meta.get("chunk_key_encoding", {})
    plain = (meta.get("zarr_format") == 3 and meta.get("node_type") == "array" and len(shape) > 0
             and meta.get("shape") == list(shape) and meta.get("chunk_grid") == whole
             and keys.get("name") == "default" and keys.get("configuration", {}).get("separator", "/") == "/"
             and codec.get("name") == "sharding_indexed" and sharding.pop("index_location", "end") == "end"
             and sharding == {"chunk_shape": list(shape), "codecs": [bytes_codec(stored)],
                              "index_codecs": [LITTLE, {"name": "crc32c"}]})
    return stored if plain else None


def bytes_codec(dtype) -> dict:
    """The `bytes` codec tensorstore writes for `dtype` (one-byte types name no byte order)."""
    return LITTLE if jnp.dtype(dtype).itemsize > 1 else {"name": "bytes"}


def shard_file(array_dir: Path, ndim: int) -> Path:
    """The one shard file of an array stored as `one_plain_shard` (chunk key `c/0/.../0`)."""
    return array_dir.joinpath("c", *["0"] * ndim)


def data_offset(shard: Path, nbytes: int) -> int:
    """Where the array's `nbytes` start in `shard`, from the shard's index. A shard that is
    missing, cut short, or whose index fails its crc32c raises CheckpointError, naming the file."""
    try:
        with open(shard, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(size - INDEX_BYTES, 0))
            index = f.read(INDEX_BYTES)
    except OSError as e:
        raise CheckpointError(f"{shard}: cannot read the array's data ({e.strerror or e})") from None
    offset, stored = (int(v) for v in np.frombuffer(index[:16].ljust(16, b"\0"), "<u8"))
    if (len(index) < INDEX_BYTES or crc32c(index[:16]) != int.from_bytes(index[16:], "little")
            or stored != nbytes or offset + nbytes > size - INDEX_BYTES):
        raise CheckpointError(f"{shard}: damaged ({size} bytes, its index does not hold {nbytes} bytes of data)")
    return offset


def map_array(array_dir: Path, shape: tuple[int, ...], dtype) -> np.ndarray | None:
    """`array_dir`'s array as a copy-on-write mapping of its shard file, or None where it is not
    stored as `one_plain_shard`, or is stored in another dtype: orbax reads (and casts) those.
    A plain shard that is damaged raises CheckpointError (`data_offset`), whatever the dtype."""
    try:
        meta = json.loads((array_dir / "zarr.json").read_text())
    except (OSError, ValueError):
        return None
    stored = one_plain_shard(meta, shape)
    if stored is None:
        return None
    shard = shard_file(array_dir, len(shape))
    offset = data_offset(shard, int(np.prod(shape)) * stored.itemsize)
    if stored != jnp.dtype(dtype):
        return None
    try:
        return np.memmap(shard, dtype=stored, mode="c", offset=offset, shape=tuple(shape))
    except (OSError, ValueError):  # a file system that cannot map files: orbax reads it
        return None


def descriptors_left() -> int:
    """How many more files this process may hold open, less `SPARE_DESCRIPTORS`."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        held = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64
    except (ImportError, OSError):
        return 0
    return (1 << 30) if soft == resource.RLIM_INFINITY else soft - held - SPARE_DESCRIPTORS


def map_arrays(params_dir: Path, wanted: dict[str, tuple[tuple[int, ...], object]]) -> dict[str, np.ndarray]:
    """{leaf path: mapping} for every leaf of `wanted` ({path: (shape, dtype)}) whose directory
    (orbax names it by the dotted path) holds it as `one_plain_shard`, while file descriptors last."""
    room = descriptors_left()
    out = {}
    for path, (shape, dtype) in wanted.items():
        if len(out) >= room:
            break
        array = map_array(params_dir / path, tuple(shape), dtype)
        if array is not None:
            out[path] = array
    return out
