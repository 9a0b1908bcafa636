"""hybridjax: Qwen3.5 / Qwen3-Next hybrid models in JAX with pure-functional caches.

    cfg, params = hybridjax.load_hf("path/to/hf_model_dir", dtype="float32")
    cache = hybridjax.init_cache(cfg, batch_size=1, max_len=4096)
    logits, cache = hybridjax.forward(params, tokens, cache, cfg)

Over several devices (docs/sharding.md): `mesh = hybridjax.make_mesh("tensor=2,expert=4")`, then
`load_hf(..., mesh=mesh)` and `init_cache(..., mesh=mesh)`; forward is unchanged.
"""

from hybridjax.cache import Cache, GDNState, KVState, init_cache, reserve
from hybridjax.config import Config, ConfigError, config_from_dict, load_config
from hybridjax.model import forward
from hybridjax.params import Params, init_params
from hybridjax.sharding import MeshError, make_mesh, shard_cache, shard_params

__version__ = "0.1.0"


def load_hf(model_dir, dtype="float32", mesh=None):
    """(Config, Params) from a Hugging Face model directory; see `conversion.hf.load_hf`.
    `mesh` (from `make_mesh`): each device receives its shard as the tensors are read."""
    # The facade reaches down into conversion lazily; nothing below it imports conversion.
    from conversion.hf import load_hf as _load_hf

    return _load_hf(model_dir, dtype=dtype, mesh=mesh)


def load(path, dtype=None, mesh=None):
    """(Config, Params) from an HF model directory or a converted hybridjax checkpoint, placed on
    `mesh` shard by shard when given."""
    from conversion import load as _load

    return _load(path, dtype=dtype, mesh=mesh)


__all__ = [
    "Cache", "Config", "ConfigError", "GDNState", "KVState", "Params", "config_from_dict",
    "MeshError", "forward", "init_cache", "init_params", "load", "load_config", "load_hf", "make_mesh", "reserve",
    "shard_cache", "shard_params",
]
