"""Decode through the engine and the HTTP server against the library's `generate`, in one run.

    python benchmarks/bench_serve_decode.py [--model-dir DIR] [--dtype float32] [--prompt 32]
        [--new-tokens 128] [--streams 1,4] [--rounds 3] [--max-len 4096] [--profile] [--json OUT]
        [--pack-for-decode] [--llama-server PATH --gguf MODEL.gguf [--threads 2]]

One process, one model (the random Qwen3.5 of bench_generate.py, 228 M params, built into
--model-dir if absent; a word-level tokenizer of its 32000 ids is written beside it, since the
server needs one). Greedy, `--new-tokens` after a `--prompt`-token prompt, no stop tokens:

  generate   the library's `hybridjax.generate.generate`, batch 1:
             (N - 1) / (t(N new tokens) - t(1 new token))
  engine     `Engine` as `hybridjax serve` builds it (`build_engine`, default ServerConfig but
             --max-len; prefix cache on), S concurrent requests submitted directly:
             tokens after each first / (last token's time - first token's time)
  server     the same engine behind the app and uvicorn on 127.0.0.1, S concurrent streamed
             `/v1/completions` requests (token-id prompts, `ignore_eos`), timed as `engine` from
             the SSE chunks the client reads; in this process, so the clients' threads share its
             interpreter (and GIL) with the server and the engine
  process    with the `process` section: `hybridjax serve` in a process of its own, as a user runs
             it and as llama-server runs, with the same model, dtype and --max-len; it loads the
             executables the engine above kept (`--compile-cache-dir`), and timing waits until its
             /metrics says every program exists; streamed and timed as `server`
  llama-server  with --llama-server: llama.cpp's server on a GGUF of the same weights (`-np S`,
             `-t --threads`), S concurrent streamed `/completion` requests (the same token-id
             prompts, greedy, `ignore_eos`, no prompt cache), timed as `server` per token; its
             tokens are compared with generate's (different float arithmetic: a count, not a check)
  compiles   the engine serves once its covering set is compiled and compiles the rest behind
             (`Engine.background_shapes`); timing waits until that is done unless
             --during-compiles (then the rounds run on the covering set's padded decode bucket,
             beside the compiling thread: what a user timing a fresh server sees)
  per token  with --profile: where the engine worker's time per token goes (wall time inside
             `_dispatch` (building arguments, launching the step), the wait for a step's outputs,
             delivering (detokenising, events) and the rest of the loop), from the engine's
             own methods timed around their calls during one extra engine round

Each round runs every section once (generate, then engine and server per S), so load drift hits
all alike; medians over `--rounds` are shown, and ratios to `generate` of the same round. The
engine's and the server's tokens are checked against `generate`'s. The machine may be shared:
the load average is printed before and after; quote ratios from one run.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def loadavg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def word_tokenizer(model_dir: Path, vocab: int) -> None:
    """A word-level tokenizer.json with one word per id (w0 .. w{vocab-1}) and ChatML specials above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The app over `engine` under uvicorn in a thread of this process."""

    def __init__(self, engine, name: str, sc):
        import uvicorn

        from hybridjax.server import create_app
        from hybridjax.server.connections import uvicorn_options

        self.port = free_port()
        app = create_app(engine, name, warmup=False)
        options = uvicorn_options(dataclasses.replace(sc, host="127.0.0.1", port=self.port))
        self.server = uvicorn.Server(uvicorn.Config(app, **options, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def stream_one(port: int, name: str, prompt: list[int], n: int) -> tuple[list[float], list[str], list[float]]:
    """Chunk arrival times, texts and process CPU times of one streamed /v1/completions request."""
    import httpx

    body = dict(model=name, prompt=prompt, max_tokens=n, temperature=0, stream=True, ignore_eos=True)
    times, texts, cpu = [], [], []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                if choice.get("text"):
                    times.append(time.perf_counter())
                    cpu.append(time.process_time())
                    texts.append(choice["text"])
    return times, texts, cpu


class LlamaServer:
    """llama.cpp's `llama-server` on a GGUF of the same weights, `slots` parallel sequences, in a
    subprocess; `stream(prompt, n)` as `stream_one` over its native /completion endpoint (token-id
    prompt, greedy, `ignore_eos`, no prompt cache), timed per generated token."""

    def __init__(self, binary: str, gguf: str, slots: int, threads: int, ctx_per_slot: int):
        import subprocess

        import httpx

        self.port = free_port()
        cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), "-np", str(slots),
               "-t", str(threads), "-c", str(slots * ctx_per_slot), "--no-webui"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited ({self.proc.returncode}): {' '.join(cmd)}")
            time.sleep(0.2)
        raise SystemExit("llama-server did not become healthy in 300 s")

    def stream(self, prompt: list[int], n: int) -> tuple[list[float], list[int], list[float]]:
        import httpx

        body = dict(prompt=prompt, n_predict=n, temperature=0, ignore_eos=True, stream=True, cache_prompt=False,
                    return_tokens=True)
        times, tokens, cpu = [], [], []
        with httpx.stream("POST", f"http://127.0.0.1:{self.port}/completion", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got = json.loads(line[6:]).get("tokens") or []
                    for t in got:  # one event per token (an event may carry none: the final one)
                        times.append(time.perf_counter())
                        cpu.append(time.process_time())
                        tokens.append(t)
        return times, tokens, cpu

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


class ServeProcess:
    """`hybridjax serve` in a subprocess (`process` above); `port` and the served model's `name`."""

    def __init__(self, model_dir: Path, dtype: str, max_len: int, compile_cache: Path, log: Path, pack: bool):
        import subprocess

        import httpx

        self.port = free_port()
        cmd = [sys.executable, "-m", "hybridjax.cli", "serve", "--model", str(model_dir), "--dtype", dtype,
               "--max-len", str(max_len), "--port", str(self.port), "--compile-cache-dir", str(compile_cache)]
        cmd += ["--pack-for-decode"] if pack else []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"), env=env)
        url, deadline = f"http://127.0.0.1:{self.port}", time.time() + 900
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"hybridjax serve exited ({self.proc.returncode}); its log: {log}")
            try:
                metrics = dict(line.split(" ", 1) for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
                               if line.startswith("hybridjax_programs"))
                if metrics and metrics["hybridjax_programs_ready"] == metrics["hybridjax_programs"]:
                    self.name = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"hybridjax serve did not have every program in 900 s; its log: {log}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def rate(firsts: list[float], lasts: list[float], tokens: int) -> float:
    return tokens / (max(lasts) - min(firsts))


