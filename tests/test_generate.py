"""Generation: greedy parity with transformers, cache reuse, sampling, streaming, chat
template, and the `hybridjax generate` CLI."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # checks against transformers: skipped without torch

import hybridjax
from hybridjax.generate import generate, stream
from hybridjax.sampling import filter_logits, sampling_params
from hybridjax.tokenizer import StreamDecoder, Tokenizer, byte_level_tokenizer, save_tokenizer

NEW = 32


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts_for(cfg, lengths, seed):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, cfg.vocab_size, n).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["qwen3_next_moe", "qwen3_5_dense", "qwen3_5_multimodal", "qwen3_5_moe"])
def test_greedy_batch_equals_transformers(arch, loaded, torch_models):
    """A batch of ragged prompts, greedy, 32 new tokens: every row equals transformers'
    greedy generate on that prompt alone, token for token."""
    cfg, params = loaded[arch]
    prompts = prompts_for(cfg, [5, 17, 1], seed=10)
    ours = generate(params, cfg, prompts, max_new_tokens=NEW).token_lists()
    for row, prompt in enumerate(prompts):
        assert ours[row] == hf_greedy(torch_models[arch], prompt, NEW), (arch, row)


def test_generate_from_kept_cache_equals_scratch_and_keeps_it(loaded):
    cfg, params = loaded["qwen3_next_moe"]
    prefix, suffix = prompts_for(cfg, [23, 6], seed=11)
    g0 = generate(params, cfg, [prefix], max_new_tokens=4, max_len=128)
    kept = g0.cache  # prefix + 4 generated tokens
    before = [np.array(x) for x in jax.tree_util.tree_leaves(kept)]
    history = prefix + g0.token_lists()[0]
    warm = generate(params, cfg, [suffix], max_new_tokens=20, cache=kept).token_lists()
    again = generate(params, cfg, [suffix[:3]], max_new_tokens=20, cache=kept).token_lists()
    assert warm == generate(params, cfg, [history + suffix], max_new_tokens=20).token_lists()
    assert again == generate(params, cfg, [history + suffix[:3]], max_new_tokens=20).token_lists()
    for x, y in zip(before, jax.tree_util.tree_leaves(kept)):  # the kept cache is intact and usable
        np.testing.assert_array_equal(x, np.asarray(y))


def test_stop_ids_and_per_row_max_tokens(loaded):
    cfg, params = loaded["qwen3_5_dense"]
    prompts = prompts_for(cfg, [4, 9], seed=12)
    free = generate(params, cfg, prompts, max_new_tokens=12).token_lists()
    stop = free[0][5]
    got = generate(params, cfg, prompts, max_new_tokens=[12, 3], stop_ids=[stop])
    first = free[0].index(stop)
    assert got.token_lists()[0] == free[0][: first + 1]  # stops at (and keeps) the stop token
    assert got.token_lists()[1] == free[1][: min(3, free[1].index(stop) + 1 if stop in free[1] else 3)]
    assert list(np.asarray(got.cache.lengths)) == [4 + first + 1, 9 + len(got.token_lists()[1])]


def test_stream_equals_generate(loaded):
    cfg, params = loaded["qwen3_5_dense"]
    prompt = prompts_for(cfg, [9], seed=13)[0]
    expect = generate(params, cfg, [prompt], max_new_tokens=10).token_lists()[0]
    assert list(stream(params, cfg, prompt, max_new_tokens=10)) == expect
    sp = sampling_params(1, temperature=0.9, top_k=20)
    a = list(stream(params, cfg, prompt, max_new_tokens=10, seed=5, sampling=sp))
    b = generate(params, cfg, [prompt], max_new_tokens=10, seeds=[5], sampling=sp).token_lists()[0]
    assert a == b


def test_sampling_is_seeded_per_row_and_topk1_is_greedy(loaded):
    cfg, params = loaded["qwen3_5_multimodal"]
    prompts = prompts_for(cfg, [6, 6, 6], seed=14)
    sp = sampling_params(3, temperature=[1.0, 1.0, 1.0], top_k=[0, 1, 0])
    run = lambda seeds: generate(params, cfg, prompts, max_new_tokens=16, seeds=seeds, sampling=sp).token_lists()  # noqa: E731
    a, b, c = run([1, 2, 3]), run([1, 2, 3]), run([4, 2, 3])
    assert a == b  # same seeds, same output
    assert a[0] != c[0] and a[1:] == c[1:]  # a row's draws depend on its own seed only
    greedy = generate(params, cfg, prompts, max_new_tokens=16).token_lists()
    assert a[1] == greedy[1]  # top-k = 1 is greedy
    alone = generate(params, cfg, [prompts[2]], max_new_tokens=16, seeds=[3],
                     sampling=sampling_params(1, temperature=1.0)).token_lists()
    assert alone[0] == a[2]  # independent of the rest of the batch


def test_filters_mask_what_they_should():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    kept = lambda **kw: np.isfinite(np.asarray(filter_logits(logits, sampling_params(2, temperature=1.0, **kw))))  # noqa: E731
    np.testing.assert_array_equal(kept(top_p=0.7)[0], [True, True, False, False])  # 0.5 < 0.7 <= 0.8
    np.testing.assert_array_equal(kept(top_p=0.5)[0], [True, False, False, False])
    np.testing.assert_array_equal(kept(top_k=2)[0], [True, True, False, False])
    np.testing.assert_array_equal(kept(min_p=0.5)[0], [True, True, False, False])  # >= 0.25
    assert kept(top_p=0.9, top_k=3).sum() == 3 + 4  # row 1: all four tie at the threshold, all kept
    assert kept().all()


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=2.0), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(temperature=float("nan")), "temperature"),
])
def test_invalid_sampling_parameters_are_named(kw, field):
    with pytest.raises(ValueError, match=f"invalid sampling parameter '{field}'"):
        sampling_params(1, **kw)


def test_stream_decoder_never_splits_utf8():
    tok = byte_level_tokenizer()
    text = "héllo 世界 🙂 ok"
    dec = StreamDecoder(tok)
    deltas = [dec.push(t) for t in tok.encode(text)] + [dec.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[tok.encode(text).index(0xE4)] == ""  # first byte of 世 alone emits nothing


CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  "},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "ça va? 世界"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
]


@pytest.mark.parametrize("template", ["chatml", "tojson"])
def test_chat_template_matches_transformers(tmp_path, template):
    from transformers import AutoTokenizer

    source = None if template == "chatml" else (
        "{% for m in messages %}{{ m | tojson }}{% if not loop.last %}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ eos_token }}{% endif %}")
    tok = byte_level_tokenizer(source) if source else byte_level_tokenizer()
    save_tokenizer(tok, tmp_path)
    ours, theirs = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for chat in CHATS:
        for gen in (True, False):
            expect = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours.render_chat(chat, add_generation_prompt=gen) == expect
            assert ours.encode(expect) == theirs.encode(expect, add_special_tokens=False)


def test_chat_template_errors(tmp_path):
    tok = byte_level_tokenizer()
    with pytest.raises(ValueError, match="Unknown role: robot"):
        tok.render_chat([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[0\] must be an object with a 'role'"):
        tok.render_chat(["hi"])


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory, hf_dirs):
    d = tmp_path_factory.mktemp("cli") / "model"
    shutil.copytree(hf_dirs["qwen3_5_dense"], d)
    save_tokenizer(byte_level_tokenizer(), d)
    return d


def test_cli_generate_json(cli_model, capsys, loaded):
    from hybridjax.cli import main

    assert main(["generate", "--no-compile-cache", "--model", str(cli_model), "--prompt", "Hi there", "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg, params = loaded["qwen3_5_dense"]
    tok = Tokenizer.from_dir(cli_model)
    assert out["prompt_token_ids"] == tok.encode("Hi there")
    expect = generate(params, cfg, [out["prompt_token_ids"]], max_new_tokens=6, stop_ids=tok.eos_token_ids).token_lists()[0]
    assert out["token_ids"] == expect and out["text"] == tok.decode(expect, skip_special_tokens=True)

    msgs = cli_model.parent / "msgs.json"
    msgs.write_text(json.dumps(CHATS[1]))
    assert main(["generate", "--no-compile-cache", "--model", str(cli_model), "--messages", str(msgs), "--max-new-tokens", "3", "--json", "--stream"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_token_ids"] == tok.encode_chat(CHATS[1]) and len(out["token_ids"]) <= 3


def test_cli_errors_are_one_line(cli_model, tmp_path, capsys):
    from hybridjax.cli import main

    assert main(["generate", "--no-compile-cache", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model directory not found" in err
    assert main(["generate", "--no-compile-cache", "--model", str(cli_model), "--token-ids", "1,99999"]) == 1
    assert "token id 99999 is outside the vocabulary" in capsys.readouterr().err
    assert main(["generate", "--no-compile-cache", "--model", str(cli_model), "--prompt", "x", "--top-p", "0"]) == 1
    assert "invalid sampling parameter 'top_p'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["generate", "--no-compile-cache", "--token-ids", "a,b"])
    assert e.value.code == 2


def test_cli_default_model_runs(capsys):
    from hybridjax.cli import main
    from hybridjax.default_model import default_model

    assert main(["generate", "--no-compile-cache", "--prompt", "Hello", "--max-new-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    tok = default_model()[2]
    assert out["prompt_token_ids"] == tok.encode("Hello") and 1 <= len(out["token_ids"]) <= 5
    assert out["text"] == tok.decode(out["token_ids"], skip_special_tokens=True)


def test_cli_dtype_and_packing_reach_the_default_model(capsys):
    """--dtype is honoured for the embedded default (it was loaded as float32 whatever was asked),
    and --pack-for-decode hands generate the packed params the library makes: same tokens as the
    library's call on them (one code path, so equal exactly)."""
    from hybridjax import cpu_kernels
    from hybridjax.cli import main
    from hybridjax.default_model import default_model

    cfg, params, tok = default_model("bfloat16")
    assert params.embed.dtype == jnp.bfloat16
    prompt = tok.encode("Hello")
    for flags, p in (([], params), (["--pack-for-decode"], cpu_kernels.pack_params(params))):
        args = ["generate", "--no-compile-cache", "--dtype", "bfloat16", "--prompt", "Hello", "--max-new-tokens", "5", "--json"]
        assert main(args + flags) == 0
        expect = generate(p, cfg, [prompt], max_new_tokens=5, stop_ids=tok.eos_token_ids).token_lists()[0]
        assert json.loads(capsys.readouterr().out)["token_ids"] == expect
    assert main(["generate", "--no-compile-cache", "--pack-for-decode", "--mesh", "1", "--prompt", "x"]) == 1
    assert "--pack-for-decode runs on one device" in capsys.readouterr().err


