"""One model over many devices with XLA SPMD: a mesh from a spec, one table of partition rules.

    mesh = hybridjax.make_mesh("data=1,tensor=2,expert=4")   # or "auto"
    params = hybridjax.shard_params(params, cfg, mesh)         # or load_hf(..., mesh=mesh)
    cache = hybridjax.init_cache(cfg, batch, max_len, mesh=mesh)
    logits, cache = hybridjax.forward(params, tokens, cache, cfg)

The mesh always has the three axes `data` (batch rows), `tensor` (heads, hidden columns,
vocabulary) and `expert` (MoE experts), size 1 when unused, so every rule can name every axis.
Parameters are placed by `RULES`, one table keyed by the leaf's dotted path (the names of
`hybridjax.conversion.hf.leaf_shapes`); XLA's partitioner inserts the collectives (Megatron-style: column
sharded in, row sharded out, one all-reduce per block; experts on their own axis). The delta rule
is the exception: it is independent per head, so `delta_rule_specs` runs it under `shard_map` with
no communication inside (the Pallas kernels could not be partitioned by XLA anyway).

Sharded params carry their mesh (`Params.mesh`, static), so `forward` can open it as the abstract
mesh while tracing (`mesh_scope`) and `ops` can see it. Design and numbers: docs/sharding.md.
References followed: the JAX sharded-computation and shard_map guides, and the Megatron-LM
column/row split (Shoeybi et al. 2019).
"""

from __future__ import annotations

import contextlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hybridjax import cache as cache_lib
from hybridjax.cache import GDNState, KVState, PagedKV
from hybridjax.config import Config

AXES = ("data", "tensor", "expert")


class MeshError(ValueError):
    """A mesh spec, or a model that does not divide over a mesh; the message says which and why."""


# --- meshes ------------------------------------------------------------------------------


def parse_spec(spec: str) -> dict[str, int]:
    """"data=1,tensor=2,expert=4" -> {"data": 1, "tensor": 2, "expert": 4} (missing axes: 1)."""
    sizes = dict.fromkeys(AXES, 1)
    seen = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in AXES:
            raise MeshError(f"mesh spec {spec!r}: {part!r} is not AXIS=SIZE with AXIS one of {', '.join(AXES)}")
        if name in seen:
            raise MeshError(f"mesh spec {spec!r}: axis {name!r} given twice")
        try:
            size = int(value)
        except ValueError:
            raise MeshError(f"mesh spec {spec!r}: size of {name!r} is {value.strip()!r}, not an integer") from None
        if size < 1:
            raise MeshError(f"mesh spec {spec!r}: size of {name!r} must be >= 1, got {size}")
        sizes[name] = size
        seen.add(name)
    return sizes


def auto_sizes(n: int, cfg: Config | None = None) -> dict[str, int]:
    """A sensible mesh for n devices: `tensor` as wide as every head count allows (all n without
    a config), then `expert` for the rest when the experts divide over it, else `data`."""
    if cfg is None:
        return {"data": 1, "tensor": n, "expert": 1}
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.linear_num_key_heads,
             cfg.linear_num_value_heads, cfg.vocab_size)
    tensor = max(d for d in range(1, n + 1) if n % d == 0 and all(h % d == 0 for h in heads))
    rest = n // tensor
    if cfg.num_experts and cfg.num_experts % rest == 0:
        return {"data": 1, "tensor": tensor, "expert": rest}
    return {"data": rest, "tensor": tensor, "expert": 1}


# Device order when a spec does not give one: `tensor` innermost (its all-reduces come every
# layer: keep them on the fastest links, within a host), `data` outermost (no traffic).
DEFAULT_ORDER = ("data", "expert", "tensor")


