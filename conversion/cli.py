"""`hybridjax convert`: HF safetensors -> hybridjax checkpoint, and back with --to-hf.

    hybridjax convert --hf-dir D --out D [--dtype bfloat16|float32|float16] [--force] [--quiet] [--verify]
    hybridjax convert --to-hf --checkpoint D --out D [--max-shard-size 5GB] [--force] [--quiet] [--verify]

`add_arguments` / `run` plug into the top-level CLI; `main` runs them alone. Problems with the
input (bad directories, existing --out, missing shards, unknown / missing / mis-shaped tensors,
unsupported architectures) print one line on stderr and exit 1; nothing is left at --out.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from hybridjax.conversion.checkpoint import Report, convert_hf
from hybridjax.conversion.hf import CheckpointError
from hybridjax.conversion.progress import TensorBar
from hybridjax.conversion.to_hf import export_hf
from hybridjax.config import ConfigError

DTYPES = ("bfloat16", "float32", "float16")
VERIFY_TOKENS = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf-dir", help="Hugging Face model directory to convert (config.json + safetensors), "
                                         "or a hub id ORG/NAME[@REVISION]")
    parser.add_argument("--to-hf", action="store_true", help="convert a hybridjax checkpoint back to HF safetensors")
    parser.add_argument("--checkpoint", type=Path, help="converted hybridjax checkpoint (with --to-hf)")
    parser.add_argument("--out", type=Path, required=True, help="output directory (written atomically)")
    parser.add_argument("--dtype", choices=DTYPES, help="weight dtype of the output (default: keep the source's)")
    parser.add_argument("--max-shard-size", default="5GB", help="safetensors shard size limit with --to-hf (default 5GB)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    parser.add_argument("--verify", action="store_true",
                        help=f"run {VERIFY_TOKENS} tokens through source and result (hybridjax, and transformers for HF "
                             "output) and print the max logit difference; loads both models in float32")


def run(args: argparse.Namespace, logits_fn=None) -> int:
    """Run `hybridjax convert`. `logits_fn(cfg, params, tokens [1, T]) -> float32 logits`
    runs the model for --verify; the caller passes it in (conversion sits below the model)."""
    # HF -> checkpoint steps once per param leaf (stacked experts are one), the export once per HF tensor.
    bar = None if args.quiet else TensorBar("tensors" if args.to_hf else "arrays", "convert")
    try:
        _check_flags(args)
        say = (lambda *a: None) if args.quiet else functools.partial(print, flush=True)
        if args.to_hf:
            report = export_hf(args.checkpoint, args.out, max_shard_size=args.max_shard_size, dtype=args.dtype,
                               force=args.force, progress=bar)
            source = args.checkpoint
        else:
            report = convert_hf(args.hf_dir, args.out, dtype=args.dtype, force=args.force, progress=bar)
            source = args.hf_dir
        if bar:
            bar.close()
        _summary(report, say)
        return verify(source, args.out, args.to_hf, logits_fn) if args.verify else 0
    except (CheckpointError, ConfigError, OSError) as e:
        if bar:
            bar.close(failed=True)
        print(f"hybridjax convert: error: {_one_line(e)}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None, logits_fn=None) -> int:
    parser = argparse.ArgumentParser(prog="hybridjax convert", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv), logits_fn)


def _check_flags(args: argparse.Namespace) -> None:
    if args.to_hf:
        if args.hf_dir is not None:
            raise CheckpointError("--hf-dir is the source of the HF -> hybridjax direction; with --to-hf use --checkpoint")
        if args.checkpoint is None:
            raise CheckpointError("--to-hf needs --checkpoint DIR (a converted hybridjax checkpoint)")
        if not args.checkpoint.is_dir():
            raise CheckpointError(f"checkpoint directory not found: {args.checkpoint}")
    else:
        if args.checkpoint is not None:
            raise CheckpointError("--checkpoint is the source of --to-hf; to convert an HF directory use --hf-dir")
        if args.hf_dir is None:
            raise CheckpointError("--hf-dir DIR is required (or --to-hf --checkpoint DIR)")


def _one_line(e: Exception) -> str:
    if isinstance(e, OSError) and e.filename:
        return f"{e.strerror or e}: {e.filename}"
    return " ".join(str(e).split())


def _summary(r: Report, say) -> None:
    say(f"wrote {r.out}: {r.tensors} tensors, {r.nbytes / 2**20:.1f} MiB, {r.dtype}, in {r.seconds:.1f} s")
    if r.dropped:
        vision = [n for n in r.dropped if n.startswith("model.visual.")]
        if vision:
            say(f"dropped {len(vision)} vision-tower tensors (model.visual.*): not part of the text model")
        if len(r.dropped) > len(vision):
            say(f"dropped {len(r.dropped) - len(vision)} other tensor(s): {', '.join(n for n in r.dropped if n not in vision)}"
                " (tied embeddings)")
    if r.kept:
        vision = [n for n in r.kept if n.startswith("model.visual.")]
        if vision:
            say(f"kept {len(vision)} vision-tower tensors (model.visual.*) verbatim in params.extra: not used by the text model")
        scales = [n for n in r.kept if n.endswith("_scale_inv")]
        if scales:
            say(f"kept {len(scales)} fp8 scales (*_scale_inv) verbatim in params.extra: the export writes fp8 again")
        other = [n for n in r.kept if n not in vision and n not in scales]
        if other:
            say(f"kept {len(other)} other tensor(s) verbatim in params.extra: {', '.join(other[:6])}"
                + (" ..." if len(other) > 6 else ""))
    for note in r.notes:
        say(note)


# --- --verify ---------------------------------------------------------------------------


def transformers_logits(model_dir: Path, tokens):
    import numpy as np
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def verify(source: Path, result: Path, to_hf: bool, logits_fn) -> int:
    """Print max |logits| differences between source and result; 1 if they are not finite."""
    if logits_fn is None:
        raise CheckpointError("--verify needs the model: run it as `hybridjax convert ... --verify`")
    import numpy as np

    from hybridjax.conversion.checkpoint import load

    cfg, ref_params = load(source, dtype="float32")
    tokens = ((np.arange(VERIFY_TOKENS) * 7919 + 11) % cfg.vocab_size).astype(np.int32)[None]
    ref = logits_fn(cfg, ref_params, tokens)
    del ref_params
    out_cfg, out_params = load(result, dtype="float32")
    got = logits_fn(out_cfg, out_params, tokens)
    diffs = {"hybridjax(result)": float(np.max(np.abs(got - ref)))}
    del out_params
    if to_hf:
        try:
            diffs["transformers(result)"] = float(np.max(np.abs(transformers_logits(result, tokens) - ref)))
        except ImportError:
            print("verify: transformers not installed, skipping it", flush=True)
        except Exception as e:  # noqa: BLE001  any failure to load or run is the finding
            print(f"hybridjax convert: error: verify: transformers cannot run the output: {_one_line(e)}", file=sys.stderr)
            return 1
    for who, d in diffs.items():
        print(f"verify: max |logits {who} - logits hybridjax(source)| = {d:.3g}  ({VERIFY_TOKENS} tokens, float32)", flush=True)
    if not all(np.isfinite(d) for d in diffs.values()):
        print("hybridjax convert: error: verify produced non-finite logits", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
