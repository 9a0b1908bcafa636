"""hybridjax: Qwen3.5 / Qwen3-Next hybrid models in JAX with pure-functional caches.

Text in, text out:

    model = hybridjax.load_model("path/to/model_dir")   # or "Qwen/Qwen3.5-0.8B"; None: the embedded default
    model.generate("Hello")                              # or a list of chat messages

The functional API (token ids, caches as values):

    cfg, params = hybridjax.load_hf("path/to/hf_model_dir", dtype="float32")
    cache = hybridjax.init_cache(cfg, batch_size=1, max_len=4096)
    logits, cache = hybridjax.forward(params, tokens, cache, cfg)         # tokens: int32 [B, T]

    # Under jit, cfg is a static argument (it is hashable) and the KV room is reserved first:
    fast = jax.jit(hybridjax.forward, static_argnames="cfg")
    logits, cache = fast(params, tokens, hybridjax.reserve(cache, tokens.shape[1]), cfg)

Over several devices (docs/sharding.md): `mesh = hybridjax.make_mesh("tensor=2,expert=4")`, then
`load_hf(..., mesh=mesh)` and `init_cache(..., mesh=mesh)`; forward is unchanged.

See docs/architecture.md for how the pieces fit.
"""

from pathlib import Path as _Path

# The kernels and the converter sit at the repository root (pallas_kernels/, conversion/) and are
# installed as hybridjax.pallas_kernels / hybridjax.conversion (setup.py's package_dir). A source
# checkout used without installing it (the project on PYTHONPATH, as on the GPU image) finds them
# beside this folder instead.
_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "pallas_kernels").exists() and (_checkout / "pallas_kernels" / "__init__.py").exists():
    __path__.append(str(_checkout))

from hybridjax.cache import Cache, GDNState, KVState, reserve
from hybridjax.config import Config, ConfigError, config_from_dict, load_config
from hybridjax.model import forward
from hybridjax.params import Params, init_params
from hybridjax.sharding import MeshError, init_cache, make_mesh, shard_cache, shard_params
from hybridjax.text import Model, load_model

__version__ = "0.1.0"


def load_hf(model_dir, dtype="float32", mesh=None, progress=None, pack_for_decode=False, quantize=None):
    """(Config, Params) from a Hugging Face model directory or hub id ORG/NAME[@REVISION] (FP8
    checkpoints dequantised; optional parts kept in params.extra); see `hybridjax.conversion.hf.load_hf`.
    `mesh` (from `make_mesh`): each device receives its shard as the tensors are read.
    `progress`: as for `load`. `pack_for_decode`, `quantize`: see `load`."""
    _check_layout(mesh, pack_for_decode, quantize)
    # The facade reaches down into conversion lazily; nothing below it imports conversion.
    from hybridjax.conversion.hf import load_hf as _load_hf
    from hybridjax.conversion.progress import load_progress

    cfg, params = _load_hf(model_dir, dtype=dtype, mesh=mesh, progress=load_progress(progress))
    return cfg, _pack(params, mesh, pack_for_decode, quantize)


def load(path, dtype=None, mesh=None, progress=None, pack_for_decode=False, quantize=None):
    """(Config, Params) from an HF model directory, a hub id ORG/NAME[@REVISION] or a converted
    hybridjax checkpoint, placed on
    `mesh` shard by shard when given. `progress`: a bar on stderr (tensors, bytes) when True, or
    when None and stderr is a terminal; False: none (see `hybridjax.conversion.load`).
    `pack_for_decode`: bfloat16 projections are also kept as packed panels that the CPU decode
    kernel streams faster (`cpu_kernels.pack_params`; twice the weight memory, three times where
    prefill widens bf16 (no AVX512_BF16): its copy is then kept in float32; single device,
    CPUs with AVX2 or AVX512_BF16 (`cpu_kernels.PACKED_ISAS`); on AVX-512 without AVX512_BF16
    only prefill's float32 copy is kept (three times the memory; decode reads the bf16 weights);
    float32 projections on AVX2 or AVX-512 (`cpu_kernels.TRANSPOSED_ISAS`) are held transposed
    instead, the same memory, decode ~1.2x faster, about a second of transposing at load; else a
    no-op).
    `quantize="int8-wo"`: the projections become weight-only int8 with a scale per output column
    (`cpu_kernels.quantize_params`, from the weights in `dtype`); embeddings, norms and the MoE
    router stay in `dtype`. Decode streams a quarter of float32's weight bytes; single device,
    and not together with `pack_for_decode` (ValueError). `quantize="int8-dot"`: instead int8 with a
    scale per column per block of 32 k, packed, for decode's int8 x int8 dots
    (`cpu_kernels.matmul_q8`: activations rounded to int8 per block of 32, as llama.cpp's Q8_0),
    1 + 1/16 bytes per weight; prefill dequantises the same panels. "int8" is int8-dot where
    `cpu_kernels.INT8_DOT_ISAS` has this CPU's best path (AVX2), else
    "int8-wo" (weight-only)."""
    _check_layout(mesh, pack_for_decode, quantize)
    from hybridjax.conversion import load as _load

    cfg, params = _load(path, dtype=dtype, mesh=mesh, progress=progress)
    return cfg, _pack(params, mesh, pack_for_decode, quantize)


def _check_layout(mesh, pack_for_decode, quantize):
    """Refuse, before reading weights, a decode layout that cannot apply."""
    if quantize is None:
        return
    from hybridjax import cpu_kernels

    if quantize not in cpu_kernels.QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {', '.join(cpu_kernels.QUANTIZE_MODES)} or None, got {quantize!r}")
    if mesh is not None:
        raise ValueError(f"quantize={quantize!r} runs on one device only, not with a mesh")
    if pack_for_decode:
        raise ValueError(f"quantize={quantize!r} and pack_for_decode are two decode layouts: pick one")


def _pack(params, mesh, pack_for_decode, quantize=None):
    from hybridjax import cpu_kernels

    if quantize is not None:
        return cpu_kernels.quantize_params(params, quantize)
    if not pack_for_decode or mesh is not None:  # the kernel runs on one device only
        return params
    return cpu_kernels.pack_params(params)


def resolve_model(ref):
    """The local directory of a model reference: a directory (always wins), or a Hugging Face Hub
    id ORG/NAME[@REVISION] fetched into the hub cache (`hybridjax.conversion.hub`)."""
    from hybridjax.conversion.hub import resolve_model as _resolve

    return _resolve(ref)


def is_hub_id(ref) -> bool:
    """Whether `ref` is read as a hub id (it has the form ORG/NAME[@REVISION] and is no directory)."""
    from hybridjax.conversion.hub import parse_hub_id

    return not _Path(ref).is_dir() and parse_hub_id(str(ref)) is not None


def save_hf(params, cfg, out_dir, **kw):
    """Write params as an HF safetensors model directory (config.json, shards and index) that
    `load_hf` and transformers read; see `hybridjax.conversion.to_hf.write_hf` for the options."""
    from hybridjax.conversion import write_hf

    return write_hf(params, cfg, out_dir, **kw)


__all__ = [
    "Cache", "Config", "ConfigError", "GDNState", "KVState", "MeshError", "Model", "Params", "config_from_dict",
    "forward", "init_cache", "init_params", "load", "load_config", "load_hf", "load_model", "make_mesh", "reserve", "resolve_model",
    "save_hf", "shard_cache", "shard_params",
]
