"""Model configuration read from a Hugging Face `config.json`.

`Config` is a frozen, hashable dataclass so it can be a static argument of `jax.jit`.
Field names follow the HF keys verbatim. Supported `model_type`s: `qwen3_next`,
`qwen3_5` / `qwen3_5_moe` (the multimodal wrappers, text taken from `text_config`),
`qwen3_5_text`, `qwen3_5_moe_text`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

LINEAR = "linear_attention"
FULL = "full_attention"

_TEXT_TYPES = {
    "qwen3_next": "qwen3_next",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
_WRAPPER_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


class ConfigError(ValueError):
    """A config.json that hybridjax cannot serve; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Config:
    family: str  # "qwen3_next" | "qwen3_5" | "qwen3_5_moe": selects the checkpoint layout
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # gated deltanet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # feed-forward: dense MLP and/or mixture of experts
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    max_position_embeddings: int = 32768
    eos_token_id: tuple[int, ...] = ()
    # identity of the source checkpoint, kept so converters can write it back
    model_type: str = ""
    # block-wise fp8 checkpoints: quantization_config.weight_block_size (rows, cols); () when the
    # weights are not quantised. Loading dequantises (hybridjax.conversion.fp8); the export uses it.
    weight_block_size: tuple[int, ...] = ()

    def kv_heads_laid_out(self, tensor: int = 1) -> int:
        """KV heads as caches hold them over `tensor` shards: num_key_value_heads, or, when the
        heads do not divide over the shards (tensor > Hkv), each head repeated so that every shard
        holds the KV heads its query heads read (vLLM's replication): lcm(Hkv, tensor)."""
        return math.lcm(self.num_key_value_heads, tensor)

    # --- derived sizes (axis vocabulary of docs/architecture.md) ---
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:  # Hk * K
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:  # Hv * V
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:  # C = 2 * Hk * K + Hv * V, channel order [q | k | v]
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[i]


def _get(d: dict, key: str, default: Any = dataclasses.MISSING) -> Any:
    if key in d and d[key] is not None:
        return d[key]
    if default is dataclasses.MISSING:
        raise ConfigError(f"config.json: missing required field '{key}'")
    return default


def _layer_types(text: dict, n_layers: int) -> tuple[str, ...]:
    if text.get("layer_types") is not None:
        types = tuple(text["layer_types"])
    else:
        interval = int(_get(text, "full_attention_interval", 4))
        if interval < 1:
            raise ConfigError(f"config.json: 'full_attention_interval' must be >= 1, got {interval}")
        types = tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers))
    if len(types) != n_layers:
        raise ConfigError(
            f"config.json: 'layer_types' has {len(types)} entries but 'num_hidden_layers' is {n_layers}"
        )
    for i, t in enumerate(types):
        if t not in (LINEAR, FULL):
            raise ConfigError(f"config.json: 'layer_types[{i}]' is {t!r}; expected {LINEAR!r} or {FULL!r}")
    return types


def _rope(text: dict) -> tuple[float, float]:
    """rope_theta and partial_rotary_factor, from `rope_parameters` or top-level keys."""
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"config.json: rope_type {rope_type!r} is not supported (only 'default')")
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    if not 0.0 < float(factor) <= 1.0:
        raise ConfigError(f"config.json: 'partial_rotary_factor' must be in (0, 1], got {factor}")
    return float(theta), float(factor)


def _moe_layers(family: str, text: dict, n_layers: int) -> tuple[bool, ...]:
    if family == "qwen3_5":
        return ()
    if int(_get(text, "num_experts", 0)) <= 0:
        return ()
    if family == "qwen3_5_moe":
        return (True,) * n_layers
    step = int(_get(text, "decoder_sparse_step", 1))
    only_mlp = set(text.get("mlp_only_layers") or [])
    return tuple(i not in only_mlp and (i + 1) % step == 0 for i in range(n_layers))


