"""Every Python block of the README runs as written (issue 29): a newcomer pastes them in order
and each works on a fresh machine, with the embedded default model wherever a model is needed.
The client block talks to a real server on the embedded model; only its port is this test's."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path

import pytest

from hybridjax import cli
from hybridjax.default_model import DEFAULT_NAME, default_model

ROOT = Path(__file__).resolve().parents[1]
README_URL = "http://127.0.0.1:8000"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


BLOCKS = python_blocks(ROOT / "README.md")


@pytest.fixture(scope="module")
def default_server():
    from test_server import RunningServer

    s = RunningServer(model=(DEFAULT_NAME, default_model()), slots=2, max_len=2048, warmup=False)
    yield s
    s.stop()


def test_the_readme_has_its_blocks():
    assert len(BLOCKS) >= 4  # client, text in / text out, the functional API, training


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs_as_written(block, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)  # a block may write files (metrics.jsonl)
    if README_URL in block:
        block = block.replace(README_URL, request.getfixturevalue("default_server").url)
    out = io.StringIO()  # not capsys: the server thread's log handlers hold on to the streams they saw
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), {"__name__": "__readme__"})
    assert out.getvalue().strip(), "every block shows its result"


def test_help_shows_a_default_for_every_option_that_has_one():
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, p in sub.choices.items():
        formatter = p.formatter_class(prog=name)
        for a in p._actions:
            if not a.option_strings or a.default in (None, False, argparse.SUPPRESS):
                continue
            shown = formatter._get_help_string(a) or ""
            assert a.help and "default" in shown, f"hybridjax {name} {a.option_strings[0]}: no default in --help"
