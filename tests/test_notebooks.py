"""Every notebook runs top to bottom: its code cells are executed in order, in one namespace
(the same as a fresh kernel running all cells; no Jupyter needed), and their asserts hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path, monkeypatch):
    monkeypatch.delenv("MODEL_DIR", raising=False)
    namespace = {"__name__": "__main__"}
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert cells, f"{path.name} has no code"
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        exec(compile(source, f"{path.name}[cell {i}]", "exec"), namespace)  # noqa: S102
