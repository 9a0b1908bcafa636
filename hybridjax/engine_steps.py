"""The engine's device state and its jitted steps: the engine's jit boundaries.

`EngineState` holds, for a fixed number of slots, every row's recurrent (GDN) state, cache
length, last logits and sampler, and the attention KV of all rows in one page pool
(`PagedKV`, shared by rows and snapshots; see hybridjax.pages). Each step takes the state and
returns the new one, donated, so nothing is copied between steps.

A step works on a few rows, named by an index array `rows` (a batch bucket: 1, 2, 4, ... rows,
so idle slots cost nothing). Padding entries hold `slots`, out of range: gathers clamp them and
scatters drop them, and their token counts are 0, so their KV writes are dropped too. A padded
call changes nothing but its real rows, which also lets start-up compile every shape by running
it on padding alone.

Token flow: a row's `pending` token has been drawn but not yet fed to the model. A prefill
chunk that completes a prompt draws the first token at once (it is sent before any decode
step runs); a decode step feeds every active row's pending token and draws the next. A row
stops drawing by itself (`done`) when it draws one of its stop ids or exhausts its budget; the
next step feeds that last token and the row goes `idle`, its cache covering every token it
drew (what its response snapshot needs; the engine spares that step when the budget ended the
row: the host knew it was coming, and a request arriving next would wait for the step). So a
step dispatched before the host has seen the previous one never moves a finished row past its
end: the host reads step N's tokens while step N+1 runs. A speculative engine's step (`spec_decode`) feeds the pending token with K drafts
and keeps the accepted ones: it may draw several tokens per row, and a row that stops on an
accepted draft goes idle at once (that draft is already fed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hybridjax import compile_cache, ops, pytree, sharding
from hybridjax.cache import Cache, GDNState, PagedKV
from hybridjax.config import FULL, Config
from hybridjax.generate import Sampler, next_token
from hybridjax.model import forward, forward_hidden, lm_logits
from hybridjax.mtp import mtp_hidden
from hybridjax.sampling import SamplingParams, adjust_logits, apply_penalties, logprobs_of

Array = jax.Array

MAX_STOPS = 8  # stop ids a row checks on the device; more are checked by the host, a step later
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@pytree.dataclass
class EngineState:
    layers: tuple  # per model layer: GDNState [slots, ...] or the PagedKV pool [P, S, Hkv, Dh] (table None)
    lengths: Array  # [slots] int32: tokens in each row's cache
    logits: Array  # [slots, vocab] float32: after each row's last cached token
    sampler: Sampler  # [slots]
    pending: Array  # [slots] int32: drawn, not yet fed
    budget: Array  # [slots] int32: tokens the row may still draw
    stops: Array  # [slots, MAX_STOPS] int32, -1 = none
    done: Array  # [slots] bool: drew a stop id or exhausted its budget: draws no more
    idle: Array  # [slots] bool: nothing pending (a done row's last token has been fed too)
    want_logprobs: Array  # [slots] bool: the request asked for log-probabilities
    # Per-row logit adjustments (sampling.adjust_logits), skipped for a batch where no row has any:
    adjust: Array  # [slots] bool: the row has a logit_bias, a min_tokens or a grammar
    bias: Array  # [slots, vocab] float32: additive logit_bias (-inf bans)
    min_tokens: Array  # [slots] int32: the row's stop ids are banned until it has drawn this many
    bits: Array  # [slots, ceil(vocab / 32)] int32: the grammar's allowed tokens for the next draw (-1: all)
    # Speculative engines only (None otherwise; spec_decode below):
    mtp: PagedKV | None = None  # the MTP layer's KV, in pages of the same ids as the model's
    hidden: Array | None = None  # [slots, D]: main final-normed hidden state after each row's last token

    @property
    def slots(self) -> int:
        return int(self.lengths.shape[0])


def state_shardings(state: EngineState, mesh):
    """Where each leaf lives on `mesh`: the page pool by KV heads, GDN states by heads (slots are
    gathered by index, so not split on `data`), the per-slot bookkeeping replicated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    layers = tuple(sharding.state_specs(s, mesh, 1) for s in state.layers)
    mtp = None if state.mtp is None else sharding.state_specs(state.mtp, mesh, 1)
    specs = jax.tree_util.tree_map(lambda _: P(), draw_part(state))  # the bookkeeping: replicated
    return jax.tree_util.tree_map(lambda p: NamedSharding(mesh, p), specs.replace(layers=layers, mtp=mtp),
                                  is_leaf=lambda x: isinstance(x, P))


