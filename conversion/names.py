"""The name table between HF checkpoints and hybridjax params, with the transforms both ways.

A `Rule` maps some HF tensors (by name) to some param leaves (by dotted path) with a pair of
pure numpy functions, `to_params` and `to_hf`, which are exact inverses (transposes, reshapes,
splits and stacks only), so a round trip is bit-identical.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
from typing import Callable, Sequence

import numpy as np

from hybridjax.config import FULL, Config


@dataclasses.dataclass(frozen=True)
class Rule:
    hf: tuple[str, ...]  # HF tensor names
    params: tuple[str, ...]  # param leaf paths, e.g. "layers.3.mixer.q_proj"
    to_params: Callable[..., tuple]  # (*hf arrays) -> tuple of param arrays
    to_hf: Callable[..., tuple]  # (*param arrays) -> tuple of hf arrays
    # how a slice of the params maps onto slices of the HF tensors, for sharded loading (which
    # reads only a device's part): "copy", "linear", "stack", "swap12", "gate_up"; "" for
    # layouts read whole (Qwen3-Next's per-key-head fused projections)
    kind: str = ""


def _same(x):
    return (x,)


def _t(x):
    return (transposed(x),)


_TILE = 128  # a 128 x 128 float32 tile of each side is 64 KB: both stay in the L2 cache
_SMALL = 1 << 20  # elements; below this numpy's own copy is as quick


def transposed(x: np.ndarray) -> np.ndarray:
    """x.T, contiguous. A matrix is copied tile by tile on every core: numpy's strided copy of a
    large one misses the cache on every element (a 3072 x 1024 float32 copy 25 ms, against 1 ms
    untransposed), so it was most of loading a checkpoint (2.5 of 4.5 s for a 0.23B model)."""
    if x.ndim != 2 or x.size < _SMALL:
        return np.ascontiguousarray(x.T)
    rows, cols = x.shape
    out = np.empty((cols, rows), x.dtype)

    def band(lo: int) -> None:  # output rows lo.. of one thread; numpy copies without the GIL
        for i in range(lo, min(lo + per_thread, cols), _TILE):
            for j in range(0, rows, _TILE):
                out[i:i + _TILE, j:j + _TILE] = x[j:j + _TILE, i:i + _TILE].T

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, min(cores, 8))
    per_thread = -(-cols // threads // _TILE) * _TILE
    list(_pool(threads).map(band, range(0, cols, per_thread)))
    return out


@functools.lru_cache(maxsize=None)
def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="hybridjax-transpose")


def copy(hf: str, path: str) -> Rule:
    return Rule((hf,), (path,), _same, _same, "copy")


def linear(hf: str, path: str) -> Rule:
    """nn.Linear weight [out, in] <-> our [in, out]."""
    return Rule((hf,), (path,), _t, _t, "linear")


def conv(hf: str, path: str) -> Rule:
    """Depthwise conv1d weight [C, 1, W] <-> our [W, C]."""
    return Rule(
        (hf,), (path,),
        lambda w: (np.ascontiguousarray(w[:, 0, :].T),),
        lambda w: (np.ascontiguousarray(w.T[:, None, :]),),
    )


def fused_qkvz(hf: str, qkv: str, z: str, cfg: Config) -> Rule:
    """Qwen3-Next `in_proj_qkvz` [Hk*(2K + 2rV), D], grouped per key head as
    [q_h | k_h | v_h (r heads) | z_h (r heads)], <-> in_qkv [D, q|k|v] and in_z [D, Hv*V]."""
    hk, kd, vd = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    rv = cfg.linear_num_value_heads // hk * vd
    sizes = np.cumsum([kd, kd, rv])

    def split(w):
        g = w.reshape(hk, 2 * kd + 2 * rv, -1)  # [Hk, per-group rows, D]
        q, k, v, zz = np.split(g, sizes, axis=1)
        flat = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731  [heads*dim, D]
        qkv_w = np.concatenate([flat(q), flat(k), flat(v)], axis=0)
        return np.ascontiguousarray(qkv_w.T), np.ascontiguousarray(flat(zz).T)

    def fuse(qkv_w, z_w):
        d = qkv_w.shape[0]
        q, k, v = np.split(qkv_w.T, [hk * kd, 2 * hk * kd], axis=0)
        parts = [a.reshape(hk, -1, d) for a in (q, k, v, z_w.T)]
        return (np.ascontiguousarray(np.concatenate(parts, axis=1).reshape(-1, d)),)

    return Rule((hf,), (qkv, z), split, fuse)


def fused_ba(hf: str, b: str, a: str, cfg: Config) -> Rule:
    """Qwen3-Next `in_proj_ba` [Hk*2r, D], per key head [b (r) | a (r)], <-> in_b, in_a [D, Hv]."""
    hk = cfg.linear_num_key_heads
    r = cfg.linear_num_value_heads // hk

    def split(w):
        g = w.reshape(hk, 2 * r, -1)
        return (np.ascontiguousarray(g[:, :r].reshape(-1, g.shape[-1]).T),
                np.ascontiguousarray(g[:, r:].reshape(-1, g.shape[-1]).T))

    def fuse(b_w, a_w):
        d = b_w.shape[0]
        g = np.concatenate([b_w.T.reshape(hk, r, d), a_w.T.reshape(hk, r, d)], axis=1)
        return (np.ascontiguousarray(g.reshape(-1, d)),)

    return Rule((hf,), (b, a), split, fuse)


def stacked_experts(names: Sequence[str], path: str) -> Rule:
    """Per-expert nn.Linear weights [out, in] x E <-> our stacked [E, in, out]."""
    return Rule(
        tuple(names), (path,),
        lambda *ws: (np.ascontiguousarray(np.stack([w.T for w in ws])),),
        lambda s: tuple(np.ascontiguousarray(w.T) for w in s),
        "stack",
    )


def fused_gate_up(hf: str, gate: str, up: str) -> Rule:
    """transformers' fused `experts.gate_up_proj` [E, 2I, D] <-> gate, up [E, D, I]."""

    def split(w):
        i = w.shape[1] // 2
        return (np.ascontiguousarray(w[:, :i].transpose(0, 2, 1)), np.ascontiguousarray(w[:, i:].transpose(0, 2, 1)))

    def fuse(g, u):
        return (np.ascontiguousarray(np.concatenate([g, u], axis=2).transpose(0, 2, 1)),)

    return Rule((hf,), (gate, up), split, fuse, "gate_up")


