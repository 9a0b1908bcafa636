"""Converted hybridjax checkpoints: an orbax checkpoint of `Params` beside the HF side files.

A checkpoint directory holds:

    params/            orbax (tensorstore, zarr3, uncompressed, one directory per array) checkpoint of
                       the Params pytree, `extra` (mtp.* tensors) included
    config.json        the source's HF config.json, byte for byte (so `load_config` reads it)
    hybridjax.json     marker: format, version, dtype, every array's shape, the extra tensors,
                       the dtype to write the gates back to HF in, notes on the source
    tokenizer.json ... tokenizer / chat template / generation files copied from the source

Loading first checks the shapes the marker recorded against `param_shapes(cfg)` (so an edited
config.json is caught and every mismatching leaf named), then restores into those abstract
shapes: each array stored whole in the dtype wanted is mapped from its file without a copy
(`conversion.mapped`), the others are read a layer or so at a time. Checkpoints written before
(orbax's OCDBT layout) load as they did, through orbax. Every writer goes through `staged_dir`:
output is built in a hidden sibling directory and renamed into place at the end, so a failure
never leaves a half-written `out`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from hybridjax.conversion.hf import (CheckpointError, assemble, flat_leaves, has_mtp, leaf_shapes, load_hf, open_hf, path_str,
                           read_params)
from hybridjax.conversion.mapped import map_arrays
from hybridjax.conversion.progress import Progress, TensorBar, load_progress
from hybridjax.config import Config, load_config, read_json
from hybridjax.params import FLOAT32_LEAVES, Params, is_shape, param_shapes

FORMAT = "hybridjax-orbax"
FORMAT_VERSION = 1
MARKER = "hybridjax.json"
PARAMS_DIR = "params"
# Side files carried over in both directions when the source has them.
AUX_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
    "tokenizer.model",
)


# --- output directories ----------------------------------------------------------------


def check_out(out: Path, force: bool, sources: tuple[Path, ...] = ()) -> Path:
    """Refuse an existing `out` (unless force) and an `out` that overlaps a source."""
    out = Path(out).absolute()
    real_out = out.resolve()  # through `..` and symlinks: `--force` must never replace a source
    for src in sources:
        src = Path(src).resolve()
        if real_out == src or src in real_out.parents or real_out in src.parents:
            raise CheckpointError(f"output {out} overlaps the source directory {src}; choose another --out")
    if out.exists() and not force:
        raise CheckpointError(f"output already exists: {out} (use --force to replace it)")
    return out


@contextlib.contextmanager
def staged_dir(out: Path, force: bool = False, sources: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Yield a fresh hidden sibling of `out`; on success it replaces `out`, on any error it is removed."""
    out = check_out(out, force, sources)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        if out.exists() or out.is_symlink():
            check_out(out, force)
            old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_aux_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in AUX_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


# --- marker -----------------------------------------------------------------------------


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def read_marker(path: Path) -> dict:
    marker = Path(path) / MARKER
    if not marker.is_file():
        raise CheckpointError(f"{path}: not a converted hybridjax checkpoint (no {MARKER})")
    info = read_json(marker, CheckpointError)
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(f"{marker}: 'format' is {info.get('format') if isinstance(info, dict) else None!r}, expected {FORMAT!r}")
    if info.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{marker}: 'format_version' {info.get('format_version')!r} is not supported (this hybridjax reads {FORMAT_VERSION})"
        )
    for key in ("dtype", "extra", "shapes"):
        if key not in info:
            raise CheckpointError(f"{marker}: missing field {key!r}")
    return info


# --- orbax ------------------------------------------------------------------------------


