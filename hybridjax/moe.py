"""Routed mixture of experts: route once, then run only the chosen experts.

    r = route(x, router, k, norm_topk_prob, valid)    # Routing: weights, experts [N, k]; valid [N]
    # many tokens (prefill, batched decode): sort the (token, expert) pairs by expert
    d = dispatch(r, E)                                # Dispatch: pair order, group sizes [E]
    y = combine(d, grouped_experts(gate, up, down, permute(x, d), d.group_sizes), r)
    # few tokens (decode): each row reads its k experts' weights, nothing else
    y = gathered_experts(gate, up, down, x, r)
    y = routed_experts(p, x, valid, cfg)              # picks one of the two by the number of pairs

Routing is the model's contract (transformers' Qwen3NextSparseMoeBlock / Qwen3_5MoeSparseMoeBlock):
router logits and softmax in float32, `lax.top_k` (ties go to the lower expert id), weights
renormalised over the k chosen when `norm_topk_prob`. torch.topk may break exact ties in
another order, so on exactly tied router scores the chosen experts can differ from
transformers'; the tests pin routed == dense for a given selection. Rows with valid False (right
padding, inactive engine slots) are routed nowhere: no expert runs for them, their output is zero.

Expert compute: on CPU, `hybridjax.cpu_kernels.matmul_indexed` reads each chosen expert in place
(XLA:CPU copies a dynamically sliced expert before a dot, ~25 us per 512 KB) for the gathered
path and for grouped tiles of up to 8 rows; otherwise `hybridjax.pallas_kernels.grouped_matmul` (the XLA
group loop on CPU, the Pallas kernel when lowered for a GPU).

Dispatch and combine are separate from the expert compute so that expert parallelism can put an
all-to-all between them later. The grouped path has no capacity limit and drops no token: its
buffers are sized N * k, the pairs of invalid rows parked past the groups. Dtypes: weights and
activations as given, every matmul accumulated in float32, the expert outputs combined in
float32 and returned in x's dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hybridjax import cpu_kernels, ops, sharding
from hybridjax.config import Config
from hybridjax.pallas_kernels.grouped_matmul import default_tile_rows, group_tiles, grouped_matmul, tgmm_xla

Array = jax.Array

# Up to this many (token, expert) pairs a layer gathers each pair's expert weights (no sort);
# more take the sort + grouped-matmul path, where rows sharing an expert read it once. Measured
# (benchmarks/bench_moe.py --crossover: E = 128, hidden 512, expert FFN 256, 2-core EPYC,
# benchmarks/README.md): within noise of each other up to ~20 pairs, grouped ahead from ~40.
GATHER_MAX_PAIRS = 16
# On CPU, grouped tiles of up to this many rows go to the CPU kernel's indexed matmul (experts
# read in place, all tiles in one call); larger tiles to the XLA loop, whose per-expert weight
# copy is then small beside the tile's compute.
CPU_KERNEL_MAX_TILE_ROWS = cpu_kernels.DECODE_ROWS


class Routing(NamedTuple):
    weights: Array  # [N, k] float32 combine weights (renormalised when norm_topk_prob)
    experts: Array  # [N, k] int32 chosen expert ids
    valid: Array  # [N] bool: rows that are routed at all


class Dispatch(NamedTuple):
    order: Array  # [N*k] int32: pair index (row * k + j) of each sorted slot, by expert
    token: Array  # [N*k] int32: the row each sorted slot reads
    group_sizes: Array  # [E] int32: slots per expert (invalid rows' pairs are in no group)


def route(x: Array, router: Array, k: int, norm_topk_prob: bool, valid: Array | None = None) -> Routing:
    """x [N, D], router [D, E] -> the top-k experts of every row and their weights."""
    probs = jax.nn.softmax(ops.dense(x, router, jnp.float32), axis=-1)  # [N, E]
    weights, experts = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    valid = jnp.ones(x.shape[:1], bool) if valid is None else valid
    return Routing(weights, experts.astype(jnp.int32), valid)


def dispatch(r: Routing, num_experts: int) -> Dispatch:
    """Sort the N*k (row, expert) pairs by expert (stable: rows in order within an expert)."""
    n, k = r.experts.shape
    eid = jnp.where(r.valid[:, None], r.experts, num_experts).reshape(-1)  # invalid rows sort last
    order = jnp.argsort(eid, stable=True).astype(jnp.int32)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[eid].add(1, mode="drop")
    return Dispatch(order, order // k, group_sizes)


def permute(x: Array, d: Dispatch) -> Array:
    """x [N, D] -> the rows of the sorted pairs [N*k, D]."""
    return x[d.token]


def combine(d: Dispatch, y: Array, r: Routing) -> Array:
    """Sorted expert outputs y [N*k, D] -> float32 [N, D], each row the weighted sum of its k.

    Unpermuting (a gather by the inverse order) and summing over k is the scatter-add by row,
    written so that each row adds its k terms in a fixed order, without atomics."""
    n, k = r.experts.shape
    inverse = jnp.zeros_like(d.order).at[d.order].set(jnp.arange(d.order.shape[0], dtype=jnp.int32))
    per_pair = y[inverse].astype(jnp.float32).reshape(n, k, -1)  # [N, k, D]
    w = jnp.where(r.valid[:, None], r.weights, 0.0)  # invalid rows: y is zero there already
    return jnp.einsum("nk,nkd->nd", w, per_pair)


def grouped_experts(gate: Array, up: Array, down: Array, xs: Array, group_sizes: Array,
                    implementation: str | None = None) -> Array:
    """The expert SwiGLU on rows sorted by expert: xs [M, D], gate/up [E, D, I], down [E, I, D]
    -> float32 [M, D] (rows past the groups: zeros)."""
    def gmm(a, w):
        return _gmm(a, w, group_sizes, implementation)

    h = (jax.nn.silu(gmm(xs, gate)) * gmm(xs, up)).astype(xs.dtype)  # [M, I]
    return gmm(h, down)


def gathered_experts(gate: Array, up: Array, down: Array, x: Array, r: Routing) -> Array:
    """Each valid row through its k experts only: reads those experts' weights and nothing else.
    x [N, D] -> float32 [N, D]. On CPU one indexed-matmul call per weight (all pairs at once,
    experts read in place); elsewhere a loop over the (row, expert) pairs."""
    if _cpu_kernel_ok(x, gate):
        return jax.lax.platform_dependent(gate, up, down, x, r, cpu=_gathered_cpu, default=_gathered_loop)
    return _gathered_loop(gate, up, down, x, r)


def _gathered_cpu(gate, up, down, x, r: Routing) -> Array:
    n, k = r.experts.shape
    idx = jnp.where(r.valid[:, None], r.experts, -1).reshape(-1)  # [N*k]; -1: nothing read
    xp = jnp.repeat(x, k, axis=0)[:, None, :]  # [N*k, 1, D], pair p = row * k + j
    h = jax.nn.silu(cpu_kernels.matmul_indexed(xp, gate, idx)) * cpu_kernels.matmul_indexed(xp, up, idx)
    y = cpu_kernels.matmul_indexed(h.astype(x.dtype), down, idx).reshape(n, k, -1)  # [N, k, D]
    return jnp.einsum("nk,nkd->nd", jnp.where(r.valid[:, None], r.weights, 0.0), y)


def _gathered_loop(gate, up, down, x, r: Routing) -> Array:
    n, k = r.experts.shape

    def pair(i, out):
        row, j = i // k, i % k

        def run(out):
            e = r.experts[row, j]
            xr = jax.lax.dynamic_slice_in_dim(x, row, 1)  # [1, D]
            h = jax.nn.silu(_dot(xr, gate[e])) * _dot(xr, up[e])  # [1, I]
            y = _dot(h.astype(x.dtype), down[e])  # [1, D]
            return out.at[row].add(r.weights[row, j] * y[0])

        return jax.lax.cond(r.valid[row], run, lambda out: out, out)

    return jax.lax.fori_loop(0, n * k, pair, jnp.zeros(x.shape, jnp.float32))


def _cpu_kernel_ok(x: Array, w: Array) -> bool:
    return (cpu_kernels.supports(1, x.dtype, w.dtype) and w.dtype != jnp.int8 and cpu_kernels.enabled())


def _gmm(x: Array, w: Array, group_sizes: Array, implementation: str | None) -> Array:
    """grouped_matmul, with small tiles on CPU sent to the indexed CPU kernel."""
    tm = default_tile_rows(x.shape[0], w.shape[0])
    xla = functools.partial(grouped_matmul, implementation=implementation)
    if implementation is None and tm <= CPU_KERNEL_MAX_TILE_ROWS and _cpu_kernel_ok(x, w):
        return jax.lax.platform_dependent(x, w, group_sizes, cpu=functools.partial(_gmm_cpu, tm=tm), default=xla)
    return xla(x, w, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm_cpu(x, w, group_sizes, tm, transposed=False):
    """grouped_matmul's contract on the CPU kernel: every tile of `group_tiles` gathered
    ([T, tm, K], activations only), one indexed-matmul call reading each tile's expert in place,
    rows put back (each row is owned by exactly one tile; the rest land on a dropped extra row)."""
    m = x.shape[0]
    start, count, grp = group_tiles(group_sizes, m, tm)
    offset = jnp.arange(tm)[None, :]
    rows, mask = start[:, None] + offset, offset < count[:, None]  # [T, tm]
    xp = jnp.pad(x, ((0, 1), (0, 0)))  # row m: a zero row for the masked tail of a tile
    y = cpu_kernels.matmul_indexed(xp[jnp.where(mask, rows, m)], w, grp, transposed=transposed)  # [T, tm, N]
    out = jnp.zeros((m + 1, y.shape[-1]), jnp.float32).at[jnp.where(mask, rows, m)].add(y)
    return out[:m]


def _gmm_cpu_fwd(x, w, group_sizes, tm, transposed):
    return _gmm_cpu(x, w, group_sizes, tm, transposed), (x, w, group_sizes)


def _gmm_cpu_bwd(tm, transposed, res, dy):
    x, w, group_sizes = res  # as hybridjax.pallas_kernels.grouped_matmul's VJP: dx grouped, dw per group
    dx = _gmm_cpu(dy, w, group_sizes, tm, not transposed)
    dw = tgmm_xla(dy, x, group_sizes, w.shape[0]) if transposed else tgmm_xla(x, dy, group_sizes, w.shape[0])
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_gmm_cpu.defvjp(_gmm_cpu_fwd, _gmm_cpu_bwd)


def _dot(a: Array, w: Array) -> Array:
    return jnp.dot(a, w, preferred_element_type=jnp.float32)


def routed_experts(p, x: Array, valid: Array | None, cfg: Config, *, path: str | None = None,
                   implementation: str | None = None) -> Array:
    """The routed half of a MoE layer (p: MoEParams). x [N, D] -> [N, D] in x's dtype.

    path: "grouped" | "gathered" | None (gathered up to GATHER_MAX_PAIRS pairs, else grouped).
    implementation: the grouped matmul's (hybridjax.pallas_kernels.grouped_matmul)."""
    r = route(x, p.router, cfg.num_experts_per_tok, cfg.norm_topk_prob, valid)
    pairs = x.shape[0] * cfg.num_experts_per_tok
    path = path or ("gathered" if pairs <= GATHER_MAX_PAIRS else "grouped")
    if path not in ("gathered", "grouped"):
        raise ValueError(f"unknown MoE path {path!r}; valid: 'grouped', 'gathered' or None")
    mesh = sharding.current_mesh()
    if mesh is not None and (sharding.axis_size(mesh, "expert") > 1 or sharding.axis_size(mesh, "tensor") > 1):
        y = _expert_parallel(p, x, r, path, implementation, mesh)
    else:
        y = _experts(p.gate, p.up, p.down, x, r, path, implementation)
    return y.astype(x.dtype)


