"""The embedded default model, and a tiny random model for tests.

`default_model()`: a small Qwen3.5-layout hybrid (8 layers, Gated DeltaNet 3 : 1 gated
attention, an MTP head) trained here on Python's own documentation (`pydoc_data` topics and
standard-library docstrings) by `python -m hybridjax.default_model.build`, shipped in
`weights/` as an HF-layout directory (config.json, model.safetensors, tokenizer, ChatML
template; `weights/build.json` records the Python version, data fingerprint, held-out loss).
It knows a little about Python's standard library; it is not a general assistant.

`tiny_test_model()`: a 4-layer model with seeded random weights and a character-level
tokenizer (one token per character), made on first use. Its text is noise; tests pin prompt
lengths on it, and every path of the stack runs on it in seconds.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax

from hybridjax.config import Config, config_from_dict
from hybridjax.params import Params, init_params
from hybridjax.tokenizer import Tokenizer, char_level_tokenizer

DEFAULT_NAME = "hybridjax-default"
WEIGHTS_DIR = Path(__file__).parent / "weights"

TINY_NAME = "hybridjax-default-tiny"
TINY_SEED = 0
TINY_CONFIG = {
    "model_type": "qwen3_5_text",
    "vocab_size": 128,  # the character-level tokenizer's vocabulary
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "eos_token_id": 127,
}
# Kept for callers of the old names: the tiny model's config.
DEFAULT_CONFIG = TINY_CONFIG


@functools.lru_cache(maxsize=2)
def default_model(dtype: str = "float32") -> tuple[Config, Params, Tokenizer]:
    """(cfg, params in `dtype`, tokenizer) of the shipped default model (float32 weights)."""
    if not (WEIGHTS_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the default model's weights are missing from {WEIGHTS_DIR}: "
            "build them with `python -m hybridjax.default_model.build`"
        )
    import hybridjax  # the facade's loader (conversion) is reached lazily, as the CLI does

    cfg, params = hybridjax.load(WEIGHTS_DIR, dtype=dtype)
    return cfg, params, Tokenizer.from_dir(WEIGHTS_DIR, cfg.eos_token_id)


@functools.lru_cache(maxsize=1)
def tiny_test_model() -> tuple[Config, Params, Tokenizer]:
    """(cfg, params, tokenizer) of the tiny random test model (deterministic, no files)."""
    cfg = config_from_dict(TINY_CONFIG)
    params = init_params(jax.random.PRNGKey(TINY_SEED), cfg)
    return cfg, params, char_level_tokenizer()