def fused_down(hf: str, path: str) -> Rule:
    """transformers' fused `experts.down_proj` [E, D, I] <-> our [E, I, D]."""
    f = lambda w: (np.ascontiguousarray(w.transpose(0, 2, 1)),)  # noqa: E731
    return Rule((hf,), (path,), f, f, "swap12")


def _mlp_rules(src: str, dst: str) -> list[Rule]:
    return [linear(f"{src}.{n}_proj.weight", f"{dst}.{n}") for n in ("gate", "up", "down")]


def _moe_rules(src: str, dst: str, cfg: Config, fused_experts: bool) -> list[Rule]:
    rules = [
        linear(f"{src}.gate.weight", f"{dst}.router"),
        linear(f"{src}.shared_expert_gate.weight", f"{dst}.shared_gate"),
        *_mlp_rules(f"{src}.shared_expert", f"{dst}.shared"),
    ]
    if fused_experts:
        rules += [
            fused_gate_up(f"{src}.experts.gate_up_proj", f"{dst}.gate", f"{dst}.up"),
            fused_down(f"{src}.experts.down_proj", f"{dst}.down"),
        ]
    else:
        for n in ("gate", "up", "down"):
            names = [f"{src}.experts.{e}.{n}_proj.weight" for e in range(cfg.num_experts)]
            rules.append(stacked_experts(names, f"{dst}.{n}"))
    return rules