def test_donation_rule(loaded):
    """Only `..._donating` functions donate; `stream` from a kept cache leaves it intact."""
    from hybridjax.generate import decode_step, decode_step_donating, prefill

    cfg, params = loaded["qwen3_5_dense"]
    prompt = prompts_for(cfg, [7], seed=15)[0]
    _, kept = prefill(params, np.array([prompt]), hybridjax.init_cache(cfg, 1, 64), cfg)
    before = [np.array(x) for x in jax.tree_util.tree_leaves(kept)]
    tok = jnp.array([3], jnp.int32)
    _, fresh = decode_step(params, tok, kept, cfg)  # no donation: kept stays alive
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(kept))
    list(stream(params, cfg, [5, 6], max_new_tokens=4, cache=kept))  # first step from a snapshot
    for x, y in zip(before, jax.tree_util.tree_leaves(kept)):
        np.testing.assert_array_equal(x, np.asarray(y))
    _, _ = decode_step_donating(params, tok, fresh, cfg)  # fresh is held by nobody: donated
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(fresh.layers))


def test_scoring_in_pieces_equals_one_forward():
    """`score_in_pieces` (the engine's echo + logprobs) against `prompt_logprobs` (one forward over
    the padded prompt): pieces of 64 and 8 tokens, the last one padded, keys on two pages of the
    scoring cache, a repetition penalty whose record of seen tokens crosses pieces; then a second
    prompt on the cache the first returned (a piece at position 0 empties it). Within 1e-4: the
    pieces cut the delta rule's chunks elsewhere, so float32 sums run in another order (measured
    ~4e-6); a wrong seen set or state moves log-probabilities by 1e-1 and more."""
    from hybridjax.default_model import tiny_test_model
    from hybridjax.generate import (SCORE_PAGE, _score_piece, prompt_logprobs, score_cache, score_in_pieces,
                                    score_list, score_piece_inputs)

    cfg, params, tok = tiny_test_model()
    capacity = 2 * SCORE_PAGE
    signatures = set()  # (width, how each argument is held): one per program, the first piece's too

    def recorded(scorer):  # (a second signature's first call takes JAX's slow path: 10-15 ms an echo)
        def call(*args):
            held = tuple((type(x).__name__, getattr(x, "committed", None)) for x in jax.tree_util.tree_leaves(args[1:]))
            signatures.add((len(args[2]), held))
            return scorer(*args)
        return call

    scorers = {w: recorded(_score_piece.lower(params, *score_piece_inputs(params, cfg, w, capacity), cfg=cfg).compile())
               for w in (8, 64)}
    cache = score_cache(cfg, capacity, params.embed.dtype)
    sp = sampling_params(1, temperature=0.7, repetition_penalty=1.3)
    # pieces 64 x 4, 8 x 7, 8 (6 real); then 8, 8, 8 (6 real)
    for text in ("abc abc abc, then abc again. " * 11, "another prompt: xyz xyz"):
        ids = tok.encode(text)
        want = prompt_logprobs(params, ids, cfg, sp, top=3)
        arrays, cache = score_in_pieces(params, cfg, ids, sp, scorers, cache)
        got = score_list(*arrays, len(ids), 3)
        assert len(got) == len(want) == len(ids) - 1
        assert max(abs(g[0] - w[0]) for g, w in zip(got, want)) < 1e-4
        for (_, g_alts), (_, w_alts) in zip(got, want):
            assert max(abs(a[1] - b[1]) for a, b in zip(g_alts, w_alts)) < 1e-4
    assert sorted(w for w, _ in signatures) == [8, 64]
