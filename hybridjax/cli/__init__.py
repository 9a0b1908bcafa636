"""The `hybridjax` command: thin wrappers over library functions.

    hybridjax generate [--model DIR] (--prompt TEXT | --messages FILE.json | --token-ids 1,2,3) ...
    hybridjax serve [--model DIR] [--port 8000] ...
    hybridjax convert --hf-dir D --out D  |  --to-hf --checkpoint D --out D
    hybridjax train (--model DIR | --config FILE) --data FILE.jsonl --out DIR [--steps N] ...

Every error is one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import sys

# Re-exported: what callers and tests use by its old address.
from hybridjax.cli.common import (EXIT_ERROR, CLIError, HelpFormatter, int_at_least, load_model,  # noqa: F401
                                  read_api_keys, setup_logging)
from hybridjax.cli.convert import add_convert, model_logits  # noqa: F401
from hybridjax.cli.generate import add_generate
from hybridjax.cli.serve import add_serve
from hybridjax.cli.train import add_train


def build_parser() -> argparse.ArgumentParser:
    from hybridjax import __version__

    parser = argparse.ArgumentParser(prog="hybridjax", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hybridjax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    add_serve(sub)
    add_convert(sub)
    add_train(sub)
    for p in sub.choices.values():
        p.formatter_class = HelpFormatter
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        setup_logging()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (CLIError, ValueError, OSError) as e:
        # ValueError covers ConfigError, CheckpointError, TokenizerError and bad parameters.
        print(f"hybridjax {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
