"""The layers of the hybrid model, each a pure function `(p, x, state, ...) -> (y, new_state)`.

Shapes use the axis vocabulary of docs/architecture.md. `valid [B, T]` marks real tokens; right padding
must leave a row's state exactly as if the pads were absent, so pads get g = 0 and beta = 0
(the delta rule then keeps the state), zeroed inputs, and the conv state is cut at each row's
true end. Attention pads write keys past a row's length that later tokens overwrite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridjax import ops
from hybridjax.cache import GDNState, KVState, PagedKV
from hybridjax.config import Config
from hybridjax.moe import routed_experts
from hybridjax.params import AttentionParams, DecoderLayer, GDNParams, MLPParams, MoEParams

Array = jax.Array


def gated_deltanet(p: GDNParams, x: Array, state: GDNState, valid: Array, cfg: Config, implementation=None,
                   all_states: bool = False):
    """Gated DeltaNet token mixer. x [B, T, D] -> ([B, T, D], new GDNState).

    all_states: return the state after every token instead, GDNState(conv [B, T, W-1, C],
    ssm [B, T, Hv, K, V]) (speculative verification; every token must be real, valid ignored).
    """
    b, t, _ = x.shape
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    kd, vd = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    x = jnp.where(valid[..., None], x, 0)

    qkv = ops.dense(x, p.in_qkv).astype(jnp.float32)  # [B, T, C], C = [q | k | v]
    mixed, conv_state = ops.causal_conv(qkv, state.conv, p.conv.astype(jnp.float32), valid.sum(-1))
    q, k, v = jnp.split(mixed, [cfg.gdn_key_dim, 2 * cfg.gdn_key_dim], axis=-1)
    q, k = q.reshape(b, t, hk, kd), k.reshape(b, t, hk, kd)
    v = v.reshape(b, t, hv, vd).astype(x.dtype)

    # Gates in float32: beta in (0, 1); g = log-decay <= 0. Pads: g = 0, beta = 0 keep the state.
    beta = jax.nn.sigmoid(ops.dense(x, p.in_b).astype(jnp.float32))  # [B, T, Hv]
    a = ops.dense(x, p.in_a).astype(jnp.float32)
    g = -jnp.exp(p.A_log.astype(jnp.float32)) * jax.nn.softplus(a + p.dt_bias.astype(jnp.float32))
    beta, g = jnp.where(valid[..., None], beta, 0.0), jnp.where(valid[..., None], g, 0.0)

    if all_states:
        o, ssm = ops.delta_rule_steps(q.astype(x.dtype), k.astype(x.dtype), v, g, beta, state.ssm)
        full = jnp.concatenate([state.conv, qkv], axis=1)  # [B, W-1+T, C]: after token t, rows t+1 .. t+W-1
        w = state.conv.shape[1]
        conv_state = jnp.stack([full[:, i + 1 : i + 1 + w] for i in range(t)], axis=1)  # [B, T, W-1, C]
    else:
        o, ssm = ops.delta_rule(q.astype(x.dtype), k.astype(x.dtype), v, g, beta, state.ssm, implementation)
    z = ops.dense(x, p.in_z).reshape(b, t, hv, vd)
    y = ops.gated_rms_norm(o, z, p.norm, cfg.rms_norm_eps).reshape(b, t, hv * vd)
    return ops.dense(y, p.out_proj), GDNState(conv=conv_state, ssm=ssm)


def gated_attention(p: AttentionParams, x: Array, state: KVState | PagedKV, starts: Array, valid: Array, cfg: Config,
                    implementation=None):
    """Gated full attention over the KV cache. x [B, T, D]; starts [B]: each row's cache length.

    The cache is a row-contiguous `KVState` (the library's `Cache`) or the engine's page pool
    (`PagedKV`): the same projections, norms and rope, then the matching write and attention.
    """
    b, t, _ = x.shape
    hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qg = ops.dense(x, p.q_proj).reshape(b, t, hq, 2 * dh)  # per head [q_h | gate_h]
    q, gate = qg[..., :dh], qg[..., dh:].reshape(b, t, hq * dh)
    q = ops.rms_norm(q, p.q_norm, cfg.rms_norm_eps)
    k = ops.rms_norm(ops.dense(x, p.k_proj).reshape(b, t, hkv, dh), p.k_norm, cfg.rms_norm_eps)
    v = ops.dense(x, p.v_proj).reshape(b, t, hkv, dh)

    positions = starts[:, None] + jnp.arange(t, dtype=starts.dtype)  # [B, T]
    cos, sin = ops.rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
    q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
    copies = state.k.shape[2] // hkv  # > 1: KV heads replicated over tensor shards (Config.kv_heads_laid_out)
    if copies > 1:  # repeat, never tile: laid-out head j is head j // copies, so query head h still reads h // (Hq/Hkv)
        k, v = jnp.repeat(k, copies, axis=2), jnp.repeat(v, copies, axis=2)

    if isinstance(state, PagedKV):
        k_pool = ops.write_kv_paged(state.k, k, state.table, starts, valid)
        v_pool = ops.write_kv_paged(state.v, v, state.table, starts, valid)
        out = ops.paged_attention(q, k_pool, v_pool, state.table, positions, scale=dh**-0.5,
                                  implementation=implementation)
        new_state = state.replace(k=k_pool, v=v_pool)
    else:
        k_buf = ops.write_kv(state.k, k.astype(state.k.dtype), starts, valid)
        v_buf = ops.write_kv(state.v, v.astype(state.v.dtype), starts, valid)
        out = ops.attention(q, k_buf.astype(q.dtype), v_buf.astype(q.dtype), positions, dh**-0.5)
        new_state = KVState(k=k_buf, v=v_buf)
    out = out.reshape(b, t, hq * dh) * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(x.dtype)
    return ops.dense(out, p.o_proj), new_state


def mlp(p: MLPParams, x: Array) -> Array:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    return ops.dense(jax.nn.silu(ops.dense(x, p.gate)) * ops.dense(x, p.up), p.down)


def moe(p: MoEParams, x: Array, cfg: Config, valid: Array | None = None) -> Array:
    """Top-k routed experts plus a sigmoid-gated shared expert. x [..., D]; valid [...] (optional):
    rows routed at all (pads and inactive rows cost no expert work; their routed part is zero).

    Only the chosen experts run (hybridjax.moe: sorted grouped matmuls for many tokens, gathered
    expert weights for a few), so the cost follows k, not the number of experts."""
    shape = x.shape
    xs = x.reshape(-1, shape[-1])  # [N, D]
    routed = routed_experts(p, xs, None if valid is None else valid.reshape(-1), cfg)
    shared = mlp(p.shared, xs) * jax.nn.sigmoid(ops.dense(xs, p.shared_gate).astype(jnp.float32)).astype(xs.dtype)
    return (routed + shared).reshape(shape)


def decoder_layer(p: DecoderLayer, x: Array, state, starts: Array, valid: Array, cfg: Config, implementation=None,
                  all_states: bool = False):
    """Pre-norm residual block: x + mixer(norm(x)), then + ffn(norm(x)). all_states: a GDN layer
    returns its state after every token (see `gated_deltanet`)."""
    h = ops.rms_norm(x, p.input_norm, cfg.rms_norm_eps)
    if isinstance(p.mixer, GDNParams):
        h, state = gated_deltanet(p.mixer, h, state, valid, cfg, implementation, all_states)
    else:
        h, state = gated_attention(p.mixer, h, state, starts, valid, cfg, implementation)
    x = x + h
    h = ops.rms_norm(x, p.post_norm, cfg.rms_norm_eps)
    h = moe(p.ffn, h, cfg, valid) if isinstance(p.ffn, MoEParams) else mlp(p.ffn, h)
    return x + h, state