def make_mesh(spec: str = "auto", cfg: Config | None = None, devices=None) -> Mesh:
    """A `jax.sharding.Mesh` with axes data, tensor and expert over `devices` (default: all, every
    process's). `spec` is "AXIS=SIZE,..." (sizes must multiply to the device count) or "auto".

    Devices are laid out in the spec's axis order, the first varying slowest (axes it leaves out
    have size 1); with `jax.devices()` ordered process by process, "expert=2,tensor=8" on 2 hosts
    of 8 puts `expert` across the hosts and `tensor` within each. "auto" uses DEFAULT_ORDER.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    auto = spec.strip() == "auto"
    sizes = auto_sizes(n, cfg) if auto else parse_spec(spec)
    total = math.prod(sizes.values())
    if total != n:
        shown = " x ".join(f"{a}={sizes[a]}" for a in AXES)
        raise MeshError(f"mesh {shown} has {total} devices but there are {n}; the sizes must multiply to {n}")
    given = [] if auto else [p.partition("=")[0].strip() for p in spec.split(",") if p.strip()]
    order = tuple(given) + tuple(a for a in DEFAULT_ORDER if a not in given)
    kinds = (jax.sharding.AxisType.Auto,) * len(order)
    return jax.make_mesh(tuple(sizes[a] for a in order), order, axis_types=kinds, devices=devices)


def axis_size(mesh, name: str) -> int:
    """Size of a mesh axis (1 when the mesh is None, empty, or has no such axis)."""
    if mesh is None or getattr(mesh, "empty", False):
        return 1
    return int(dict(mesh.shape).get(name, 1))


def is_multi_device(mesh) -> bool:
    return mesh is not None and not getattr(mesh, "empty", False) and mesh.size > 1


def mesh_scope(mesh):
    """While tracing, make `mesh` the abstract mesh that `ops` consults (a no-op for None)."""
    if not is_multi_device(mesh):
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh))


def current_mesh():
    """The abstract mesh being traced under (set by `mesh_scope` or `jax.set_mesh`), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh if is_multi_device(mesh) else None


# --- heads that must divide -------------------------------------------------------------


def check_model(cfg: Config, mesh) -> None:
    """Raise MeshError naming every head / width count of `cfg` that does not divide over its axis.

    Attention KV heads and GDN key heads need not divide: with more shards than heads they are
    replicated, each shard holding the heads its query / value heads read (`kv_replicated`)."""
    t, e = axis_size(mesh, "tensor"), axis_size(mesh, "expert")
    counts = [
        ("attention query heads (num_attention_heads)", cfg.num_attention_heads, "tensor", t),
        ("GDN value heads (linear_num_value_heads)", cfg.linear_num_value_heads, "tensor", t),
        ("vocabulary (vocab_size)", cfg.vocab_size, "tensor", t),
    ]
    if not cfg.moe_layers or not all(cfg.moe_layers):  # some layer has a dense MLP
        counts.append(("MLP width (intermediate_size)", cfg.intermediate_size, "tensor", t))
    if cfg.num_experts:
        counts += [
            ("experts (num_experts)", cfg.num_experts, "expert", e),
            ("expert width (moe_intermediate_size)", cfg.moe_intermediate_size, "tensor", t),
            ("shared expert width (shared_expert_intermediate_size)", cfg.shared_expert_intermediate_size, "tensor", t),
        ]
    bad = [f"{what} = {n} does not divide evenly over {axis}={size}" for what, n, axis, size in counts
           if size > 1 and n % size]
    if bad:
        raise MeshError("model does not fit the mesh: " + "; ".join(bad))


# --- the partition rules -----------------------------------------------------------------

# (pattern searched in the leaf's dotted path, rank, spec). First match wins; rank None: any.
# Column-parallel in (outputs split by head / column), row-parallel out (inputs split), so each
# block needs one all-reduce of [B, T, D]. GDN's in_qkv / conv are split by channel in the
# checkpoint's [q | k | v] order, which is not head-aligned: XLA moves the conv output (C values
# per token) to the head shards before the delta rule (docs/sharding.md).
RULES: tuple[tuple[str, int | None, P], ...] = (
    (r"^embed$", 2, P("tensor", None)),  # [vocab, D]: by vocabulary
    (r"^lm_head$", 2, P(None, "tensor")),  # [D, vocab]
    (r"mixer\.q_proj$", 2, P(None, "tensor")),  # [D, Hq*2*Dh]: per head [q_h | gate_h]
    (r"mixer\.[kv]_proj$", 2, P(None, "tensor")),  # [D, Hkv*Dh]
    (r"mixer\.o_proj$", 2, P("tensor", None)),  # [Hq*Dh, D]
    (r"mixer\.in_qkv$", 2, P(None, "tensor")),  # [D, C] by channel
    (r"mixer\.conv$", 2, P(None, "tensor")),  # [W, C] by channel, as in_qkv
    (r"mixer\.in_[zba]$", 2, P(None, "tensor")),  # [D, Hv*V], [D, Hv]
    (r"mixer\.(dt_bias|A_log)$", 1, P("tensor")),  # [Hv]
    (r"mixer\.out_proj$", 2, P("tensor", None)),  # [Hv*V, D]
    (r"ffn\.(gate|up)$", 3, P("expert", None, "tensor")),  # MoE [E, D, I]
    (r"ffn\.down$", 3, P("expert", "tensor", None)),  # MoE [E, I, D]
    (r"ffn\.router$", 2, P()),  # [D, E]: every device routes every token
    (r"ffn\.shared_gate$", 2, P()),  # [D, 1]
    (r"ffn\.(shared\.)?(gate|up)$", 2, P(None, "tensor")),  # MLP / shared expert [D, I]
    (r"ffn\.(shared\.)?down$", 2, P("tensor", None)),  # [I, D]
    (r"", None, P()),  # norms, the MTP head's fc, extra tensors: replicated
)


