"""The `hybridjax` command: thin wrappers over library functions.

    hybridjax generate [--model DIR] (--prompt TEXT | --messages FILE.json | --token-ids 1,2,3) ...
    hybridjax serve [--model DIR] [--port 8000] ...
    hybridjax convert --hf-dir D --out D  |  --to-hf --checkpoint D --out D
    hybridjax train (--model DIR | --config FILE) --data FILE.jsonl --out DIR [--steps N] ...

Every error is one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import sys
from pathlib import Path

EXIT_ERROR = 1


class CLIError(Exception):
    """An error whose message is shown to the user as is."""


class _HelpFormatter(argparse.HelpFormatter):
    """--help shows each option's default (unless its help already says it)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def int_at_least(n: int):
    """An argparse type: an integer >= n, its errors in the user's terms (argparse prints them
    after the flag's name)."""
    def integer(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < n:
            raise argparse.ArgumentTypeError(f"must be >= {n}, got {v}")
        return v

    return integer


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s}")
    return v


def _port(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {s!r}") from None
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


def _power_of_two(s: str) -> int:
    v = int_at_least(1)(s)
    if v & (v - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two, got {v}")
    return v


def _token_ids(s: str) -> list[int]:
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
PACK_HELP = ("with --dtype bfloat16 on one CPU device with AVX2 or AVX512_BF16: also keep the projections as packed "
             "panels that decode streams faster (about 2x float32's decode instead of 1.6x), at twice the "
             "bf16 weight memory")


def use_compile_cache(directory: str | None, enabled: bool = True) -> None:
    """Keep compiled programs on disk between runs (`hybridjax.compile_cache`)."""
    from hybridjax.compile_cache import use_compile_cache as use

    use(directory, enabled)


def _add_compile_cache(p) -> None:
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


def _add_mesh_args(p) -> None:
    p.add_argument("--mesh", help='shard the model over devices: "data=1,tensor=2,expert=4" or "auto" '
                                  "(sizes multiply to the device count; default: one device)")
    p.add_argument("--coordinator", help="HOST:PORT of process 0, for a model spanning several processes / hosts")
    p.add_argument("--num-processes", type=int_at_least(0), default=None, help="processes in the job (with --coordinator)")
    p.add_argument("--process-id", type=int, default=None, help="this process's index, 0..N-1 (with --coordinator)")


def load_model(model: str | None, dtype: str | None = None, mesh: str | None = None, pack: bool = False):
    """(cfg, params, tokenizer or None, name) for a model directory, or the embedded default;
    with `mesh` (a spec for `hybridjax.make_mesh`) the params are placed on it as they are read.
    `pack`: bfloat16 projections also kept as the CPU decode kernel's packed panels (PACK_HELP)."""
    import hybridjax

    if pack and (dtype != "bfloat16" or mesh):
        raise CLIError("--pack-for-decode needs --dtype bfloat16 and no --mesh")
    if model is None:
        from hybridjax import cpu_kernels
        from hybridjax.default_model import DEFAULT_NAME, default_model

        cfg, params, tok = default_model(dtype or "float32")
        if mesh:
            params = hybridjax.shard_params(params, cfg, hybridjax.make_mesh(mesh, cfg))
        return cfg, cpu_kernels.pack_params(params) if pack else params, tok, DEFAULT_NAME
    from hybridjax.tokenizer import Tokenizer

    from hybridjax.conversion.hub import resolve_model

    path = resolve_model(model)  # a local directory, else a hub id ORG/NAME[@REVISION]
    placed = hybridjax.make_mesh(mesh, hybridjax.load_config(path)) if mesh else None
    # float32 unless asked: on CPU it decodes faster than bfloat16 (see DTYPE_HELP).
    cfg, params = hybridjax.load(path, dtype=dtype or "float32", mesh=placed, pack_for_decode=pack)
    tok = Tokenizer.from_dir(path, cfg.eos_token_id) if (path / "tokenizer.json").is_file() else None
    return cfg, params, tok, str(model) if hybridjax.is_hub_id(model) else path.name


def _prompt_ids(args, tok) -> list[int]:
    if args.token_ids is not None:
        return args.token_ids
    if tok is None:
        raise CLIError("this model directory has no tokenizer.json: pass --token-ids")
    if args.messages is not None:
        try:
            messages = json.loads(Path(args.messages).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CLIError(f"--messages: cannot read {args.messages}: {e}") from None
        if not isinstance(messages, list):
            raise CLIError("--messages: the file must hold a JSON list of {role, content} objects")
        return tok.encode_chat(messages, add_generation_prompt=True)
    return tok.encode(args.prompt)


def cmd_generate(args) -> int:
    from hybridjax.generate import generate, stream
    from hybridjax.sampling import sampling_params
    from hybridjax.tokenizer import StreamDecoder

    init_distributed(args)
    use_compile_cache(args.compile_cache_dir, not args.no_compile_cache)
    cfg, params, tok, _ = load_model(args.model, args.dtype, args.mesh, args.pack_for_decode)
    prompt = _prompt_ids(args, tok)
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise CLIError(f"token id {bad[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    sp = sampling_params(1, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                         repetition_penalty=args.repetition_penalty)
    stops = tuple(tok.eos_token_ids) if tok is not None else cfg.eos_token_id
    max_len = len(prompt) + args.max_new_tokens
    spec = {}
    if args.speculative_tokens:
        if args.stream:
            raise CLIError("--speculative-tokens runs the whole-call generate: drop --stream")
        from hybridjax.speculative import check_speculative

        check_speculative(params, args.speculative_tokens)
        spec = dict(speculative_tokens=args.speculative_tokens)
    if args.stream:
        decoder = StreamDecoder(tok) if tok is not None else None
        out = []
        for t in stream(params, cfg, prompt, max_new_tokens=args.max_new_tokens, stop_ids=stops, seed=args.seed,
                        sampling=sp, max_len=max_len):
            out.append(t)
            if not args.json:
                print(decoder.push(t) if decoder else f"{t} ", end="", flush=True)
        if not args.json:
            print(decoder.flush() if decoder else "", flush=True)
    else:
        g = generate(params, cfg, [prompt], max_new_tokens=args.max_new_tokens, stop_ids=stops, seeds=[args.seed],
                     sampling=sp, max_len=max_len, **spec)
        out = g.token_lists()[0]
        if spec:
            spec = {"speculative": {"drafted": int(g.drafted[0]), "accepted": int(g.accepted[0])}}
    _say_what_compiled(args)
    text = tok.decode(out, skip_special_tokens=True) if tok is not None else None
    if args.json:
        print(json.dumps({"prompt_token_ids": prompt, "token_ids": out, "text": text, **spec}))
    elif not args.stream:
        print(text if text is not None else " ".join(map(str, out)))
    return 0


def _say_what_compiled(args) -> None:
    """After a first run's compiles, one line: how many programs, how long, and that the next
    run skips them (the compile cache keeps them)."""
    from hybridjax.compile_cache import compiled_so_far

    n, seconds = compiled_so_far()
    if n and not args.no_compile_cache:
        print(f"hybridjax: compiled {n} programs in {seconds:.1f} s; the next run loads them instead", file=sys.stderr,
              flush=True)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("--model", help="HF model directory or converted checkpoint (default: the embedded default model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--messages", help="JSON file with a list of chat messages (rendered with the chat template)")
    src.add_argument("--token-ids", type=_token_ids, help="comma-separated prompt token ids")
    p.add_argument("--max-new-tokens", type=int_at_least(0), default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help=DTYPE_HELP)
    p.add_argument("--pack-for-decode", action="store_true", help=PACK_HELP)
    p.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                   help="draft K (1-4) tokens per step with the model's MTP head and verify them in one forward "
                        "(same greedy output, same sampling distribution; default 0: off)")
    p.add_argument("--json", action="store_true",
                   help='print {"prompt_token_ids", "token_ids", "text"} (+ "speculative": drafted / accepted counts)')
    _add_mesh_args(p)
    _add_compile_cache(p)
    p.set_defaults(func=cmd_generate)


def cmd_serve(args) -> int:
    from hybridjax.compile_cache import executable_dir
    from hybridjax.server import ServerConfig, serve
    from hybridjax.server.app import bind

    sc = ServerConfig(
        host=args.host, port=args.port, slots=args.slots, max_len=args.max_len,
        max_queue=args.max_queue, prefix_cache=not args.no_prefix_cache, cache_mb=args.cache_mb,
        cache_entries=args.cache_entries, cache_eviction=args.cache_eviction, cache_ttl_s=args.cache_ttl, checkpoint_interval=args.checkpoint_interval,
        cache_dir=args.prefix_cache_dir, api_key=args.api_key, page_size=args.page_size, kv_pages=args.kv_pages, kv_mb=args.kv_mb,
        prefill_chunk=args.prefill_chunk, warmup=not args.no_warmup,
        api_keys=read_api_keys(args.api_key_file) if args.api_key_file else (),
        max_body_bytes=int(args.max_body_mb * 2**20), speculative_tokens=args.speculative_tokens,
        speculative_adaptive=args.speculative_adaptive, header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout, keep_alive_s=args.keep_alive, max_connections=args.max_connections,
    )

    multi = (args.num_processes or 1) > 1
    if multi and not args.mesh:
        raise CLIError("serve across processes needs --mesh (a mesh over every process's devices)")
    if multi and args.prefix_cache_dir:
        # Saving reads sharded KV pages into process 0's host alone (docs/sharding.md).
        raise CLIError("--prefix-cache-dir is not supported across processes")
    if multi and args.speculative_tokens:
        # The speculative step is not among the steps followers replay (hybridjax.multihost).
        raise CLIError("--speculative-tokens is not supported across processes")
    if args.prefix_cache_dir and not args.no_prefix_cache:
        from hybridjax.prefix_cache import DirectoryLock

        DirectoryLock(args.prefix_cache_dir).release()  # in use by another server: say so before loading the model
    # The port before the model: one in use is an error now, not after loading and compiling.
    sock = bind(args.host, args.port) if not multi or args.process_id == 0 else None
    init_distributed(args)
    use_compile_cache(args.compile_cache_dir, not args.no_compile_cache)
    sc.executable_dir = str(executable_dir()) if executable_dir() and not args.no_compile_cache else None
    import logging
    import time

    log = logging.getLogger("hybridjax.serve")
    log.info("loading %s", args.model or "the embedded default model")
    t0 = time.perf_counter()
    cfg, params, tok, name = load_model(args.model, args.dtype, args.mesh, args.pack_for_decode)
    if tok is None:
        raise CLIError(f"{args.model}: serve needs a tokenizer.json in the model directory")
    n, nbytes = _size(params)
    log.info("loaded %s: %.1fM parameters, %.1f MB (%s), %d layers, context %d, in %.1f s", name, n / 1e6,
             nbytes / 2**20, params.embed.dtype, cfg.num_hidden_layers, min(args.max_len, cfg.max_position_embeddings),
             time.perf_counter() - t0)
    if not multi:
        return serve(sc, cfg, params, tok, name, sock=sock)
    # Process 0 serves HTTP; the others replay its engine steps (hybridjax.multihost).
    from hybridjax import multihost

    host = args.coordinator.rsplit(":", 1)[0].strip("[]")
    if args.process_id != 0:
        log.info("process %d: following process 0's engine steps", args.process_id)
        return multihost.follow(cfg, params, multihost.connect(host, cfg, params))
    calls = multihost.lead(host, cfg, params)
    # uvicorn re-raises SIGTERM once it has shut down; with the default action the process would
    # die there, before `finally` tells the followers to stop.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        return serve(sc, cfg, params, tok, name, calls=calls, sock=sock)
    finally:
        calls.close()


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def _size(params) -> tuple[int, int]:
    import jax

    leaves = jax.tree_util.tree_leaves(params)
    return sum(x.size for x in leaves), sum(x.size * x.dtype.itemsize for x in leaves)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with exact-prefix snapshot reuse")
    p.add_argument("--model", help="HF model directory or converted checkpoint (default: the embedded default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on")
    p.add_argument("--slots", type=int_at_least(0), default=4, help="requests decoded together")
    p.add_argument("--max-len", type=int_at_least(0), default=4096, help="context length per request")
    p.add_argument("--max-queue", type=int_at_least(0), default=64, help="waiting requests before 429")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn the snapshot store off")
    p.add_argument("--cache-mb", type=_positive_float, default=1024.0, help="snapshot store budget in MB")
    p.add_argument("--cache-entries", type=int_at_least(0), default=256, help="snapshot store entry limit")
    p.add_argument("--cache-eviction", choices=("gdsf", "lru"), default="gdsf",
                   help="which snapshot goes first: the least prefill saved per byte, aged by recency (gdsf), "
                        "or the least recently used (lru)")
    p.add_argument("--cache-ttl", type=_positive_float, default=3600.0, help="seconds a snapshot lives unused")
    p.add_argument("--checkpoint-interval", type=int_at_least(0), default=256,
                   help="snapshot every N prompt tokens of a long prefill (0 = off)")
    p.add_argument("--prefix-cache-dir", help="persist snapshots here across restarts")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    p.add_argument("--api-key-file", help="accept every key in this file (one per line); each key has its own cache")
    p.add_argument("--max-body-mb", type=_positive_float, default=8.0, help="largest request body in MB (413 above)")
    p.add_argument("--header-timeout", type=_positive_float, default=10.0,
                   help="seconds a connection has to send a request's headers (then it is closed)")
    p.add_argument("--body-timeout", type=_positive_float, default=60.0,
                   help="seconds a request's body has to arrive (408 and closed after)")
    p.add_argument("--keep-alive", type=_positive_float, default=5.0,
                   help="seconds an idle kept-alive connection stays open")
    p.add_argument("--max-connections", type=int_at_least(1), default=1000,
                   help="open connections at most; one more is answered 503 (kept below the open-file limit)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help=DTYPE_HELP)
    p.add_argument("--pack-for-decode", action="store_true", help=PACK_HELP)
    p.add_argument("--page-size", type=_power_of_two, default=64, help="tokens per KV page")
    p.add_argument("--kv-pages", type=int_at_least(0), default=None,
                   help="pages in the KV pool (default: from --kv-mb, else every slot at --max-len, twice)")
    p.add_argument("--kv-mb", type=_positive_float, default=None, help="memory for the KV pool in MB (instead of --kv-pages)")
    p.add_argument("--prefill-chunk", type=_power_of_two, default=256,
                   help="prompt tokens per engine step; running streams decode between chunks")
    p.add_argument("--no-warmup", action="store_true",
                   help="serve at once and compile each program when a request first needs it (that request waits)")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K", choices=range(5),
                   help="draft K tokens (1-4) per decode step with the model's MTP head, verify them in one "
                        "forward (greedy output unchanged; needs mtp.* weights)")
    p.add_argument("--speculative-adaptive", action="store_true",
                   help="plain steps while the measured step times and acceptance say drafting does not pay "
                        "(default: draft on every step; adaptive makes seeded sampling depend on timing)")
    _add_mesh_args(p)
    _add_compile_cache(p)
    p.set_defaults(func=cmd_serve)


@functools.lru_cache(maxsize=None)
def _jitted_forward():
    import jax

    import hybridjax

    return jax.jit(hybridjax.forward, static_argnames=("cfg",))


def model_logits(cfg, params, tokens):
    """float32 logits [1, T, vocab] on tokens [1, T] from an empty cache (convert --verify)."""
    import numpy as np

    import hybridjax

    cache = hybridjax.reserve(hybridjax.init_cache(cfg, 1, tokens.shape[1]), tokens.shape[1])
    logits, _ = _jitted_forward()(params, tokens, cache, cfg)
    return np.asarray(logits, np.float32)


def _add_convert(sub) -> None:
    from hybridjax.conversion import cli as convert_cli

    p = sub.add_parser("convert", help="convert HF safetensors <-> hybridjax checkpoints")
    convert_cli.add_arguments(p)
    p.set_defaults(func=functools.partial(convert_cli.run, logits_fn=model_logits))


def build_parser() -> argparse.ArgumentParser:
    from hybridjax import __version__

    parser = argparse.ArgumentParser(prog="hybridjax", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hybridjax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_convert(sub)
    from hybridjax.cli.train import add_train

    add_train(sub)
    for p in sub.choices.values():
        p.formatter_class = _HelpFormatter
    return parser


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