def pin_state(state: EngineState, mesh) -> EngineState:
    """Inside a step: keep the state's layout as it came in, so a donated state is reused in place
    and the next step sees the same shardings (no recompilation)."""
    if not sharding.is_multi_device(mesh):
        return state
    return jax.lax.with_sharding_constraint(state, state_shardings(state, mesh))


def init_state(cfg: Config, slots: int, num_pages: int, page_size: int, dtype=jnp.float32, mesh=None,
               mtp: bool = False) -> EngineState:
    """Zeros everywhere (every leaf its own buffer: donation needs that); placed on `mesh` when
    given (`state_shardings`). mtp: with the MTP layer's KV pool and the rows' hidden states
    (a speculative engine). Page pools of bfloat16 KV hold its bits on CPU (`ops.pool_dtype`)."""
    heads = cfg.kv_heads_laid_out(sharding.axis_size(mesh, "tensor"))
    state = _zeros_state(cfg, slots, num_pages, page_size, dtype, heads)
    if mtp:
        shape, pool = (num_pages, page_size, heads, cfg.head_dim), ops.pool_dtype(dtype)
        state = state.replace(mtp=PagedKV(k=jnp.zeros(shape, pool), v=jnp.zeros(shape, pool)),
                              hidden=jnp.zeros((slots, cfg.hidden_size), dtype))
    if not sharding.is_multi_device(mesh):
        return state
    return jax.tree_util.tree_map(jax.device_put, state, state_shardings(state, mesh))


# One program makes the whole state: each of its ~50 leaves made by its own jnp.zeros was one
# dispatch and one compilation-cache lookup, 0.7 s of a warm start (0.23B model, load 2).
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _zeros_state(cfg: Config, slots: int, num_pages: int, page_size: int, dtype=jnp.float32,
                 kv_heads: int | None = None) -> EngineState:
    layers, pool = [], ops.pool_dtype(dtype)
    for t in cfg.layer_types:
        if t == FULL:
            shape = (num_pages, page_size, kv_heads or cfg.num_key_value_heads, cfg.head_dim)
            layers.append(PagedKV(k=jnp.zeros(shape, pool), v=jnp.zeros(shape, pool)))
        else:
            hv, k, v = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
            layers.append(GDNState(conv=jnp.zeros((slots, cfg.linear_conv_kernel_dim - 1, cfg.gdn_conv_dim), jnp.float32),
                                   ssm=jnp.zeros((slots, hv, k, v), jnp.float32)))
    vocab = cfg.vocab_size
    params = SamplingParams(*(jnp.zeros((slots,), d) for d in (jnp.float32, jnp.int32) + (jnp.float32,) * 5))
    sampler = Sampler(params, jax.vmap(jax.random.PRNGKey)(jnp.zeros((slots,), jnp.uint32)), jnp.zeros((slots,), jnp.int32),
                      jnp.zeros((slots, vocab), bool), jnp.zeros((slots, vocab), jnp.int32))
    return EngineState(tuple(layers), jnp.zeros((slots,), jnp.int32), jnp.zeros((slots, vocab), jnp.float32), sampler,
                       jnp.zeros((slots,), jnp.int32), jnp.zeros((slots,), jnp.int32),
                       jnp.full((slots, MAX_STOPS), -1, jnp.int32), jnp.ones((slots,), bool), jnp.ones((slots,), bool),
                       jnp.zeros((slots,), bool), jnp.zeros((slots,), bool), jnp.zeros((slots, vocab), jnp.float32),
                       jnp.zeros((slots,), jnp.int32), jnp.full((slots, mask_words(vocab)), -1, jnp.int32))


def mask_words(vocab: int) -> int:
    """int32 words of a grammar bitmask over `vocab` tokens."""
    return (vocab + 31) // 32


def host_implementation() -> str | None:
    """The kernels for an engine that runs where it is: on a CPU host, the XLA ones directly
    (None would trace the GPU kernels too, as platform-dependent branches: slower start-up, the
    same program); elsewhere None (Pallas when lowered for a GPU)."""
    return "xla" if jax.default_backend() == "cpu" else None


# --- rows in, rows out --------------------------------------------------------------------


