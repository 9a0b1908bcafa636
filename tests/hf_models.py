"""Tiny Hugging Face checkpoints made by the tests themselves.

Each is a transformers model with random weights under a fixed seed, its norm weights, A_log
and dt_bias moved away from their init values (so a model that mishandles them shows it),
saved with `save_pretrained`. Shapes are tiny but keep every structural feature: Hv = r*Hk,
GQA, partial rotary, MoE with a shared expert, a dense layer inside a MoE model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

TINY = dict(
    vocab_size=272, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 8.0, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.5, generator=gen))
            elif "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))


def _save(model, out: Path, seed: int, **save_kw) -> Path:
    _perturb(model, seed)
    model.save_pretrained(out, **save_kw)
    return out


def qwen3_next_moe(out: Path, seed: int = 1) -> Path:
    """Qwen3-Next: fused in_proj_qkvz / in_proj_ba, per-expert MoE, layer 1 dense, Hv = 2 Hk."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(**TINY, **MOE, intermediate_size=48, linear_num_key_heads=2,
                          linear_num_value_heads=4, mlp_only_layers=[1], full_attention_interval=2)
    return _save(Qwen3NextForCausalLM(cfg).eval(), out, seed)


def qwen3_5_dense(out: Path, seed: int = 2, **save_kw) -> Path:
    """Qwen3.5 text-only: split projections, Hv = Hk, tied embeddings."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(**TINY, intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=2,
                            tie_word_embeddings=True)
    return _save(Qwen3_5ForCausalLM(cfg).eval(), out, seed, **save_kw)


def qwen3_5_multimodal(out: Path, seed: int = 3) -> Path:
    """Qwen3.5 saved through the multimodal class: text weights under model.language_model."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen3_5Config(
        text_config=dict(**TINY, intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32),
    )
    return _save(Qwen3_5ForConditionalGeneration(cfg).eval(), out, seed)


def qwen3_5_moe(out: Path, seed: int = 4) -> Path:
    """Qwen3.5-MoE text model (experts stored fused by transformers)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    cfg = Qwen3_5MoeTextConfig(**TINY, **MOE, linear_num_key_heads=2, linear_num_value_heads=4)
    return _save(Qwen3_5MoeForCausalLM(cfg).eval(), out, seed)


class TorchMTP(torch.nn.Module):
    """The MTP head written from vLLM's Qwen3NextMultiTokenPredictor / Qwen3_5MultiTokenPredictor
    (vllm/model_executor/models/qwen3_next_mtp.py, qwen3_5_mtp.py), with transformers' own
    decoder layer (full attention) for `mtp.layers.0`: the torch reference for hybridjax.mtp."""

    def __init__(self, model: torch.nn.Module, layer_idx: int):
        super().__init__()
        text = model.model.language_model if hasattr(model.model, "language_model") else model.model
        cfg = text.config
        assert cfg.layer_types[layer_idx] == "full_attention"
        norm_cls, layer_cls = type(text.norm), type(text.layers[layer_idx])
        d = cfg.hidden_size
        self.text, self.lm_head = [text], [model.lm_head]  # shared, not registered as submodules
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = norm_cls(d, eps=cfg.rms_norm_eps), norm_cls(d, eps=cfg.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * d, d, bias=False)
        self.layers = torch.nn.ModuleList([layer_cls(cfg, layer_idx)])
        self.norm = norm_cls(d, eps=cfg.rms_norm_eps)

    def forward(self, hidden, next_ids, positions):
        """hidden [B, T, D] (main model's final-normed states), next_ids [B, T], positions [B, T]."""
        text = self.text[0]
        e = self.pre_fc_norm_embedding(text.embed_tokens(next_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        t = x.shape[1]
        causal = torch.full((t, t), float("-inf")).triu(1)[None, None]  # [1, 1, T, T]
        x = self.layers[0](x, position_embeddings=text.rotary_emb(x, positions), attention_mask=causal,
                           position_ids=positions)
        x = x[0] if isinstance(x, tuple) else x
        out = self.norm(x)
        return self.lm_head[0](out), out


def add_mtp_head(model_dir: Path, model: torch.nn.Module, seed: int = 5) -> TorchMTP:
    """Give a single-file checkpoint a random MTP head (`mtp.*` tensors, experts per expert as the
    checkpoint stores them) and return it as a TorchMTP over `model`."""
    from safetensors.numpy import load_file, save_file

    text = model.model.language_model if hasattr(model.model, "language_model") else model.model
    layer_idx = max(i for i, t in enumerate(text.config.layer_types) if t == "full_attention")
    torch.manual_seed(seed)
    head = TorchMTP(model, layer_idx).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a bare module skips transformers' init (fused experts start uninitialised)
        for p in head.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    _perturb(head, seed)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name, p in head.state_dict().items():
        x = p.detach().numpy()
        if name.endswith("experts.gate_up_proj"):  # fused [E, 2I, D] -> per expert [I, D]
            stem, i = name[: -len("gate_up_proj")], x.shape[1] // 2
            for e in range(x.shape[0]):
                tensors[f"mtp.{stem}{e}.gate_proj.weight"] = np.ascontiguousarray(x[e, :i])
                tensors[f"mtp.{stem}{e}.up_proj.weight"] = np.ascontiguousarray(x[e, i:])
        elif name.endswith("experts.down_proj"):  # [E, D, I] -> per expert [D, I]
            for e in range(x.shape[0]):
                tensors[f"mtp.{name[: -len('down_proj')]}{e}.down_proj.weight"] = np.ascontiguousarray(x[e])
        else:
            tensors[f"mtp.{name}"] = np.ascontiguousarray(x)
    save_file(tensors, path, metadata={"format": "pt"})
    return head


BUILDERS = {
    "qwen3_next_moe": qwen3_next_moe,
    "qwen3_5_dense": qwen3_5_dense,
    "qwen3_5_multimodal": qwen3_5_multimodal,
    "qwen3_5_moe": qwen3_5_moe,
}


def load_torch(model_dir: Path):
    """The transformers model of a tiny checkpoint, float32, eager attention."""
    import json

    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    kind = json.loads((model_dir / "config.json").read_text())["model_type"]
    cls = Qwen3_5ForConditionalGeneration if kind == "qwen3_5" else AutoModelForCausalLM
    return cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
