"""Read a Pallas Triton kernel's quality for a GPU without the GPU: compile it offline.

A JAX computation lowered for CUDA (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`,
which works on a CPU-only host) carries each Pallas Triton kernel as a `__gpu$xla.gpu.triton`
custom call whose `mhlo.backend_config` holds the kernel's Triton IR (MLIR bytecode), its name,
`num_warps` and `num_stages`. `triton_kernels` takes them out; `compile_kernel` compiles one with
the `triton` pip package for a target such as sm_90 (`triton.compile(..., target=GPUTarget("cuda",
90, 32))`, which runs Triton's passes, LLVM and the ptxas that ships in the wheel) and reads the
result:

  tensor-core instructions  `wgmma.mma_async` (Hopper warpgroup MMA) and `mma.sync` (Ampere-style
                            MMA) in the PTX; float32 dots at Precision.HIGHEST have none;
  scalar FMAs               `fma.rn.f32` in the PTX, per thread (the issue-12 "before" figure);
  registers, stack          from the cubin (`cuobjdump -res-usage`): REG and STACK bytes;
  spills                    local-memory loads/stores in the SASS (LDL / STL): ptxas spills
                            registers there, so 0 means no spill;
  shared memory             the dynamic shared memory Triton allocates (`metadata.shared`),
                            checked against the target's per-block limit.

XLA compiles the same IR with its own copy of Triton on a real GPU, so the figures are a close
estimate, not XLA's exact binary. The IR is parsed back to text with jaxlib's Triton dialect so
that a Triton whose MLIR differs from jaxlib's can read it (triton 3.9 reads JAX 0.10's IR).
`triton` is imported lazily: only this module's compile functions need it (the test extra pins it).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile

TRITON_CALL = "__gpu$xla.gpu.triton"

# Largest dynamic shared memory one block may use (opt-in maximum), bytes, per compute capability.
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One kernel taken from a lowered module: its Triton IR as MLIR text and launch settings."""

    name: str
    ir_text: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class KernelReport:
    name: str
    arch: int
    num_warps: int
    grid: tuple[int, int, int]
    wgmma: int  # PTX wgmma.mma_async instructions
    mma: int  # PTX mma.sync instructions
    fma: int  # PTX scalar fma.rn.f32 instructions (per thread)
    registers: int
    stack_bytes: int
    local_loads: int  # SASS LDL
    local_stores: int  # SASS STL
    shared_bytes: int

    @property
    def tensor_core(self) -> int:
        return self.wgmma + self.mma

    @property
    def spills(self) -> bool:
        return self.local_loads + self.local_stores > 0 or self.stack_bytes > 0

    @property
    def shared_ok(self) -> bool:
        return self.shared_bytes <= SHARED_MEMORY_LIMIT[self.arch]


def _walk(op):
    yield op
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield from _walk(child.operation)


def triton_kernels(lowered) -> list[TritonKernel]:
    """The Triton kernels of a `jax.stages.Lowered` (lowered for CUDA), in program order."""
    from jax._src.lib.mlir import ir
    from jaxlib.mlir._mlir_libs import _triton_ext

    module = lowered.compiler_ir("stablehlo")
    found = []
    for op in _walk(module.operation):
        if op.name != "stablehlo.custom_call":
            continue
        if ir.StringAttr(op.attributes["call_target_name"]).value != TRITON_CALL:
            continue
        cfg = ir.DictAttr(op.attributes["mhlo.backend_config"])
        as_int = lambda key: ir.IntegerAttr(cfg[key]).value  # noqa: E731
        found.append((
            ir.StringAttr(cfg["name"]).value,
            ir.StringAttr(cfg["ir"]).value_bytes,
            as_int("num_warps"),
            as_int("num_stages"),
            (as_int("grid_x"), as_int("grid_y"), as_int("grid_z")),
        ))
    # Bytecode -> text with jaxlib's own Triton dialect (text survives MLIR version changes).
    ctx = ir.Context()
    _triton_ext.register_dialect(ctx)
    kernels = []
    with ctx:
        for name, code, warps, stages, grid in found:
            kernels.append(TritonKernel(name, str(ir.Module.parse(code)), warps, stages, grid))
    return kernels


def _tool(name):
    from triton import knobs

    return getattr(knobs.nvidia, name).path


def _sass_counts(cubin_path):
    sass = subprocess.run(
        [_tool("cuobjdump"), "-sass", cubin_path], capture_output=True, text=True, check=True
    ).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9]*)", sass, re.M)
    return ops.count("LDL"), ops.count("STL")


def _resource_usage(cubin_path):
    out = subprocess.run(
        [_tool("cuobjdump"), "-res-usage", cubin_path], capture_output=True, text=True, check=True
    ).stdout
    reg = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return int(reg.group(1)), int(stack.group(1))


def compile_kernel(kernel: TritonKernel, arch: int) -> KernelReport:
    """Compile one kernel for sm_<arch> with the `triton` package and read its resources."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, f"{kernel.name}.ttir")
        with open(src, "w") as f:
            f.write(kernel.ir_text)
        compiled = compile_source(src, arch, kernel.num_warps, kernel.num_stages)
    return report(compiled, kernel.name, arch, kernel.num_warps, kernel.grid)


def compile_source(src, arch, num_warps, num_stages):
    """triton.compile(src) for sm_<arch>: src is a .ttir path or a triton ASTSource."""
    import triton
    from triton.backends.compiler import GPUTarget

    # fp fusion (mul + add -> fma) as Triton and XLA have always compiled; explicit, since
    # triton 3.9 warns that its default will change.
    options = dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def report(compiled, name, arch, num_warps, grid) -> KernelReport:
    """Read a compiled Triton kernel's instruction counts and resources."""
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, f"{name}.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        registers, stack = _resource_usage(cubin)
        ldl, stl = _sass_counts(cubin)
    return KernelReport(
        name=name,
        arch=arch,
        num_warps=num_warps,
        grid=tuple(grid),
        wgmma=len(re.findall(r"\bwgmma\.mma_async\b", ptx)),
        mma=len(re.findall(r"\bmma\.sync\b", ptx)),
        fma=len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
        registers=registers,
        stack_bytes=stack,
        local_loads=ldl,
        local_stores=stl,
        shared_bytes=compiled.metadata.shared,
    )


def format_table(reports) -> str:
    """A markdown table, one row per compiled kernel."""
    head = ("| kernel | sm | warps | grid | wgmma | mma | scalar FMA | registers | stack B | "
            "LDL/STL | shared KB (limit) |")
    rows = [head, "|" + "---|" * 11]
    for r in reports:
        rows.append(
            f"| {r.name} | {r.arch} | {r.num_warps} | {'x'.join(map(str, r.grid))} | {r.wgmma} | "
            f"{r.mma} | {r.fma} | {r.registers} | {r.stack_bytes} | "
            f"{r.local_loads}/{r.local_stores} | {r.shared_bytes / 1024:.1f} "
            f"({SHARED_MEMORY_LIMIT[r.arch] // 1024}) |"
        )
    return "\n".join(rows)
