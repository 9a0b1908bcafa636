"""A newcomer's path (issue 14, part 4; the README's blocks: test_readme_blocks.py): generation
stopping at end-of-turn tokens by default, text in / text out, the CLI's --help / --version /
errors, and docs that stay inside the repository."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hybridjax
from hybridjax import cli
from hybridjax.default_model import TINY_NAME, WEIGHTS_DIR, tiny_test_model
from hybridjax.generate import generate, stream

ROOT = Path(__file__).resolve().parents[1]


def test_generate_and_stream_stop_at_the_models_end_of_turn_by_default():
    cfg, params, tok = tiny_test_model()
    prompt = tok.encode("z" * 10)  # the README test's shapes: its compiled program serves `free`
    free = generate(params, cfg, [prompt], max_new_tokens=64, stop_ids=()).token_lists()[0][:8]
    eot = free[3]  # pretend this token ends a turn for this model
    cut = free[: free.index(eot) + 1]
    cfg_eot = dataclasses.replace(cfg, eos_token_id=(eot,))
    assert generate(params, cfg_eot, [prompt], max_new_tokens=8).token_lists()[0] == cut
    assert list(stream(params, cfg_eot, prompt, max_new_tokens=8)) == cut
    assert generate(params, cfg_eot, [prompt], max_new_tokens=8, stop_ids=()).token_lists()[0] == free


def test_load_model_text_in_text_out(tmp_path):
    model = hybridjax.load_model(WEIGHTS_DIR)  # the embedded default model's HF directory
    msgs = [{"role": "user", "content": "What does json.dumps do?"}]
    text = model.generate(msgs, max_new_tokens=12)
    assert isinstance(text, str) and text and "<|im_end|>" not in text
    prompt = model.tokenizer.render_chat(msgs)  # messages go through the chat template
    assert model.generate(prompt, max_new_tokens=12) == text
    ids = generate(model.params, model.cfg, [model.tokenizer.encode(prompt)], max_new_tokens=12,
                   stop_ids=model.stop_ids).token_lists()[0]
    assert text == model.tokenizer.decode([t for t in ids if t not in model.stop_ids], skip_special_tokens=True)
    assert "".join(model.stream(msgs, max_new_tokens=12)) == text
    with pytest.raises(FileNotFoundError):
        hybridjax.load_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="tokenizer.json"):
        hybridjax.load_model(tmp_path)


def test_cli_help_shows_defaults_version_and_plain_errors(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"hybridjax {hybridjax.__version__}"
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    help_text = capsys.readouterr().out
    for flag, default in (("--slots", "4"), ("--port", "8000"), ("--max-len", "4096"), ("--max-body-mb", "8.0")):
        assert re.search(re.escape(flag) + r"[\s\S]*?\(default: " + re.escape(default) + r"\)", help_text), flag
    with pytest.raises(SystemExit):
        cli.main(["serve", "--slots", "many"])
    err = capsys.readouterr().err
    assert "--slots" in err and "expected an integer, got 'many'" in err and "integer value" not in err
    for argv, message in ((["serve", "--slots", "-1"], "argument --slots: must be >= 0, got -1"),
                          (["train", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
                          (["serve", "--page-size", "48"], "argument --page-size: must be a power of two, got 48")):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert message in capsys.readouterr().err, argv
    from hybridjax.sampling import sampling_params

    with pytest.raises(ValueError) as e:
        sampling_params(1, temperature=-1.0)
    assert "np." not in str(e.value) and "-1.0" in str(e.value)


def test_docs_live_in_the_repository():
    assert (ROOT / "docs" / "architecture.md").is_file()
    readme = (ROOT / "README.md").read_text()
    assert "docs/architecture.md" in readme and "notebooks/" in readme and "tokenizer.json" in readme
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    for d in ("hybridjax", "benchmarks"):
        files += [p for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md")]
    outside = [str(p.relative_to(ROOT)) for p in files if re.search(r"\.\./shared|shared/DESIGN", p.read_text())]
    assert outside == []


def test_everything_installed_lives_under_the_hybridjax_name(tmp_path):
    """The kernels and the checkpoint converter once installed as top-level `pallas_kernels` and
    `conversion`, names another project could own. setuptools' build_py copies exactly the
    packages a wheel (or a non-editable install) gets, from pyproject's own configuration. The
    embedded default model's files come along, without setuptools' screenful of "Package would
    be ignored" (its directory has no __init__.py) in the middle of a new user's `make run`."""
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                          check=True, capture_output=True, text=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hybridjax"]
    assert (tmp_path / "hybridjax" / "pallas_kernels" / "gated_delta_rule" / "api.py").is_file()
    assert (tmp_path / "hybridjax" / "conversion" / "hf.py").is_file()
    weights = ROOT / "hybridjax" / "default_model" / "weights"
    assert sorted(p.name for p in (tmp_path / "hybridjax" / "default_model" / "weights").iterdir()) == sorted(
        p.name for p in weights.iterdir())
    assert "would be ignored" not in done.stdout + done.stderr