def _take(x: Array, rows: Array) -> Array:
    """x[rows] (an index out of range reads the last row).

    One row is gathered twice and one copy kept: XLA turns a one-index gather into a dynamic
    slice that it fuses into every reader, and a donated state read that way while `_put` writes
    it was copied whole, twice per leaf and step (~7 ms of a 50 ms decode step on the 228M model,
    4 slots); a gather of two rows is its own small op (docs/architecture.md, Known traps)."""
    if rows.shape[0] == 1:
        return x.at[jnp.concatenate([rows, rows])].get(mode="clip")[:1]
    return x.at[rows].get(mode="clip")


def _put(x: Array, rows: Array, value: Array, mask: Array | None = None) -> Array:
    """x with x[rows] = value (rows out of range dropped); where mask is False, x keeps its row.

    Nothing reads x's old rows (a masked row is dropped like a padding row), so XLA updates the
    donated x in place. When the rows cover at least half of x, one pass choosing each row from
    x or value replaces the scatter, which XLA:CPU ran at about half that pass's speed (2-4 rows of 4)."""
    if mask is not None:
        rows = jnp.where(mask, rows, x.shape[0])
    if 2 * rows.shape[0] < x.shape[0]:
        return x.at[rows].set(value, mode="drop")
    match = rows[:, None] == jnp.arange(x.shape[0])[None, :]  # [R, slots]; rows are distinct
    chosen = jnp.any(match, axis=0).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(chosen, value.at[jnp.argmax(match, axis=0)].get(mode="clip").astype(x.dtype), x)


def _rows_cache(state: EngineState, rows: Array, table: Array) -> Cache:
    """The model's view of `rows`: their GDN states and lengths, and the pool with their page tables."""
    layers = tuple(s.replace(table=table) if isinstance(s, PagedKV) else jax.tree_util.tree_map(lambda x: _take(x, rows), s)
                   for s in state.layers)
    return Cache(layers=layers, lengths=_take(state.lengths, rows), max_len=table.shape[1] * state_page_size(state))


def state_page_size(state: EngineState) -> int:
    return next(s.page_size for s in state.layers if isinstance(s, PagedKV))


def _store_rows(state: EngineState, rows: Array, cache: Cache, mask: Array) -> EngineState:
    """Write the rows' new GDN states and lengths back (rows where mask is False keep theirs)."""
    layers = tuple(new.replace(table=None) if isinstance(new, PagedKV)
                   else jax.tree_util.tree_map(lambda x, y: _put(x, rows, y, mask), old, new)
                   for old, new in zip(state.layers, cache.layers))
    return state.replace(layers=layers, lengths=_put(state.lengths, rows, cache.lengths, mask))


