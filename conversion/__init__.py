"""Checkpoint conversion: Hugging Face safetensors <-> hybridjax params.

Every checkpoint quirk lives in this package (fused Qwen3-Next projections, the conv axis,
expert stacking, `model.language_model.` prefixes); the model has no per-format branches.
"""

from conversion.hf import CheckpointError, load_hf, read_hf_tensors

__all__ = ["CheckpointError", "load_hf", "read_hf_tensors"]
