"""TrainState, the optax optimizer and the jitted, donating `train_step`.

    opt = TrainConfig(lr=3e-4, steps=1000).optimizer()
    state = init_state(params, opt, seed=0)                  # or lora_rank=8 for adapters
    step = make_train_step(cfg, TrainConfig(...))
    state, metrics = step(state, batch)                       # state donated: use the new one

Master weights (the trainable pytree and the optimizer state) are float32; with
`compute_dtype="bfloat16"` the loss runs on a bfloat16 copy made inside the step, and gradients
come back through the cast in float32. Gradient accumulation splits the batch into
`grad_accum` micro-batches (a scan), sums their gradients and applies one update; the loss is
normalised by the target count of the whole batch, so accumulation changes nothing but memory.
Gradients through the Gated DeltaNet layers come from the delta rule's custom VJP
(pallas_kernels/gated_delta_rule/backward.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from hybridjax import pytree, sharding
from hybridjax.config import Config
from hybridjax.params import FLOAT32_LEAVES, Params, cast_params, init_params
from hybridjax.train import lora as lora_lib
from hybridjax.train.loss import loss_terms, token_counts

f32 = jnp.float32


@pytree.dataclass
class TrainState:
    params: Any  # the trainable pytree: Params (full training) or LoRA adapters; float32
    opt_state: Any
    step: jax.Array  # int32 []
    key: jax.Array  # uint32 [2]: a PRNG key, split once per step (for stochastic extensions)
    frozen: Any = None  # the base Params under LoRA (not trained), else None


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters; frozen and hashable (a static argument of the jitted step)."""

    lr: float = 3e-4
    steps: int = 1000  # length of the cosine schedule
    warmup: int = 50
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.1  # on matrices only (not norms, gates, biases)
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0  # global-norm gradient clipping
    grad_accum: int = 1
    mtp_weight: float = 0.0  # weight of the MTP loss (needs params.mtp)
    compute_dtype: str = "float32"  # or "bfloat16": the loss's copy of the weights
    lora_rank: int = 0  # 0: full training
    lora_alpha: float = 16.0
    implementation: str | None = None  # delta-rule implementation (None: the platform default)

    def schedule(self) -> optax.Schedule:
        warmup = min(self.warmup, max(self.steps - 1, 0))
        return optax.warmup_cosine_decay_schedule(
            0.0, self.lr, warmup, max(self.steps, warmup + 1), end_value=self.lr * self.min_lr_ratio
        )

    def optimizer(self) -> optax.GradientTransformation:
        """AdamW with warm-up + cosine decay, after global-norm clipping."""
        return optax.chain(
            optax.clip_by_global_norm(self.clip_norm),
            optax.adamw(self.schedule(), b1=self.b1, b2=self.b2, weight_decay=self.weight_decay, mask=_decay_mask),
        )


def _decay_mask(tree):
    """Weight decay on matrices (ndim >= 2) only, never on the gate parameters nor on the tensors
    kept verbatim in `extra` (a vision tower: zero gradients, so with no decay it stays as loaded)."""

    def decays(path, x):
        if getattr(path[0], "name", None) == "extra":
            return False
        return x.ndim >= 2 and getattr(path[-1], "name", None) not in FLOAT32_LEAVES

    return jax.tree_util.tree_map_with_path(decays, tree)


def fresh_params(cfg: Config, seed: int = 0, mtp: bool = False) -> Params:
    """Random float32 params to train from scratch: `init_params`' weights (std fan_in ** -0.5),
    with every norm at its usual start (zero for the (1 + w) norms, one for the GDN output
    norm; `init_params` draws them off-centre on purpose, for tests)."""

    def fix(path, x):
        name = getattr(path[-1], "name", "")
        if "norm" not in name:
            return x
        in_gdn = name == "norm" and any(getattr(p, "name", None) == "mixer" for p in path)
        return jnp.ones_like(x) if in_gdn else jnp.zeros_like(x)

    return jax.tree_util.tree_map_with_path(fix, init_params(seed, cfg, mtp=mtp))


def init_state(params: Params, tc: TrainConfig, seed: int = 0) -> TrainState:
    """A fresh TrainState: float32 master weights (or LoRA adapters over frozen params)."""
    if tc.lora_rank:
        trainable, frozen = lora_lib.init_lora(params, tc.lora_rank, seed), params
    else:
        # A copy: the step donates the state, and the caller's params must survive it.
        trainable, frozen = jax.tree_util.tree_map(lambda x: jnp.array(x, f32, copy=True), params), None
    return TrainState(
        params=trainable, opt_state=tc.optimizer().init(trainable), step=jnp.zeros((), jnp.int32),
        key=jax.random.PRNGKey(seed), frozen=frozen,
    )