class _NoMergeNote(logging.Filter):
    """Drops the warning orbax (0.12) logs on every save without OCDBT: that it found no OCDBT
    files to merge. There are none by design (`_checkpointer`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT checkpoints" not in record.getMessage()


def _checkpointer():
    import orbax.checkpoint as ocp

    absl = logging.getLogger("absl")
    if not any(isinstance(f, _NoMergeNote) for f in absl.filters):
        absl.addFilter(_NoMergeNote())

    # Weights barely compress (random mantissas) and zstd costs load time; store them raw, each
    # array in its own file (no OCDBT), so that a load maps them (`conversion.mapped`). A restore
    # reads either layout.
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True, use_compression=False))


def abstract_params(cfg: Config, dtype, extra: dict[str, dict], mtp: bool = False, mesh=None) -> Params:
    """Params of jax.ShapeDtypeStruct: `dtype` for weights, float32 for the gate leaves; on the
    first device, or by `hybridjax.sharding.RULES` on `mesh` (extra tensors replicated)."""
    from hybridjax.sharding import sharding_by_path

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if mesh is not None:
        by_path, sharding = sharding_by_path(cfg, mesh, mtp), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def leaf(path, shape):
        name = getattr(path[-1], "name", "")
        where = sharding if mesh is None else by_path[path_str(path)]
        return jax.ShapeDtypeStruct(shape, jnp.float32 if name in FLOAT32_LEAVES else jnp.dtype(dtype), sharding=where)

    tree = jax.tree_util.tree_map_with_path(leaf, param_shapes(cfg, mtp), is_leaf=is_shape)
    kept = {n: jax.ShapeDtypeStruct(tuple(e["shape"]), jnp.dtype(e["dtype"]), sharding=sharding) for n, e in extra.items()}
    return tree.replace(extra=kept)


def _check_shapes(path: Path, info: dict, cfg: Config) -> None:
    """Compare the stored arrays (as the marker lists them) with what config.json implies."""
    stored = {n: tuple(s) for n, s in info["shapes"].items()}
    expected = leaf_shapes(cfg, has_mtp(stored))
    problems = []
    if missing := sorted(set(expected) - set(stored)):
        problems.append(f"missing arrays ({len(missing)}): {', '.join(missing[:20])}")
    if unexpected := sorted(set(stored) - set(expected)):
        problems.append(f"unexpected arrays ({len(unexpected)}): {', '.join(unexpected[:20])}")
    bad = [f"{n} has shape {stored[n]}, expected {s}" for n, s in expected.items() if n in stored and stored[n] != s]
    if bad:
        problems.append("mis-shaped arrays: " + "; ".join(bad[:20]))
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match config.json: " + "; ".join(problems))


class CheckpointReader:
    """A converted checkpoint opened for reading: marker and config checked, the abstract target
    built in `dtype` (None: as stored; gates stay float32). Restores all params, or one group."""

    def __init__(self, path: str | Path, dtype=None, mesh=None):
        self.path = Path(path).absolute()
        self.info = read_marker(self.path)
        self.cfg = load_config(self.path)
        self.params_dir = self.path / PARAMS_DIR
        if not self.params_dir.is_dir():
            raise CheckpointError(f"{self.path}: the params directory {PARAMS_DIR}/ is missing")
        _check_shapes(self.path, self.info, self.cfg)
        self.dtype = jnp.dtype(dtype or self.info["dtype"])
        self.mesh = mesh
        self.target = abstract_params(self.cfg, self.dtype, self.info["extra"], has_mtp(self.info["shapes"]), mesh)
        self._ckpt = None  # orbax's, made when first needed: a load that maps every array never imports it
        self.counts = {"mapped": 0, "restored": 0}  # how the last `restore` read its leaves

    def restore(self, progress: Progress | None = None) -> Params:
        """Every param as a device array. On one device, each array stored whole in the dtype
        wanted is its file, mapped (`conversion.mapped`); the rest are restored as host arrays a
        layer or so at a time and placed one by one, so the transient beyond the model stays near
        one layer (orbax's own full restore holds a host copy of everything: measured 1.7x the
        model, this ~1.35x). `progress(steps, total_bytes)` returns a callback taking the bytes of
        each leaf read."""
        targets = flat_leaves(self.target)
        step = progress(len(targets), sum(x.size * x.dtype.itemsize for x in targets.values())) if progress else None
        leaves: dict[str, jax.Array] = {}
        if self.mesh is None:
            wanted = {path: (x.shape, x.dtype) for path, x in targets.items()}
            leaves = {path: jax.device_put(x) for path, x in map_arrays(self.params_dir, wanted).items()}
            if step:
                for x in leaves.values():
                    step(x.nbytes)
        self.counts = {"mapped": len(leaves), "restored": len(targets) - len(leaves)}
        for item in self._batches(skip=set(leaves)):
            got = (self.sharded(item) if self.mesh is not None else
                   {path: jax.device_put(x) for path, x in self.host(item).items()})
            leaves.update(got)
            if step:
                for x in got.values():
                    step(x.nbytes)
        extra = {p.split(".", 1)[1]: leaves.pop(p) for p in list(leaves) if p.startswith("extra.")}
        return assemble(self.cfg, leaves, extra).replace(mesh=self.mesh)

    def sharded(self, item: dict) -> dict[str, jax.Array]:
        """Restore a partial tree straight onto the mesh: orbax reads each device's slice of each
        array from tensorstore (no host copy of a whole array, on any host)."""
        import orbax.checkpoint as ocp

        if not item:
            return {}
        args = jax.tree_util.tree_map(
            lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype), item)
        got = self._restore(ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True))
        return flat_leaves(got)

    def group(self, key: str) -> dict[str, np.ndarray]:
        """One group of params as host arrays, by leaf path: key "top" (embed, final_norm, lm_head),
        "layers.<i>", "mtp" (the MTP head), or "extra" (paths "extra.<name>")."""
        if key == "top":
            return self.host(self._item(top=True))
        if key == "mtp":
            return self.host(self._item(mtp=True))
        if key == "extra":
            return self.host(self._item(extra=True))
        return self.host(self._item(layers=(int(key.split(".")[1]),)))

    def host(self, item: dict) -> dict[str, np.ndarray]:
        """Restore a partial tree (from `_item`) as host arrays in the target dtype."""
        import orbax.checkpoint as ocp

        if not item:
            return {}
        restore_args = jax.tree_util.tree_map(lambda s: ocp.RestoreArgs(restore_type=np.ndarray, dtype=s.dtype), item)
        got = self._restore(ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True))
        want = flat_leaves(item)
        out = {}
        for path, x in flat_leaves(got).items():
            if tuple(x.shape) != tuple(want[path].shape):  # host restores do not check shapes themselves
                raise CheckpointError(f"{self.params_dir}: stored array {path} has shape {tuple(x.shape)}, expected {want[path].shape}")
            out[path] = x
        return out

    def _item(self, top: bool = False, layers: tuple[int, ...] = (), extra: bool = False, mtp: bool = False) -> dict:
        t, item = self.target, {}
        if top:
            item.update(embed=t.embed, final_norm=t.final_norm, **({} if t.lm_head is None else {"lm_head": t.lm_head}))
        if layers:
            item["layers"] = [t.layers[j] if j in layers else None for j in range(len(t.layers))]
        if extra and t.extra:
            item["extra"] = dict(t.extra)
        if mtp and t.mtp is not None:
            item["mtp"] = t.mtp
        return item

    def _batches(self, skip: set[str] = frozenset()) -> list[dict]:
        """top + extra + mtp, then runs of layers of about 1/32 of the model each (a restore call
        costs ~40 ms, so a 48-layer model does not pay 48 of them), without the leaves in `skip`
        (by dotted path) and without batches left empty."""
        size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
        budget = size(self.target) / 32
        batches, run, run_bytes = [self._item(top=True, extra=True, mtp=True)], [], 0
        for i, layer in enumerate(self.target.layers):
            run.append(i)
            run_bytes += size(layer)
            if run_bytes >= budget or i == len(self.target.layers) - 1:
                batches.append(self._item(layers=tuple(run)))
                run, run_bytes = [], 0
        pruned = (jax.tree_util.tree_map_with_path(lambda p, x: None if path_str(p) in skip else x, b) for b in batches)
        return [b for b in pruned if jax.tree_util.tree_leaves(b)]

    def _restore(self, args):
        if self._ckpt is None:
            self._ckpt = _checkpointer()
        try:
            return self._ckpt.restore(self.params_dir, args=args)
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointError(f"{self.params_dir}: cannot restore the params ({' '.join(str(e).split())[:500]})") from None


def load_checkpoint(path: str | Path, dtype=None, mesh=None, progress=None) -> tuple[Config, Params]:
    """(Config, Params) from a converted checkpoint; `dtype` None keeps the stored dtype; `mesh`:
    restored onto the mesh by `hybridjax.sharding.RULES`, shard by shard; `progress` as in
    `CheckpointReader.restore`."""
    reader = CheckpointReader(path, dtype, mesh)
    return reader.cfg, reader.restore(progress)


def save_checkpoint(
    params: Params,
    out: str | Path,
    *,
    config_dir: str | Path,
    force: bool = False,
    gate_hf_dtype=None,
    source: dict | None = None,
) -> Path:
    """Write `params` as a converted checkpoint at `out` (staged, then renamed into place).

    config.json and the tokenizer files are copied from `config_dir`. `gate_hf_dtype`: the dtype the export back to HF writes A_log / dt_bias
    in (default float32, the dtype they are kept in here).
    """
    config_dir = Path(config_dir)
    cfg_json = config_dir / "config.json"
    if not cfg_json.is_file():
        raise CheckpointError(f"no config.json found at {cfg_json}")
    with staged_dir(Path(out), force, (config_dir,)) as tmp:
        with _checkpointer() as ckpt:
            ckpt.save((tmp / PARAMS_DIR).absolute(), args=_save_args(params))
        shutil.copyfile(cfg_json, tmp / "config.json")
        copy_aux_files(config_dir, tmp)
        info = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "dtype": jnp.dtype(params.embed.dtype).name,
            "gate_hf_dtype": jnp.dtype(gate_hf_dtype or jnp.float32).name,
            "extra": {n: {"shape": list(x.shape), "dtype": jnp.dtype(x.dtype).name} for n, x in params.extra.items()},
            "shapes": {n: list(x.shape) for n, x in flat_leaves(params.replace(extra={})).items()},
            "source": source or {},
        }
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    return Path(out)


def _save_args(params: Params):
    import orbax.checkpoint as ocp

    return ocp.args.PyTreeSave(params)


# --- HF -> checkpoint -------------------------------------------------------------------


@dataclass
class Report:
    """What a conversion did, for the CLI to print."""

    out: Path
    dtype: str
    tensors: int
    nbytes: int
    seconds: float
    dropped: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def convert_hf(
    hf_dir: str | Path,
    out: str | Path,
    *,
    dtype=None,
    force: bool = False,
    progress: Callable[[int, int], Callable[[int], None]] | None = None,
) -> Report:
    """HF directory -> converted checkpoint in `dtype` (None: the source's dtype).

    Tensors are read and transformed one at a time into device arrays in the target dtype
    (peak memory: one copy of the model in that dtype), then saved by orbax.
    `progress(steps, total_bytes)` returns a callback taking the bytes of each param leaf read.
    """
    from hybridjax.conversion.hub import resolve_model

    start = time.perf_counter()
    hf_dir = resolve_model(hf_dir)
    check_out(Path(out), force, (hf_dir,))  # fail before reading anything
    with open_hf(hf_dir) as src:
        stored, total = src.stored_dtype(), src.nbytes()
        n_tensors = sum(len(r.hf) for r in src.rules) + len(src.kept)
        dropped, kept, cfg = src.dropped, src.kept, src.cfg
        gate_names = [n for r in src.rules for p, n in zip(r.params, r.hf) if p.rsplit(".", 1)[-1] in FLOAT32_LEAVES]
        gate_src = src.reader.dtype(gate_names[0]) if gate_names else np.dtype("float32")
        target = jnp.dtype(stored if dtype is None else dtype)
        if src.reader.scales and target == jnp.float16:
            raise CheckpointError("fp8 weights convert to bfloat16 or float32 (--dtype): float16 cannot hold every "
                                  "dequantised value, so the export back to fp8 would not be exact")
        params = read_params(src, target, progress(src.n_leaves, total) if progress else None)
    # Write the gates back as the source stored them when it stored them in the model dtype.
    gate_hf = target if gate_src == target else jnp.dtype("float32")
    source = {"path": str(hf_dir.absolute()), "model_type": cfg.model_type, "dtype": np.dtype(stored).name,
              "dropped": len(dropped)}
    save_checkpoint(params, out, config_dir=hf_dir, force=force, gate_hf_dtype=gate_hf, source=source)
    return Report(Path(out), target.name, n_tensors, total, time.perf_counter() - start, dropped, kept)


# --- either kind ------------------------------------------------------------------------


def load(path: str | Path, dtype=None, mesh=None, progress: bool | Progress | None = None) -> tuple[Config, Params]:
    """(Config, Params) from an HF model directory, a converted checkpoint, or a Hugging Face
    Hub id ORG/NAME[@REVISION] (downloaded into the hub cache: `conversion.hub`).

    dtype None keeps the stored dtype (an HF directory's: that of its embedding table).
    mesh: place the params on a device mesh as they are read (`hybridjax.sharding`).
    progress: a tqdm bar on stderr (tensors and bytes) if True, or None and stderr is a terminal;
    none if False; or a factory `progress(steps, total_bytes) -> callback(nbytes)`.
    """
    from hybridjax.conversion.hub import resolve_model

    path = resolve_model(path)
    factory = load_progress(progress)
    try:
        if is_checkpoint(path):
            return load_checkpoint(path, dtype=dtype, mesh=mesh, progress=factory)
        return load_hf(path, dtype=dtype, mesh=mesh, progress=factory)
    except BaseException:
        if isinstance(factory, TensorBar):
            factory.close(failed=True)
        raise
