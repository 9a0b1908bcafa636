"""One command for the day a GPU is lent: every kernel against its reference, kernel timings, and
`generate` / the serving engine on a random Qwen3.5-shaped ~0.8B model.

    PYTHONPATH=. python3 benchmarks/gpu_check.py OUT_DIR [--dry-run] [--skip SECTION,...]
    make gpu-check OUT=OUT_DIR

Runs from a plain checkout with nothing installed (the GPU image: Python 3.12, JAX 0.11 + CUDA,
torch, triton; hybridjax finds pallas_kernels/ and conversion/ beside itself; the C++ CPU
extension is not needed). Writes OUT_DIR/gpu_check.json and OUT_DIR/gpu_check.md and prints the
table. Sections:

  kernels  each Pallas kernel (implementation="pallas") against its reference, on the device:
           the chunked delta rule forward and backward and its decode kernel, paged attention,
           grouped matmul; "exact" (float32 inputs; the delta rule's IEEE float32 policy) and
           "fast" (bfloat16 inputs; the delta rule's tensor-core policy). References run at
           Precision.HIGHEST. Error = max|got - want| / max|want| (float64), against a tolerance
           per row, the same ones tests/test_pallas.py and friends use on CPU.
  timing   B=1, T=8192, Hk=16 / Hv=32 heads of 128 (prefill, forward and forward+backward) and
           B=64 one-token decode: pallas against the XLA path, and against fla's
           `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule` on the same inputs when
           `fla` imports (q and k repeated to Hv heads for fla); median of 5 after a warm-up.
           On JAX 0.11+ also implementation="mosaic" (the chunked forward's three kernels on
           Mosaic GPU, bf16 "fast"): checked against the reference and timed for the prefill
           forward (in the dry run too, interpreted); its first GPU run is here, so a failure of
           it is a note, not a lost section.
  model    `hybridjax.generate` on a random bfloat16 Qwen3.5-shaped model (24 layers, hidden
           1024, vocab 248320, tied: ~0.8B): prefill tok/s (one 2048-token prompt), decode tok/s
           (128 greedy tokens, generate minus prefill); the serving engine (`Engine`, the path under
           `hybridjax serve` without HTTP) with its snapshot store: time to first token of a cold
           1024-token prompt and of turn 2 (the answer and 64 new tokens after it, resumed from the
           snapshot), and the engine's decode tok/s; a first conversation of other tokens with the
           same shapes compiles every step, so no compile is timed.

--dry-run: tiny shapes on the CPU (Pallas in interpret mode), no fla, the tiny test model; it
runs in CI (tests/test_gpu_check.py) so that this script cannot rot. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridjax.pallas_kernels.gated_delta_rule import (  # noqa: E402
    chunk_gated_delta_rule,
    mosaic,
    recurrent_gated_delta_rule_reference,
)
from hybridjax.pallas_kernels.grouped_matmul import gmm_reference, grouped_matmul  # noqa: E402
from hybridjax.pallas_kernels.paged_attention import paged_attention, paged_attention_reference  # noqa: E402

SECTIONS = ("kernels", "timing", "model")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every shape the check uses; `FULL` on the GPU, `DRY` for the CPU dry run."""

    gdr: dict  # correctness: B, T, Hk, Hv, K, V
    gdr_grad_T: int
    mosaic_gdr: dict  # implementation="mosaic" (K, V multiples of 64): B, T, Hk, Hv, K, V
    paged: dict  # B, Hq, Hkv, Dh, S (page size), context
    gmm: dict  # M, K, N, groups
    time_prefill: dict  # B, T, Hk, Hv, K, V
    time_decode_B: int
    model: dict | None  # Qwen3.5 text config (None: the tiny test model)
    prefill_T: int
    decode_N: int
    chat_T: int
    turn2_new: int
    repeats: int


