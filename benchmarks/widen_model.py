"""Widen a Qwen3.5 dense HF checkpoint without changing its function (Net2Net-style replication).

    python benchmarks/widen_model.py --out DIR [--src DIR] --hidden-factor F --mlp-factor G

Makes a larger model that computes the same logits as the source (up to float rounding), so a
benchmark gets the cost profile of a bigger model with the source's trained behaviour, e.g. the
embedded default's MTP acceptance rate (the default is too small to be bandwidth-bound, and
training a larger one here takes hours). Reference: Chen, Goodfellow, Shlens, "Net2Net:
Accelerating Learning via Knowledge Transfer" (ICLR 2016), the function-preserving widening by
unit replication; here every unit is replicated the same number of times, so no unit needs its
own divisor.

With x -> [x, x, ..., x] (F copies) on the residual stream (hidden size D -> F*D):
  - RMSNorm: mean(x**2) is unchanged by replication, so a norm with replicated weights gives
    replicated outputs. That holds for Qwen3.5's (1 + w) norms (`input_layernorm`, ...,
    `model.norm`, the MTP's norms) as for plain ones; the per-head norms (`q_norm`, `k_norm`, the
    GDN's gated `linear_attn.norm`) act on head_dim and are left as they are.
  - a linear layer reading the stream (q/k/v, GDN in_proj_*, gate/up, mtp.fc per half): input
    columns replicated F times and divided by F, so W' [x, .., x] = W x;
  - a layer writing the stream (o_proj, out_proj, down_proj): output rows replicated F times;
  - embeddings: columns replicated; the LM head is untied (`tie_word_embeddings: false`) and is
    the replicated embedding / F, since a tied head would read F copies and scale logits by F.
MLP units (intermediate I -> G*I): gate/up rows replicated G times, down_proj's columns
replicated and divided by G. Attention and GDN head counts stay as they are: only the
projections into and out of the stream change shape.

F and G powers of two keep every weight exact in bfloat16 (division by 2**n is exact); others
are written in float32. Dense Qwen3.5 text checkpoints only (an MoE or Qwen3-Next tensor name is
refused). The tokenizer and other side files are copied.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SRC = ROOT / "hybridjax" / "default_model" / "weights"

# The last component(s) of each HF tensor name -> how it is widened.
_READS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "in_proj_qkv.weight", "in_proj_z.weight",
          "in_proj_a.weight", "in_proj_b.weight")
_WRITES = ("o_proj.weight", "out_proj.weight")
_STREAM_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "pre_fc_norm_embedding.weight",
                 "pre_fc_norm_hidden.weight")
_KEPT = ("A_log", "dt_bias", "conv1d.weight", "linear_attn.norm.weight", "q_norm.weight", "k_norm.weight")


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def widen_tensor(name: str, w: np.ndarray, f: int, g: int) -> np.ndarray:
    """The widened float32 value of HF tensor `name` (float32 in, float32 out)."""
    if name.endswith(_KEPT):
        return w
    if name.endswith(_STREAM_NORMS) or name in ("model.norm.weight", "mtp.norm.weight"):
        return np.tile(w, f)
    if name == "model.embed_tokens.weight":
        return np.tile(w, (1, f))
    if name == "lm_head.weight":
        return np.tile(w, (1, f)) / f
    if name.endswith(_READS):
        return np.tile(w, (1, f)) / f
    if name.endswith(_WRITES):
        return np.tile(w, (f, 1))
    if name.endswith(("gate_proj.weight", "up_proj.weight")) and ".experts." not in name and "shared" not in name:
        return np.tile(w, (g, f)) / f  # [I, D] -> [G*I, F*D]
    if name.endswith("down_proj.weight") and ".experts." not in name and "shared" not in name:
        return np.tile(w, (f, g)) / g  # [D, I] -> [F*D, G*I]
    if name == "mtp.fc.weight":  # [D, 2D] over concat(norm(embedding), norm(hidden)): each half reads the stream
        d = w.shape[0]
        return np.concatenate([np.tile(w[:, :d], (f, f)), np.tile(w[:, d:], (f, f))], axis=1) / f
    raise ValueError(f"widen_model: no widening rule for tensor {name!r} (dense Qwen3.5 text checkpoints only)")


def widen_config(cfg: dict, f: int, g: int) -> dict:
    out = dict(cfg)
    if "text_config" in cfg or cfg.get("num_experts"):
        raise ValueError("widen_model: dense Qwen3.5 text checkpoints only (no multimodal or MoE config)")
    out["hidden_size"] = cfg["hidden_size"] * f
    out["intermediate_size"] = cfg["intermediate_size"] * g
    out["tie_word_embeddings"] = False
    if not (_is_pow2(f) and _is_pow2(g)):
        out["dtype"] = "float32"
    return out


def widen_dir(src: Path, out: Path, f: int, g: int, force: bool = False) -> Path:
    """Write the widened copy of HF directory `src` to `out` (config.json, model.safetensors and
    the side files). Returns `out`. Tensors are read and written through torch (numpy has no
    bfloat16), widened in float32 and stored in their source dtype when that is exact."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    if f < 1 or g < 1:
        raise ValueError("widen_model: factors must be >= 1")
    if out.exists():
        if not force:
            raise FileExistsError(f"widen_model: {out} exists (pass --force to replace it)")
        shutil.rmtree(out)
    new_cfg = widen_config(json.loads((src / "config.json").read_text()), f, g)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"widen_model: no *.safetensors in {src}")
    exact = _is_pow2(f) and _is_pow2(g)
    tensors = {}
    for path in files:
        with safe_open(path, "pt") as reader:
            for name in reader.keys():
                w = reader.get_tensor(name)
                v = torch.from_numpy(np.ascontiguousarray(widen_tensor(name, w.float().numpy(), f, g)))
                tensors[name] = v.to(w.dtype) if exact else v
    if "lm_head.weight" not in tensors:  # tied: the head becomes its own tensor
        emb = tensors["model.embed_tokens.weight"]
        tensors["lm_head.weight"] = (emb.float() / f).to(emb.dtype)
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(new_cfg, indent=2) + "\n")
    for side in src.iterdir():  # tokenizer, chat template, generation config
        if side.is_file() and side.suffix != ".safetensors" and side.name not in ("config.json", "build.json") \
                and not side.name.endswith(".index.json"):
            shutil.copy2(side, out / side.name)
    (out / "widened.json").write_text(json.dumps(dict(source=str(src), hidden_factor=f, mlp_factor=g), indent=2) + "\n")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default=str(DEFAULT_SRC), help="HF model directory (default: the embedded default)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden-factor", type=int, required=True, help="F: hidden size x F")
    ap.add_argument("--mlp-factor", type=int, required=True, help="G: MLP intermediate size x G")
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = ap.parse_args(argv)
    out = widen_dir(Path(args.src), Path(args.out), args.hidden_factor, args.mlp_factor, force=args.force)
    cfg = json.loads((out / "config.json").read_text())
    print(f"wrote {out}: hidden {cfg['hidden_size']}, intermediate {cfg['intermediate_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
