"""`hybridjax serve`: the OpenAI-compatible server (one process, or process 0 of a mesh whose other
processes replay its engine steps)."""

from __future__ import annotations

import signal

from hybridjax.cli.common import (DTYPE_HELP, PACK_HELP, QUANTIZE_HELP, QUANTIZE_MODES, CLIError, add_compile_cache, add_mesh_args, init_distributed,
                                 int_at_least, load_model, port_number, positive_float, power_of_two, read_api_keys,
                                 use_compile_cache)


def cmd_serve(args) -> int:
    from hybridjax.compile_cache import executable_dir

    _check_serve_args(args)
    if args.prefix_cache_dir and not args.no_prefix_cache:
        from hybridjax.prefix_cache import DirectoryLock

        DirectoryLock(args.prefix_cache_dir).release()  # in use by another server: say so before loading the model
    multi = (args.num_processes or 1) > 1
    from hybridjax.server.connections import bind

    # The port before the model: one in use is an error now, not after loading and compiling.
    sock = bind(args.host, args.port) if not multi or args.process_id == 0 else None
    init_distributed(args)
    use_compile_cache(args.compile_cache_dir, not args.no_compile_cache)
    kept = str(executable_dir()) if executable_dir() and not args.no_compile_cache else None
    launch = _launch_name(args) if kept and not multi else None
    preloading = None
    if launch:  # the programs the last such launch served from load beside the weights
        from hybridjax import engine_programs

        preloading = engine_programs.preload(kept, launch)
    try:
        cfg, params, tok, name, sc = _load_beside_imports(args)
    except BaseException:
        if preloading is not None:
            preloading.join()  # not while XLA loads a program: a process exiting beside it aborts
        raise
    sc.executable_dir, sc.launch = kept, launch
    from hybridjax.server import serve

    if not multi:
        return serve(sc, cfg, params, tok, name, sock=sock)
    # Process 0 serves HTTP; the others replay its engine steps (hybridjax.multihost).
    import logging

    from hybridjax import multihost

    host = args.coordinator.rsplit(":", 1)[0].strip("[]")
    if args.process_id != 0:
        logging.getLogger("hybridjax.serve").info("process %d: following process 0's engine steps", args.process_id)
        return multihost.follow(cfg, params, multihost.connect(host, cfg, params))
    calls = multihost.lead(host, cfg, params)
    # uvicorn re-raises SIGTERM once it has shut down; with the default action the process would
    # die there, before `finally` tells the followers to stop.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        return serve(sc, cfg, params, tok, name, calls=calls, sock=sock)
    finally:
        calls.close()


def _load_beside_imports(args):
    """(cfg, params, tokenizer, name, ServerConfig): the weights read on a thread while the server's
    modules import."""
    # The weights are read while the server's own modules import (FastAPI and the app, ~0.3-0.5 s;
    # on 2 busy cores the overlap is within the noise of a start: benchmarks/README.md).
    loading = _Background(_load, args)
    from hybridjax.server import ServerConfig

    sc = ServerConfig(
        host=args.host, port=args.port, slots=args.slots, max_len=args.max_len,
        max_queue=args.max_queue, prefix_cache=not args.no_prefix_cache, cache_mb=args.cache_mb,
        cache_entries=args.cache_entries, cache_eviction=args.cache_eviction, cache_ttl_s=args.cache_ttl, checkpoint_interval=args.checkpoint_interval,
        cache_dir=args.prefix_cache_dir, cache_disk_mb=args.prefix_cache_disk_mb or 4096.0, api_key=args.api_key, page_size=args.page_size, kv_pages=args.kv_pages, kv_mb=args.kv_mb,
        prefill_chunk=args.prefill_chunk, warmup=not args.no_warmup,
        api_keys=read_api_keys(args.api_key_file) if args.api_key_file else (),
        max_body_bytes=int(args.max_body_mb * 2**20), speculative_tokens=args.speculative_tokens,
        speculative_adaptive=args.speculative_adaptive, header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout, keep_alive_s=args.keep_alive, max_connections=args.max_connections,
    )
    return (*loading.result(), sc)


def _check_serve_args(args) -> None:
    """The flag combinations serve refuses, before anything loads."""
    if args.prefix_cache_disk_mb is not None and not args.prefix_cache_dir:
        raise CLIError("--prefix-cache-disk-mb needs --prefix-cache-dir (the directory the disk tier lives in)")
    multi = (args.num_processes or 1) > 1
    if multi and not args.mesh:
        raise CLIError("serve across processes needs --mesh (a mesh over every process's devices)")
    if multi and args.prefix_cache_dir:
        # Saving reads sharded KV pages into process 0's host alone (docs/sharding.md).
        raise CLIError("--prefix-cache-dir is not supported across processes")
    if multi and args.speculative_tokens:
        # The speculative step is not among the steps followers replay (hybridjax.multihost).
        raise CLIError("--speculative-tokens is not supported across processes")


def _launch_name(args) -> str:
    """A digest of what this launch serves and how (the model as named, every flag but the
    address): the name under which its programs are noted for the next such launch. A model
    changed in place keeps its name; its programs then have another key and are not used."""
    import hashlib
    import os

    model = os.path.abspath(args.model) if args.model and os.path.exists(args.model) else args.model
    flags = sorted((k, repr(v)) for k, v in vars(args).items() if k not in ("host", "port", "func", "model"))
    return hashlib.sha256(repr((model, flags)).encode()).hexdigest()[:24]