QWEN35_08B = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 1024, "num_hidden_layers": 24,
    "full_attention_interval": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "intermediate_size": 3584,
    "max_position_embeddings": 32768, "tie_word_embeddings": True, "eos_token_id": 248044,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}

FULL = Sizes(gdr=dict(B=2, T=1000, Hk=4, Hv=8, K=128, V=128), gdr_grad_T=300,
             mosaic_gdr=dict(B=2, T=1000, Hk=4, Hv=8, K=128, V=128),
             paged=dict(B=8, Hq=16, Hkv=2, Dh=256, S=64, context=3000), gmm=dict(M=2048, K=1024, N=512, groups=8),
             time_prefill=dict(B=1, T=8192, Hk=16, Hv=32, K=128, V=128), time_decode_B=64,
             model=QWEN35_08B, prefill_T=2048, decode_N=128, chat_T=1024, turn2_new=64, repeats=5)
DRY = Sizes(gdr=dict(B=1, T=70, Hk=1, Hv=2, K=16, V=16), gdr_grad_T=20,
            mosaic_gdr=dict(B=1, T=100, Hk=1, Hv=2, K=64, V=64),
            paged=dict(B=2, Hq=4, Hkv=2, Dh=16, S=16, context=40), gmm=dict(M=48, K=32, N=32, groups=3),
            time_prefill=dict(B=1, T=70, Hk=1, Hv=2, K=64, V=64), time_decode_B=2,  # K, V: as "mosaic" needs
            model=None, prefill_T=32, decode_N=4, chat_T=12, turn2_new=4, repeats=1)

