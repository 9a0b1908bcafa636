"""`hybridjax train`: train a model from a config, or fine-tune a loaded one (full or LoRA).

    hybridjax train (--model DIR | --config FILE) --data FILE.jsonl --out DIR [--steps N]
        [--batch-size B] [--seq-len T] [--lr X] [--lora-rank R] [--resume] ...

Data: JSON lines of {"text": ...} or {"messages": [...]} (the model's chat template; loss on
the assistant turns). The run directory `--out` holds:

    metrics.jsonl   one line per logged step: step, loss, mtp_loss, grad_norm, tokens, lr, tokens_per_s
    state/<step>/   orbax training checkpoints (params or adapters, optimizer state, data position)
    run.json        the run's settings (a resumed run must match them)
    model/          the trained model as a converted checkpoint (LoRA merged), which
                    `hybridjax.load`, `generate --model`, `serve --model` and `convert --to-hf` read

Part of the CLI layer (it writes checkpoints through `hybridjax.conversion`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from hybridjax.cli.common import int_at_least

RUN_KEYS = ("model", "config", "data", "batch_size", "seq_len", "lr", "lora_rank", "grad_accum", "warmup",
            "mtp_weight", "compute_dtype", "seed", "steps")


def add_train(sub) -> None:
    """Add the `train` subcommand."""
    p = sub.add_parser("train", help="train or fine-tune (full or LoRA) with optax")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF model directory or converted checkpoint to fine-tune")
    src.add_argument("--config", help="config.json of a model to train from scratch")
    p.add_argument("--tokenizer", help="directory with tokenizer.json (default: the model's, or the config's "
                                       "directory, else a byte-level tokenizer)")
    p.add_argument("--data", required=True, help='JSON lines of {"text": ...} or {"messages": [...]}')
    p.add_argument("--out", required=True, help="run directory (metrics.jsonl, state/, model/)")
    p.add_argument("--steps", type=int_at_least(1), default=100, help="optimizer steps (the cosine schedule's length)")
    p.add_argument("--batch-size", type=int_at_least(1), default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int_at_least(1), default=256, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-4; 1e-3 with LoRA)")
    p.add_argument("--warmup", type=int_at_least(0), default=None, help="warm-up steps (default: steps / 10, at most 100)")
    p.add_argument("--lora-rank", type=int_at_least(0), default=0, help="train rank-R adapters instead of all weights")
    p.add_argument("--grad-accum", type=int_at_least(1), default=1, help="micro-batches per step (divides --batch-size)")
    p.add_argument("--mtp-weight", type=float, default=None,
                   help="weight of the MTP head's loss (default 0.3 when the model has one and training is full)")
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the weights' copy the loss runs in (master weights stay float32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int_at_least(1), default=100, help="checkpoint every N steps (and at the end)")
    p.add_argument("--log-every", type=int_at_least(1), default=1, help="write metrics every N steps")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last checkpoint (same settings; a larger --steps "
                        "extends it, stretching the cosine schedule from there)")
    p.add_argument("--mesh", help='train on a device mesh of this process: "data=2,tensor=2" (batch rows on data, '
                                  "weights and optimizer state by the sharding rules; default: one device)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    from hybridjax.cli.common import CLIError
    from hybridjax import train

    out = Path(args.out)
    run = {k: getattr(args, k) for k in RUN_KEYS}
    _check_run_dir(out, run, args.resume, CLIError)
    cfg, params, tok, config_dir = _model(args, CLIError)
    if args.mtp_weight is None:
        args.mtp_weight = 0.3 if params.mtp is not None and not args.lora_rank else 0.0
    if args.mtp_weight > 0 and params.mtp is None:
        raise CLIError("--mtp-weight > 0 needs a model with an MTP head")
    if args.batch_size % args.grad_accum:
        raise CLIError(f"--grad-accum ({args.grad_accum}) must divide --batch-size ({args.batch_size})")
    ids, flags = train.token_stream(tok, train.read_jsonl(args.data))
    if ids.size and int(ids.max()) >= cfg.vocab_size:
        raise CLIError(f"the tokenizer makes id {int(ids.max())} but the model's vocabulary is {cfg.vocab_size}")
    batches = train.Batches(ids, flags, args.batch_size, args.seq_len, seed=args.seed)

    tc = train.TrainConfig(
        lr=args.lr or (1e-3 if args.lora_rank else 3e-4), steps=args.steps,
        warmup=args.warmup if args.warmup is not None else min(100, args.steps // 10), grad_accum=args.grad_accum,
        mtp_weight=args.mtp_weight, compute_dtype=args.compute_dtype, lora_rank=args.lora_rank,
    )
    state = train.init_state(params, tc, seed=args.seed)
    if args.resume:
        state, info = train.restore_state(out / "state", like=state)
        print(f"resuming at step {int(state.step)} (data position {info['data_position']})")
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    print(f"training {sum(x.size for x in _leaves(state.params)):,} parameters on {batches.n_tokens:,} tokens "
          f"({batches.per_epoch} batches per epoch) for {args.steps} steps")
    state, history = train.fit(
        train.make_train_step(cfg, tc), state, batches, args.steps, metrics_path=out / "metrics.jsonl",
        checkpoint_dir=out / "state", save_every=args.save_every, log_every=args.log_every, progress=not args.quiet,
    )
    try:
        _save_model(train.model_params(state, tc), out / "model", config_dir)
    finally:
        if args.config:  # the temporary directory _model made
            shutil.rmtree(config_dir, ignore_errors=True)
    if history:
        print(f"step {history[-1]['step']}: loss {history[-1]['loss']:.4f}; model written to {out / 'model'}")
    return 0


def _leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def _check_run_dir(out: Path, run: dict, resume: bool, error) -> None:
    from hybridjax import train

    has_state = train.latest_step(out / "state") is not None
    if resume:
        if not has_state:
            raise error(f"--resume: no checkpoint under {out / 'state'}")
        before = json.loads((out / "run.json").read_text()) if (out / "run.json").is_file() else {}
        changed = [k for k in RUN_KEYS if k != "steps" and k in before and before[k] != run[k]]
        if changed:
            raise error(f"--resume: settings differ from the run in {out}: {', '.join(changed)}")
    elif has_state or (out / "metrics.jsonl").exists():
        raise error(f"{out} already holds a run: pass --resume to continue it, or choose another --out")


def _model(args, error):
    """(cfg, float32 params, tokenizer, directory holding config.json + tokenizer files)."""
    import hybridjax
    from hybridjax import train
    from hybridjax.config import config_from_dict, read_json
    from hybridjax.tokenizer import Tokenizer, byte_level_tokenizer, save_tokenizer

    if args.model:
        path = Path(args.model)
        if not path.is_dir():
            raise error(f"model directory not found: {args.model}")
        mesh = hybridjax.make_mesh(args.mesh, hybridjax.load_config(path)) if args.mesh else None
        cfg, params = hybridjax.load(path, dtype="float32", mesh=mesh)
        tok_dir = Path(args.tokenizer) if args.tokenizer else path
        if not (tok_dir / "tokenizer.json").is_file():
            raise error(f"{tok_dir} has no tokenizer.json: pass --tokenizer DIR")
        return cfg, params, Tokenizer.from_dir(tok_dir, cfg.eos_token_id), path
    cfg_path = Path(args.config)
    if not cfg_path.is_file():
        raise error(f"config file not found: {args.config}")
    raw = read_json(cfg_path)
    cfg = config_from_dict(raw)
    params = train.fresh_params(cfg, args.seed, mtp=bool(raw.get("mtp_num_hidden_layers") or raw.get("num_nextn_predict_layers")))
    if args.mesh:
        params = hybridjax.shard_params(params, cfg, hybridjax.make_mesh(args.mesh, cfg))
    tok_dir = Path(args.tokenizer) if args.tokenizer else cfg_path.parent
    tok = Tokenizer.from_dir(tok_dir, cfg.eos_token_id) if (tok_dir / "tokenizer.json").is_file() else byte_level_tokenizer()
    if tok.vocab_size > cfg.vocab_size:
        raise error(f"the tokenizer has {tok.vocab_size} tokens but vocab_size is {cfg.vocab_size}")
    config_dir = Path(tempfile.mkdtemp(prefix="hybridjax-train-"))
    shutil.copyfile(cfg_path, config_dir / "config.json")
    save_tokenizer(tok, config_dir)
    return cfg, params, tok, config_dir


def _save_model(params, out: Path, config_dir: Path) -> None:
    from hybridjax.conversion import save_checkpoint

    save_checkpoint(params, out, config_dir=config_dir, force=True, source={"trained_by": "hybridjax train"})
