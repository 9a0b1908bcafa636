"""The Pallas Triton kernels compiled offline for sm_90 and sm_89, without a GPU.

The public entry point is lowered for CUDA from this CPU host; each `__gpu$xla.gpu.triton` call's
Triton IR is compiled with the `triton` package for the target (pallas_kernels/triton_offline.py,
block sizes from that generation's row of `common.TUNING`), and the result must:

  - use tensor cores in every kernel that carries matmuls (wgmma on sm_90, mma on sm_89) under
    the default "fast" precision policy: the three prefill kernels and the backward's two state
    passes; the decode kernel has no matmul (one token's products are [K] x [K, BV] reductions
    below the 16-row MMA minimum);
  - spill nothing: no local-memory loads/stores in the SASS and a zero stack frame;
  - fit the target's shared memory per block.

Shapes: a Qwen3.5 linear-attention layer's heads (K = V = 128, bf16 q/k/v, grouped heads
Hv = 2 Hk), T = 300 (a ragged last chunk) for the prefill and backward kernels, T = 1 for decode.
The printed table (`pytest -s`) is the issue-12 compile table; benchmarks/bench_delta_rule.py
prints it at T = 8192, 32 heads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("triton")

from hybridjax.pallas_kernels import triton_offline  # noqa: E402
from hybridjax.pallas_kernels.compat import lower_for_cuda  # noqa: E402
from hybridjax.pallas_kernels.gated_delta_rule import chunk_gated_delta_rule  # noqa: E402
from hybridjax.pallas_kernels.gated_delta_rule.common import compile_target  # noqa: E402

ARCHS = (90, 89)
PREFILL_KERNELS = ("gdr_intra", "gdr_state", "gdr_output")
BACKWARD_KERNELS = ("gdr_bwd_states", "gdr_bwd_reverse")


def lower_layer(T, *, hk=2, hv=4, dim=128, precision="fast", packed=0, grad=False):
    """The public entry point (pallas, fused L2 norm) lowered for CUDA at a Qwen3.5 head size;
    packed=N: N sequences packed along T (cu_seqlens); grad: its gradient (jax.grad)."""
    sds = jax.ShapeDtypeStruct
    args = (
        sds((1, T, hk, dim), jnp.bfloat16),
        sds((1, T, hk, dim), jnp.bfloat16),
        sds((1, T, hv, dim), jnp.bfloat16),
        sds((1, T, hv), jnp.float32),
        sds((1, T, hv), jnp.float32),
        sds((packed or 1, hv, dim, dim), jnp.float32),
    )
    if packed:
        args += (sds((packed + 1,), jnp.int32),)

    def f(q, k, v, g, beta, s0, cu=None):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, implementation="pallas",
                                      use_qk_l2norm_in_kernel=True, precision=precision,
                                      cu_seqlens=cu)

    fn = f
    if grad:
        def fn(*a):  # noqa: E306
            o, s = f(*a)
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

        fn = jax.grad(fn, argnums=(0, 1, 2, 3, 4, 5))
    return lower_for_cuda(fn, *args)


@functools.lru_cache(maxsize=None)
def reports(arch):
    """{kernel name: KernelReport}: prefill (T = 300), decode (T = 1), backward (T = 300)."""
    out = {}
    with compile_target(arch):
        kernels = [*triton_offline.triton_kernels(lower_layer(300)),
                   *triton_offline.triton_kernels(lower_layer(1))]
        kernels += [k for k in triton_offline.triton_kernels(lower_layer(300, grad=True))
                    if k.name in BACKWARD_KERNELS]
        for kernel in kernels:
            out[kernel.name] = triton_offline.compile_kernel(kernel, arch)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_compile_to_tensor_cores_without_spills(arch):
    got = reports(arch)
    print(f"\nsm_{arch}:\n" + triton_offline.format_table(got.values()))
    assert sorted(got) == sorted((*PREFILL_KERNELS, "gdr_decode", *BACKWARD_KERNELS))
    for name, r in got.items():
        assert not r.spills, (name, r)
        assert r.shared_ok, (name, r)
        if name != "gdr_decode":
            # Hopper runs the 64-row products as warpgroup MMAs; Ada has only mma.sync.
            assert (r.wgmma if arch >= 90 else r.mma) > 0, (name, r)
        else:
            assert r.tensor_core == 0, (name, r)


def test_varlen_kernels_compile_like_the_batched_ones():
    # Packed sequences (cu_seqlens) use the same kernels with table-driven row ranges.
    with compile_target(90):
        kernels = triton_offline.triton_kernels(lower_layer(300, packed=3))
    got = {k.name: triton_offline.compile_kernel(k, 90) for k in kernels}
    print("\nsm_90, cu_seqlens (3 sequences):\n" + triton_offline.format_table(got.values()))
    assert sorted(got) == sorted(PREFILL_KERNELS)
    for name, r in got.items():
        assert r.wgmma > 0 and not r.spills and r.shared_ok, (name, r)


def test_exact_policy_has_no_tensor_cores():
    # The control: IEEE float32 dots have no tensor-core instruction on any NVIDIA GPU, so the
    # counts above are the policy's doing. (The small output kernel is enough to show it.)
    with compile_target(90):
        kernels = triton_offline.triton_kernels(lower_layer(300, precision="exact"))
    [out] = [k for k in kernels if k.name == "gdr_output"]
    r = triton_offline.compile_kernel(out, 90)
    assert r.tensor_core == 0 and r.fma > 0, r


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_matmul_and_paged_attention_compile_for_sm90(dtype):
    # The other Pallas kernels, through the same compiler: on an H200 (JAX 0.11.2) the grouped
    # matmul's first run failed in XLA's Triton parse (a loop bound lowered as i1); the offline
    # compile verifies the same IR, so it catches such a kernel without a GPU.
    from hybridjax.pallas_kernels.grouped_matmul import grouped_matmul
    from hybridjax.pallas_kernels.paged_attention import paged_attention

    sds = jax.ShapeDtypeStruct
    gmm = lower_for_cuda(lambda x, w, s: grouped_matmul(x, w, s, implementation="pallas"),
                         sds((256, 128), dtype), sds((4, 128, 64), dtype), sds((4,), jnp.int32))
    pages, page = 16, 16
    paged = lower_for_cuda(lambda *a: paged_attention(*a, implementation="pallas"),
                           sds((2, 1, 8, 128), dtype), sds((pages, page, 2, 128), dtype),
                           sds((pages, page, 2, 128), dtype), sds((2, 8), jnp.int32), sds((2, 1), jnp.int32))
    kernels = [*triton_offline.triton_kernels(gmm), *triton_offline.triton_kernels(paged)]
    assert len(kernels) == 2, [k.name for k in kernels]
    for kernel in kernels:
        r = triton_offline.compile_kernel(kernel, 90)
        assert not r.spills and r.shared_ok, r