def _gdn_rules(src: str, dst: str, cfg: Config) -> list[Rule]:
    rules = [
        conv(f"{src}.conv1d.weight", f"{dst}.conv"),
        copy(f"{src}.dt_bias", f"{dst}.dt_bias"),
        copy(f"{src}.A_log", f"{dst}.A_log"),
        copy(f"{src}.norm.weight", f"{dst}.norm"),
        linear(f"{src}.out_proj.weight", f"{dst}.out_proj"),
    ]
    if cfg.family == "qwen3_next":
        rules += [
            fused_qkvz(f"{src}.in_proj_qkvz.weight", f"{dst}.in_qkv", f"{dst}.in_z", cfg),
            fused_ba(f"{src}.in_proj_ba.weight", f"{dst}.in_b", f"{dst}.in_a", cfg),
        ]
    else:
        rules += [linear(f"{src}.in_proj_{n}.weight", f"{dst}.in_{n}") for n in ("qkv", "z", "b", "a")]
    return rules


def _attention_rules(src: str, dst: str) -> list[Rule]:
    return [
        *(linear(f"{src}.{n}_proj.weight", f"{dst}.{n}_proj") for n in ("q", "k", "v", "o")),
        copy(f"{src}.q_norm.weight", f"{dst}.q_norm"),
        copy(f"{src}.k_norm.weight", f"{dst}.k_norm"),
    ]


def _decoder_rules(src: str, dst: str, cfg: Config, full: bool, moe: bool, fused_experts: bool) -> list[Rule]:
    rules = [
        copy(f"{src}.input_layernorm.weight", f"{dst}.input_norm"),
        copy(f"{src}.post_attention_layernorm.weight", f"{dst}.post_norm"),
    ]
    if full:
        rules += _attention_rules(f"{src}.self_attn", f"{dst}.mixer")
    else:
        rules += _gdn_rules(f"{src}.linear_attn", f"{dst}.mixer", cfg)
    if moe:
        rules += _moe_rules(f"{src}.mlp", f"{dst}.ffn", cfg, fused_experts)
    else:
        rules += _mlp_rules(f"{src}.mlp", f"{dst}.ffn")
    return rules


def mtp_rules(cfg: Config, fused_experts: bool) -> list[Rule]:
    """The multi-token-prediction head: `mtp.*` (no text-model prefix, in every layout), one
    full-attention layer `mtp.layers.0` whose ffn is MoE in MoE models."""
    return [
        copy("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_embedding"),
        copy("mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_hidden"),
        linear("mtp.fc.weight", "mtp.fc"),
        *_decoder_rules("mtp.layers.0", "mtp.layer", cfg, True, any(cfg.moe_layers), fused_experts),
        copy("mtp.norm.weight", "mtp.norm"),
    ]


def rules_for(cfg: Config, root: str, fused_experts: bool, mtp: bool = False) -> list[Rule]:
    """Every rule for a checkpoint whose text-model tensors start with `root` ("model." or
    "model.language_model."), with the MTP head's when `mtp`."""
    rules = [copy(f"{root}embed_tokens.weight", "embed"), copy(f"{root}norm.weight", "final_norm")]
    if not cfg.tie_word_embeddings:
        rules.append(linear("lm_head.weight", "lm_head"))
    for i, kind in enumerate(cfg.layer_types):
        rules += _decoder_rules(f"{root}layers.{i}", f"layers.{i}", cfg, kind == FULL, cfg.is_moe_layer(i), fused_experts)
    if mtp:
        rules += mtp_rules(cfg, fused_experts)
    return rules


# Tensors that are not the text model, accepted and kept verbatim in Params.extra (opaque to the
# model) so that a round trip back to HF gives every tensor of the source: the multimodal Qwen3.5's
# vision tower. (The MTP head, mtp.*, loads into Params.mtp; a tied checkpoint's spare
# lm_head.weight copy is kept in extra too.)
KEPT_PREFIXES: tuple[str, ...] = ("model.visual.",)
MTP_PREFIX = "mtp."