def model_params(state: TrainState, tc: TrainConfig) -> Params:
    """The model the state stands for: the trained params, or the base with adapters merged."""
    if tc.lora_rank:
        return lora_lib.merge(state.frozen, state.params, tc.lora_alpha)
    return state.params


def _objective(trainable, frozen, batch, n, n_mtp, cfg: Config, tc: TrainConfig):
    params = lora_lib.merge(frozen, trainable, tc.lora_alpha) if tc.lora_rank else trainable
    if tc.compute_dtype != "float32":
        params = cast_params(params, tc.compute_dtype)
    terms = loss_terms(params, batch, cfg, mtp=tc.mtp_weight > 0, implementation=tc.implementation)
    total = terms["ce"] / n + tc.mtp_weight * terms["mtp"] / n_mtp
    return total, terms


def _step(state: TrainState, frozen, batch: dict, cfg: Config, tc: TrainConfig):
    state = state.replace(frozen=frozen)
    n, n_mtp = (jnp.maximum(c, 1.0) for c in token_counts(batch["mask"]))
    grad_fn = jax.value_and_grad(_objective, has_aux=True)
    if tc.grad_accum == 1:
        (_, terms), grads = grad_fn(state.params, state.frozen, batch, n, n_mtp, cfg, tc)
    else:
        a = tc.grad_accum

        def micro(carry, mb):
            g_sum, t_sum = carry
            (_, terms), g = grad_fn(state.params, state.frozen, mb, n, n_mtp, cfg, tc)
            return (jax.tree_util.tree_map(jnp.add, g_sum, g), jax.tree_util.tree_map(jnp.add, t_sum, terms)), None

        # [B, ...] -> [A, B / A, ...]: micro-batch i takes rows i*B/A .. (i+1)*B/A - 1
        micro_batches = jax.tree_util.tree_map(lambda x: x.reshape(a, x.shape[0] // a, *x.shape[1:]), batch)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
        terms0 = {"ce": jnp.zeros((), f32), "mtp": jnp.zeros((), f32)}
        (grads, terms), _ = jax.lax.scan(micro, (zeros, terms0), micro_batches)
    updates, opt_state = tc.optimizer().update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    key, _ = jax.random.split(state.key)
    metrics = {
        "loss": terms["ce"] / n,
        "mtp_loss": terms["mtp"] / n_mtp,
        "grad_norm": optax.global_norm(grads),
        "tokens": jnp.sum(batch["mask"], dtype=f32),
        "lr": tc.schedule()(state.step),
    }
    new = state.replace(params=params, opt_state=opt_state, step=state.step + 1, key=key, frozen=None)
    return new, metrics


def make_train_step(cfg: Config, tc: TrainConfig):
    """`train_step(state, batch) -> (new_state, metrics)`, jitted, donating `state`.

    batch: {"tokens": int32 [B, T+1], "mask": float32 [B, T]}, B divisible by tc.grad_accum.
    metrics: loss (mean main cross-entropy), mtp_loss, grad_norm (before clipping), tokens
    (targets counted), lr (the learning rate this step used).
    """
    if tc.mtp_weight > 0 and tc.lora_rank:
        raise ValueError("the MTP loss trains the MTP head, which LoRA leaves frozen: use mtp_weight=0 with LoRA")
    # The frozen base (LoRA) goes in as its own argument: never donated, never copied.
    jitted = jax.jit(_step, static_argnames=("cfg", "tc"), donate_argnums=0)

    def train_step(state: TrainState, batch: dict):
        b = batch["tokens"].shape[0]
        if b % tc.grad_accum:
            raise ValueError(f"batch size {b} is not divisible by grad_accum={tc.grad_accum}")
        if tc.mtp_weight > 0 and _lacks_mtp(state):
            raise ValueError("mtp_weight > 0 but the model has no MTP head (params.mtp is None)")
        batch = place_batch(batch, _mesh(state))
        new, metrics = jitted(state.replace(frozen=None), state.frozen, batch, cfg, tc)
        return new.replace(frozen=state.frozen), metrics

    return train_step


def place_batch(batch: dict, mesh) -> dict:
    """The batch on `mesh` with its rows split over `data` (data parallelism; replicated when
    they do not divide); as given without a multi-device mesh. XLA then all-reduces the
    gradients over `data`, as it all-reduces activations over `tensor` (docs/sharding.md)."""
    if not sharding.is_multi_device(mesh):
        return batch
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rows = sharding.batch_axis(mesh, batch["tokens"].shape[0])
    return {k: jax.device_put(v, NamedSharding(mesh, P(rows))) for k, v in batch.items()}


def _mesh(state: TrainState):
    """The mesh the model lives on (Params.mesh, static), or None."""
    p = state.frozen if state.frozen is not None else state.params
    return getattr(p, "mesh", None)


def _lacks_mtp(state: TrainState) -> bool:
    p = state.frozen if state.frozen is not None else state.params
    return getattr(p, "mtp", None) is None
