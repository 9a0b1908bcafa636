"""GGUF files of a benchmark model, for llama.cpp's llama-bench beside bench_cpu_decode.py.

    python benchmarks/make_gguf.py --llama-cpp DIR --model-dir M [--out-dir D] [--types f32,bf16]

DIR is a llama.cpp source tree (its `convert_hf_to_gguf.py` and `gguf-py/`; any release with
Qwen3.5 support, e.g. the one vendored in the `llama-cpp-python` sdist from PyPI). M is an HF
model directory without a tokenizer (bench_generate.build_model's random Qwen3.5). Writes
D/model-f32.gguf, D/model-bf16.gguf (D defaults to M).

The converter needs a tokenizer; llama-bench feeds random token ids, so its content does not
change the figures. We lend it the embedded default's byte-level BPE (4096 tokens, padded by the
converter up to the model's vocab_size) and tell the converter that its pre-tokenizer is GPT-2's
(it is: `pre_tokenizers.ByteLevel(use_regex=True)`), which it cannot know by hash. MTP tensors
are left out (`--no-mtp`): llama-bench does not draft.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Run inside the converter's process: our one change to it is the pre-tokenizer's name.
_DRIVER = """
import runpy, sys
llama_cpp, script = sys.argv[1], sys.argv[2]
sys.argv = [script] + sys.argv[3:]
sys.path[:0] = [llama_cpp, llama_cpp + "/gguf-py"]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
runpy.run_path(script, run_name="__main__")
"""


def staged_model_dir(model_dir: Path, work: Path) -> Path:
    """model_dir's config and weights (linked) with the default model's tokenizer beside them."""
    stage = work / "model"
    stage.mkdir()
    for f in model_dir.iterdir():
        if f.suffix in (".json", ".safetensors") and f.name not in TOKENIZER_FILES:
            (stage / f.name).symlink_to(f.resolve())
    for name in TOKENIZER_FILES:
        shutil.copy(ROOT / "hybridjax" / "default_model" / "weights" / name, stage / name)
    return stage


def convert(llama_cpp: Path, model_dir: Path, out: Path, outtype: str) -> None:
    script = llama_cpp / "convert_hf_to_gguf.py"
    cmd = [sys.executable, "-c", _DRIVER, str(llama_cpp), str(script), str(model_dir),
           "--no-mtp", "--outtype", outtype, "--outfile", str(out)]
    subprocess.run(cmd, check=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--types", default="f32,bf16")
    a = ap.parse_args(argv)
    if not (a.llama_cpp / "convert_hf_to_gguf.py").is_file():
        print(f"error: no convert_hf_to_gguf.py in {a.llama_cpp}", file=sys.stderr)
        return 2
    if not (a.model_dir / "config.json").is_file():
        print(f"error: no config.json in {a.model_dir}", file=sys.stderr)
        return 2
    out_dir = a.out_dir or a.model_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="make_gguf_") as work:
        stage = staged_model_dir(a.model_dir, Path(work))
        for t in a.types.split(","):
            out = out_dir / f"model-{t}.gguf"
            convert(a.llama_cpp, stage, out, t)
            print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
