"""The jit boundaries: prefill, decode step, whole-call generate, a streaming iterator, and the
log-probabilities of a prompt's own tokens.

Donation rule (docs/architecture.md): only functions named `..._donating` donate the cache, and only a
cache no snapshot holds may be passed to them. `prefill`, `decode_step` and `generate` never
donate, so a kept cache stays usable; `stream` runs its first step without donation and
donates from then on (each later cache is its own fresh value).

Shapes that would otherwise vary per call are bucketed so that jit does not retrace: prompt
lengths pad to powers of two (>= 16), `generate`'s output buffer to powers of two (>= 16),
and KV capacity grows in buckets (`cache.reserve`).
"""

from __future__ import annotations

import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybridjax import cache as cache_lib
from hybridjax import compile_cache, ops, pytree
from hybridjax.cache import Cache, GDNState, KVState, PagedKV, reserve
from hybridjax.config import Config
from hybridjax.model import forward, forward_hidden, lm_logits
from hybridjax.params import Params
from hybridjax.sampling import (Sampler, SamplingParams, init_sampler, logprobs_of, next_token,  # noqa: F401  (re-exported)
                                sampling_params)
from hybridjax.sharding import init_cache
from hybridjax.speculative import check_speculative, generate_speculative

Array = jax.Array

MIN_BUCKET = 16


def length_bucket(n: int) -> int:
    """Smallest power of two >= n, at least MIN_BUCKET."""
    b = MIN_BUCKET
    while b < n:
        b *= 2
    return b


