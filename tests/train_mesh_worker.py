"""The body of tests/test_train_mesh.py, run in a subprocess with 4 host devices.

`python tests/train_mesh_worker.py OUT_DIR` (XLA_FLAGS must ask for 4 host devices) prints one
JSON report: the loss and gradients of the first batch on one device and on mesh
`data=2,tensor=2` (params by the sharding rules, batch rows on `data`), and the metrics of
`hybridjax train --mesh data=2,tensor=2` from the same fresh params on the same batches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np

import hybridjax
from hybridjax import train
from hybridjax.config import config_from_dict
from hybridjax.default_model import TINY_CONFIG
from hybridjax.tokenizer import Tokenizer, char_level_tokenizer, save_tokenizer

MESH = "data=2,tensor=2"
B, T, SEED = 4, 32, 3
TEXT = ("The delta rule keeps a state per head; attention keeps its keys and values. " * 3).strip()


def write_run_inputs(root: Path) -> tuple[Path, Path]:
    """config.json beside the char-level tokenizer (128 tokens, the tiny model's vocabulary), and
    a JSON-lines data file."""
    d = root / "cfg"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    save_tokenizer(char_level_tokenizer(), d)
    data = root / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"{i}: {TEXT}"}) for i in range(8)) + "\n")
    return d / "config.json", data


def loss_and_grads(params, batch, cfg):
    """The training objective of TrainConfig(mtp_weight=0): mean cross-entropy over the targets."""
    n = np.maximum(batch["mask"].sum(), 1.0)

    def objective(p):
        return train.loss_terms(p, batch, cfg)["ce"] / n

    loss, grads = jax.jit(jax.value_and_grad(objective))(params)
    return float(loss), grads


def main(out_dir: str) -> dict:
    root = Path(out_dir)
    cfg_file, data = write_run_inputs(root)
    cfg = config_from_dict(TINY_CONFIG)
    tok = Tokenizer.from_dir(cfg_file.parent, cfg.eos_token_id)
    ids, flags = train.token_stream(tok, train.read_jsonl(data))
    batch = train.Batches(ids, flags, B, T, seed=SEED)[0]  # what the CLI's first step trains on
    params = train.fresh_params(cfg, SEED)

    loss, grads = loss_and_grads(params, batch, cfg)
    mesh = hybridjax.make_mesh(MESH)
    sharded = hybridjax.shard_params(params, cfg, mesh)
    placed = train.place_batch(batch, mesh)
    mesh_loss, mesh_grads = loss_and_grads(sharded, placed, cfg)

    flat = jax.tree_util.tree_leaves_with_path(grads.replace(mesh=None))
    flat_mesh = jax.tree_util.tree_leaves(mesh_grads.replace(mesh=None))
    report = {
        "loss": loss, "mesh_loss": mesh_loss,
        "grad_norm": float(np.sqrt(sum(float(np.sum(np.square(np.asarray(g)))) for _, g in flat))),
        "grads": {jax.tree_util.keystr(path): [float(np.abs(np.asarray(g) - np.asarray(m)).max()),
                                              float(np.abs(np.asarray(g)).max())]
                  for (path, g), m in zip(flat, flat_mesh)},
        "batch_spec": str(placed["tokens"].sharding.spec),
        "grad_specs": sorted({str(getattr(m.sharding, "spec", None)) for m in flat_mesh}),
    }

    from hybridjax.cli import main as cli

    run = root / "run"
    code = cli(["train", "--config", str(cfg_file), "--data", str(data), "--out", str(run), "--steps", "2",
                "--batch-size", str(B), "--seq-len", str(T), "--seed", str(SEED), "--warmup", "0", "--lr", "1e-2",
                "--mesh", MESH, "--quiet"])
    report["cli_code"] = code
    report["cli_metrics"] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    _, trained = hybridjax.load(run / "model")
    report["cli_model_changed"] = bool(
        np.abs(np.asarray(trained.embed) - np.asarray(params.embed)).max() > 0)
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