def test_no_code_imports_the_old_top_level_names():
    """An import of the old names would still succeed in a venv holding an older install (its
    editable finder maps them to that other tree): scan code, tests, benchmarks and notebooks."""
    sources = {p: p.read_text() for d in ("hybridjax", "pallas_kernels", "conversion", "tests", "benchmarks")
               for p in (ROOT / d).rglob("*.py")}
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        cells = json.loads(nb.read_text())["cells"]
        sources[nb] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    old = []
    for path, text in sources.items():
        for n in ast.walk(ast.parse(text)):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [n.module] if isinstance(n, ast.ImportFrom) and n.module and n.level == 0 else []
            old += [f"{path.relative_to(ROOT)}: {m}" for m in names if m.split(".")[0] in ("conversion", "pallas_kernels")]
    assert old == []


def test_serve_logs_the_model_its_size_and_load_time(monkeypatch, caplog):
    import logging

    import hybridjax.server

    seen = {}
    monkeypatch.setattr(hybridjax.server, "serve", lambda sc, cfg, params, tok, name, **kw: seen.update(name=name) or 0)
    monkeypatch.setattr(hybridjax.server.app, "bind", lambda host, port: None)  # the port may be taken here
    with caplog.at_level(logging.INFO):
        assert cli.main(["serve", "--no-compile-cache", "--port", "8123"]) == 0
    assert seen["name"] == "hybridjax-default"
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded "))
    assert re.search(r"loaded hybridjax-default: [\d.]+M parameters, [\d.]+ MB .* in [\d.]+ s", line), line


def test_api_key_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team keys\nkey-a\n\n  key-b  \n")
    assert cli.read_api_keys(str(f)) == ("key-a", "key-b")
    f.write_text("# none yet\n")
    with pytest.raises(cli.CLIError, match="holds no keys"):
        cli.read_api_keys(str(f))
    with pytest.raises(cli.CLIError, match="cannot read"):
        cli.read_api_keys(str(tmp_path / "missing"))


# A ChatML template without tools, as many models ship: it drops `tools` and would answer as if none.
PLAIN_CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_the_embedded_template_renders_tools_and_tool_calls():
    """It dropped `tools` and rendered an assistant's tool call as the literal 'None' (issue 29.6)."""
    from hybridjax.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(WEIGHTS_DIR)
    assert tok.renders_tools
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = tok.render_chat(msgs, tools=[WEATHER])
    assert '"name": "get_weather"' in text.split("<|im_end|>")[0]  # the signature, in the system block
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "None" not in text
    plain = [{"role": "user", "content": "Hi"}]
    assert tok.render_chat(plain, tools=None) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_tools_on_a_template_that_drops_them_are_a_400():
    import httpx
    from test_server import RunningServer

    from hybridjax.tokenizer import Tokenizer

    _, _, tok = tiny_test_model()
    plain = Tokenizer(tok.backend, PLAIN_CHATML, tok.special_tokens, tok.eos_token_ids)
    assert not plain.renders_tools
    s = RunningServer(tokenizer=plain, slots=1, max_len=128, warmup=False)
    try:
        body = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tools" and "does not render tools" in err["message"]
    finally:
        s.stop()


def test_loading_a_converted_checkpoint_logs_no_third_party_info(tmp_path, caplog):
    """Serving a converted checkpoint printed 49 'INFO absl:' lines (orbax's restore steps)."""
    import logging

    from hybridjax.conversion.checkpoint import convert_hf

    convert_hf(WEIGHTS_DIR, tmp_path / "ckpt")  # the embedded model, as `hybridjax convert` writes it
    cli.setup_logging()
    with caplog.at_level(logging.INFO):
        hybridjax.load(tmp_path / "ckpt", progress=False)
    noise = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno < logging.WARNING
             and not r.name.startswith("hybridjax")]
    assert noise == []
