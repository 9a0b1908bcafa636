"""Parameter pytrees, their shapes, random init and dtype casting.

Weights are stored `[in, out]` so every projection is `x @ w`. Layout choices that
differ from checkpoints (fused Qwen3-Next projections, conv axis, expert stacking)
are undone in `conversion/`, never here.

`Params.layers` is a tuple aligned 1:1 with HF layer indices; each entry is a
`DecoderLayer` whose `mixer` is `GDNParams` (linear attention) or `AttentionParams`
(gated full attention) and whose `ffn` is `MLPParams` or `MoEParams`. `Params.mtp` is the
optional multi-token-prediction head (`MTPParams`, Qwen3.5 / Qwen3-Next `mtp.*` tensors), None
when the checkpoint has none.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np

from hybridjax import pytree
from hybridjax.config import FULL, Config

Array = jax.Array


@pytree.dataclass
class AttentionParams:
    q_proj: Array  # [D, Hq * 2 * Dh]   per head: [q_h | gate_h]
    k_proj: Array  # [D, Hkv * Dh]
    v_proj: Array  # [D, Hkv * Dh]
    o_proj: Array  # [Hq * Dh, D]
    q_norm: Array  # [Dh]  zero-centred: scale is (1 + w)
    k_norm: Array  # [Dh]


@pytree.dataclass
class GDNParams:
    in_qkv: Array  # [D, C]  C = 2*Hk*K + Hv*V, order [q | k | v]
    in_z: Array  # [D, Hv * V]
    in_b: Array  # [D, Hv]
    in_a: Array  # [D, Hv]
    conv: Array  # [W, C]  row W-1 multiplies the current token
    dt_bias: Array  # [Hv]
    A_log: Array  # [Hv]  kept float32 whatever the param dtype
    norm: Array  # [V]  plain scale w (not 1 + w)
    out_proj: Array  # [Hv * V, D]


@pytree.dataclass
class MLPParams:
    gate: Array  # [D, I]
    up: Array  # [D, I]
    down: Array  # [I, D]


@pytree.dataclass
class MoEParams:
    router: Array  # [D, E]
    gate: Array  # [E, D, I]
    up: Array  # [E, D, I]
    down: Array  # [E, I, D]
    shared: MLPParams
    shared_gate: Array  # [D, 1]


@pytree.dataclass
class DecoderLayer:
    input_norm: Array  # [D]  (1 + w)
    mixer: Union[GDNParams, AttentionParams]
    post_norm: Array  # [D]  (1 + w)
    ffn: Union[MLPParams, MoEParams]


@pytree.dataclass
class MTPParams:
    """The multi-token-prediction head: predicts token t+2 from the main model's hidden state at t
    and the embedding of token t+1 (embeddings and LM head shared with the main model)."""

    pre_fc_norm_embedding: Array  # [D]  (1 + w)
    pre_fc_norm_hidden: Array  # [D]  (1 + w)
    fc: Array  # [2D, D]  input [normed embedding | normed hidden]
    layer: DecoderLayer  # one full-attention decoder layer (MoE ffn in MoE models)
    norm: Array  # [D]  (1 + w)


@pytree.dataclass
class Params:
    embed: Array  # [vocab, D]
    layers: tuple  # tuple[DecoderLayer, ...]
    final_norm: Array  # [D]
    lm_head: Any  # [D, vocab], or None when tied to embed
    extra: dict = dataclasses.field(default_factory=dict)  # checkpoint tensors kept verbatim (vision tower; unused by the model)
    mtp: Any = None  # MTPParams, or None when the checkpoint has no MTP head
    # The jax.sharding.Mesh the leaves are placed on (hybridjax.sharding.shard_params), static so
    # that `forward` sees it while tracing; None on one device.
    mesh: Any = pytree.static(default=None)


# --- shapes ---------------------------------------------------------------------------


def _mlp_shapes(d: int, i: int) -> MLPParams:
    return MLPParams(gate=(d, i), up=(d, i), down=(i, d))


def layer_shapes(cfg: Config, i: int) -> DecoderLayer:
    """The shape of every tensor of layer i, as a DecoderLayer of tuples (i = "mtp": the MTP
    head's layer: full attention, MoE when the model has experts)."""
    d = cfg.hidden_size
    if i == "mtp" or cfg.layer_types[i] == FULL:
        hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        mixer = AttentionParams(
            q_proj=(d, hq * 2 * dh), k_proj=(d, hkv * dh), v_proj=(d, hkv * dh),
            o_proj=(hq * dh, d), q_norm=(dh,), k_norm=(dh,),
        )
    else:
        hv = cfg.linear_num_value_heads
        mixer = GDNParams(
            in_qkv=(d, cfg.gdn_conv_dim), in_z=(d, cfg.gdn_value_dim), in_b=(d, hv), in_a=(d, hv),
            conv=(cfg.linear_conv_kernel_dim, cfg.gdn_conv_dim), dt_bias=(hv,), A_log=(hv,),
            norm=(cfg.linear_value_head_dim,), out_proj=(cfg.gdn_value_dim, d),
        )
    if (any(cfg.moe_layers) if i == "mtp" else cfg.is_moe_layer(i)):
        e, mi = cfg.num_experts, cfg.moe_intermediate_size
        ffn = MoEParams(
            router=(d, e), gate=(e, d, mi), up=(e, d, mi), down=(e, mi, d),
            shared=_mlp_shapes(d, cfg.shared_expert_intermediate_size), shared_gate=(d, 1),
        )
    else:
        ffn = _mlp_shapes(d, cfg.intermediate_size)
    return DecoderLayer(input_norm=(d,), mixer=mixer, post_norm=(d,), ffn=ffn)


def mtp_shapes(cfg: Config) -> MTPParams:
    d = cfg.hidden_size
    return MTPParams(pre_fc_norm_embedding=(d,), pre_fc_norm_hidden=(d,), fc=(2 * d, d),
                     layer=layer_shapes(cfg, "mtp"), norm=(d,))


def param_shapes(cfg: Config, mtp: bool = False) -> Params:
    """Params whose leaves are shape tuples (no arrays): the contract loaders check against.
    `mtp`: include the multi-token-prediction head."""
    return Params(
        embed=(cfg.vocab_size, cfg.hidden_size),
        layers=tuple(layer_shapes(cfg, i) for i in range(cfg.num_hidden_layers)),
        final_norm=(cfg.hidden_size,),
        lm_head=None if cfg.tie_word_embeddings else (cfg.hidden_size, cfg.vocab_size),
        mtp=mtp_shapes(cfg) if mtp else None,
    )


def is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


# --- dtype policy ---------------------------------------------------------------------

# Leaves that stay float32 whatever the model dtype: gate parameters (precision policy).
FLOAT32_LEAVES = ("A_log", "dt_bias")


def cast_params(params: Params, dtype) -> Params:
    """Cast floating leaves to `dtype`, keeping the gate parameters in float32."""
    dtype = jnp.dtype(dtype)

    def cast(path, x):
        name = getattr(path[-1], "name", None)
        target = jnp.float32 if name in FLOAT32_LEAVES else dtype
        return x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree_util.tree_map_with_path(cast, params)


# --- random init (tests, benchmarks, the embedded default model) ----------------------


def init_params(key, cfg: Config, dtype=jnp.float32, mtp: bool = False) -> Params:
    """Random params with the shapes of `cfg` (and an MTP head if `mtp`), from a PRNG key or an
    integer seed.

    Drawn with numpy on the host (no per-shape compilation; the same values on every
    machine). Norm weights, A_log and dt_bias are drawn away from their usual init values
    (zeros, ones) so that a model that mishandles them shows it.
    """
    seed = key if isinstance(key, int) else int(np.asarray(jax.random.key_data(key)).ravel()[-1])
    rng = np.random.default_rng(seed)
    shapes = param_shapes(cfg, mtp)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)
    out = []
    for path, shape in leaves:
        name = getattr(path[-1], "name", "")
        if name == "A_log":
            x = np.log(rng.uniform(0.5, 8.0, shape))
        elif name == "dt_bias":
            x = rng.uniform(-1.0, 1.5, shape)
        elif "norm" in name:
            x = 0.2 * rng.standard_normal(shape) + (1.0 if _in_gdn(path) else 0.0)
        else:
            fan_in = shape[-2] if len(shape) >= 2 else shape[0]
            # embed: rows of norm ~1, so tied logits have unit scale
            std = cfg.hidden_size**-0.5 if name == "embed" else fan_in**-0.5
            x = std * rng.standard_normal(shape)
        out.append(jnp.asarray(x, jnp.float32))
    return cast_params(jax.tree_util.tree_unflatten(treedef, out), dtype)


def _in_gdn(path) -> bool:
    return any(getattr(p, "name", None) == "mixer" for p in path) and getattr(path[-1], "name", "") == "norm"