def _eos(raw: dict, text: dict) -> tuple[int, ...]:
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def config_from_dict(raw: dict) -> Config:
    """Build a Config from the parsed contents of an HF config.json."""
    model_type = raw.get("model_type")
    text = raw
    if model_type in _WRAPPER_TYPES:
        text = dict(raw.get("text_config") or {})
        if not text:
            raise ConfigError(f"config.json: model_type {model_type!r} needs a 'text_config'")
        text.setdefault("model_type", _WRAPPER_TYPES[model_type])
    text_type = text.get("model_type")
    if text_type not in _TEXT_TYPES:
        supported = sorted(set(_TEXT_TYPES) | set(_WRAPPER_TYPES))
        raise ConfigError(f"config.json: model_type {model_type!r} is not supported; expected one of {supported}")
    family = _TEXT_TYPES[text_type]

    n_layers = int(_get(text, "num_hidden_layers"))
    hidden = int(_get(text, "hidden_size"))
    n_heads = int(_get(text, "num_attention_heads"))
    n_kv = int(_get(text, "num_key_value_heads", n_heads))
    hk, hv = int(_get(text, "linear_num_key_heads")), int(_get(text, "linear_num_value_heads"))
    theta, factor = _rope(text)
    if n_heads % n_kv:
        raise ConfigError(
            f"config.json: 'num_attention_heads' ({n_heads}) must be a multiple of 'num_key_value_heads' ({n_kv})"
        )
    if hv % hk:
        raise ConfigError(
            f"config.json: 'linear_num_value_heads' ({hv}) must be a multiple of 'linear_num_key_heads' ({hk})"
        )
    if text.get("attention_bias"):
        raise ConfigError("config.json: 'attention_bias' = true is not supported by these architectures")
    if text.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: 'hidden_act' {text.get('hidden_act')!r} is not supported (only 'silu')")

    moe_layers = _moe_layers(family, text, n_layers)
    cfg = Config(
        family=family,
        vocab_size=int(_get(text, "vocab_size")),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        layer_types=_layer_types(text, n_layers),
        rms_norm_eps=float(_get(text, "rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=int(_get(text, "head_dim", hidden // n_heads)),
        rope_theta=theta,
        partial_rotary_factor=factor,
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=int(_get(text, "linear_key_head_dim")),
        linear_value_head_dim=int(_get(text, "linear_value_head_dim")),
        linear_conv_kernel_dim=int(_get(text, "linear_conv_kernel_dim", 4)),
        intermediate_size=int(_get(text, "intermediate_size", 0)),
        num_experts=int(_get(text, "num_experts", 0)) if moe_layers else 0,
        num_experts_per_tok=int(_get(text, "num_experts_per_tok", 0)) if moe_layers else 0,
        moe_intermediate_size=int(_get(text, "moe_intermediate_size", 0)) if moe_layers else 0,
        shared_expert_intermediate_size=int(_get(text, "shared_expert_intermediate_size", 0)) if moe_layers else 0,
        # Qwen3.5-MoE always renormalises the top-k weights; Qwen3-Next makes it a field.
        norm_topk_prob=bool(text.get("norm_topk_prob", True)) or family == "qwen3_5_moe",
        moe_layers=moe_layers,
        max_position_embeddings=int(_get(text, "max_position_embeddings", 32768)),
        eos_token_id=_eos(raw, text),
        model_type=str(model_type),
        weight_block_size=_weight_block_size(raw.get("quantization_config", text.get("quantization_config"))),
    )
    _check_sizes(cfg)
    return cfg


QUANT_METHODS = ("fp8",)


def _weight_block_size(quant) -> tuple[int, ...]:
    """quantization_config -> the fp8 block (rows, cols); () for none. Other methods are refused."""
    if quant is None:
        return ()
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method not in QUANT_METHODS:
        raise ConfigError(f"config.json: quantization_config.quant_method {method!r} is not supported (hybridjax reads "
                          "unquantised and block-wise fp8 checkpoints): use the unquantised or the -FP8 release of the model")
    block = quant.get("weight_block_size", [128, 128])  # transformers' FineGrainedFP8Config default
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"config.json: quantization_config.weight_block_size must be [rows, cols], got {block!r}")
    return tuple(block)


def _check_sizes(cfg: Config) -> None:
    moe = any(cfg.moe_layers)
    if moe:
        if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            raise ConfigError(
                f"config.json: 'num_experts_per_tok' ({cfg.num_experts_per_tok}) must be in 1..'num_experts' ({cfg.num_experts})"
            )
    needs_dense = not moe or not all(cfg.moe_layers)
    if needs_dense and cfg.intermediate_size <= 0:
        raise ConfigError("config.json: 'intermediate_size' must be > 0 for dense MLP layers")
    if cfg.rotary_dim % 2:
        raise ConfigError(
            f"config.json: head_dim * partial_rotary_factor = {cfg.rotary_dim} must be even"
        )


def read_json(path: str | Path, error: type[Exception] = ConfigError) -> Any:
    """Parse a JSON file; unparsable content raises `error` naming the file."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: invalid JSON ({e})") from None


def load_config(model_dir: str | Path) -> Config:
    """Read `<model_dir>/config.json` (or a path to the json itself)."""
    path = Path(model_dir)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json found at {path}: a model directory holds the Hugging Face config.json and "
                          "*.safetensors (or is a converted hybridjax checkpoint); check the path")
    return config_from_dict(read_json(path))
