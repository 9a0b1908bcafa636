"""Training mechanics on the tiny test model: chunked cross-entropy, gradient accumulation,
resuming from an orbax checkpoint, LoRA, bfloat16 compute, data masks and batches, learning,
and the `hybridjax train` command end to end (output read by load, generate and convert).

Shapes are pinned (batch 4 x 32 tokens) so each train configuration compiles once.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hybridjax
from hybridjax.default_model import TINY_CONFIG, tiny_test_model
from hybridjax.train import (
    Batches, DataError, TrainConfig, cross_entropy_sum, fit, init_state, make_train_step, model_params, read_jsonl,
    restore_state, save_state, token_stream,
)
from hybridjax.train.data import encode_example

BATCH, SEQ = 4, 32
TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def err_ratio(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.fixture(scope="module")
def tiny():
    return tiny_test_model()


@pytest.fixture(scope="module")
def batches(tiny):
    _, _, tok = tiny
    ids, flags = token_stream(tok, [{"text": TEXT}])
    return Batches(ids, flags, BATCH, SEQ, seed=0)


def leaves_close(a, b, tol):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max() <= tol


def test_vocab_chunked_cross_entropy_equals_direct():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((10, 16)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((16, 272)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 272, 10), jnp.int32)
    mask = jnp.asarray(rng.random(10) < 0.7, jnp.float32)
    logp = jax.nn.log_softmax(x @ head, axis=-1)
    want = -jnp.sum(mask * logp[jnp.arange(10), targets])
    f = lambda x, head, chunk: cross_entropy_sum(x, head, targets, mask, chunk)  # noqa: E731
    for chunk in (100, 272, 4096):  # 3 chunks (the last padded), one exact chunk, the direct path
        assert err_ratio(f(x, head, chunk), want) < 1e-6
    g_direct = jax.grad(f, argnums=(0, 1))(x, head, 4096)
    g_chunked = jax.grad(f, argnums=(0, 1))(x, head, 100)
    for a, b in zip(g_chunked, g_direct):
        assert err_ratio(a, b) < 1e-4


def test_gradient_accumulation_equals_one_batch(tiny, batches):
    cfg, params, _ = tiny
    base = dict(lr=1e-3, steps=10, warmup=0)
    one, two = TrainConfig(**base), TrainConfig(**base, grad_accum=2)
    s1, m1 = make_train_step(cfg, one)(init_state(params, one), batches[0])
    s2, m2 = make_train_step(cfg, two)(init_state(params, two), batches[0])
    assert abs(float(m1["loss"]) - float(m2["loss"])) < 1e-5 and float(m1["tokens"]) == BATCH * SEQ
    assert abs(float(m1["grad_norm"]) - float(m2["grad_norm"])) < 1e-5 * float(m1["grad_norm"])
    # Adam's first moment after one step is (1 - b1) * clipped gradient: the same gradient, up
    # to float32 summation order (two half-batch sums; measured 1.2e-5).
    # (Not the params: Adam's first update lr * g / (|g| + eps) turns float32 rounding of
    # gradients near eps into visible steps.)

    mu1, mu2 = (optax.tree_utils.tree_get(s.opt_state, "mu") for s in (s1, s2))
    for a, b in zip(jax.tree_util.tree_leaves(mu2), jax.tree_util.tree_leaves(mu1)):
        assert err_ratio(a, b) < 1e-4
    with pytest.raises(ValueError, match="not divisible"):
        make_train_step(cfg, TrainConfig(**base, grad_accum=3))(s1, batches[0])


def test_resume_gives_the_same_losses(tiny, batches, tmp_path):
    cfg, params, _ = tiny
    tc = TrainConfig(lr=1e-3, steps=6, warmup=2)
    step = make_train_step(cfg, tc)
    _, straight = fit(step, init_state(params, tc), batches, 6, progress=False)
    state, first = fit(step, init_state(params, tc), batches, 3, progress=False, checkpoint_dir=tmp_path / "state")
    del state  # a new process would have nothing but the checkpoint
    restored, info = restore_state(tmp_path / "state", like=init_state(params, tc))
    assert int(restored.step) == 3 and info["data_position"] == 3
    _, rest = fit(step, restored, batches, 6, progress=False)
    assert [h["loss"] for h in first + rest] == [h["loss"] for h in straight]
    assert [h["step"] for h in first + rest] == list(range(1, 7))


def test_lora_trains_adapters_only_and_merges(tiny, batches, tmp_path):
    cfg, params, _ = tiny
    tc = TrainConfig(lr=1e-2, steps=8, warmup=0, lora_rank=4)
    state = init_state(params, tc)
    assert "layers.0.mixer.in_qkv" in state.params and "layers.3.mixer.q_proj" in state.params
    assert "layers.0.ffn.down" in state.params
    leaves_close(model_params(state, tc), params, 0.0)  # b = 0: the merged model is the base
    before = [np.array(x) for x in jax.tree_util.tree_leaves(params)]
    step = make_train_step(cfg, tc)
    state, hist = fit(step, state, batches, 8, progress=False, checkpoint_dir=tmp_path / "s")
    for x, y in zip(before, jax.tree_util.tree_leaves(params)):  # the base is frozen and intact
        np.testing.assert_array_equal(x, np.asarray(y))
    assert hist[-1]["loss"] < hist[0]["loss"]
    merged = model_params(state, tc)
    assert float(jnp.abs(merged.layers[3].mixer.q_proj - params.layers[3].mixer.q_proj).max()) > 0
    np.testing.assert_array_equal(np.asarray(merged.embed), np.asarray(params.embed))  # not a target
    restored, _ = restore_state(tmp_path / "s", like=init_state(params, tc))
    leaves_close(model_params(restored, tc), merged, 0.0)


def test_bfloat16_compute_keeps_float32_masters(tiny, batches):
    cfg, params, _ = tiny
    f32, bf16 = TrainConfig(lr=1e-3, steps=4, warmup=0), TrainConfig(lr=1e-3, steps=4, warmup=0, compute_dtype="bfloat16")
    _, m32 = make_train_step(cfg, f32)(init_state(params, f32), batches[1])
    s16, m16 = make_train_step(cfg, bf16)(init_state(params, bf16), batches[1])
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(s16.params))
    # bf16 weights and activations: the loss moves by bf16 rounding (~2^-8 relative per op).
    assert abs(float(m16["loss"]) - float(m32["loss"])) < 0.05 * float(m32["loss"])


def test_training_from_scratch_learns_a_text(batches):
    cfg = hybridjax.config_from_dict(TINY_CONFIG)
    from hybridjax.train import fresh_params

    tc = TrainConfig(lr=3e-3, steps=40, warmup=5)
    _, hist = fit(make_train_step(cfg, tc), init_state(fresh_params(cfg, 1), tc), batches, 40, progress=False)
    # From ~ln(128) = 4.85 nats for a random model to a memorised repeating sentence.
    assert hist[0]["loss"] > 4.0 and hist[-1]["loss"] < 1.0, (hist[0]["loss"], hist[-1]["loss"])


# --- data ---------------------------------------------------------------------------------


def test_chat_examples_count_only_assistant_tokens(tiny):
    _, _, tok = tiny
    ex = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                       {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More?"},
                       {"role": "assistant", "content": "No."}]}
    ids, flags = encode_example(tok, ex)
    counted = tok.decode([i for i, f in zip(ids, flags) if f])
    assert counted == "Hello.<|im_end|>\nNo.<|im_end|>\n"
    text_ids, text_flags = encode_example(tok, {"text": "abc"})
    assert text_ids == tok.encode("abc") and text_flags == [1, 1, 1]


def test_batches_are_a_function_of_the_index(batches):
    a, b = batches[5], batches[5]
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    fixed = Batches(batches.ids, batches.flags, BATCH, SEQ, seed=0, shift=False)

    def epoch(b, e):
        return np.concatenate([b[i + e * b.per_epoch]["tokens"] for i in range(b.per_epoch)])

    assert not np.array_equal(epoch(fixed, 0), epoch(fixed, 1))  # reshuffled
    assert sorted(map(tuple, epoch(fixed, 0))) == sorted(map(tuple, epoch(fixed, 1)))  # the same windows
    # Shifted: epoch 0 cuts at offset 0, a later epoch at its own offset, every window of it.
    windows = np.lib.stride_tricks.sliding_window_view(batches.ids, SEQ + 1)
    assert batches.offset(0) == 0 and 0 < batches.offset(1) < SEQ
    for e in (0, 1):
        for row in epoch(batches, e):
            starts = np.flatnonzero(np.all(windows == row, axis=1))
            assert any(s % SEQ == batches.offset(e) for s in starts)
    with pytest.raises(DataError, match="fewer than one batch"):
        Batches(np.zeros(10, np.int32), np.ones(10, np.float32), 4, 32)


def test_bad_data_lines_are_named(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "ok"}\n{"txt": 1}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: expected"):
        read_jsonl(p)
    p.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: invalid JSON"):
        read_jsonl(p)
    p.write_text('{"messages": [{"role": "user"}]}\n')
    with pytest.raises(DataError, match="string 'role' and 'content'"):
        read_jsonl(p)


def test_save_state_keeps_the_data_position(tiny, tmp_path):
    cfg, params, _ = tiny
    tc = TrainConfig(steps=4)
    state = init_state(params, tc).replace(step=jnp.asarray(7, jnp.int32))
    save_state(tmp_path, state, data_position=7, meta={"note": "x"})
    got, info = restore_state(tmp_path, like=init_state(params, tc))
    assert int(got.step) == 7 and info == {"step": 7, "data_position": 7, "note": "x"}


# --- the command ----------------------------------------------------------------------------


def _data(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [{"text": TEXT[:600]}, {"messages": [{"role": "user", "content": "Say fox."},
                                                 {"role": "assistant", "content": "fox " * 30}]}] * 3
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_cli_trains_resumes_and_writes_a_model(tmp_path, capsys):
    from hybridjax.cli import main
    from hybridjax.tokenizer import save_tokenizer

    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps(TINY_CONFIG))
    save_tokenizer(tiny_test_model()[2], cfg_dir)
    out = tmp_path / "run"
    common = ["train", "--config", str(cfg_dir / "config.json"), "--data", str(_data(tmp_path)), "--out", str(out),
              "--batch-size", str(BATCH), "--seq-len", str(SEQ), "--quiet", "--save-every", "2"]
    assert main(common + ["--steps", "3"]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and all(np.isfinite(x["loss"]) for x in lines)
    assert main(common + ["--steps", "3"]) == 1
    assert "already holds a run" in capsys.readouterr().err
    assert main(common + ["--steps", "5", "--resume"]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5]
    assert main(common + ["--steps", "6", "--resume", "--lr", "0.5"]) == 1
    assert "settings differ" in capsys.readouterr().err

    cfg, params = hybridjax.load(out / "model")
    assert cfg.num_hidden_layers == 4 and params.embed.dtype == jnp.float32
    capsys.readouterr()
    assert main(["generate", "--no-compile-cache", "--model", str(out / "model"), "--prompt", "The quick", "--max-new-tokens", "4", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) <= 4
    assert main(["convert", "--to-hf", "--checkpoint", str(out / "model"), "--out", str(tmp_path / "hf"), "--quiet"]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()


def test_cli_lora_on_an_hf_model_merges(hf_dirs, loaded, tmp_path):
    from hybridjax.cli import main
    from hybridjax.tokenizer import byte_level_tokenizer, save_tokenizer

    src = tmp_path / "hf"
    shutil.copytree(hf_dirs["qwen3_5_dense"], src)
    save_tokenizer(byte_level_tokenizer(), src)  # 259 tokens <= the model's 272
    out = tmp_path / "run"
    assert main(["train", "--model", str(src), "--data", str(_data(tmp_path)), "--out", str(out), "--steps", "2",
                 "--batch-size", "2", "--seq-len", "16", "--lora-rank", "2", "--quiet"]) == 0
    _, base = loaded["qwen3_5_dense"]
    _, tuned = hybridjax.load(out / "model")
    changed = float(jnp.abs(tuned.layers[0].mixer.in_qkv - base.layers[0].mixer.in_qkv).max())
    assert changed > 0  # adapters merged into the weights
    np.testing.assert_array_equal(np.asarray(tuned.embed), np.asarray(base.embed))