# Tolerances on max|got - want| / max|want|. float32 "exact": the kernels' own float32 rounding
# over T steps (tests/test_pallas.py F32_TOL 2e-5 at T <= 300; 1e-4 leaves room for T = 1000 and
# the GPU's different summation order). bfloat16 "fast": inputs and intermediates in bfloat16
# (spacing 2^-7 at 1; test_pallas FAST_MAX_TOL 2e-2).
TOL = {"exact": 1e-4, "fast": 3e-2}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def err_ratio(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want), initial=0.0) / max(np.max(np.abs(want), initial=0.0), 1e-30))


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` (which blocks until its result is ready) after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ready(x):
    return jax.block_until_ready(x)


# ---- inputs -----------------------------------------------------------------------------------

def gdr_inputs(B, T, Hk, Hv, K, V, dtype, seed=0):
    """(q, k, v, g, beta, s0) with unit keys and model-like gates (as tests/delta_inputs.py)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Hk, K), np.float32)
    k = rng.standard_normal((B, T, Hk, K), np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, Hv, V), np.float32)
    g = -np.exp(rng.uniform(-2, 1, (Hv,))) * np.logaddexp(0, rng.standard_normal((B, T, Hv)) - 1)
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, Hv))))
    s0 = rng.standard_normal((B, Hv, K, V), np.float32) * 0.1
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v)) + tuple(jnp.asarray(x, jnp.float32) for x in (g, beta, s0))


def upcast(args):
    """The same values in float32: a bfloat16 kernel is judged on the inputs it was given."""
    return tuple(jnp.asarray(x, jnp.float32) for x in args)


def paged_inputs(B, Hq, Hkv, Dh, S, context, dtype, seed=0):
    """One decode query per row over `context` keys held in shuffled pages of a pool."""
    rng = np.random.default_rng(seed)
    ends = context - 1 - np.arange(B) * (context // (2 * B))  # rows of different lengths
    n_table = -(-context // S)
    pool = B * n_table + 2
    table = rng.permutation(pool)[: B * n_table].reshape(B, n_table).astype(np.int32)
    q = rng.standard_normal((B, 1, Hq, Dh), np.float32)
    kp = rng.standard_normal((pool, S, Hkv, Dh), np.float32)
    vp = rng.standard_normal((pool, S, Hkv, Dh), np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(kp, dtype), jnp.asarray(vp, dtype), jnp.asarray(table),
            jnp.asarray(ends[:, None].astype(np.int32)))


def gmm_inputs(M, K, N, groups, dtype, seed=0):
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, M), groups - 1, replace=False))
    sizes = np.diff(np.concatenate([[0], cuts, [M]])).astype(np.int32)
    x = rng.standard_normal((M, K), np.float32) / np.sqrt(K)
    w = rng.standard_normal((groups, K, N), np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(sizes)


# ---- kernels against their references ---------------------------------------------------------

def _gdr_pallas(precision):
    return jax.jit(lambda q, k, v, g, b, s: chunk_gated_delta_rule(
        q, k, v, g, b, initial_state=s, implementation="pallas", precision=precision))


@jax.jit
def _gdr_reference(q, k, v, g, b, s):
    with jax.default_matmul_precision("highest"):
        return recurrent_gated_delta_rule_reference(q, k, v, g, b, scale=q.shape[-1] ** -0.5, initial_state=s)


def _gdr_loss(fn):
    def loss(q, k, v, g, b, s):
        o, state = fn(q, k, v, g, b, s)
        return jnp.sum(jnp.sin(o.astype(jnp.float32))) + jnp.sum(state * state)  # non-linear: all grads differ
    return jax.jit(jax.grad(loss, argnums=tuple(range(6))))


def _row(kernel, policy, got, want):
    errs = [err_ratio(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    e = max(errs)
    return {"kernel": kernel, "policy": policy, "error": e, "tolerance": TOL[policy], "ok": e < TOL[policy]}


def check_mosaic(sz: Sizes) -> list[dict]:
    """implementation="mosaic" (the chunked forward on Mosaic GPU; bf16 "fast" only) against the
    reference; its first run on a GPU is here, so a failure is a note, not a lost section."""
    d = sz.mosaic_gdr
    args = gdr_inputs(d["B"], d["T"], d["Hk"], d["Hv"], d["K"], d["V"], jnp.bfloat16)
    got = jax.jit(lambda q, k, v, g, b, s: chunk_gated_delta_rule(
        q, k, v, g, b, initial_state=s, implementation="mosaic"))(*args)
    return [_row("delta rule forward (mosaic)", "fast", got, _gdr_reference(*upcast(args)))]


def _checked(kernel: str, policy: str, check) -> dict:
    """One kernel's row from `check()` -> (got, want); a kernel that fails to compile or run is a
    failed row with its reason, and the other kernels still run."""
    try:
        row = _row(kernel, policy, *check())
    except Exception as e:  # noqa: BLE001 - one broken kernel must not hide the others' figures
        row = {"kernel": kernel, "policy": policy, "error": None, "tolerance": TOL[policy], "ok": False,
               "failure": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    log(f"{kernel:32s} {policy:5s} error {_num(row['error'], '.2e')} (tolerance {row['tolerance']:.0e})"
        f" {'ok' if row['ok'] else 'FAIL ' + row.get('failure', '')}")
    return row


def check_kernels(sz: Sizes) -> list[dict]:
    rows = []
    for policy, dtype in (("exact", jnp.float32), ("fast", jnp.bfloat16)):
        d = sz.gdr
        args = gdr_inputs(d["B"], d["T"], d["Hk"], d["Hv"], d["K"], d["V"], dtype)
        dec = tuple(x[:, :1] if i < 5 else x for i, x in enumerate(args))  # T = 1: the decode kernel
        short = tuple(x[:, : sz.gdr_grad_T] if i < 5 else x for i, x in enumerate(args))
        p, m = sz.paged, sz.gmm
        pa = paged_inputs(p["B"], p["Hq"], p["Hkv"], p["Dh"], p["S"], p["context"], dtype)
        x, w, sizes = gmm_inputs(m["M"], m["K"], m["N"], m["groups"], dtype)

        def paged_reference():
            with jax.default_matmul_precision("highest"):
                return jax.jit(lambda *a: paged_attention_reference(*a, scale=p["Dh"] ** -0.5))(*upcast(pa[:3]), *pa[3:])

        def gmm_want():
            with jax.default_matmul_precision("highest"):
                return jax.jit(gmm_reference)(*upcast((x, w)), sizes)

        checks = {
            "delta rule forward (chunked)": lambda: (_gdr_pallas(policy)(*args), _gdr_reference(*upcast(args))),
            "delta rule decode (T=1)": lambda: (_gdr_pallas(policy)(*dec), _gdr_reference(*upcast(dec))),
            "delta rule backward": lambda: (
                _gdr_loss(lambda *a: chunk_gated_delta_rule(*a[:5], initial_state=a[5], implementation="pallas",
                                                            precision=policy))(*short),
                _gdr_loss(_gdr_reference)(*upcast(short))),
            "paged attention decode": lambda: (
                jax.jit(lambda *a: paged_attention(*a, implementation="pallas"))(*pa), paged_reference()),
            "grouped matmul": lambda: (
                jax.jit(lambda x, w, s: grouped_matmul(x, w, s, implementation="pallas"))(x, w, sizes), gmm_want()),
        }
        rows += [_checked(kernel, policy, check) for kernel, check in checks.items()]
    return rows


# ---- kernel timings ---------------------------------------------------------------------------

def _fla():
    """fla's delta-rule ops and torch, or None (with the reason) when they cannot run here."""
    try:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    except Exception as e:  # noqa: BLE001 - any import failure means: no fla row
        return None, f"fla not importable ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return None, "fla needs CUDA (torch.cuda.is_available() is False)"
    return (torch, fla_chunk, fla_recurrent), ""


def _fla_time(fla, fn, args, Hv, repeats):
    """fla on the same values: torch CUDA tensors, q and k repeated to Hv heads."""
    torch = fla[0]
    q, k, v, g, beta, s0 = (torch.from_numpy(np.asarray(jnp.asarray(x, jnp.float32))).cuda() for x in args)
    r = Hv // q.shape[2]
    q, k = (t.repeat_interleave(r, dim=2).to(torch.bfloat16).contiguous() for t in (q, k))
    v = v.to(torch.bfloat16)

    def run():
        fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.cuda.synchronize()
    return timed(run, repeats)


def time_kernels(sz: Sizes, dry: bool) -> tuple[list[dict], list[str]]:
    notes, rows = [], []
    fla, why = (None, "dry run: no fla") if dry else _fla()
    if why:
        notes.append(why)
    p = sz.time_prefill
    pre = gdr_inputs(p["B"], p["T"], p["Hk"], p["Hv"], p["K"], p["V"], jnp.bfloat16)
    dec = gdr_inputs(sz.time_decode_B, 1, p["Hk"], p["Hv"], p["K"], p["V"], jnp.bfloat16)

    def fwd(impl):
        return jax.jit(lambda *a: chunk_gated_delta_rule(*a[:5], initial_state=a[5], implementation=impl,
                                                         use_qk_l2norm_in_kernel=True))

    def grad(impl):
        return _gdr_loss(lambda *a: chunk_gated_delta_rule(*a[:5], initial_state=a[5], implementation=impl,
                                                           use_qk_l2norm_in_kernel=True))

    cases = [("prefill forward", f"B={p['B']} T={p['T']} Hv={p['Hv']}", pre, fwd),
             ("prefill forward+backward", f"B={p['B']} T={p['T']} Hv={p['Hv']}", pre, grad),
             ("decode", f"B={sz.time_decode_B} T=1 Hv={p['Hv']}", dec, fwd)]
    if dry:  # interpreting the backward kernels costs the dry run most of its time; the check ran them
        cases.pop(1)
    # "mosaic" (JAX 0.11+): only its chunked prefill differs from "pallas" (decode stays Triton)
    with_mosaic = mosaic.AVAILABLE
    for name, shape, args, make in cases:
        impls = ("pallas", "xla") + (("mosaic",) if with_mosaic and name == "prefill forward" else ())
        ms = {}
        for impl in impls:
            try:
                ms[impl] = 1e3 * timed(lambda f=make(impl): ready(f(*args)), sz.repeats)
            except Exception as e:  # noqa: BLE001 - a failing variant is a note, the row stays
                notes.append(f"{name} {impl}: {type(e).__name__}: {str(e)[:300]}")
        if fla and name != "prefill forward+backward":
            fn = fla[1] if name.startswith("prefill") else fla[2]
            ms["fla"] = 1e3 * _fla_time(fla, fn, args, p["Hv"], sz.repeats)
        rows.append({"kernel": f"delta rule {name}", "shape": shape, "ms": ms})
        log(f"{name:26s} {shape:22s} " + "  ".join(f"{k} {v:.3f} ms" for k, v in ms.items()))
    return rows, notes


# ---- the model: generate and the serving engine -----------------------------------------------

def _model(sz: Sizes, dtype=jnp.bfloat16):
    from hybridjax.config import config_from_dict
    from hybridjax.default_model import tiny_test_model
    from hybridjax.params import init_params

    if sz.model is None:
        cfg, params, _ = tiny_test_model()
        return cfg, params
    cfg = config_from_dict(sz.model)
    return cfg, init_params(jax.random.PRNGKey(0), cfg, dtype=dtype)


def _prompt(rng, n, vocab):
    return rng.integers(3, min(vocab, 30000) - 3, n).tolist()


def model_figures(sz: Sizes, dtype=jnp.bfloat16) -> dict:
    from hybridjax.engine import Engine, GenerationRequest
    from hybridjax.generate import generate, stream
    from hybridjax.prefix_cache import SnapshotStore

    cfg, params = _model(sz, dtype)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    rng = np.random.default_rng(0)
    max_len = sz.prefill_T + sz.decode_N + 64

    def gen(prompt, n):
        g = generate(params, cfg, [prompt], max_new_tokens=n, max_len=max_len, stop_ids=())
        return ready(g.tokens)

    def streamed(prompt, n):  # one program per token, each token read on the host (as the engine)
        return list(stream(params, cfg, prompt, max_new_tokens=n, max_len=max_len, stop_ids=()))

    prompt = _prompt(rng, sz.prefill_T, cfg.vocab_size)
    t_prefill = timed(lambda: gen(prompt, 1), sz.repeats)
    t_full = timed(lambda: gen(prompt, sz.decode_N), sz.repeats)
    t_stream_1, t_stream = timed(lambda: streamed(prompt, 1), sz.repeats), timed(lambda: streamed(prompt, sz.decode_N), 1)
    out = {"params": int(n_params), "dtype": str(params.embed.dtype),
           "prefill_tokens": sz.prefill_T, "prefill_tok_s": sz.prefill_T / t_prefill,
           "decode_tokens": sz.decode_N,
           "decode_tok_s": (sz.decode_N - 1) / (t_full - t_prefill) if t_full > t_prefill else None,
           "stream_decode_tok_s": (sz.decode_N - 1) / (t_stream - t_stream_1) if t_stream > t_stream_1 else None}
    log(f"generate: prefill {out['prefill_tok_s']:.0f} tok/s, decode {_num(out['decode_tok_s'], '.1f')} tok/s;"
        f" stream decode {_num(out['stream_decode_tok_s'], '.1f')} tok/s")

    chat_len = sz.chat_T + 2 * sz.turn2_new + 64
    eng = Engine(cfg, params, None, store=SnapshotStore("gpu-check"), slots=4, max_len=chat_len,
                 prefill_chunk=256 if sz.model else 32).start()
    try:
        def ask(ids, n, namespace=""):
            """(seconds to the first token, seconds for the rest, the answer's token ids)."""
            t0 = time.perf_counter()
            handle = eng.submit(GenerationRequest(list(ids), max_tokens=n, namespace=namespace))
            first = None
            for event in handle.events(timeout=600):
                if first is None:
                    first = time.perf_counter() - t0
            return first, time.perf_counter() - t0 - first, handle.token_ids

        def conversation():
            turn1 = _prompt(rng, sz.chat_T, cfg.vocab_size)
            ttft_cold, rest, answer = ask(turn1, sz.turn2_new)
            turn2 = turn1 + answer + _prompt(rng, sz.turn2_new, cfg.vocab_size)
            ttft_turn2, _, answer2 = ask(turn2, sz.turn2_new)
            return ttft_cold, ttft_turn2, (len(answer) - 1) / max(rest, 1e-9), turn2, answer2

        conversation()  # the same shapes with other tokens: compiles every step the figures use
        ttft_cold, ttft_turn2, engine_decode, turn2, answer2 = conversation()
        # Turn 2 again in a namespace of its own: no snapshot, the cold path. Greedy answers of a hit
        # and of the cold path agree token for token on CPU (tests); here: how far they agree.
        _, _, cold2 = ask(turn2, sz.turn2_new, namespace="cold")
    finally:
        eng.stop()
    same = next((i for i, (a, b) in enumerate(zip(answer2, cold2)) if a != b), min(len(answer2), len(cold2)))
    out.update({"chat_prompt_tokens": sz.chat_T, "turn2_new_tokens": sz.turn2_new,
                "ttft_cold_s": ttft_cold, "ttft_turn2_s": ttft_turn2,
                "engine_decode_tok_s": engine_decode,
                "turn2_hit_equals_cold_tokens": same, "turn2_answer_tokens": len(answer2)})
    log(f"engine: TTFT cold {ttft_cold:.3f} s, turn 2 {ttft_turn2:.3f} s, decode {engine_decode:.1f} tok/s;"
        f" turn 2 from the snapshot equals the cold path for {same}/{len(answer2)} tokens")
    return out


# ---- report -----------------------------------------------------------------------------------

def environment() -> dict:
    dev = jax.devices()[0]
    return {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device": getattr(dev, "device_kind", str(dev)), "devices": len(jax.devices())}


def _num(x, fmt) -> str:
    return "-" if x is None else format(x, fmt)


def markdown(res: dict) -> str:
    env = res["environment"]
    lines = [f"# gpu_check{' (dry run: figures mean nothing)' if res['dry_run'] else ''}", "",
             f"{env['device']} x{env['devices']}, JAX {env['jax']} ({env['backend']}), Python {env['python']};"
             f" {res['seconds']:.0f} s", ""]
    if res.get("kernels"):
        lines += ["| kernel | policy | error | tolerance | ok |", "|---|---|---:|---:|---|"]
        lines += [f"| {r['kernel']} | {r['policy']} | {_num(r['error'], '.2e')} | {r['tolerance']:.0e} |"
                  f" {'ok' if r['ok'] else '**FAIL** ' + r.get('failure', '')} |" for r in res["kernels"]]
        lines.append("")
    if res.get("timing"):
        cols = ("pallas", "mosaic", "xla", "fla")
        lines += ["| timing | shape | " + " | ".join(f"{c} ms" for c in cols) + " | xla / pallas |",
                  "|---|---|" + "---:|" * (len(cols) + 1)]
        for r in res["timing"]:
            ms = r["ms"]
            ratio = f"{ms['xla'] / ms['pallas']:.2f}x" if "xla" in ms and "pallas" in ms else "-"
            lines.append(f"| {r['kernel']} | {r['shape']} | " + " | ".join(_num(ms.get(c), ".3f") for c in cols)
                         + f" | {ratio} |")
        lines.append("")
    if res.get("model"):
        m = res["model"]
        lines += ["| model | value |", "|---|---:|",
                  f"| parameters ({m['dtype']}) | {m['params'] / 1e9:.3f} B |",
                  f"| generate prefill, {m['prefill_tokens']} tokens | {m['prefill_tok_s']:.0f} tok/s |",
                  f"| generate decode, {m['decode_tokens']} tokens | {_num(m['decode_tok_s'], '.1f')} tok/s |",
                  f"| engine TTFT cold, {m['chat_prompt_tokens']}-token prompt | {m['ttft_cold_s'] * 1e3:.1f} ms |",
                  f"| engine TTFT turn 2 (+{m['turn2_new_tokens']} tokens) | {m['ttft_turn2_s'] * 1e3:.1f} ms |",
                  f"| engine decode | {m['engine_decode_tok_s']:.1f} tok/s |"]
        if "stream_decode_tok_s" in m:
            lines.append(f"| `stream` decode (a program and a host read per token) | {_num(m['stream_decode_tok_s'], '.1f')} tok/s |")
        if "turn2_hit_equals_cold_tokens" in m:
            lines.append(f"| turn 2 from the snapshot = cold path, leading tokens | {m['turn2_hit_equals_cold_tokens']}"
                         f" / {m['turn2_answer_tokens']} |")
        lines.append("")
    lines += [f"- {n}" for n in res["notes"]]
    return "\n".join(lines).rstrip() + "\n"


def run(out_dir: Path, dry: bool, skip: set[str], model_dtype=jnp.bfloat16) -> dict:
    sz = DRY if dry else FULL
    t0 = time.perf_counter()
    res = {"dry_run": dry, "environment": environment(), "notes": []}
    if not dry and res["environment"]["backend"] != "gpu":
        res["notes"].append(f"no GPU: running on {res['environment']['backend']} (Pallas interpreted)")
    for name, fn in (("kernels", lambda: check_kernels(sz)), ("timing", lambda: time_kernels(sz, dry)),
                     ("model", lambda: model_figures(sz, model_dtype))):
        if name in skip:
            continue
        log(f"-- {name}")
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - one failing section must not lose the others' figures
            res["notes"].append(f"{name}: {type(e).__name__}: {e}")
            res[f"{name}_error"] = True
            log(f"{name} failed: {type(e).__name__}: {e}")
            continue
        if name == "timing":
            value, notes = value
            res["notes"] += notes
        if name == "kernels" and mosaic.AVAILABLE:
            try:
                value += check_mosaic(sz)
            except Exception as e:  # noqa: BLE001
                res["notes"].append(f"mosaic check: {type(e).__name__}: {str(e)[:300]}")
        res[name] = value
        save(res, out_dir, time.perf_counter() - t0)  # each section as it ends: a run cut short keeps them
    table = save(res, out_dir, time.perf_counter() - t0)
    print(table)
    return res


def save(res: dict, out_dir: Path, seconds: float) -> str:
    """Write gpu_check.json and gpu_check.md of what has run so far; returns the table."""
    res["seconds"] = seconds
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(res, indent=1))
    table = markdown(res)
    (out_dir / "gpu_check.md").write_text(table)
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path, help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, Pallas interpreted (CI)")
    ap.add_argument("--skip", default="", help=f"comma-separated sections to skip: {','.join(SECTIONS)}")
    ap.add_argument("--model-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the model section's weights (float32 with JAX_DEFAULT_MATMUL_PRECISION=highest"
                         " separates a numerical difference from a wrong one)")
    a = ap.parse_args(argv)
    skip = {s for s in a.skip.split(",") if s}
    if skip - set(SECTIONS):
        ap.error(f"unknown section(s) {sorted(skip - set(SECTIONS))}; choose from {','.join(SECTIONS)}")
    if a.dry_run:
        jax.config.update("jax_platforms", "cpu")
    res = run(a.out_dir, a.dry_run, skip, jnp.dtype(a.model_dtype))
    failed = [r for r in res.get("kernels", []) if not r["ok"]] or any(k.endswith("_error") for k in res)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
