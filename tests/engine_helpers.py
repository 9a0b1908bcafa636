"""Shared by the engine tests: one engine configuration (so every engine shares the compiled
programs), the cold path (`generate` from scratch) and small request helpers.

All shapes are pinned: every prompt is 17..32 tokens (one or two prefill chunks of 16/32
tokens, pages of 16), and the cold path always asks for the same 16 new tokens (greedy tokens
of a shorter request are a prefix of those).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hybridjax.config import config_from_dict
from hybridjax.default_model import TINY_CONFIG, tiny_test_model
from hybridjax.engine import Engine, GenerationRequest
from hybridjax.generate import generate
from hybridjax.params import init_params
from hybridjax.sampling import sampling_params

SLOTS, MAX_LEN, COLD_NEW = 4, 256, 16
TIMEOUT = 300  # seconds for one request (the first ones include compilation)
# Small pages and prefill chunks, so that prompts of 17..32 tokens span pages and chunks.
ENGINE_KW = dict(slots=SLOTS, max_len=MAX_LEN, page_size=16, prefill_chunk=32)


def enc(text: str) -> list[int]:
    return tiny_test_model()[2].encode(text)


def ids(text: str) -> list[int]:
    """A prompt in the one prefill bucket the tests use (byte-level: one token per byte)."""
    p = enc(text)
    assert 17 <= len(p) <= 32, (text, len(p))
    return p


@functools.lru_cache(maxsize=None)
def _cold(prompt: tuple, seed: int, temperature: float) -> tuple:
    cfg, params, _ = tiny_test_model()
    sp = sampling_params(1, temperature=temperature)
    g = generate(params, cfg, [list(prompt)], max_new_tokens=COLD_NEW, max_len=MAX_LEN, seeds=[seed], sampling=sp,
                 stop_ids=())  # no stop: the engine tests ask for every token
    return tuple(g.token_lists()[0])


def cold(prompt, n: int, *, seed: int = 0, temperature: float = 0.0) -> list[int]:
    """The first n tokens `hybridjax.generate.generate` gives for `prompt` alone, from scratch."""
    assert n <= COLD_NEW and len(prompt) <= 32
    return list(_cold(tuple(prompt), seed, temperature)[:n])


def collect(handle, timeout: float = TIMEOUT):
    """Drain a handle's events, check they agree with the handle, return the handle."""
    events = list(handle.events(timeout=timeout))
    assert events[-1].finish_reason is not None and events[-1].token_id is None
    assert all(e.finish_reason is None for e in events[:-1])
    assert [e.token_id for e in events[:-1]] == handle.token_ids
    assert "".join(e.text for e in events) == handle.text
    assert handle.finish_reason == events[-1].finish_reason
    return handle


def run(eng: Engine, prompt, max_tokens: int, **kw):
    return collect(eng.submit(GenerationRequest(list(prompt), max_tokens=max_tokens, **kw)))


def serve_cold_checked(eng: Engine, prompts, max_tokens: int) -> None:
    """Start `eng`, answer each prompt (each answer must equal the cold path's), stop it."""
    eng.start()
    try:
        for p in prompts:
            assert run(eng, p, max_tokens).token_ids == cold(p, max_tokens)
    finally:
        eng.stop()


def prefilled(eng: Engine) -> int:
    return eng.store.counters["tokens_prefilled"]


def covered(handle) -> int:
    """How many of a finished response's tokens its snapshot covers: all when a stop token ended
    it (a dispatched step feeds that token), all but the last when max_tokens did (no step is
    spent feeding a token nobody needs yet: the next request would wait for it)."""
    return len(handle.token_ids) - (handle.finish_reason == "length")


def _quiet(layer, c):
    m, f = layer.mixer, layer.ffn
    m = m.replace(o_proj=m.o_proj * c) if hasattr(m, "o_proj") else m.replace(out_proj=m.out_proj * c)
    return layer.replace(mixer=m, ffn=f.replace(down=f.down * c))


def speculative_test_model(vocab: int, scale: float, head_scale: float = 1.0):
    """(cfg, params) of the tiny model built to accept drafts often: every layer's residual
    writes scaled by `scale` (so the next token depends mostly on the current one), and an MTP
    head that reads only the token embedding; `head_scale` scales the head's logits (through its
    (1 + w) final norm). No stop id lies in the vocabulary."""
    cfg = config_from_dict(dict(TINY_CONFIG, vocab_size=vocab, eos_token_id=127))
    params = init_params(jax.random.PRNGKey(0), cfg, mtp=True)
    d = cfg.hidden_size
    fc = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0).astype(params.mtp.fc.dtype)  # [2D, D]: embedding only
    mtp = params.mtp.replace(fc=fc, layer=_quiet(params.mtp.layer, scale))
    if head_scale != 1.0:
        mtp = mtp.replace(norm=(mtp.norm + 1) * head_scale - 1)
    return cfg, params.replace(layers=tuple(_quiet(layer, scale) for layer in params.layers), mtp=mtp)