def _experts(gate, up, down, x: Array, r: Routing, path: str, implementation) -> Array:
    """Every valid pair of `r` through its expert, combined: float32 [N, D]."""
    if path == "gathered":
        return gathered_experts(gate, up, down, x, r)
    d = dispatch(r, gate.shape[0])
    return combine(d, grouped_experts(gate, up, down, permute(x, d), d.group_sizes, implementation), r)


def _expert_parallel(p, x: Array, r: Routing, path: str, implementation, mesh) -> Array:
    """The routed experts under a mesh, per device in `shard_map`: each device runs the pairs
    routed to its own experts (on `expert`) over its slice of their width (on `tensor`; SwiGLU is
    elementwise in the width, so the down projection gives a partial sum), combines them into a
    partial [N, D], and one all-reduce over expert and tensor adds the partials: combine, then
    reduce. Left to XLA's partitioner, the routed gathers and grouped matmuls all-gathered every
    expert's weights onto every device in every forward (checked in the compiled HLO)."""
    in_specs, out_spec = sharding.moe_specs(mesh, x.shape[0])

    def local(gate, up, down, x, weights, experts, valid):
        e = gate.shape[0]
        ids = experts - jax.lax.axis_index("expert") * e
        mine = (ids >= 0) & (ids < e)
        # Other devices' pairs: weight 0 and an expert id that reads nothing (-1, gathered path)
        # or sorts past every group (e, grouped path), so they cost no expert work.
        parked = -1 if path == "gathered" else e
        y = _experts(gate, up, down, x, Routing(jnp.where(mine, weights, 0.0), jnp.where(mine, ids, parked), valid),
                     path, implementation)
        return jax.lax.psum(y, ("expert", "tensor"))

    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(
        p.gate, p.up, p.down, x, r.weights, r.experts, r.valid)
