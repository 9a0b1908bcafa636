"""What every subcommand shares: the one-line error, argument types, the model loader, the
compile cache and mesh flags, logging."""

from __future__ import annotations

import argparse
from pathlib import Path

EXIT_ERROR = 1


class CLIError(Exception):
    """An error whose message is shown to the user as is."""


class HelpFormatter(argparse.HelpFormatter):
    """--help shows each option's default (unless its help already says it)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def _parsed(s: str, convert, what: str):
    """convert(s), or argparse's error in the user's terms (printed after the flag's name)."""
    try:
        return convert(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None


def int_at_least(n: int):
    """An argparse type: an integer >= n."""
    def integer(s: str) -> int:
        v = _parsed(s, int, "an integer")
        if v < n:
            raise argparse.ArgumentTypeError(f"must be >= {n}, got {v}")
        return v

    return integer


def positive_float(s: str) -> float:
    v = _parsed(s, float, "a number")
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s}")
    return v


def port_number(s: str) -> int:
    v = _parsed(s, int, "a port number")
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1..65535, got {v}")
    return v


def read_api_keys(path: str) -> tuple[str, ...]:
    """Keys from a file, one per line (blank lines and '#' comments skipped)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise CLIError(f"--api-key-file: cannot read {path}: {e.strerror or e}") from None
    keys = tuple(k for k in (line.strip() for line in lines) if k and not k.startswith("#"))
    if not keys:
        raise CLIError(f"--api-key-file: {path} holds no keys")
    return keys


def power_of_two(s: str) -> int:
    v = int_at_least(1)(s)
    if v & (v - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two, got {v}")
    return v


def token_ids(s: str) -> list[int]:
    try:
        ids = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


# Measured on CPU (benchmarks/README.md): with the CPU kernel bfloat16 prefills and decodes
# faster than float32; float32 stays the default for its accuracy.
DTYPE_HELP = "weights dtype (default: float32; on CPU bfloat16 prefills and decodes faster)"
PACK_HELP = ("keep the projections in the layouts this CPU's decode streams fastest (one device). bfloat16 with AVX2 "
             "or AVX512_BF16: also as packed panels (about 2x float32's decode instead of 1.6x), at twice the "
             "bf16 weight memory; without AVX512_BF16 prefill's copy is kept in float32 (3x the bf16 bytes) "
             "so that prefill runs at float32's speed (on AVX-512 without AVX512_BF16 only that copy). float32 "
             "on AVX2 or AVX-512: held transposed, the same memory (decode ~1.2x faster; the transpose costs "
             "about a second at load)")

QUANTIZE_MODES = ("int8", "int8-wo", "int8-dot")  # cpu_kernels.QUANTIZE_MODES (no import of the kernels here)
QUANTIZE_HELP = ("int8: int8 projections (decode on CPU reads about a quarter of float32's weight bytes; "
                 "embeddings, norms and the MoE router stay in --dtype); one device only; int8 is int8-dot on "
                 "AVX2 CPUs, else int8-wo. "
                 "int8-wo: weight-only int8, one scale per output column. int8-dot: a scale per column per "
                 "block of 32 (as llama.cpp's Q8_0), and decode rounds the activations to int8 per block of "
                 "32 and multiplies integers (faster decode on AVX2, about as accurate, 1 + 1/16 bytes per "
                 "weight; prefill dequantises the weights each call: about weight-only's speed from 256 tokens, "
                 "0.8x at 64)")


def use_compile_cache(directory: str | None, enabled: bool = True) -> None:
    """Keep compiled programs on disk between runs (`hybridjax.compile_cache`)."""
    from hybridjax.compile_cache import use_compile_cache as use

    use(directory, enabled)


def add_compile_cache(p) -> None:
    from hybridjax.compile_cache import default_compile_cache_dir

    p.add_argument("--compile-cache-dir", help=f"where compiled programs are kept (default {default_compile_cache_dir()})")
    p.add_argument("--no-compile-cache", action="store_true", help="do not keep compiled programs between runs")


def init_distributed(args) -> None:
    """Join a multi-process JAX job (--coordinator/--num-processes/--process-id) before anything
    touches a device; on CPU the processes exchange collectives through gloo."""
    n = getattr(args, "num_processes", None)
    if not n or n == 1:
        return
    if not args.coordinator or args.process_id is None:
        raise CLIError("--num-processes > 1 needs --coordinator HOST:PORT and --process-id I")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=n, process_id=args.process_id)


def add_mesh_args(p) -> None:
    p.add_argument("--mesh", help='shard the model over devices: "data=1,tensor=2,expert=4" or "auto" '
                                  "(sizes multiply to the device count; default: one device)")
    p.add_argument("--coordinator", help="HOST:PORT of process 0, for a model spanning several processes / hosts")
    p.add_argument("--num-processes", type=int_at_least(0), default=None, help="processes in the job (with --coordinator)")
    p.add_argument("--process-id", type=int, default=None, help="this process's index, 0..N-1 (with --coordinator)")


def load_model(model: str | None, dtype: str | None = None, mesh: str | None = None, pack: bool = False,
               quantize: str | None = None):
    """(cfg, params, tokenizer or None, name) for a model directory, or the embedded default;
    with `mesh` (a spec for `hybridjax.make_mesh`) the params are placed on it as they are read.
    `pack`: projections also (bfloat16) or instead (float32) kept in the CPU decode kernel's layouts (PACK_HELP).
    `quantize`: "int8", "int8-wo" or "int8-dot" int8 projections (QUANTIZE_HELP)."""
    import hybridjax

    if pack and mesh:
        raise CLIError("--pack-for-decode runs on one device: drop --mesh")
    if quantize and mesh:
        raise CLIError(f"--quantize {quantize} runs on one device: drop --mesh")
    if quantize and pack:
        raise CLIError(f"--quantize {quantize} and --pack-for-decode are two decode layouts: pick one")
    if model is None:
        from hybridjax import cpu_kernels
        from hybridjax.default_model import DEFAULT_NAME, default_model

        cfg, params, tok = default_model(dtype or "float32")
        if mesh:
            params = hybridjax.shard_params(params, cfg, hybridjax.make_mesh(mesh, cfg))
        if quantize:
            params = cpu_kernels.quantize_params(params, quantize)
        return cfg, cpu_kernels.pack_params(params) if pack else params, tok, DEFAULT_NAME
    from hybridjax.tokenizer import Tokenizer

    from hybridjax.conversion.hub import resolve_model

    path = resolve_model(model)  # a local directory, else a hub id ORG/NAME[@REVISION]
    placed = hybridjax.make_mesh(mesh, hybridjax.load_config(path)) if mesh else None
    # float32 unless asked: on CPU it decodes faster than bfloat16 (see DTYPE_HELP).
    cfg, params = hybridjax.load(path, dtype=dtype or "float32", mesh=placed, pack_for_decode=pack, quantize=quantize)
    tok = Tokenizer.from_dir(path, cfg.eos_token_id) if (path / "tokenizer.json").is_file() else None
    return cfg, params, tok, str(model) if hybridjax.is_hub_id(model) else path.name


def setup_logging(verbose: bool = True) -> None:
    """One line per event on stderr: the server's and the engine's own lines (model, load time,
    one per request), beside uvicorn's access log."""
    import logging

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    # Third-party INFO is not news to a user: jax's backend probing ("no TPU"), orbax's restore
    # steps through absl (dozens of lines per checkpoint load).
    for name in ("jax", "absl", "orbax"):
        logging.getLogger(name).setLevel(logging.WARNING)
