"""Training and fine-tuning with optax: loss, TrainState, the jitted train step, LoRA, orbax
checkpoints, data from JSON lines, and the loop. Sits beside `generate` (model <- train).

    from hybridjax.train import TrainConfig, init_state, make_train_step
    tc = TrainConfig(lr=3e-4, steps=1000)
    state = init_state(params, tc)
    step = make_train_step(cfg, tc)
    state, metrics = step(state, {"tokens": tokens, "mask": mask})   # tokens [B, T+1], mask [B, T]

On a mesh: params from `shard_params` / `load(..., mesh=)`; the state follows their shardings
and the step puts the batch's rows on `data` (`place_batch`).
"""

from hybridjax.train.checkpoint import latest_step, restore_state, save_state
from hybridjax.train.data import Batches, DataError, read_jsonl, token_stream
from hybridjax.train.loop import fit
from hybridjax.train.lora import init_lora, merge
from hybridjax.train.loss import cross_entropy_sum, loss_terms
from hybridjax.train.step import (TrainConfig, TrainState, fresh_params, init_state, make_train_step, model_params,
                                  place_batch)

__all__ = [
    "Batches", "DataError", "TrainConfig", "TrainState", "cross_entropy_sum", "fit", "fresh_params", "init_lora",
    "init_state", "latest_step", "loss_terms", "make_train_step", "merge", "model_params", "place_batch", "read_jsonl",
    "restore_state", "save_state", "token_stream",
]
