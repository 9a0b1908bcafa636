"""LoRA: rank-r adapters on the projections of attention, Gated DeltaNet and the MLPs.

An adapter on weight W [in, out] is a pair a [in, r], b [r, out] with b = 0 at the start, and
the effective weight is W + (alpha / r) * a @ b. Adapters live in a flat dict keyed by the
weight's dotted path ("layers.3.mixer.q_proj"), so they are a pytree optax and orbax take as
is. `merge` folds them into the weights: training runs on merged weights (the base stays
frozen, only the adapters get gradients), and export writes merged weights, so a fine-tuned
model is an ordinary checkpoint.

Targets: attention q/k/v/o, GDN in_qkv/in_z/in_b/in_a/out_proj, and the dense MLPs (the
MoE's shared expert included; routed experts and the MTP head are left alone).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hybridjax.params import AttentionParams, GDNParams, MLPParams, Params

TARGETS = {
    AttentionParams: ("q_proj", "k_proj", "v_proj", "o_proj"),
    GDNParams: ("in_qkv", "in_z", "in_b", "in_a", "out_proj"),
    MLPParams: ("gate", "up", "down"),
}


def _targets(params: Params) -> dict[str, jax.Array]:
    """dotted path -> weight, for every LoRA target of the main layers."""
    out = {}

    def walk(node, path):
        if type(node) in TARGETS:
            for name in TARGETS[type(node)]:
                out[f"{path}.{name}"] = getattr(node, name)
        for field in ("mixer", "ffn", "shared"):
            if hasattr(node, field):
                walk(getattr(node, field), f"{path}.{field}")

    for i, layer in enumerate(params.layers):
        walk(layer, f"layers.{i}")
    return out


def init_lora(params: Params, rank: int, seed: int = 0) -> dict[str, dict[str, jax.Array]]:
    """Adapters for every target: a ~ N(0, 1/in), b = 0 (so the model starts unchanged), float32."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    rng = np.random.default_rng(seed)
    adapters = {}
    for path, w in _targets(params).items():
        n_in, n_out = w.shape
        a = rng.standard_normal((n_in, rank)) * n_in**-0.5
        adapters[path] = {"a": jnp.asarray(a, jnp.float32), "b": jnp.zeros((rank, n_out), jnp.float32)}
    return adapters


def merge(params: Params, adapters: dict, alpha: float) -> Params:
    """params with every adapter folded in: W + (alpha / r) * a @ b, in W's dtype."""

    def fold(node, path):
        if type(node) in TARGETS:
            updates = {}
            for name in TARGETS[type(node)]:
                ad = adapters.get(f"{path}.{name}")
                if ad is not None:
                    w = getattr(node, name)
                    scale = alpha / ad["a"].shape[1]
                    # [in, r] @ [r, out] -> [in, out]
                    delta = jnp.dot(ad["a"], ad["b"], preferred_element_type=jnp.float32) * scale
                    updates[name] = (w.astype(jnp.float32) + delta).astype(w.dtype)
            node = node.replace(**updates)
        for field in ("mixer", "ffn", "shared"):
            if hasattr(node, field):
                node = node.replace(**{field: fold(getattr(node, field), f"{path}.{field}")})
        return node

    layers = tuple(fold(layer, f"layers.{i}") for i, layer in enumerate(params.layers))
    return params.replace(layers=layers)
