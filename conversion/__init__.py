"""Checkpoint conversion: Hugging Face safetensors <-> hybridjax params and checkpoints.

Every checkpoint quirk lives in this package (fused Qwen3-Next projections, the conv axis,
expert stacking, `model.language_model.` prefixes); the model has no per-format branches.

    from hybridjax import conversion
    cfg, params = conversion.load(path)          # HF directory or converted checkpoint
    conversion.convert_hf(hf_dir, out)           # HF -> orbax checkpoint (+ config, tokenizer)
    conversion.export_hf(checkpoint, out)        # checkpoint -> HF safetensors shards
"""

from hybridjax.conversion.checkpoint import convert_hf, is_checkpoint, load, load_checkpoint, save_checkpoint
from hybridjax.conversion.hf import CheckpointError, load_hf, read_hf_tensors
from hybridjax.conversion.to_hf import export_hf, write_hf

__all__ = [
    "CheckpointError", "convert_hf", "export_hf", "is_checkpoint", "load", "load_checkpoint", "load_hf",
    "read_hf_tensors", "save_checkpoint", "write_hf",
]
