"""fla's gated-delta-rule forward kernels compiled offline, for the compile table of
bench_delta_rule.py (`--fla-src DIR`).

fla (github.com/fla-org/flash-linear-attention) is read from a checkout the caller points at; it
is never vendored here. Its kernels are `@triton.jit` functions behind autotuners: each is
compiled with `triton.compile(ASTSource(...))` for one representative config from fla's own
autotune list (stated below, the one closest to our block sizes), with the argument types of
a bf16 layer (q, k, v, w, u, A, h in bf16; gates, beta, states float32), no varlen.

Importing fla on a CPU-only host: only the kernel modules are loaded (its package __init__s pull
in every op, and one of them fails triton 3.9's autotune-key check), and `einops`, which the
kernels do not use, is stubbed if absent.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

BT = 64


class _Stub(types.ModuleType):
    """A module whose every public attribute is a no-op function (for unused imports)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: None


def _import_fla(src):
    src = os.fspath(src)
    if "einops" not in sys.modules:
        try:
            importlib.import_module("einops")
        except ImportError:
            sys.modules["einops"] = _Stub("einops")
    for pkg in ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.ops.common"):
        if pkg not in sys.modules:
            mod = types.ModuleType(pkg)
            mod.__path__ = [os.path.join(src, *pkg.split("."))]
            mod.__version__ = "src"
            sys.modules[pkg] = mod
    sys.path.insert(0, src)
    names = ("fla.ops.gated_delta_rule.chunk_fwd", "fla.ops.gated_delta_rule.wy_fast",
             "fla.ops.common.chunk_delta_h", "fla.ops.common.chunk_o")
    return [importlib.import_module(n) for n in names]


def _jit_fn(kernel):
    """The JITFunction under fla's heuristics / autotune wrappers."""
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


def _source(kernel, args):
    """ASTSource from {arg: "*bf16" / "i32" / "fp32" (runtime) or a python value (constexpr)}."""
    from triton.compiler import ASTSource

    fn = _jit_fn(kernel)
    missing = set(fn.arg_names) - set(args)
    assert not missing, (fn.__name__, missing)
    runtime = {k: v for k, v in args.items() if isinstance(v, str)}
    signature = {k: (runtime[k] if k in runtime else "constexpr") for k in fn.arg_names}
    constexprs = {k: v for k, v in args.items() if k not in runtime}
    # Pointers 16-byte aligned, as the launcher specialises them for torch allocations.
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]]
             for k, v in runtime.items() if v.startswith("*")}
    return ASTSource(fn, signature, constexprs, attrs)


def fla_reports(src, arch, *, T, B, Hk, Hv, K, V):
    """KernelReports of fla's four forward kernels at one layer shape, for sm_<arch>."""
    from hybridjax.pallas_kernels import triton_offline

    cf, wy, dh, co = _import_fla(src)
    nt = -(-T // BT)
    common = dict(cu_seqlens=None, T="i32", H=Hk, HV=Hv, K=K, BT=BT, IS_VARLEN=False)
    bf, f4 = "*bf16", "*fp32"
    kernels = [
        # (name, kernel, args, num_warps, num_stages, grid)
        ("fla kkt_solve", cf.chunk_gated_delta_rule_fwd_kkt_solve_kernel,
         dict(k=bf, g=f4, beta=f4, A=bf, chunk_indices=None, BC=16, BK=64, USE_G=True, **common),
         4, 3, (nt, B * Hv, 1)),
        ("fla recompute_w_u", wy.recompute_w_u_fwd_kernel,
         dict(k=bf, v=bf, beta=f4, w=bf, u=bf, A=bf, g=f4, chunk_indices=None, V=V, BK=64,
              BV=64, USE_G=True, **common), 4, 3, (nt, B * Hv, 1)),
        ("fla fwd_h", dh.chunk_gated_delta_rule_fwd_kernel_h_blockdim64,
         dict(k=bf, v=bf, w=bf, v_new=bf, g=f4, gk=None, h=bf, h0=f4, ht=f4, chunk_offsets=None,
              V=V, BV=32, USE_G=True, USE_GK=False, USE_INITIAL_STATE=True,
              STORE_FINAL_STATE=True, SAVE_NEW_VALUE=True, STATE_V_FIRST=False, **common),
         4, 2, (V // 32 * B * Hv, 1, 1)),
        ("fla fwd_o", co.chunk_fwd_kernel_o,
         dict(q=bf, k=bf, v=bf, h=bf, g=f4, g_gamma=None, o=bf, chunk_indices=None, scale="fp32",
              V=V, BK=64, BV=64, USE_G=True, USE_G_GAMMA=False, STATE_V_FIRST=False, **common),
         4, 3, (V // 64, nt, B * Hv)),
    ]
    out = []
    for name, kernel, args, warps, stages, grid in kernels:
        compiled = triton_offline.compile_source(_source(kernel, args), arch, warps, stages)
        out.append(triton_offline.report(compiled, name, arch, warps, grid))
    return out