def spec_for(path: str, shape: tuple[int, ...], kv_replicated: bool = False) -> P:
    """The PartitionSpec of a leaf by `RULES`; `kv_replicated`: k_proj / v_proj whole on every
    device (their heads are fewer than the tensor shards, see `kv_replicated`)."""
    if kv_replicated and re.search(_KV_PROJ, path):
        return P()
    for pattern, rank, spec in RULES:
        if (rank is None or rank == len(shape)) and re.search(pattern, path):
            return spec
    raise AssertionError("the last rule matches everything")


_KV_PROJ = r"mixer\.[kv]_proj$"


def kv_replicated(cfg: Config | None, mesh) -> bool:
    """Whether `mesh` has more tensor shards than `cfg` has KV heads (more exactly: they do not
    divide). Then, as vLLM does, every device computes all Hkv heads (k_proj / v_proj replicated:
    they are small) and keeps in its cache only the copies its query heads read
    (`Config.kv_heads_laid_out`: the cache holds lcm(Hkv, tensor) heads, split on `tensor`)."""
    return cfg is not None and cfg.num_key_value_heads % axis_size(mesh, "tensor") != 0


def _leaf_path(path) -> str:
    return ".".join(str(getattr(p, "name", getattr(p, "idx", getattr(p, "key", p)))) for p in path)


def _checked(path: str, shape, spec: P, mesh) -> P:
    for dim, axis in zip(shape, tuple(spec)):
        if axis is not None and dim % axis_size(mesh, axis):
            raise MeshError(f"{path} {tuple(shape)}: dimension {dim} does not divide evenly over {axis}={axis_size(mesh, axis)}")
    return spec


def param_specs(tree, mesh, cfg: Config | None = None):
    """PartitionSpecs for a Params-shaped tree whose leaves are arrays, ShapeDtypeStructs or
    shape tuples (`params.param_shapes`), by `RULES` (KV projections replicated when `cfg`'s KV
    heads do not divide over `tensor`: `kv_replicated`)."""
    from hybridjax.params import is_shape

    replicate = kv_replicated(cfg, mesh)

    def one(path, leaf):
        shape = leaf if is_shape(leaf) else tuple(leaf.shape)
        p = _leaf_path(path)
        return _checked(p, shape, spec_for(p, shape, replicate), mesh)

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_shape)


def param_shardings(tree, cfg: Config, mesh: Mesh):
    """NamedShardings for a Params-shaped tree (see `param_specs`), after `check_model`."""
    check_model(cfg, mesh)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), param_specs(tree, mesh, cfg),
                                  is_leaf=lambda x: isinstance(x, P))


def sharding_by_path(cfg: Config, mesh: Mesh, mtp: bool = False) -> dict[str, NamedSharding]:
    """Leaf path -> NamedSharding for every param of `cfg` (what loaders place shards by)."""
    from hybridjax.params import is_shape, param_shapes

    check_model(cfg, mesh)
    flat, _ = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, mtp), is_leaf=is_shape)
    replicate = kv_replicated(cfg, mesh)
    return {_leaf_path(p): NamedSharding(mesh, _checked(_leaf_path(p), s, spec_for(_leaf_path(p), s, replicate), mesh))
            for p, s in flat}


def shard_params(params, cfg: Config, mesh: Mesh):
    """`params` placed on `mesh` by `RULES` (a new value), carrying the mesh for `forward`."""
    shardings = param_shardings(params.replace(mesh=None), cfg, mesh)
    placed = jax.tree_util.tree_map(jax.device_put, params.replace(mesh=None), shardings)
    return placed.replace(mesh=mesh)


# --- caches and activations -------------------------------------------------------------


def batch_axis(mesh, batch: int):
    """"data" when the batch divides over it, else None (rows replicated)."""
    d = axis_size(mesh, "data")
    return "data" if d > 1 and batch % d == 0 else None


