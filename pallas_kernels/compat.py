"""What differs between the two JAX lines the kernels run on (0.10.x and 0.11.x), in one place.

Lowering for CUDA on a host without a GPU (`jax.jit(f).trace(...).lower(lowering_platforms=
("cuda",))`): JAX 0.10's Triton lowering falls back to sm_90 when it finds no GPU; JAX 0.11 raises
"No supported GPU devices found" unless an abstract GPU device is named through an abstract mesh.
`cuda_target()` names one (an H100 by default, sm_90, what 0.10 assumed), and is a no-op on 0.10.
"""

from __future__ import annotations

import contextlib

import jax

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:2])

# The target both lines assume when lowering for CUDA without a GPU: Hopper, sm_90.
DEFAULT_CUDA_DEVICE = "NVIDIA H100"


@contextlib.contextmanager
def cuda_target(device_kind: str = DEFAULT_CUDA_DEVICE):
    """Lower for `device_kind` inside this block when no GPU is attached (JAX 0.11+); on a GPU
    host, or on JAX 0.10, it changes nothing."""
    if JAX_VERSION < (0, 11) or any(d.platform == "gpu" for d in jax.devices()):
        yield
        return
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    # An empty mesh: only its device matters (the Pallas GPU lowerings read it for the target).
    device = AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    with use_abstract_mesh(AbstractMesh((), (), abstract_device=device)):
        yield


def targets_gpu() -> bool:
    """True on a GPU host, or inside `cuda_target()`: for kernels that must choose compiled or
    interpreted at trace time (Mosaic GPU's interpreter has effects that `platform_dependent`
    cannot carry into a CUDA lowering)."""
    if any(d.platform == "gpu" for d in jax.devices()):
        return True
    if JAX_VERSION < (0, 11):
        return False
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device is not None and device.platform == "gpu"


def lower_for_cuda(fn, *args, **kwargs):
    """`jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))` on any host and
    either JAX line (see `cuda_target`)."""
    with cuda_target():
        return jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