class Profile:
    """Wall seconds the engine worker spends in its parts, from its loop's methods timed around
    their calls (instance attributes shadow the class's methods while the profile is open)."""

    PARTS = {"_admit": "admit", "_prefill": "prefill", "_dispatch": "dispatch (arguments, launch)",
             "_deliver": "deliver (detokenise, events)"}

    def __init__(self, engine):
        self.engine, self.totals = engine.loop, collections.Counter()  # hybridjax.engine.DeviceLoop

    def _timed(self, fn, label):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.totals[label] += time.perf_counter() - t0
        return wrapped

    def __enter__(self):
        import jax

        for name, label in self.PARTS.items():
            setattr(self.engine, name, self._timed(getattr(self.engine, name), label))
        process = self.engine._process

        def wait_then_process(step):  # the first read of a step's outputs waits for the step
            t0 = time.perf_counter()
            jax.block_until_ready(step.outputs)
            self.totals["wait for the step's outputs"] += time.perf_counter() - t0
            process(step)

        self.engine._process = wait_then_process
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        for name in (*self.PARTS, "_process"):
            delattr(self.engine, name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="/tmp/bench_serve_decode_model")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--streams", default="1,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--during-compiles", action="store_true",
                    help="time from when the engine is ready, while the rest of its programs compile behind")
    ap.add_argument("--sections", default="engine,server")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary: its S streams beside ours, each round")
    ap.add_argument("--gguf", help="GGUF of the same weights and dtype, for --llama-server")
    ap.add_argument("--threads", type=int, default=2, help="llama-server threads")
    ap.add_argument("--pack-for-decode", action="store_true",
                    help="every section on the params in the CPU's decode layouts (`hybridjax.load(pack_for_decode=True)`)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    import bench_generate

    model_dir = Path(a.model_dir)
    if not (model_dir / "config.json").exists():
        print(f"building the model into {model_dir}", flush=True)
        bench_generate.build_model(model_dir)
    if not (model_dir / "tokenizer.json").exists():
        word_tokenizer(model_dir, bench_generate.MODEL["vocab_size"])

    import jax

    import hybridjax
    from hybridjax import generate as hg
    from hybridjax.engine import GenerationRequest
    from hybridjax.server import ServerConfig
    from hybridjax.server.app import build_engine
    from hybridjax.tokenizer import Tokenizer

    print(f"load before: {loadavg()}; {os.cpu_count()} CPUs; machine may be shared", flush=True)
    cfg, params = hybridjax.load_hf(model_dir, dtype=a.dtype, pack_for_decode=a.pack_for_decode)
    tok = Tokenizer.from_dir(model_dir)
    name = "bench"
    sections = a.sections.split(",")
    compile_cache = Path(tempfile.mkdtemp(prefix="bench_serve_decode_"))  # executables for the `process` server
    sc = ServerConfig(max_len=a.max_len, executable_dir=str(compile_cache / "executables") if "process" in sections else None)
    engine, _ = build_engine(sc, cfg, params, tok, name)
    t0 = time.perf_counter()
    engine.start(warmup=True)
    engine.ready.wait()
    print(f"engine ready in {time.perf_counter() - t0:.0f} s (covering set)", flush=True)
    if not a.during_compiles:
        while engine.compiling:  # the rest compiles behind, taking a core the steps would use
            time.sleep(0.5)
        print(f"every program compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    server = Server(engine, name, sc) if "server" in sections else None
    process = None
    if "process" in sections:
        t1 = time.perf_counter()
        process = ServeProcess(model_dir, a.dtype, a.max_len, compile_cache, compile_cache / "serve.log", a.pack_for_decode)
        print(f"hybridjax serve (own process) has every program after {time.perf_counter() - t1:.0f} s", flush=True)
    streams = [int(s) for s in a.streams.split(",")]
    n = a.new_tokens
    prompts = [bench_generate.prompt_tokens(a.prompt + i).tolist() for i in range(max(streams))]

    def lib(new: int):
        t0 = time.perf_counter()
        g = hg.generate(params, cfg, [prompts[0]], max_new_tokens=new, stop_ids=())
        jax.block_until_ready(g)
        return time.perf_counter() - t0, g.token_lists()[0]

    def lib_rate():
        c0 = time.process_time()
        t1, _ = lib(1)
        c1 = time.process_time()
        tn, toks = lib(n)
        c2 = time.process_time()
        return ((n - 1) / (tn - t1), (n - 1) / ((c2 - c1) - (c1 - c0))), toks

    def eng_rate(s: int):
        hs = [engine.submit(GenerationRequest(prompts[i], max_tokens=n)) for i in range(s)]
        firsts, lasts, cpu = [], [], []
        for h in hs:
            for i, _ in enumerate(h.events()):
                if i == 0:
                    firsts.append(time.perf_counter())
                    cpu.append(time.process_time())
            lasts.append(time.perf_counter())
        tokens = sum(len(h.token_ids) - 1 for h in hs)
        return (rate(firsts, lasts, tokens), tokens / (time.process_time() - min(cpu))), [h.token_ids for h in hs]

    def srv_rate(s: int, port_name=None):
        port, model = port_name or (server.port, name)
        with cf.ThreadPoolExecutor(s) as ex:
            res = list(ex.map(lambda i: stream_one(port, model, prompts[i], n), range(s)))
        tokens = sum(len(t) - 1 for t, _, _ in res)
        wall = rate([t[0] for t, _, _ in res], [t[-1] for t, _, _ in res], tokens)
        cpu = rate([c[0] for _, _, c in res], [c[-1] for _, _, c in res], tokens)
        return (wall, cpu), [x for _, x, _ in res]

    def proc_rate(s: int):  # this process's CPU time is only the clients': no CPU figure
        (wall, _), texts = srv_rate(s, (process.port, process.name))
        return (wall, float("nan")), texts

    llama = None
    if a.llama_server:
        if not a.gguf:
            raise SystemExit("--llama-server needs --gguf")
        llama = LlamaServer(a.llama_server, a.gguf, max(streams), a.threads, a.prompt + max(streams) + n + 64)

    def llama_rate(s: int):
        with cf.ThreadPoolExecutor(s) as ex:
            res = list(ex.map(lambda i: llama.stream(prompts[i], n), range(s)))
        tokens = sum(len(t) - 1 for t, _, _ in res)
        wall = rate([t[0] for t, _, _ in res], [t[-1] for t, _, _ in res], tokens)
        return (wall, float("nan")), [x for _, x, _ in res]

    ref = {}  # the tokens of each prompt, from generate (batch 1)
    for i in range(max(streams)):
        ref[i] = hg.generate(params, cfg, [prompts[i]], max_new_tokens=n, stop_ids=()).token_lists()[0]
    same = {}
    for s in streams:  # compile / warm every path once (not timed)
        if "engine" in sections:
            same[("engine", s)] = eng_rate(s)[1] == [ref[i] for i in range(s)]
        for kind, at in (("server", server and (server.port, name)), ("process", process and (process.port, process.name))):
            if at:
                texts = srv_rate(s, at)[1]
                same[(kind, s)] = ["".join(t) == tok.decode(ref[i]) for i, t in enumerate(texts)] == [True] * s
        if llama:  # its float arithmetic differs from ours: how many of its tokens match, not a check
            equal = sum(t == ref[i] for i, t in enumerate(llama_rate(s)[1]))
            same[("llama-server", s)] = f"{equal}/{s} equal"
    lib_rate()

    results = collections.defaultdict(list)  # path -> [(wall tok/s, cpu tok/s, wall x, cpu x)] per round
    for r in range(a.rounds):
        base = lib_rate()[0]
        results["generate"].append(base + (1.0, 1.0))
        for s in streams:
            for kind, fn in (("engine", eng_rate), ("server", srv_rate if server else None),
                             ("process", (lambda s: proc_rate(s)) if process else None),
                             ("llama-server", llama_rate if llama else None)):
                if (kind in sections or kind == "llama-server") and fn is not None:
                    v = fn(s)[0]
                    results[f"{kind} x{s}"].append(v + (v[0] / base[0], v[1] / base[1]))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1][0]:.1f}" for k, v in results.items())
              + f"; load {loadavg()}; compiling behind: {engine.compiling}", flush=True)

    layout = ", decode layouts (--pack-for-decode)" if a.pack_for_decode else ""
    print(f"\n{cfg.num_hidden_layers} layers, {a.dtype}{layout}, {n} tokens after {a.prompt}, greedy, medians of {a.rounds} "
          f"rounds; load after: {loadavg()}")
    print("cpu tok/s: tokens per second of this process's CPU time (all threads; the server's includes its client)")
    print(f"{'path':<12} {'tok/s':>7} {'x generate':>10} {'cpu tok/s':>10} {'x generate':>10} {'same tokens':>12}")
    rows = []
    for k, v in results.items():
        med = [statistics.median(x[j] for x in v) for j in range(4)]
        kind, _, s = k.partition(" x")
        ok = same.get((kind, int(s)), True) if s else True
        print(f"{k:<12} {med[0]:>7.1f} {med[2]:>9.2f}x {med[1]:>10.1f} {med[3]:>9.2f}x {str(ok):>12}")
        rows.append(dict(path=k, tok_s=med[0], ratio=med[2], cpu_tok_s=med[1], cpu_ratio=med[3], same=ok))

    by_path = {r["path"]: r["tok_s"] for r in rows}
    for s in streams:
        for kind in ("server", "process"):
            if f"llama-server x{s}" in by_path and f"{kind} x{s}" in by_path:
                print(f"{kind} x{s} / llama-server x{s}: {by_path[f'{kind} x{s}'] / by_path[f'llama-server x{s}']:.2f}x")

    if a.profile:
        for s in streams:
            with Profile(engine) as p:
                _, toks = eng_rate(s)
            tokens = sum(len(t) for t in toks)
            print(f"\nper token, engine x{s} ({tokens} tokens, {p.wall / tokens * 1e3:.1f} ms wall per token; load {loadavg()}):")
            for label, sec in p.totals.most_common():
                print(f"  {label:<26} {sec / tokens * 1e3:7.2f} ms")
    if server:
        server.stop()
    if process:
        process.stop()
    if llama:
        llama.stop()
    engine.stop()
    if a.json:
        Path(a.json).write_text(json.dumps(dict(rows=rows, load=loadavg()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