def _load(args):
    """(cfg, params, tokenizer, name) for serve, with its two log lines."""
    import logging
    import time

    log = logging.getLogger("hybridjax.serve")
    log.info("loading %s", args.model or "the embedded default model")
    t0 = time.perf_counter()
    cfg, params, tok, name = load_model(args.model, args.dtype, args.mesh, args.pack_for_decode, args.quantize)
    if tok is None:
        raise CLIError(f"{args.model}: serve needs a tokenizer.json in the model directory")
    n, nbytes = _size(params)
    log.info("loaded %s: %.1fM parameters, %.1f MB (%s), %d layers, context %d, in %.1f s", name, n / 1e6,
             nbytes / 2**20, params.embed.dtype, cfg.num_hidden_layers, min(args.max_len, cfg.max_position_embeddings),
             time.perf_counter() - t0)
    return cfg, params, tok, name


class _Background:
    """fn(*args) on a daemon thread; `result()` waits and returns it or raises what it raised.
    Daemon: an error in the caller meanwhile (an unreadable --api-key-file) exits at once, not
    after the load."""

    def __init__(self, fn, *args):
        import threading

        self._out: list = []
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="hybridjax-load", daemon=True)
        self._thread.start()

    def _run(self, fn, args) -> None:
        try:
            self._out.append((True, fn(*args)))
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            self._out.append((False, e))

    def result(self):
        self._thread.join()
        ok, value = self._out[0]
        if not ok:
            raise value
        return value


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def _size(params) -> tuple[int, int]:
    import jax

    leaves = jax.tree_util.tree_leaves(params)
    return sum(x.size for x in leaves), sum(x.size * x.dtype.itemsize for x in leaves)


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with exact-prefix snapshot reuse")
    p.add_argument("--model", help="HF model directory or converted checkpoint (default: the embedded default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=port_number, default=8000, help="port to listen on")
    p.add_argument("--slots", type=int_at_least(0), default=4, help="requests decoded together")
    p.add_argument("--max-len", type=int_at_least(0), default=4096, help="context length per request")
    p.add_argument("--max-queue", type=int_at_least(0), default=64, help="waiting requests before 429")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn the snapshot store off")
    p.add_argument("--cache-mb", type=positive_float, default=1024.0, help="snapshot store budget in MB")
    p.add_argument("--cache-entries", type=int_at_least(0), default=256, help="snapshot store entry limit")
    p.add_argument("--cache-eviction", choices=("gdsf", "lru"), default="gdsf",
                   help="which snapshot goes first: the least prefill saved per byte, aged by recency (gdsf), "
                        "or the least recently used (lru)")
    p.add_argument("--cache-ttl", type=positive_float, default=3600.0, help="seconds a snapshot lives unused")
    p.add_argument("--checkpoint-interval", type=int_at_least(0), default=256,
                   help="snapshot every N prompt tokens of a long prefill (0 = off)")
    p.add_argument("--prefix-cache-dir",
                   help="write snapshots here as they are stored (kept across restarts and kill -9; "
                        "evicted ones stay on disk and come back on a hit)")
    p.add_argument("--prefix-cache-disk-mb", type=positive_float, default=None,
                   help="disk budget for --prefix-cache-dir in MB (default: 4096)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    p.add_argument("--api-key-file", help="accept every key in this file (one per line); each key has its own cache")
    p.add_argument("--max-body-mb", type=positive_float, default=8.0, help="largest request body in MB (413 above)")
    p.add_argument("--header-timeout", type=positive_float, default=10.0,
                   help="seconds a connection has to send a request's headers (then it is closed)")
    p.add_argument("--body-timeout", type=positive_float, default=60.0,
                   help="seconds a request's body has to arrive (408 and closed after)")
    p.add_argument("--keep-alive", type=positive_float, default=5.0,
                   help="seconds an idle kept-alive connection stays open")
    p.add_argument("--max-connections", type=int_at_least(1), default=1000,
                   help="open connections at most; one more is answered 503 (kept below the open-file limit)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help=DTYPE_HELP)
    p.add_argument("--pack-for-decode", action="store_true", help=PACK_HELP)
    p.add_argument("--quantize", choices=list(QUANTIZE_MODES), default=None, help=QUANTIZE_HELP)
    p.add_argument("--page-size", type=power_of_two, default=64, help="tokens per KV page")
    p.add_argument("--kv-pages", type=int_at_least(0), default=None,
                   help="pages in the KV pool (default: from --kv-mb, else every slot at --max-len, twice)")
    p.add_argument("--kv-mb", type=positive_float, default=None, help="memory for the KV pool in MB (instead of --kv-pages)")
    p.add_argument("--prefill-chunk", type=power_of_two, default=256,
                   help="prompt tokens per engine step; running streams decode between chunks")
    p.add_argument("--no-warmup", action="store_true",
                   help="serve at once and compile each program when a request first needs it (that request waits)")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K", choices=range(5),
                   help="draft K tokens (1-4) per decode step with the model's MTP head, verify them in one "
                        "forward (greedy output unchanged; needs mtp.* weights)")
    p.add_argument("--speculative-adaptive", action="store_true",
                   help="plain steps while the measured step times and acceptance say drafting does not pay "
                        "(default: draft on every step; adaptive makes seeded sampling depend on timing)")
    add_mesh_args(p)
    add_compile_cache(p)
    p.set_defaults(func=cmd_serve)
