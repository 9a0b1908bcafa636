"""Numerical building blocks shared by the layers: norms, RoPE, causal conv, attention.

Precision policy (declared once, here): norms, softmax, gates and all recurrent state are
computed in float32; matmuls take the parameter dtype and accumulate in float32 (`dense`).
The delta rule itself is chosen in `hybridjax.pallas_kernels.gated_delta_rule` (reference / xla /
pallas); `delta_rule` below is the one place the model reaches it, as `paged_attention`
(wrapping `hybridjax.pallas_kernels.paged_attention`) is for attention over the engine's pages; under a
multi-device mesh both run per head shard in `shard_map`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from hybridjax import cpu_kernels, sharding
from hybridjax.pallas_kernels.gated_delta_rule import chunk_gated_delta_rule
from hybridjax.pallas_kernels.paged_attention import paged_attention as _paged_attention
from hybridjax.pallas_kernels.paged_attention import pool_dtype, pool_values, to_pool  # noqa: F401 (re-exported)
from hybridjax.pallas_kernels.gated_delta_rule.common import l2norm

Array = jax.Array


def dense(x: Array, w: Array, dtype=None, transposed: bool = False) -> Array:
    """x [..., n_in] @ w [n_in, n_out], accumulated in float32, returned in `dtype` (x's).

    transposed: w is [n_out, n_in] (a tied embedding as the head), read in place.
    w may be a `cpu_kernels.PackedWeight` (`cpu_kernels.pack_params`): decode rows then stream
    its packed bfloat16 panels, everything else reads its plain weight; a
    `cpu_kernels.WidenedWeight` (also `pack_params`): decode rows stream its bf16 weight,
    everything else reads its float32 copy; or a `cpu_kernels.Int8Weight`
    (`cpu_kernels.quantize_params`): decode rows stream its int8 weight
    (int8-dot's packed panels: int8 x int8 dots, `cpu_kernels.matmul_q8`), more rows widen it to
    float32 for XLA's matmul.

    A few rows (decode, and narrow prefill chunks: `cpu_kernels.max_rows`) on CPU go to the
    streaming kernel of `hybridjax.cpu_kernels` when it is built: XLA:CPU's one-row dots leave
    memory bandwidth unused, its bfloat16 ones run ~20x below it, and its 16-row ones are
    compute-bound below the stream. More rows (wide prefill chunks) stay on XLA's matmuls. The
    choice follows the platform the computation is lowered for, so a CPU host can still lower
    for a GPU.
    """
    if isinstance(w, cpu_kernels.TransposedWeight):  # held [n_out, n_in]: every reader takes it so
        if transposed:
            raise ValueError("dense: a TransposedWeight is a [n_in, n_out] projection; a tied head is not one")
        return dense(x, w.t, dtype, transposed=True)
    lead, n_in = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, n_in)
    xla = functools.partial(_xla_dot, transposed=transposed)
    packed = isinstance(w, cpu_kernels.PackedWeight)  # bf16 kept twice: [K, N] and decode's panels
    widened = isinstance(w, cpu_kernels.WidenedWeight)  # bf16 kept twice: float32 for prefill, and itself
    # What XLA's matmuls read: a packed weight's `w` as held (float32 where prefill widens).
    xla_w = w.w if packed or widened else w
    if isinstance(w, cpu_kernels.Int8Weight):
        y = _int8_dense(rows, w, transposed)
    elif (cpu_kernels.supports(rows.shape[0], x.dtype, w.dtype) and sharding.current_mesh() is None
            and cpu_kernels.enabled()):
        kernel = functools.partial(cpu_kernels.matmul, transposed=transposed)
        if packed and not transposed:
            n = w.shape[1]
            y = jax.lax.platform_dependent(rows, xla_w, w.panels, cpu=lambda r, _, p: cpu_kernels.matmul_packed(r, p, n),
                                           default=lambda r, w, _: xla(r, w))
        elif widened:  # the kernel streams the bf16 weight, not the float32 copy
            y = jax.lax.platform_dependent(rows, xla_w, w.bf16, cpu=lambda r, _, b: kernel(r, b),
                                           default=lambda r, w, _: xla(r, w))
        else:
            y = jax.lax.platform_dependent(rows, xla_w, cpu=kernel, default=xla)
    elif (w.dtype == jnp.bfloat16 and rows.shape[0] > cpu_kernels.DECODE_ROWS and sharding.current_mesh() is None
          and cpu_kernels.widen_bf16_prefill()):
        # XLA:CPU's bf16 dots run below its float32 ones where the CPU has no bf16 dot
        # instruction: widen both operands inside the step (once per prefill chunk) there; a
        # packed or widened weight's float32 copy (`pack_params`) is widened already.
        widened_dot = functools.partial(_widened_dot, transposed=transposed)
        y = jax.lax.platform_dependent(rows, xla_w, cpu=widened_dot, default=xla)
    else:
        y = xla(rows, xla_w)
    return y.astype(dtype or x.dtype).reshape(*lead, y.shape[-1])


def _int8_dense(rows: Array, w, transposed: bool) -> Array:
    """rows @ w -> float32 [R, n_out] for an `Int8Weight`. Weight-only: decode rows stream q through
    the kernel's int8 path; otherwise XLA's float32 matmul over q widened, then the per-column
    scale (the kernel's order too: the scale multiplies the finished sum). int8-dot: decode rows
    go to `matmul_q8` (x rounded to int8 too, integer dots); otherwise the panels dequantised to
    float32 inside the step and XLA's matmul: once per call, small beside a prefill's matmul."""
    if transposed:
        raise ValueError("dense: an Int8Weight is [n_in, n_out]; a transposed (tied) head is not quantised")
    decode = (cpu_kernels.supports(rows.shape[0], rows.dtype, jnp.int8) and sharding.current_mesh() is None
              and cpu_kernels.enabled())
    if w.is_dot:
        k, n = w.shape

        def xla_dot(r, p, s):
            return jnp.dot(r.astype(jnp.float32), cpu_kernels.dequantize_int8_panels(p, s, k, n))

        if decode:
            return jax.lax.platform_dependent(rows, w.panels, w.panel_scales,
                                              cpu=lambda r, p, s: cpu_kernels.matmul_q8(r, p, s, n), default=xla_dot)
        return xla_dot(rows, w.panels, w.panel_scales)

    def xla(r, q, scale):
        return jnp.dot(r.astype(jnp.float32), q.astype(jnp.float32)) * scale.astype(jnp.float32)

    if decode:
        return jax.lax.platform_dependent(rows, w.q, w.scale, cpu=cpu_kernels.matmul, default=xla)
    return xla(rows, w.q, w.scale)


def _widened_dot(rows: Array, w: Array, transposed: bool = False) -> Array:
    """rows @ w in float32 from 16-bit operands: the same exact products (bf16 x bf16 fits a
    float32 mantissa), float32 sums; XLA:CPU's float32 matmul instead of its bf16 one."""
    w = w.astype(jnp.float32)
    return jnp.dot(rows.astype(jnp.float32), w.T if transposed else w)


def _xla_dot(rows: Array, w: Array, transposed: bool = False) -> Array:
    """rows [R, n_in] @ w -> float32 [R, n_out] with XLA's dot.

    Asking for a float32 result is also what puts 16-bit matmuls on XLA:CPU's fast path (bf16,
    2048 x 1024 x 8192 on the AMX dev machine: 590 GFLOP/s, against 153 with a bf16 result and
    184 in float32). That path is ~8x slower for a single row than for two, so a lone 16-bit row
    is padded to two.
    """
    lone = rows.shape[0] == 1 and rows.dtype.itemsize == 2
    if lone:
        rows = jnp.pad(rows, ((0, 1), (0, 0)))
    y = jnp.dot(rows, w.T if transposed else w, preferred_element_type=jnp.float32)
    return y[:1] if lone else y


def rms_norm(x: Array, w: Array, eps: float) -> Array:
    """Zero-centred RMSNorm: x / rms(x) * (1 + w), in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x: Array, gate: Array, w: Array, eps: float) -> Array:
    """The GDN output norm: plain scale w (not 1 + w), then times silu(gate) in float32."""
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    y = (w * y).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    return y.astype(x.dtype)


def rope_cos_sin(positions: Array, rotary_dim: int, theta: float) -> tuple[Array, Array]:
    """cos, sin [B, T, rotary_dim] for integer positions [B, T] (NeoX layout: halves repeated).

    The frequency denominator is rotary_dim, not head_dim (partial rotary).
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rotary_dim/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate the first rotary_dim features of x [B, T, H, Dh]; the rest pass through."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot].astype(jnp.float32), x[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
    out = (xr * c + rotated * s).astype(x.dtype)
    return jnp.concatenate([out, xp], axis=-1)


def causal_conv(x: Array, state: Array, w: Array, counts: Array) -> tuple[Array, Array]:
    """Depthwise causal conv over time with a carried state, then SiLU.

    x [B, T, C] (float32), state [B, W-1, C]: the last W-1 inputs before x; w [W, C], row W-1
    multiplies the current token. counts [B]: valid tokens per row (the rest is right padding),
    so the new state is taken at each row's true end, not at T.
    Returns (silu(conv) [B, T, C], new_state [B, W-1, C]).
    """
    width, t = w.shape[0], x.shape[1]
    full = jnp.concatenate([state, x], axis=1)  # [B, W-1+T, C]
    y = sum(full[:, i : i + t] * w[i] for i in range(width))
    # Built by slicing a fresh concatenation, never by shifting the state in place (an XLA:CPU trap).
    new_state = jax.vmap(lambda f, n: jax.lax.dynamic_slice_in_dim(f, n, width - 1, axis=0))(full, counts)
    return jax.nn.silu(y), new_state


def attention(q: Array, k: Array, v: Array, q_pos: Array, scale: float) -> Array:
    """Causal GQA attention of new queries over the whole KV buffer.

    q [B, T, Hq, Dh]; k, v [B, S, Hkv, Dh] (the buffer, this step's keys already written);
    q_pos [B, T]: each query's absolute position; key s is visible iff s <= q_pos.
    Softmax in float32. Returns [B, T, Hq, Dh].
    """
    b, t, hq, dh = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = hq // hkv  # query head h uses kv head h // g
    # Heads lead and each kv head's g x T queries form one matrix, so both products are plain
    # batched matmuls over [B, Hkv]: on XLA:CPU 1.4-2.2x faster than contracting in the cache
    # layout, transposes included (benchmarks/bench_attention.py).
    qh = q.reshape(b, t, hkv, g, dh).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, dh)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, S, Dh]
    scores = jnp.einsum("bhqd,bhsd->bhqs", qh, kh, preferred_element_type=jnp.float32) * scale
    visible = jnp.arange(s)[None, None, :] <= q_pos[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores.reshape(b, hkv, g, t, s), -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, hkv, g * t, s)
    out = jnp.einsum("bhqs,bhsd->bhqd", probs, vh, preferred_element_type=jnp.float32).astype(v.dtype)
    return out.reshape(b, hkv, g, t, dh).transpose(0, 3, 1, 2, 4).reshape(b, t, hq, dh)


def write_kv(buf: Array, new: Array, starts: Array, valid: Array) -> Array:
    """Write new [B, T, Hkv, Dh] into buf [B, S, Hkv, Dh] at positions starts[b] + t.

    Pads (valid [B, T] False) and positions past the buffer are dropped, so capacity only has
    to cover real tokens.
    """
    b, t = new.shape[:2]
    pos = starts[:, None] + jnp.arange(t, dtype=starts.dtype)  # [B, T]
    pos = jnp.where(valid, pos, buf.shape[1])  # out of range: dropped
    return buf.at[jnp.arange(b)[:, None], pos].set(new, mode="drop")


def write_kv_paged(pages: Array, new: Array, table: Array, starts: Array, valid: Array) -> Array:
    """Write new [B, T, Hkv, Dh] into pages [P, S, Hkv, Dh] at each row's positions starts[b] + t,
    through table [B, Np]. Pads and positions past a row's pages are dropped (page id P), so a
    padding row never touches another row's pages, and full pages (before `starts`) are never
    written: the pool's write-once rule. A pool of bits takes new's bits (`to_pool`)."""
    n_pages, size = pages.shape[:2]
    pos = starts[:, None] + jnp.arange(new.shape[1], dtype=starts.dtype)  # [B, T]
    slot = pos // size
    page = jnp.take_along_axis(table, jnp.minimum(slot, table.shape[1] - 1), axis=1)
    page = jnp.where(valid & (slot < table.shape[1]), page, n_pages)  # out of range: dropped
    return pages.at[page, pos % size].set(to_pool(new, pages), mode="drop")


def paged_attention(q, k_pages, v_pages, page_table, q_pos, *, scale=None, implementation=None):
    """Attention over the engine's page pool (the model's one way in; see
    hybridjax.pallas_kernels.paged_attention). Under a multi-device mesh it runs per KV-head shard in
    `shard_map` (query head h reads KV head h // g, so contiguous shards line up): the Pallas
    kernel is an opaque call XLA would otherwise run on a gathered pool."""
    attend = functools.partial(_paged_attention, scale=scale, implementation=implementation)
    mesh = sharding.current_mesh()
    if mesh is None:
        return attend(q, k_pages, v_pages, page_table, q_pos)
    in_specs, out_spec = sharding.paged_attention_specs(mesh, q.shape[0], k_pages.shape[2])
    return jax.shard_map(attend, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(
        q, k_pages, v_pages, page_table, q_pos)


def delta_rule(q, k, v, g, beta, state, implementation=None):
    """The gated delta rule with q/k L2-normalised inside; see hybridjax.pallas_kernels.gated_delta_rule.

    Under a multi-device mesh (`sharding.mesh_scope`) it runs per head shard in `shard_map`:
    heads are independent, so nothing is communicated inside, and the kernels see local shapes.
    """
    rule = functools.partial(chunk_gated_delta_rule, use_qk_l2norm_in_kernel=True, implementation=implementation)
    mesh = sharding.current_mesh()
    if mesh is None:
        return rule(q, k, v, g, beta, initial_state=state)
    copies = math.lcm(q.shape[2], sharding.axis_size(mesh, "tensor")) // q.shape[2]
    if copies > 1:  # fewer key heads than shards: repeat them (value head h reads key head h // r still)
        q, k = jnp.repeat(q, copies, axis=2), jnp.repeat(k, copies, axis=2)
    in_specs, out_specs = sharding.delta_rule_specs(mesh, q.shape[0], q.shape[2])
    local = lambda q, k, v, g, beta, s: rule(q, k, v, g, beta, initial_state=s)  # noqa: E731
    # check_vma off: the Pallas kernels do not declare how their outputs vary over the mesh.
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
        q, k, v, g, beta, state)


def delta_rule_steps(q, k, v, g, beta, state):
    """The gated delta rule token by token, keeping the state after every token: for
    speculative verification, where the state after the last accepted token is wanted and
    recurrent state cannot be trimmed. q/k L2-normalised inside, float32 throughout, the same
    recurrence and order as `hybridjax.pallas_kernels.gated_delta_rule.reference` (what the xla path runs
    for a few tokens), so its outputs equal a decode step's.

    q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; state [B, Hv, K, V].
    Returns (o [B, T, Hv, V] in v's dtype, states [B, T, Hv, K, V] float32: after token t).
    """
    f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
    r = v.shape[2] // q.shape[2]
    q = jnp.repeat(l2norm(q), r, axis=2) * q.shape[-1] ** -0.5  # value head h reads key head h // r
    k = jnp.repeat(l2norm(k), r, axis=2)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, Hv, K] x2, [B, Hv, V], [B, Hv] x2
        s = s * jnp.exp(g_t)[:, :, None, None]
        kv_mem = jnp.einsum("bhk,bhkv->bhv", k_t, s, precision=hi)
        delta = b_t[:, :, None] * (v_t - kv_mem)
        s = s + jnp.einsum("bhk,bhv->bhkv", k_t, delta, precision=hi)
        return s, (jnp.einsum("bhk,bhkv->bhv", q_t, s, precision=hi), s)

    # Unrolled: T is a handful of tokens, and XLA:CPU fuses across an unrolled loop, not a scan.
    s, outs, states = state.astype(f32), [], []
    for t in range(q.shape[1]):
        s, (o_t, _) = step(s, tuple(x[:, t].astype(f32) for x in (q, k, v, g, beta)))
        outs.append(o_t)
        states.append(s)
    return jnp.stack(outs, 1).astype(v.dtype), jnp.stack(states, 1)
