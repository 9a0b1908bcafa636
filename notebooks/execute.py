"""Run a notebook top to bottom and store its outputs (stdout, the last expression's value,
matplotlib figures as PNG) in place, with stable cell ids: what the repo commits.

    python notebooks/execute.py notebooks/03_training.ipynb [...]

Cells run in one namespace in order, as tests/test_notebooks.py runs them (no Jupyter kernel
needed); figures are drawn with matplotlib's Agg backend.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import hashlib
import io
import json
import sys
import traceback
from pathlib import Path


def _figures() -> list[dict]:
    import matplotlib.pyplot as plt

    out = []
    for num in plt.get_fignums():
        buf = io.BytesIO()
        plt.figure(num).savefig(buf, format="png", dpi=80, bbox_inches="tight")
        out.append({"output_type": "display_data", "metadata": {},
                    "data": {"image/png": base64.b64encode(buf.getvalue()).decode(), "text/plain": ["<Figure>"]}})
    plt.close("all")
    return out


def run_cell(source: str, ns: dict, name: str) -> list[dict]:
    """Execute one cell; returns its outputs in nbformat 4 form."""
    tree = ast.parse(source)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    buf, outputs, value = io.StringIO(), [], None
    with contextlib.redirect_stdout(buf):
        exec(compile(tree, name, "exec"), ns)  # noqa: S102
        if last is not None:
            value = eval(compile(ast.Expression(last.value), name, "eval"), ns)  # noqa: S307
    if buf.getvalue():
        outputs.append({"output_type": "stream", "name": "stdout", "text": buf.getvalue().splitlines(keepends=True)})
    outputs += _figures()
    if value is not None and not type(value).__module__.startswith("matplotlib"):
        outputs.append({"output_type": "execute_result", "execution_count": None, "metadata": {},
                        "data": {"text/plain": repr(value).splitlines(keepends=True)}})
    return outputs


def execute(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    nb = json.loads(path.read_text())
    ns = {"__name__": "__main__"}
    count = 0
    for i, cell in enumerate(nb["cells"]):
        cell.setdefault("id", hashlib.sha1(f"{path.name}:{i}".encode()).hexdigest()[:8])
        if cell["cell_type"] != "code":
            continue
        count += 1
        try:
            outputs = run_cell("".join(cell["source"]), ns, f"{path.name}[cell {i}]")
        except Exception:
            traceback.print_exc()
            raise SystemExit(f"{path}: cell {i} failed")
        for o in outputs:
            if o["output_type"] == "execute_result":
                o["execution_count"] = count
        cell["outputs"], cell["execution_count"] = outputs, count
    nb["nbformat"], nb["nbformat_minor"] = 4, 5
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        execute(Path(arg))
        print(f"executed {arg}")