def _at(x: Array, idx: Array) -> Array:
    """x[r, idx[r]] for x [R, T, ...], idx [R]."""
    return jnp.take_along_axis(x, idx.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


def mtp_pairs(params, state, rows, table, hidden, tokens, starts, counts, cfg, implementation=None) -> PagedKV:
    """The MTP pool after writing the pairs (h_{p-1}, x_p) of tokens x_starts .. (counts [R] of
    tokens [R, T], main hidden states hidden [R, T, D] after each). The pair that predicts from
    x_p's position is kept at position p, not p - 1 (vLLM keeps it at p - 1): then a row writes
    MTP keys only where it writes the model's keys, at or past its length, and a full page stays
    full in both pools (RoPE is relative, so the shift changes no score). Position 0 holds the
    pair (0, x_0) (`state.hidden` of a fresh row is zeros)."""
    prev = jnp.concatenate([_take(state.hidden, rows)[:, None].astype(hidden.dtype), hidden[:, :-1]], axis=1)
    valid = jnp.arange(tokens.shape[1])[None, :] < counts[:, None]
    _, pool = mtp_hidden(params, prev, tokens, state.mtp.replace(table=table), starts, cfg, valid, implementation)
    return pool.replace(table=None)


@pytree.dataclass
class Drawn:
    """A step's draws: tokens [R] (-1 where none was drawn) and, when a row asked, the
    log-probability of its token and the MAX_TOP_LOGPROBS most likely ([R], [R, 20] x 2)."""

    tokens: Array
    logprob: Array
    top_ids: Array
    top_logprobs: Array


def _logprobs(logits: Array, sampler: Sampler, tok: Array, want: Array):
    """Log-probabilities from the logits the sampler used: penalties applied, then divided by the
    temperature (1 for greedy), before any top-k / top-p / min-p cut. Zeros unless a row wants them
    (a vocabulary-wide top-k is not free)."""
    def compute(_):
        lp = logprobs_of(logits, sampler.params, sampler.seen, sampler.out_counts)
        top_lp, top_ids = jax.lax.top_k(lp, min(MAX_TOP_LOGPROBS, lp.shape[-1]))
        pad = ((0, 0), (0, MAX_TOP_LOGPROBS - top_lp.shape[-1]))  # a vocabulary smaller than 20 (test models)
        top_lp, top_ids = jnp.pad(top_lp, pad, constant_values=-jnp.inf), jnp.pad(top_ids, pad)
        return jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    r = logits.shape[0]
    zeros = (jnp.zeros((r,), jnp.float32), jnp.zeros((r, MAX_TOP_LOGPROBS), jnp.int32),
             jnp.zeros((r, MAX_TOP_LOGPROBS), jnp.float32))
    return jax.lax.cond(jnp.any(want), compute, lambda _: zeros, None)


def _adjusted(state: EngineState, rows: Array, logits: Array, sampler: Sampler, masks: bool = True) -> Array:
    """The logits [R, vocab] rows draw from: their logit_bias, their stop ids banned before
    min_tokens (counted by the rows' `sampler`) and, with `masks`, their grammar masks. A batch
    where no row has any of these skips it all."""
    adjust = _take(state.adjust, rows) & (rows < state.slots)

    def apply(_):
        return adjust_logits(logits, _take(state.bias, rows), _take(state.bits, rows) if masks else None,
                             _take(state.stops, rows), adjust & (sampler.step < _take(state.min_tokens, rows)))

    return jax.lax.cond(jnp.any(adjust), apply, lambda _: logits, None)


def _draw(state: EngineState, rows: Array, logits: Array, mask: Array) -> tuple[Drawn, EngineState]:
    """Draw one token per masked row from logits [R, vocab]; it becomes the row's pending token."""
    sampler = jax.tree_util.tree_map(lambda x: _take(x, rows), state.sampler)
    logits = _adjusted(state, rows, logits, sampler)
    tok, stepped = next_token(logits, sampler)
    drawn = Drawn(jnp.where(mask, tok, -1), *_logprobs(logits, sampler, tok, mask & _take(state.want_logprobs, rows)))
    budget = _take(state.budget, rows) - 1
    stopped = jnp.any(tok[:, None] == _take(state.stops, rows), axis=-1) | (budget <= 0)
    state = state.replace(
        sampler=jax.tree_util.tree_map(lambda x, y: _put(x, rows, y, mask), state.sampler, stepped),
        pending=_put(state.pending, rows, tok, mask), budget=_put(state.budget, rows, budget, mask),
        done=_put(state.done, rows, stopped, mask))
    return drawn, state


# --- the steps ----------------------------------------------------------------------------


def _prefill_model(params, state, rows, tokens, counts, table, cfg, implementation=None):
    """Run a chunk of each row's prompt (tokens [R, T], counts [R] real); each row's logits after
    it are kept for `_draw_rows`. Returns (reads, state): reads, each row's `_read_row` after the
    chunk (a snapshot at the chunk's end takes it, with no call of its own: a separate read cost
    the host ~0.6 ms after a long prefill on CPU)."""
    cache = _rows_cache(state, rows, table)
    live = counts > 0
    if state.hidden is None:
        logits, cache = forward(params, tokens, cache, cfg, token_counts=counts, last_logits_only=True,
                                implementation=implementation)
    else:  # a speculative engine: the MTP layer's KV follows the prompt too
        hidden, new = forward_hidden(params, tokens, cache, cfg, token_counts=counts, implementation=implementation)
        h_end = _at(hidden, jnp.maximum(counts - 1, 0))  # [R, D]
        logits = lm_logits(params, h_end)[:, None]
        state = state.replace(mtp=mtp_pairs(params, state, rows, table, hidden, tokens, cache.lengths, counts, cfg,
                                            implementation),
                              hidden=_put(state.hidden, rows, h_end.astype(state.hidden.dtype), live))
        cache = new
    state = _store_rows(state, rows, cache, live)
    state = state.replace(logits=_put(state.logits, rows, logits[:, 0], live))
    state = pin_state(state, params.mesh)
    return tuple(_read_row(state, rows[i]) for i in range(rows.shape[0])), state


def _prefill(params, state, rows, tokens, counts, table, last, cfg, implementation=None):
    """`_prefill_model`, then rows whose prompt ends here (`last`) draw their first token.
    Returns (Drawn, reads, state)."""
    reads, state = _prefill_model(params, state, rows, tokens, counts, table, cfg, implementation)
    drawn, _, _, state = _draw_rows(state, rows, last & (counts > 0))
    return drawn, reads, pin_state(state, params.mesh)


def _decode_model(params, state, rows, table, cfg, implementation=None):
    """Feed each row's pending token; its logits are kept for `_draw_rows`. A row that is done
    (on the device) gets its last token fed and goes idle, so its cache covers every token it
    drew. Idle and padding rows keep everything."""
    feed = (rows < state.slots) & ~_take(state.idle, rows)
    draw = feed & ~_take(state.done, rows)
    cache = _rows_cache(state, rows, table)
    tokens = _take(state.pending, rows)[:, None]
    if state.hidden is None:
        logits, cache = forward(params, tokens, cache, cfg, token_counts=feed.astype(jnp.int32),
                                implementation=implementation)
    else:  # a speculative engine's plain step: the MTP pair (h_{n-1}, t0) and the hidden state follow
        hidden, new = forward_hidden(params, tokens, cache, cfg, token_counts=feed.astype(jnp.int32),
                                     implementation=implementation)
        logits = lm_logits(params, hidden)
        state = state.replace(mtp=mtp_pairs(params, state, rows, table, hidden, tokens, cache.lengths,
                                            feed.astype(jnp.int32), cfg, implementation),
                              hidden=_put(state.hidden, rows, hidden[:, 0].astype(state.hidden.dtype), feed))
        cache = new
    state = _store_rows(state, rows, cache, feed)
    state = state.replace(logits=_put(state.logits, rows, logits[:, 0], feed),
                          idle=_put(state.idle, rows, feed & ~draw, feed & ~draw))
    return pin_state(state, params.mesh)


def _decode(params, state, rows, table, cfg, implementation=None):
    """`_decode_model`, then each row that was fed and is not done draws its next token. Returns
    ((Drawn, done [R], lengths [R]), state)."""
    state = _decode_model(params, state, rows, table, cfg, implementation)
    drawn, done, lengths, state = _draw_rows(state, rows, jnp.ones(rows.shape, bool))
    return (drawn, done, lengths), pin_state(state, params.mesh)


@pytree.dataclass
class SpecDrawn:
    """A speculative step's draws: up to K + 1 tokens per row [R, K+1] (-1 past the row's count)
    and their log-probabilities as in `Drawn` ([R, K+1], [R, K+1, 20] x 2)."""

    tokens: Array
    logprob: Array
    top_ids: Array
    top_logprobs: Array


def _spec_decode(params, state, rows, table, cfg, k, implementation=None):
    """A decode step with k drafts (hybridjax.speculative's step, for rows of the pool): feed
    each row's pending token t0 with k drafts of the MTP head, verify them in one forward of
    k + 1 tokens, accept the longest passing prefix (greedy: the argmax; sampling: Leviathan et
    al.'s rejection rule, `speculative.judge`) and draw the next pending token (the residual of
    a rejection, else a plain draw after the last draft). The GDN state after the last accepted
    token is picked from the verify pass's per-token states; the keys of rejected drafts lie
    past the row's new length, invisible, and are overwritten later.

    A row that is done (on the device) only gets its last token fed, as in `_decode`; a row
    that accepts a stop id or exhausts its budget on a draft stops there (that draft is fed: it
    goes idle at once). Returns ((SpecDrawn, count [R] tokens drawn, accepted [R] drafts,
    drafting [R] rows that drafted, lengths [R] after the step, idle [R], done [R]), state)."""
    from hybridjax import speculative as spec

    r = rows.shape[0]
    feed = (rows < state.slots) & ~_take(state.idle, rows)
    drafting = feed & ~_take(state.done, rows)
    n, t0 = _take(state.lengths, rows), _take(state.pending, rows)
    sampler = jax.tree_util.tree_map(lambda x: _take(x, rows), state.sampler)
    sp, stops, want = sampler.params, _take(state.stops, rows), drafting & _take(state.want_logprobs, rows)

    # 1. drafts: the pair (h_{n-1}, t0) at position n, then the head's own output with each draft
    pool = state.mtp.replace(table=table)
    out, pool = mtp_hidden(params, _take(state.hidden, rows)[:, None], t0[:, None], pool, n, cfg, feed[:, None],
                           implementation)
    d, q = spec.draft_token(lm_logits(params, out[:, 0]), sp, spec._keys(sampler, spec._DRAFT))

    def more(carry, j):
        h, d, pool = carry
        h, pool = mtp_hidden(params, h[:, None], d[:, None], pool, n + 1 + j, cfg, drafting[:, None], implementation)
        d, q = spec.draft_token(lm_logits(params, h[:, 0]), sp, spec._keys(sampler, spec._DRAFT + 1 + j))
        return (h[:, 0], d, pool), (d, q)

    (_, _, pool), (ds, qs) = jax.lax.scan(more, (out[:, 0], d, pool), jnp.arange(k - 1))
    drafts = jnp.concatenate([d[:, None], jnp.moveaxis(ds, 0, 1)], axis=1)  # [R, K]
    qs = jnp.concatenate([q[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)  # [R, K, vocab]

    # 2. verify [t0, d_1 .. d_k] in one forward, keeping the GDN state after every token
    fed = jnp.concatenate([t0[:, None], drafts], axis=1)  # [R, K+1]
    counts = jnp.where(drafting, k + 1, feed.astype(jnp.int32))
    cache = _rows_cache(state, rows, table)
    hidden, every = forward_hidden(params, fed, cache, cfg, token_counts=counts, implementation=implementation,
                                   all_states=True)
    logits = lm_logits(params, hidden)  # [R, K+1, vocab]

    # 3. judge the drafts in order (penalties see the accepted ones), as speculative.spec_step
    def judge_next(carry, xs):
        s, n_acc, forced, going, ended, budget = carry
        target, d, q = xs
        target = _adjusted(state, rows, target, s, masks=False)
        pen = apply_penalties(target, s.params, s.seen, s.out_counts)
        ok, resid = spec.judge(pen, d, q, s.params, spec._keys(s, spec._ACCEPT), spec._keys(s, spec._RESIDUAL))
        acc, rej = going & ok, going & ~ok
        lp = _logprobs(target, s, d, acc & want)
        s, budget = spec._record(s, d, acc), budget - acc
        end = acc & (jnp.any(d[:, None] == stops, axis=-1) | (budget <= 0))
        return (s, n_acc + acc, jnp.where(rej, resid, forced), acc & ~end, ended | end, budget), lp

    zeros = jnp.zeros((r,), jnp.int32)
    init = (sampler, zeros, jnp.full((r,), -1, jnp.int32), drafting, jnp.zeros((r,), bool), _take(state.budget, rows))
    xs = (jnp.moveaxis(logits[:, :k], 1, 0), drafts.T, jnp.moveaxis(qs, 1, 0))
    (sampler, n_acc, forced, _, ended, budget), lps = jax.lax.scan(judge_next, init, xs)

    # 4. the next pending token: a rejection's residual, else a plain draw after the last draft
    n_fed = jnp.where(drafting, n_acc + 1, feed.astype(jnp.int32))
    last_logits = _at(logits, jnp.maximum(n_fed - 1, 0))
    draw_logits = _adjusted(state, rows, last_logits, sampler, masks=False)
    draw = drafting & ~ended
    rejected = forced >= 0
    plain, plain_sampler = next_token(draw_logits, sampler)
    tok = jnp.where(rejected, forced, plain)
    lp_last = _logprobs(draw_logits, sampler, tok, draw & want)
    recorded = spec._record(sampler, jnp.maximum(forced, 0), draw & rejected)
    sampler = jax.tree_util.tree_map(
        lambda a, b: jnp.where((draw & ~rejected).reshape((-1,) + (1,) * (a.ndim - 1)), a, b), plain_sampler, recorded)
    budget = budget - draw
    stopped = draw & (jnp.any(tok[:, None] == stops, axis=-1) | (budget <= 0))
    done = _take(state.done, rows) | ended | stopped
    idle = ~drafting | ended  # the row's last drawn token is in its cache

    # 5. the state after the last accepted token; the MTP pairs of the accepted drafts
    # (h_{n+j}, d_{j+1}) at positions n+1+j, replacing the drafting pass's own pairs
    state = _store_rows(state, rows, spec.take_position(every, cache, n_fed), feed)
    accepted = drafting[:, None] & (jnp.arange(k)[None, :] < n_acc[:, None])
    _, pool = mtp_hidden(params, hidden[:, :k], drafts, pool, n + 1, cfg, accepted, implementation)
    state = state.replace(
        mtp=pool.replace(table=None),
        hidden=_put(state.hidden, rows, _at(hidden, jnp.maximum(n_fed - 1, 0)).astype(state.hidden.dtype), feed),
        logits=_put(state.logits, rows, last_logits, feed),
        sampler=jax.tree_util.tree_map(lambda x, y: _put(x, rows, y, drafting), state.sampler, sampler),
        pending=_put(state.pending, rows, tok, draw), budget=_put(state.budget, rows, budget, drafting),
        done=_put(state.done, rows, done, feed), idle=_put(state.idle, rows, idle, feed))

    # what the host reads: drafts 1 .. n_acc, then the pending token when one was drawn
    cols = jnp.arange(k + 1)[None, :]
    last_col = cols == n_acc[:, None]
    tokens = jnp.where(cols < n_acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), -1)
    tokens = jnp.where(last_col & draw[:, None], tok[:, None], tokens)
    lps = [jnp.concatenate([jnp.moveaxis(a, 0, 1), b[:, None]], axis=1) for a, b in zip(lps, lp_last)]
    lps = [jnp.where(last_col.reshape(last_col.shape + (1,) * (a.ndim - 2)), b[:, None], a)
           for a, b in zip(lps, lp_last)]
    out = (SpecDrawn(tokens, *lps), n_acc + draw, n_acc, drafting, _take(state.lengths, rows), idle | ~feed,
           _take(state.done, rows))
    return out, pin_state(state, params.mesh)


def _draw_rows(state, rows, mask):
    """Rows `rows` [R] draw a token from the logits kept for them (by the model step just run, or
    a snapshot's): those `mask`ed that exist and are neither idle nor done. Returns (Drawn, done
    [R], lengths [R], state). Its own program: the sampler (sort, cumsum, draws: about a third of
    a decode step's compile) is compiled once per row count, not into every model program."""
    draw = mask & (rows < state.slots) & ~_take(state.idle, rows) & ~_take(state.done, rows)
    drawn, state = _draw(state, rows, _take(state.logits, rows), draw)
    return drawn, _take(state.done, rows), _take(state.lengths, rows), state


def draw_part(state: EngineState) -> EngineState:
    """What `_draw_rows` reads and writes: the state without the model's caches. The engine's draw
    program takes only this, so a call passes 23 arrays, not every layer's too (the default
    model's one-row draw: 359 us a call against 401 us with the whole state, medians of 15 rounds)."""
    return state.replace(layers=(), mtp=None)


def with_draw_part(state: EngineState, part: EngineState) -> EngineState:
    return part.replace(layers=state.layers, mtp=state.mtp)


def _sample_first(state, rows):
    """Rows whose logits are already there (an exact snapshot hit) draw their first token."""
    drawn, done, _, state = _draw_rows(state, rows, jnp.ones(rows.shape, bool))
    return drawn, done, state


def _setup_row(state, row, gdn, logits, length, sp: SamplingParams, seed, seen, budget, stops, want_logprobs,
               bias, min_tokens):
    """Prepare row `row` for a new request: its GDN state (a snapshot's tuple of batch-of-one
    GDNStates, or None for zeros), logits [vocab] (or None), length, sampling parameters (one
    row each), seed, seen [vocab] (the prompt's tokens), budget, stops [MAX_STOPS], whether
    its draws report log-probabilities, its logit bias [vocab] (sampling.bias_row) and its
    min_tokens. Its grammar mask allows everything until `set_bits`."""
    rows = row[None]
    snap = iter(gdn or ())
    layers = []
    for s in state.layers:
        if isinstance(s, PagedKV):
            layers.append(s)
            continue
        src = next(snap) if gdn is not None else jax.tree_util.tree_map(lambda x: jnp.zeros((1,) + x.shape[1:], x.dtype), s)
        layers.append(jax.tree_util.tree_map(lambda x, y: _put(x, rows, y.astype(x.dtype)), s, src))
    if state.hidden is not None:  # a snapshot of a speculative engine ends with the hidden state [1, D]
        h = gdn[-1] if gdn is not None else jnp.zeros((1,) + state.hidden.shape[1:], state.hidden.dtype)
        state = state.replace(hidden=_put(state.hidden, rows, h.astype(state.hidden.dtype)))
    sampler = Sampler(sp, jax.random.PRNGKey(seed)[None], jnp.zeros((1,), jnp.int32), seen[None],
                      jnp.zeros((1, seen.shape[0]), jnp.int32))
    state = state.replace(
        layers=tuple(layers), lengths=_put(state.lengths, rows, length[None]),
        sampler=jax.tree_util.tree_map(lambda x, y: _put(x, rows, y.astype(x.dtype)), state.sampler, sampler),
        budget=_put(state.budget, rows, budget[None]), stops=_put(state.stops, rows, stops[None]),
        done=_put(state.done, rows, jnp.zeros((1,), bool)), idle=_put(state.idle, rows, jnp.zeros((1,), bool)),
        want_logprobs=_put(state.want_logprobs, rows, want_logprobs[None]),
        adjust=_put(state.adjust, rows, (jnp.any(bias != 0) | (min_tokens > 0))[None]),
        bias=_put(state.bias, rows, bias[None]), min_tokens=_put(state.min_tokens, rows, min_tokens[None]),
        bits=_put(state.bits, rows, jnp.full((1,) + state.bits.shape[1:], -1, jnp.int32)))
    if logits is not None:
        state = state.replace(logits=_put(state.logits, rows, logits[None]))
    return state


def _set_bits(state, rows, bits):
    """Rows `rows` [R] draw their next token under grammar masks bits [R, words] (the host's,
    from each row's matcher; padding rows dropped)."""
    return state.replace(bits=_put(state.bits, rows, bits), adjust=_put(state.adjust, rows, jnp.ones(rows.shape, bool)))


def _read_row(state, row):
    """A copy of row `row`'s GDN states (a tuple of batch-of-one GDNStates; in a speculative
    engine followed by its hidden state [1, D]) and logits [vocab]."""
    gdn = tuple(jax.tree_util.tree_map(lambda x: jax.lax.dynamic_slice_in_dim(x, row, 1), s)
                for s in state.layers if isinstance(s, GDNState))
    if state.hidden is not None:
        gdn += (jax.lax.dynamic_slice_in_dim(state.hidden, row, 1),)
    return gdn, state.logits[row]


def _pools(state) -> list:
    """Every page pool: the attention layers', then the MTP layer's (a speculative engine)."""
    return [s for s in state.layers if isinstance(s, PagedKV)] + ([state.mtp] if state.mtp is not None else [])


def _with_pools(state, pools) -> EngineState:
    pools = iter(pools)
    layers = tuple(next(pools) if isinstance(s, PagedKV) else s for s in state.layers)
    return state.replace(layers=layers, mtp=next(pools) if state.mtp is not None else None)


def _copy_page(state, src, dst):
    """Page `dst` := page `src`, in every attention layer (copy-on-write of a partial page)."""
    def copy(x):
        return x.at[dst].set(x.at[src].get(mode="clip"), mode="drop")

    return _with_pools(state, [s.replace(k=copy(s.k), v=copy(s.v)) for s in _pools(state)])


def _read_pages(state, ids):
    """(k, v) of pages `ids` [n] in every pool (`_pools`): tuples of [n, S, Hkv, Dh] (persistence)."""
    kv = _pools(state)
    return tuple(ops.pool_values(s.k[ids]) for s in kv), tuple(ops.pool_values(s.v[ids]) for s in kv)


def _write_pages(state, ids, ks, vs):
    """Pages `ids` [n] := ks, vs (tuples over the pools, `_pools`, of [n, S, Hkv, Dh])."""
    return _with_pools(state, [s.replace(k=s.k.at[ids].set(ops.to_pool(k, s.k)), v=s.v.at[ids].set(ops.to_pool(v, s.v)))
                               for s, k, v in zip(_pools(state), ks, vs)])


_donating = compile_cache.jit(donate_argnames="state")  # (compile_cache.jit: the engine keeps these as executables)
prefill_chunk = _donating(_prefill, static_argnames=("cfg", "implementation"))
decode = _donating(_decode, static_argnames=("cfg", "implementation"))
# The engine's compiled programs run a step in two: the model (no sampler), then the draw.
prefill_model = _donating(_prefill_model, static_argnames=("cfg", "implementation"))
decode_model = _donating(_decode_model, static_argnames=("cfg", "implementation"))
draw = _donating(_draw_rows)
spec_decode = _donating(_spec_decode, static_argnames=("cfg", "k", "implementation"))
sample_first = _donating(_sample_first)
setup_row = _donating(_setup_row)
set_bits = _donating(_set_bits)
copy_page = _donating(_copy_page)
write_pages = _donating(_write_pages)
read_row = compile_cache.jit(_read_row)
read_pages = jax.jit(_read_pages)