def pad_prompts(prompts: Sequence[Sequence[int]], bucket: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists into int32 [B, T] (T a bucket) and their counts [B]."""
    counts = np.array([len(p) for p in prompts], np.int32)
    width = bucket or length_bucket(int(counts.max(initial=1)))
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = p
    return tokens, counts


def host_value(x) -> np.ndarray:
    """x as a numpy array, gathered from every process when it spans several (multi-host meshes)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# --- jitted steps ----------------------------------------------------------------------


def _prefill(params, tokens, counts, cache, cfg):
    logits, cache = forward(params, tokens, cache, cfg, token_counts=counts, last_logits_only=True)
    return logits[:, 0], cache


def _decode(params, tokens, active, cache, cfg):
    logits, cache = forward(params, tokens[:, None], cache, cfg, token_counts=active.astype(jnp.int32))
    return logits[:, 0], cache


_prefill_jit = jax.jit(_prefill, static_argnames="cfg")
_prefill_donating_jit = jax.jit(_prefill, static_argnames="cfg", donate_argnames="cache")
_decode_jit = jax.jit(_decode, static_argnames="cfg")
_decode_donating_jit = jax.jit(_decode, static_argnames="cfg", donate_argnames="cache")
_next_token_jit = jax.jit(next_token)


def _prepare_prefill(tokens, counts, cache):
    tokens = np.asarray(tokens, np.int32)
    counts = np.full((tokens.shape[0],), tokens.shape[1], np.int32) if counts is None else np.asarray(counts, np.int32)
    return tokens, counts, reserve(cache, counts)


def prefill(params: Params, tokens, cache: Cache, cfg: Config, counts=None) -> tuple[Array, Cache]:
    """Run right-padded prompts tokens [B, T] (counts [B] real tokens each) from `cache`.

    Returns (logits after each row's last real token [B, vocab], new cache). Never donates.
    """
    tokens, counts, cache = _prepare_prefill(tokens, counts, cache)
    return _prefill_jit(params, tokens, counts, cache, cfg)


def prefill_donating(params: Params, tokens, cache: Cache, cfg: Config, counts=None) -> tuple[Array, Cache]:
    """`prefill` that donates `cache` (which must be held by no snapshot)."""
    tokens, counts, cache = _prepare_prefill(tokens, counts, cache)
    return _prefill_donating_jit(params, tokens, counts, cache, cfg)


def decode_step(params: Params, tokens, cache: Cache, cfg: Config, active=None) -> tuple[Array, Cache]:
    """One token per row, tokens [B]; rows with active False keep their state. Never donates."""
    tokens = jnp.asarray(tokens, jnp.int32)
    active = jnp.ones(tokens.shape, bool) if active is None else jnp.asarray(active, bool)
    return _decode_jit(params, tokens, active, reserve(cache, 1), cfg)


def decode_step_donating(params: Params, tokens, cache: Cache, cfg: Config, active=None) -> tuple[Array, Cache]:
    """`decode_step` that donates `cache` (held by no snapshot)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    active = jnp.ones(tokens.shape, bool) if active is None else jnp.asarray(active, bool)
    return _decode_donating_jit(params, tokens, active, reserve(cache, 1), cfg)


# --- a prompt's own log-probabilities ----------------------------------------------------

SCORE_CHUNK = 256  # positions whose vocabulary-wide logits exist at once
MAX_SCORE_TOP = 20  # alternatives computed per position (callers take fewer)


def _score_positions(params, x, tokens, nxt, seen, sp, cfg, chunk):
    """The head's part of scoring: x [T, D] the hidden states after tokens [T]; position i scores
    nxt[i] with the sampler's processing (`logprobs_of`): the tokens so far (`seen` [vocab], those
    before this piece, then tokens[: i + 1]) count as seen for the repetition penalty; the
    output-only penalties see no output. `chunk` positions at a time. Returns seen after the T
    tokens and ([T], [T, k] ids, [T, k])."""
    t, vocab = tokens.shape[0], cfg.vocab_size
    c = min(chunk, t)  # both powers of two: c divides t
    chunks = (x.reshape(t // c, c, -1), tokens.reshape(t // c, c), nxt.reshape(t // c, c))
    rows_sp = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (c,)), sp)

    def step(seen, xs):
        xc, tc, nc = xs  # [C, D], [C], [C]
        here = tc[:, None] == jnp.arange(vocab)[None]  # [C, vocab]
        seen_c = seen[None] | jax.lax.associative_scan(jnp.logical_or, here, axis=0)
        lp = logprobs_of(lm_logits(params, xc), rows_sp, seen_c, jnp.zeros((1, vocab), jnp.int32))
        top_lp, top_ids = jax.lax.top_k(lp, min(MAX_SCORE_TOP, vocab))
        return seen_c[-1], (jnp.take_along_axis(lp, nc[:, None], axis=-1)[:, 0], top_ids, top_lp)

    seen, (lp, top_ids, top_lp) = jax.lax.scan(step, seen, chunks)
    return seen, (lp.reshape(t), top_ids.reshape(t, -1), top_lp.reshape(t, -1))


@functools.partial(jax.jit, static_argnames=("cfg", "chunk"))
def _prompt_logprobs(params, tokens, cache, sp, cfg, chunk):
    """tokens [T] (T a bucket, right-padded), scored in one forward. Returns ([T], [T, k] ids, [T, k])."""
    x, _ = forward_hidden(params, tokens[None], cache, cfg)
    nxt = jnp.concatenate([tokens[1:], tokens[:1]])
    return _score_positions(params, x[0], tokens, nxt, jnp.zeros((cfg.vocab_size,), bool), sp, cfg, chunk)[1]


@compile_cache.jit(static_argnames=("cfg",), donate_argnames=("cache",))  # kept by the engine as an executable
def _score_piece(params, cache, tokens, nxt, count, start, seen, sp, cfg):
    """One piece of a prompt scored in pieces (`score_in_pieces`): tokens [C] (`count` real, then
    padding) are the prompt's tokens from position `start`, nxt [C] the token after each, `seen`
    [vocab] the tokens before `start`. `cache`: `score_cache`, holding the whole prompt, emptied
    here when start is 0 (its KV past a query's position is never visible, so only the recurrent
    state and the length need clearing). Returns ([C], [C, k] ids, [C, k]), the cache
    after the piece, and seen after it."""
    fresh = start == 0
    layers = tuple(jax.tree_util.tree_map(lambda a: jnp.where(fresh, jnp.zeros_like(a), a), s)
                   if isinstance(s, GDNState) else s for s in cache.layers)
    cache = cache.replace(layers=layers, lengths=jnp.full_like(cache.lengths, start))
    x, cache = forward_hidden(params, tokens[None], cache, cfg, token_counts=count[None])
    seen, scores = _score_positions(params, x[0], tokens, nxt, seen, sp, cfg, min(SCORE_CHUNK, tokens.shape[0]))
    return scores, cache, seen


SCORE_PAGE = 256  # tokens per page of the scoring cache: one page per step of the paged attention's loop


def score_cache(cfg: Config, capacity: int, dtype, zeros=jnp.zeros) -> Cache:
    """An empty one-row cache for `_score_piece`: the recurrent state, and KV as pages in order, so
    that attention reads up to the prompt's last position (paged attention's loop) where a plain
    buffer would be read whole, its capacity (max_len) for every 16-token piece. `zeros=np.zeros`:
    host arrays (`cache.init_cache`)."""
    cache = cache_lib.init_cache(cfg, 1, capacity, dtype, zeros=zeros)  # KV: a small plain buffer, replaced
    pages = -(-capacity // SCORE_PAGE)
    table = zeros((1, pages), np.int32) + np.arange(pages, dtype=np.int32)

    def paged(state):
        if not isinstance(state, KVState):
            return state
        shape, pool = (pages, SCORE_PAGE) + state.k.shape[2:], ops.pool_dtype(state.k.dtype)  # (bits: `ops.pool_dtype`)
        return PagedKV(k=zeros(shape, pool), v=zeros(shape, pool), table=table)

    return cache.replace(layers=tuple(map(paged, cache.layers)))


def score_piece_inputs(params: Params, cfg: Config, width: int, capacity: int):
    """Abstract arguments of `_score_piece` (all but params) for pieces of `width` tokens and a
    cache of `capacity` positions (`score_cache`)."""
    cache = jax.eval_shape(lambda: score_cache(cfg, capacity, params.embed.dtype))
    sp = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), sampling_params(1))
    ints = jax.ShapeDtypeStruct((width,), np.int32)
    one = jax.ShapeDtypeStruct((), np.int32)
    return cache, ints, ints, one, one, jax.ShapeDtypeStruct((cfg.vocab_size,), np.bool_), sp


def score_in_pieces(params: Params, cfg: Config, prompt_ids: Sequence[int], sp, scorers: dict, cache: Cache):
    """The scores `prompt_logprobs` returns, from compiled `_score_piece` programs (`scorers`:
    piece width -> executable), called one after another: each piece is the widest that the
    prompt's rest fills, the last the narrowest that holds what remains. `cache`: a `score_cache`
    of capacity >= len(prompt_ids) (donated; the one after the last piece is returned, for reuse).
    Returns ((lp [n-1], ids [n-1, k], top_lp [n-1, k]) as numpy, cache)."""
    ids = np.asarray(prompt_ids, np.int32)
    n, widths = len(ids) - 1, sorted(scorers)  # the last token scores nothing
    # Each piece passes `seen` on as a device array held as the cache is (the engine's: committed to
    # its device): the first piece's is held so too, so that every call has one signature (a new
    # one takes JAX's slow path once: 10-15 ms a call on the default model, the first echoes').
    held = jax.tree_util.tree_leaves(cache)[0]
    seen = jax.device_put(np.zeros((cfg.vocab_size,), bool), held.sharding if getattr(held, "committed", False) else None)
    pieces, start = [], 0
    while start < n:
        rest = n - start
        width = max((w for w in widths if w <= rest), default=None) or min(w for w in widths if w >= rest)
        count = min(width, rest)
        tokens, nxt = np.zeros(width, np.int32), np.zeros(width, np.int32)
        tokens[:count], nxt[:count] = ids[start:start + count], ids[start + 1:start + count + 1]
        out, cache, seen = scorers[width](params, cache, tokens, nxt, np.int32(count), np.int32(start), seen, sp)
        pieces.append((out, count))
        start += count
    parts = [[host_value(a)[:count] for a in out] for out, count in pieces]
    return tuple(np.concatenate(p) for p in zip(*parts)), cache


def prompt_logprobs(params: Params, prompt_ids: Sequence[int], cfg: Config, sp: SamplingParams | None = None,
                    top: int = 0, chunk: int = SCORE_CHUNK) -> list[tuple[float, tuple]]:
    """For each prompt token after the first: (its log-probability given the tokens before it,
    the `top` most likely (id, logprob), best first), from one forward over the prompt, with the
    logits processed as the sampler's log-probabilities of generated tokens are (`sp`: one row of
    sampling parameters; default greedy, no penalties: the model's own distribution). `chunk`
    (a power of two): positions whose vocabulary-wide logits are computed at once. The prompt is
    padded to its length bucket (padding on the right changes no position's score); the engine
    scores in pieces on programs it keeps instead (`Engine.prompt_logprobs`)."""
    n = len(prompt_ids)
    check_score_top(top)
    if n < 2:
        return []
    tokens, _ = pad_prompts([prompt_ids])
    t = tokens.shape[1]
    cache = init_cache(cfg, 1, t, params.embed.dtype, capacity=t, mesh=params.mesh)
    out = _prompt_logprobs(params, tokens[0], cache, sampling_params(1) if sp is None else sp, cfg, chunk)
    return score_list(*(host_value(a) for a in out), n, top)


def check_score_top(top: int) -> None:
    if not 0 <= top <= MAX_SCORE_TOP:
        raise ValueError(f"prompt_logprobs: top must be in [0, {MAX_SCORE_TOP}], got {top}")


def score_list(lp, ids, top_lp, n: int, top: int) -> list[tuple[float, tuple]]:
    """Scores as `prompt_logprobs` returns them, from its arrays (numpy, >= n - 1 positions)."""
    return [(float(lp[i]), tuple(zip(ids[i, :top].tolist(), top_lp[i, :top].tolist()))) for i in range(n - 1)]


# --- whole-call generate ---------------------------------------------------------------


@pytree.dataclass
class Generation:
    tokens: Array  # [B, N] generated tokens (N a bucket >= max_new_tokens; past n_generated: 0)
    n_generated: Array  # [B]
    cache: Cache  # prompt + every generated token of each row
    logits: Array  # [B, vocab] after each row's last token (what a continuation samples from)
    drafted: Array | None = None  # [B] speculative drafts proposed (None without speculation)
    accepted: Array | None = None  # [B] of which accepted

    def token_lists(self) -> list[list[int]]:
        toks, n = host_value(self.tokens), host_value(self.n_generated)
        return [toks[row, : n[row]].tolist() for row in range(toks.shape[0])]


@functools.partial(jax.jit, static_argnames=("cfg", "out_len"))
def _generate(params, tokens, counts, cache, sampler, stop_ids, max_new, cfg, out_len):
    logits, cache = _prefill(params, tokens, counts, cache, cfg)
    b = tokens.shape[0]
    out = jnp.zeros((b, out_len), jnp.int32)
    done = max_new <= 0

    def cond(c):
        step, *_, done = c
        return (step < out_len) & ~jnp.all(done)

    def body(c):
        step, cache, logits, sampler, out, n_gen, done = c
        tok, sampler = next_token(logits, sampler)
        active = ~done
        out = out.at[:, step].set(jnp.where(active, tok, 0))
        n_gen = n_gen + active
        # Every drawn token is fed back, so the final cache covers the whole response.
        new_logits, cache = _decode(params, tok, active, cache, cfg)
        logits = jnp.where(active[:, None], new_logits, logits)
        stop = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
        return step + 1, cache, logits, sampler, out, n_gen, done | (active & (stop | (n_gen >= max_new)))

    init = (jnp.int32(0), cache, logits, sampler, out, jnp.zeros((b,), jnp.int32), done)
    _, cache, logits, _, out, n_gen, _ = jax.lax.while_loop(cond, body, init)
    return Generation(out, n_gen, cache, logits)


def generate(
    params: Params,
    cfg: Config,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    cache: Cache | None = None,
    max_len: int | None = None,
    stop_ids: Sequence[int] | None = None,
    seeds: Sequence[int] | None = None,
    sampling: SamplingParams | None = None,
    speculative_tokens: int = 0,
    rollback: str = "states",
    adaptive: bool = True,
) -> Generation:
    """Prefill ragged prompts and decode until each row stops, in one jitted call.

    A row stops at a token in `stop_ids` (kept as its last token; default: the model's
    `cfg.eos_token_id`, `()` for none) or after its `max_new_tokens`. `cache` (optional) holds
    what precedes the prompts; it is not donated, so it stays usable (a snapshot). A new cache
    holds up to `max_len` tokens (default: the model's context; memory grows with use), so the
    returned `.cache` can be continued. Default sampling is greedy.

    speculative_tokens K (1..4, needs params.mtp): draft K tokens per step with the MTP head
    and verify them in one forward (`hybridjax.speculative`); greedy output is the same token
    for token, sampled output has the same distribution. `rollback`: "states" or "rerun" (how
    the state after the last accepted token is had; see there). `adaptive`: decode without
    drafts while the acceptance is too low for drafting to pay (probing again now and then).
    """
    b = len(prompts)
    if b == 0 or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (b,))
    if np.any(max_new < 0):
        raise ValueError("generate: max_new_tokens must be >= 0")
    out_len = length_bucket(int(max_new.max()))
    tokens, counts = pad_prompts(prompts)
    if cache is None:
        cache = init_cache(cfg, b, max_len or max(cfg.max_position_embeddings, tokens.shape[1] + out_len), mesh=params.mesh)
    cache = reserve(cache, counts + max_new)
    sp = sampling if sampling is not None else sampling_params(b)
    sampler = init_sampler(sp, seeds if seeds is not None else [0] * b, cfg.vocab_size, tokens, counts)
    stop_ids = cfg.eos_token_id if stop_ids is None else stop_ids
    stops = jnp.asarray(np.array(list(stop_ids) or [-1], np.int32))
    if speculative_tokens:
        check_speculative(params, speculative_tokens, rollback)
        out, n_gen, st = generate_speculative(params, tokens, counts, cache, sampler, stops, jnp.asarray(max_new), cfg,
                                              out_len, speculative_tokens, rollback, adaptive)
        return Generation(out, n_gen, st.cache, st.logits, st.drafted, st.accepted)
    return _generate(params, tokens, counts, cache, sampler, stops, jnp.asarray(max_new), cfg, out_len)


# --- streaming ---------------------------------------------------------------------------


def stream(
    params: Params,
    cfg: Config,
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    cache: Cache | None = None,
    max_len: int | None = None,
    stop_ids: Sequence[int] | None = None,
    seed: int = 0,
    sampling: SamplingParams | None = None,
) -> Iterator[int]:
    """Yield generated tokens one at a time (batch of one), stopping like `generate` (by
    default at the model's `cfg.eos_token_id`).

    The first step (prefill from `cache`, maybe a snapshot) does not donate; every later step
    donates the cache the previous step made, which nothing else holds.
    """
    if not prompt:
        raise ValueError("stream: the prompt needs at least one token")
    if cache is None:
        cache = init_cache(cfg, 1, max_len or max(cfg.max_position_embeddings, len(prompt) + max_new_tokens), mesh=params.mesh)
    tokens, counts = pad_prompts([prompt])
    sampler = init_sampler(sampling or sampling_params(1), [seed], cfg.vocab_size, tokens, counts)
    logits, cache = prefill(params, tokens, cache, cfg, counts)
    stops = set(cfg.eos_token_id if stop_ids is None else stop_ids)
    for i in range(max_new_tokens):
        tok, sampler = _next_token_jit(logits, sampler)
        t = int(tok[0])
        yield t
        if t in stops or i == max_new_tokens - 1:
            return
        logits, cache = decode_step_donating(params, tok, cache, cfg)


# --- the engine's steps: a fixed batch of slots, rows joining and leaving between steps ----


def _sample_and_decode(params, logits, cache, sampler, active, cfg):
    tok, stepped = next_token(logits, sampler)
    new_logits, cache = _decode(params, tok, active, cache, cfg)
    # Only active rows move on; an idle slot keeps its logits, state and sampler untouched.
    keep = lambda new, old: jnp.where(active.reshape(active.shape + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
    return tok, keep(new_logits, logits), cache, jax.tree_util.tree_map(keep, stepped, sampler)


sample_and_decode_donating = jax.jit(
    _sample_and_decode, static_argnames="cfg", donate_argnames=("logits", "cache", "sampler")
)
sample_and_decode_donating.__doc__ = """(params, logits [B, vocab], cache, sampler, active [B], cfg) ->
(tokens [B], logits, cache, sampler): draw one token per active row from `logits` and feed it
back, so the cache always covers every drawn token. Donates logits, cache and sampler."""


def _write_row(batch, row_value, row):
    """Write a batch-of-one pytree into row `row` of a batched pytree with the same structure.
    A row's KV buffer may be shorter than the batch's: it fills the front (the rest is unused)."""
    def put(b, r):
        return jax.lax.dynamic_update_slice(b, r.astype(b.dtype), (row,) + (0,) * (b.ndim - 1))

    return jax.tree_util.tree_map(put, batch, row_value)


write_row_donating = jax.jit(_write_row, donate_argnums=0)


@functools.partial(jax.jit, static_argnames="capacity")
def _read_row(cache, row, capacity):
    def take(x):
        return jax.lax.dynamic_slice(x, (row,) + (0,) * (x.ndim - 1), (1,) + x.shape[1:])

    layers = []
    for s in cache.layers:
        if isinstance(s, KVState):  # keep only the first `capacity` positions
            cut = lambda x: jax.lax.dynamic_slice(x, (row, 0, 0, 0), (1, capacity) + x.shape[2:])  # noqa: E731
            layers.append(s.replace(k=cut(s.k), v=cut(s.v)))
        else:
            layers.append(jax.tree_util.tree_map(take, s))
    return cache.replace(layers=tuple(layers), lengths=take(cache.lengths))


def read_row(cache: Cache, row: int, capacity: int) -> Cache:
    """Row `row` of a batched cache as a new batch-of-one cache with KV capacity `capacity`
    (a copy of that row: the batched cache stays free to be donated)."""
    return _read_row(cache, jnp.int32(row), min(capacity, cache.capacity))
