"""The embedded default model: a tiny Qwen3.5-shaped model with random weights, made
deterministically (fixed seed) on first use, with a byte-level tokenizer and a ChatML template.

It lets `hybridjax generate` and `hybridjax serve` run with no model directory. Its text is
noise; its value is that every path of the stack runs end to end on any machine.
"""

from __future__ import annotations

import functools

import jax

from hybridjax.config import Config, config_from_dict
from hybridjax.params import Params, init_params
from hybridjax.tokenizer import Tokenizer, char_level_tokenizer

DEFAULT_NAME = "hybridjax-default-tiny"
DEFAULT_SEED = 0
DEFAULT_CONFIG = {
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


@functools.lru_cache(maxsize=1)
def default_model() -> tuple[Config, Params, Tokenizer]:
    cfg = config_from_dict(DEFAULT_CONFIG)
    params = init_params(jax.random.PRNGKey(DEFAULT_SEED), cfg)
    return cfg, params, char_level_tokenizer()
