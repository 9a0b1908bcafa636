"""Training checkpoints with orbax: trainable params + optimizer state + step + PRNG key, and
the data position (batches consumed) with the run's settings as JSON beside them.

    save_state(dir, state, data_position=i, meta={...})      # dir/<step>/
    state, info = restore_state(dir, like=fresh_state)       # the latest step

The frozen base of a LoRA run is not saved (it is the model the run started from); pass a
fresh state built from it as `like`, and the restored state keeps its `frozen`.
"""

from __future__ import annotations

from pathlib import Path

import jax

from hybridjax.train.step import TrainState

KEEP = 2  # checkpoints kept per run: the latest and the one before it


def _manager(directory: str | Path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        Path(directory).absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=KEEP, create=True)
    )


def _savable(state: TrainState) -> dict:
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step, "key": state.key}


def save_state(directory: str | Path, state: TrainState, *, data_position: int, meta: dict | None = None) -> None:
    """Write `state` as step `state.step` under `directory` (older checkpoints beyond KEEP go)."""
    import orbax.checkpoint as ocp

    step = int(state.step)
    info = {"step": step, "data_position": int(data_position), **(meta or {})}
    with _manager(directory) as mngr:
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_savable(state)),
                                                info=ocp.args.JsonSave(info)))
        mngr.wait_until_finished()


def latest_step(directory: str | Path) -> int | None:
    if not Path(directory).is_dir():
        return None
    with _manager(directory) as mngr:
        return mngr.latest_step()


def restore_state(directory: str | Path, like: TrainState) -> tuple[TrainState, dict]:
    """The latest checkpoint under `directory`, restored into the structure of `like`."""
    import orbax.checkpoint as ocp

    step = latest_step(directory)
    if step is None:
        raise FileNotFoundError(f"no training checkpoint under {directory}")
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _savable(like))
    with _manager(directory) as mngr:
        got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                         info=ocp.args.JsonRestore()))
    s = got["state"]
    state = like.replace(params=s["params"], opt_state=s["opt_state"], step=s["step"], key=s["key"])
    return state, dict(got["info"])