def state_specs(state, mesh, batch: int):
    """PartitionSpecs for one layer's state: KV [B|P, S, Hkv, Dh] and GDN ssm [B, Hv, K, V] by
    heads, the GDN conv state [B, W-1, C] by channel (as in_qkv), rows on `data`."""
    b = batch_axis(mesh, batch)
    if isinstance(state, KVState):
        return KVState(k=P(b, None, "tensor", None), v=P(b, None, "tensor", None))
    if isinstance(state, PagedKV):  # pages are shared between rows: never split on data
        return PagedKV(k=P(None, None, "tensor", None), v=P(None, None, "tensor", None),
                       table=None if state.table is None else P(b, None))
    if isinstance(state, GDNState):
        return GDNState(conv=P(b, None, "tensor"), ssm=P(b, "tensor", None, None))
    raise TypeError(f"no partition rule for a layer state of type {type(state).__name__}")


def init_cache(cfg: Config, batch_size: int, max_len: int, dtype=jnp.float32, capacity: int | None = None,
               mesh: Mesh | None = None) -> cache_lib.Cache:
    """`hybridjax.cache.init_cache`, placed on `mesh` when one is given (the facade's `init_cache`):
    the KV heads laid out for its `tensor` axis, then every leaf put on its devices."""
    kv_shards = axis_size(mesh, "tensor")
    empty = cache_lib.init_cache(cfg, batch_size, max_len, dtype, capacity, kv_shards=kv_shards)
    return empty if mesh is None else shard_cache(empty, mesh)


def shard_cache(cache, mesh: Mesh):
    """A `Cache` placed on `mesh`: KV and GDN state by heads, rows on `data` when they divide."""
    b = cache.batch_size
    layers = tuple(
        jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), st, state_specs(st, mesh, b))
        for st in cache.layers
    )
    lengths = jax.device_put(cache.lengths, NamedSharding(mesh, P(batch_axis(mesh, b))))
    return cache.replace(layers=layers, lengths=lengths)


def delta_rule_specs(mesh, batch: int, hk: int):
    """shard_map specs for the delta rule (q, k, v, g, beta, state) -> (o, state): heads on
    `tensor`, rows on `data`. Value head h reads key head h // r, so contiguous key-head shards
    and value-head shards line up and no shard needs another's heads."""
    t = axis_size(mesh, "tensor")
    if hk % t:
        raise MeshError(f"GDN key heads (linear_num_key_heads) = {hk} does not divide evenly over tensor={t}")
    b = batch_axis(mesh, batch)
    qkv = P(b, None, "tensor", None)  # [B, T, H, K|V]
    gate = P(b, None, "tensor")  # [B, T, Hv]
    state = P(b, "tensor", None, None)  # [B, Hv, K, V]
    return (qkv, qkv, qkv, gate, gate, state), (qkv, state)


def paged_attention_specs(mesh, batch: int, hkv: int):
    """shard_map specs for paged attention (q, k_pages, v_pages, table, q_pos) -> out: heads on
    `tensor`; rows on `data` (the pool, shared by rows, is not split on data)."""
    t = axis_size(mesh, "tensor")
    if hkv % t:
        raise MeshError(f"attention key/value heads (num_key_value_heads) = {hkv} does not divide evenly over tensor={t}")
    b = batch_axis(mesh, batch)
    q = P(b, None, "tensor", None)  # [B, T, Hq, Dh]
    pool = P(None, None, "tensor", None)  # [P, S, Hkv, Dh]
    return (q, pool, pool, P(b, None), P(b, None)), q


def moe_specs(mesh, rows: int):
    """shard_map specs for the routed experts (gate, up, down, x, weights, experts, valid) -> y:
    experts on `expert`, their width on `tensor` (as RULES place them), token rows on `data`."""
    b = batch_axis(mesh, rows)
    wide = P("expert", None, "tensor")  # gate, up [E, D, I]
    return (wide, wide, P("expert", "tensor", None), P(b, None), P(b, None), P(b, None), P(b)), P(b, None)


# --- accounting --------------------------------------------------------------------------


def bytes_per_device(tree) -> dict:
    """{device: bytes of `tree`'s arrays that device holds} (addressable shards only)."""
    out: dict = {}
    for x in jax.tree_util.tree_leaves(tree):
        for s in x.addressable_shards:
            out[s.device] = out.get(s.device, 0) + int(np.prod(s.data.shape)) * x.dtype.itemsize
    return out
