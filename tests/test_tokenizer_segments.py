"""Tokenizer.encode through the segment cache (tokenizer.SegmentCache) gives exactly the ids of a
plain full encode: on bench_agent's transcripts with the default model's tokenizer and the
Qwen3.5-style template, cut at random points (inside special tokens too), and on random texts
over alphabets full of added-token fragments, for tokenizers with and without a normalizer,
with overlapping added tokens, and with tokens the cache must leave to the backend."""

import random
import sys
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers

from hybridjax.default_model import default_model
from hybridjax.tokenizer import SegmentCache, Tokenizer, added_token_splitter, byte_level_backend, char_level_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_agent import TOOLS, reasoning_dropping_template, trace  # noqa: E402

QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def plain(backend, text):
    return backend.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def agent_tok():
    _, _, tok0 = default_model()
    return Tokenizer(tok0.backend, reasoning_dropping_template(), tok0.special_tokens, tok0.eos_token_ids)


def test_agent_transcripts_at_random_cuts(agent_tok):
    rng = random.Random(0)
    for seed in range(4):
        for messages in trace(seed, 12, (20, 300), agent_tok):
            text = agent_tok.render_chat(messages, tools=TOOLS)
            assert agent_tok.encode(text) == plain(agent_tok.backend, text)
            for k in [rng.randrange(len(text) + 1) for _ in range(6)]:
                assert agent_tok.encode(text[:k]) == plain(agent_tok.backend, text[:k])
                assert agent_tok.encode(text[k:]) == plain(agent_tok.backend, text[k:])
    assert agent_tok._segments._ids  # the transcripts went through the cache


def test_history_renderings_hit_the_cache(agent_tok):
    """Each turn resends the transcript: after the first, only its new segments are encoded (the
    newest tool result, and the previous assistant turn, whose reasoning the template now drops)."""
    requests = trace(9, 6, (100, 200), agent_tok)
    agent_tok.encode(agent_tok.render_chat(requests[-2], tools=TOOLS))
    calls = []
    backend = agent_tok.backend

    class Counting:  # the backend, counting the characters it is asked to encode
        def __getattr__(self, name):
            return getattr(backend, name)

        def encode(self, text, **k):
            calls.append(len(text))
            return backend.encode(text, **k)

    text = agent_tok.render_chat(requests[-1], tools=TOOLS)
    ids = agent_tok._segments.encode(Counting(), text)
    assert ids == plain(backend, text)
    assert len(calls) == 2 and sum(calls) < len(requests[-1][-1]["content"]) + 128 < len(text) / 4


def qwen_like(extra: list[AddedToken], normalizer=True):
    """Byte-level BPE with Qwen2/3's pre-tokenizer and NFC normalizer, ChatML specials, and `extra`."""
    b = byte_level_backend()
    if normalizer:
        b.normalizer = normalizers.NFC()
    b.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    b.add_tokens(extra)
    return b


def _tok(content, **k):
    return AddedToken(content, special=False, normalized=k.pop("normalized", False), **k)


BACKENDS = {
    "default": lambda: default_model()[2].backend,
    "byte_level": byte_level_backend,
    "char_level": lambda: char_level_tokenizer().backend,
    # Qwen3-style: non-special added tokens that overlap (leftmost-longest decides), NFC normalizer
    "qwen_like": lambda: qwen_like([_tok("<think>"), _tok("</think>"), _tok("<tool_call>"), _tok("xy"),
                                    _tok("xyz"), _tok("yzw"), _tok("<tool")]),
    # no normalizer: tokens matched in a second pass after the non-normalized ones
    "two_pass": lambda: qwen_like([_tok("xy"), _tok("yzw", normalized=True), _tok("zw", normalized=True),
                                   _tok("<tool_call>")], normalizer=False),
}
FRAGMENTS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "end|>", "<|", "|>", "<think>", "</think>",
             "<tool_call>", "<tool", "x", "y", "z", "w", "xy", "yz", "zw", "\n", "\n\n", " ", "  ", "\t", "a", "Ab",
             "123", "é", "e\u0301", "ﬁ", "😀", "中文", "'s", "def f(x):", "\r\n"]


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_random_texts(name):
    backend = BACKENDS[name]()
    assert added_token_splitter(backend) is not None  # these all take the segment path
    cache = SegmentCache(max_tokens=4096)
    rng = random.Random(name)
    texts = ["", *FRAGMENTS]
    for _ in range(400):
        texts.append("".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 40))))
    for _ in range(300):  # resent texts with a changed tail, as a chat
        t = rng.choice(texts)
        texts.append(t[: rng.randrange(len(t) + 1)] + "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 9))))
    for t in texts:
        assert cache.encode(backend, t) == plain(backend, t), repr(t)
    assert cache._tokens <= cache.max_tokens


@pytest.mark.parametrize("token", [_tok("<x>", lstrip=True), _tok("<x>", rstrip=True), _tok("xy", single_word=True),
                                   _tok("xy", normalized=True)])
def test_tokens_that_are_no_plain_cut_leave_the_text_to_the_backend(token):
    backend = qwen_like([token])
    assert added_token_splitter(backend) is None
    cache = SegmentCache()
    for t in ["a <x> b", "  <x>  ", "xy axy xyb", "<|im_start|> xy <x>\n"]:
        assert cache.encode(backend, t) == plain(backend, t)
    assert not cache._ids


def test_a_token_added_later_is_honoured():
    backend = byte_level_backend()
    tok = Tokenizer(backend, None, {}, [])
    text = "<|im_start|>user\nhello <new> world<|im_end|>"
    assert tok.encode(text) == plain(backend, text)
    backend.add_tokens([_tok("<new>")])
    assert tok.encode(text) == plain(backend, text)
    assert backend.token_to_id("<new>") in tok.encode(text)


def test_the_cache_is_bounded():
    backend = byte_level_backend()
    cache = SegmentCache(max_tokens=100, max_piece_tokens=30)
    for i in range(200):
        t = f"<|im_start|>user\nmessage {i}<|im_end|>" + "x" * (i % 50)
        assert cache.encode(backend, t) == plain(backend, t)
        assert cache._tokens <= 100
    assert all(len(ids) <= 30 for ids in cache._ids.values())



def test_scopes_do_not_share_segments(agent_tok):
    """The server encodes in the request's cache namespace: a text one client sent is not a
    (faster) hit for another, whose request's timing could otherwise tell it was sent."""
    backend = agent_tok.backend
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(backend, name)

        def encode(self, text, **k):
            calls.append(text)
            return backend.encode(text, **k)

    cache = SegmentCache()
    text = "<|im_start|>user\nthe same document<|im_end|>\n"
    assert cache.encode(Counting(), text, "key-a:") == plain(backend, text)
    n = len(calls)
    assert cache.encode(Counting(), text, "key-a:") == plain(backend, text) and len(calls) == n  # a hit
    assert cache.encode(Counting(), text, "key-b:") == plain(backend, text) and len(calls) == 2 * n  # not one
    scoped = agent_tok.scoped("key-c:")
    assert scoped.encode(text) == agent_tok.encode(text, scope="key-c:") == plain(backend, text)
    assert ("key-c:", "user\nthe same document") in agent_tok._segments._ids
