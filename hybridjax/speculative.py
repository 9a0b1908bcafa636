"""Speculative decoding with the MTP head: draft k tokens, verify them in one forward of k + 1
tokens, keep the longest prefix the main model agrees with.

One step, per row, from a cache holding tokens x_0 .. x_{n-1}, the logits after x_{n-1} and the
main model's hidden state h_{n-1} (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; drafting as vLLM's MTP proposer, vllm/v1/spec_decode/eagle.py, with the
head of vllm/model_executor/models/qwen3_next_mtp.py):

    t0 = x_n         drawn from the logits (or the token a previous rejection drew)
    d_1 .. d_k       the MTP head, recursively: (h_{n-1}, t0) -> d_1, then (its own output, d_j) -> d_{j+1}
    verify           main forward of [t0, d_1 .. d_k] from the cache: logits L_0 .. L_k
    accept           d_j while it passes the test against L_{j-1}: greedy, d_j == argmax; sampling,
                     with probability min(1, p(d_j) / q(d_j)), and at the first rejection draw the
                     next token from normalise(max(0, p - q)) (it is fed at the next step)
    continue         from the state after the last accepted token, with the logits after it

Recurrent (GDN) state cannot be trimmed, so the state after the last accepted token is had in one
of two ways (`rollback`): "states" keeps the state after every verified token (the verify pass
runs the delta rule token by token, `ops.delta_rule_steps`) and picks one per row; "rerun" keeps
the pre-verify cache (a value, so keeping it is free) and feeds it the accepted tokens again.
Attention KV needs neither: keys past a row's length are invisible and later overwritten.
"states" is the default: measured by benchmarks/bench_speculative.py on the embedded default,
"rerun" decodes 1.5-2x slower at every K (it pays a second forward of the main model per step,
"states" only one gather of a few per-token GDN states). Its price is memory: K + 1 recurrent
states per GDN layer per row during the verify pass (for Qwen3-Next-80B's 36 GDN layers of
32 x 128 x 128 float32, 2 MB each, about 0.36 GB per row at K = 4).

The MTP layer keeps its own KV (positions of the main model's hidden states). Its pairs
(h_p, x_{p+1}) for the accepted positions are written at the start of the next step (vLLM's
proposer does the same): the draft pass runs over the k + 1 verified positions, and rows read
their output at their own last accepted index.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hybridjax import pytree
from hybridjax.cache import Cache, GDNState, KVState
from hybridjax.config import Config
from hybridjax.model import forward_hidden, lm_logits
from hybridjax.mtp import init_mtp_state, mtp_forward, mtp_hidden
from hybridjax.params import Params
from hybridjax.sampling import Sampler, SamplingParams, apply_penalties, filter_logits, sample

Array = jax.Array

ROLLBACKS = ("states", "rerun")
# Salts folded into a row's key at one step count: draft draws (draft j: _DRAFT + j), acceptance
# uniforms and residual draws must be independent of each other and of the plain draw (which
# folds in nothing more), so the ranges must not meet. They once did (_ACCEPT was _DRAFT + 1):
# threefry is counter-based, so the second draft's Gumbel noise for token 0 was the first
# draft's acceptance uniform, and after an accepted first draft (a small uniform) the second was
# drawn from a skewed q while judged against q: a bias of 0.01-0.02 in total variation on the
# test model of tests/test_engine_spec_sampling.py (computed exactly there).
_DRAFT, _ACCEPT, _RESIDUAL = 0x5EED0, 0x5EEA0, 0x5EEB0


@pytree.dataclass
class SpecState:
    """What a speculative step carries besides the sampler (B rows, K = drafted tokens)."""

    cache: Cache  # main model: every fed token
    mtp: KVState  # the MTP layer's KV: true pairs up to position lengths - 2
    hidden: Array  # [B, K+1, D] main hidden states of the last verify; index `last` is x_{n-1}'s
    tokens: Array  # [B, K+1] the token after each of those positions (index `last` set at the next step)
    last: Array  # [B] int32: accepted drafts in the last verify (the index of x_{n-1} in hidden)
    logits: Array  # [B, vocab] float32 after x_{n-1}
    forced: Array  # [B] int32: the next token when a rejection already drew it, else -1
    drafted: Array  # [B] int32: drafts proposed so far (acceptance statistics)
    accepted: Array  # [B] int32: drafts accepted so far
    rate: Array  # [] float32: moving estimate of the batch's draft acceptance (adaptive mode)
    steps: Array  # [] int32: steps taken
    probe_at: Array  # [] int32: adaptive mode drafts again at this step, whatever the rate
    probe_gap: Array  # [] int32: steps between probes (doubles while probes fail)


MAX_DRAFT = 4
assert not {_ACCEPT, _RESIDUAL} & set(range(_DRAFT, _DRAFT + MAX_DRAFT))  # independent keys (above)
# Adaptive mode: the acceptance rate below which a step of K drafts costs more than it gains
# (1 + K * rate tokens per step against the step's cost relative to a plain decode step,
# measured on the embedded default on CPU: benchmarks/bench_speculative.py --head random), and
# how often a plain-decoding batch tries drafting again.
# (A drafting step cost 1.6-1.75 plain steps at K = 1, 2.0-2.3 at K = 2, ~3 at K = 4.)
# A probe verifies K drafts for every row, so its extra cost grows with K x rows: the gap after
# a failed probe grows with it (PROBE_EVERY / 2 x K x rows, doubling while probes fail), which
# keeps probing a few percent of the steps' time (widened default, random head: a gap of 16
# whatever K and rows cost 6-10% at K = 4 or at 4 rows).
MIN_RATE = {1: 0.6, 2: 0.6, 3: 0.55, 4: 0.55}
PROBE_EVERY, MAX_PROBE_GAP = 16, 256


def _base_probe_gap(rows: int, k: int) -> int:
    return min(PROBE_EVERY // 2 * k * rows, MAX_PROBE_GAP // 2)


def check_speculative(params: Params, k: int, rollback: str = "states") -> None:
    """Raise ValueError unless K drafts per step can run with these params."""
    if not 1 <= k <= MAX_DRAFT:
        raise ValueError(f"speculative tokens must be in 1..{MAX_DRAFT}, got {k}")
    if params.mtp is None:
        if any(n.startswith("mtp.") for n in params.extra):  # kept verbatim: partial, mis-shaped or unknown
            raise ValueError("speculative decoding needs an MTP head, and this checkpoint's mtp.* tensors do not form "
                             "one (see the warning at load): run without --speculative-tokens")
        raise ValueError("speculative decoding needs an MTP head (this checkpoint has no mtp.* tensors): "
                         "run without --speculative-tokens")
    if rollback not in ROLLBACKS:
        raise ValueError(f"rollback must be one of {ROLLBACKS}, got {rollback!r}")


def _rows(x: Array, idx: Array) -> Array:
    """x[b, idx[b]] for x [B, T, ...], idx [B]."""
    return jnp.take_along_axis(x, idx.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


def _keys(s: Sampler, salt: int) -> Array:
    return jax.vmap(lambda k, n: jax.random.fold_in(jax.random.fold_in(k, n), salt))(s.keys, s.step)


def _record(s: Sampler, tok: Array, mask: Array) -> Sampler:
    """The sampler after rows `mask` emitted `tok` (as `next_token` records a draw)."""
    rows = jnp.arange(tok.shape[0])
    return s.replace(step=s.step + mask, seen=s.seen.at[rows, tok].max(mask),
                     out_counts=s.out_counts.at[rows, tok].add(mask.astype(jnp.int32)))


def _any_sampling(sp: SamplingParams) -> Array:
    return jnp.any(sp.temperature > 0)


def _probs(logits: Array, sp: SamplingParams) -> Array:
    """The distribution a sampling row draws from: softmax of the filtered, scaled logits."""
    return jax.nn.softmax(filter_logits(logits, sp), axis=-1)


def draft_token(logits: Array, sp: SamplingParams, keys: Array) -> tuple[Array, Array]:
    """A draft per row from MTP logits [B, vocab]: (tokens [B], q [B, vocab] the distribution it
    was drawn from). Greedy rows take the argmax (q one-hot); sampling rows draw from the same
    filters as the target (no penalties: q may be anything, it only moves the acceptance)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    one_hot = jax.nn.one_hot(greedy, logits.shape[-1], dtype=jnp.float32)

    def draw(_):
        q = _probs(logits, sp)
        tok = jax.vmap(jax.random.categorical)(keys, jnp.log(q)).astype(jnp.int32)
        on = sp.temperature > 0
        return jnp.where(on, tok, greedy), jnp.where(on[:, None], q, one_hot)

    return jax.lax.cond(_any_sampling(sp), draw, lambda _: (greedy, one_hot), None)


def judge(logits: Array, draft: Array, q: Array, sp: SamplingParams, keys_u: Array, keys_r: Array):
    """Accept or reject one draft per row against target logits [B, vocab] (penalties applied).

    Greedy rows accept iff the draft is the argmax (the residual is the argmax). Sampling rows
    accept with probability min(1, p(d) / q(d)), and the residual is drawn from
    normalise(max(0, p - q)): together exactly a draw from p. Returns (accept [B], residual [B]).
    """
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        p = _probs(logits, sp)
        pd, qd = _rows(p[:, :, None], draft)[:, 0], _rows(q[:, :, None], draft)[:, 0]
        u = jax.vmap(jax.random.uniform)(keys_u)
        ok = u * qd < pd  # u < p/q without dividing; q(d) > 0 for a drawn d
        rest = jnp.maximum(p - q, 0.0)
        rest = jnp.where(jnp.sum(rest, -1, keepdims=True) > 0, rest, p)  # p == q: never rejected anyway
        resid = jax.vmap(jax.random.categorical)(keys_r, jnp.log(rest)).astype(jnp.int32)
        on = sp.temperature > 0
        return jnp.where(on, ok, draft == best), jnp.where(on, resid, best)

    return jax.lax.cond(_any_sampling(sp), sampled, lambda _: (draft == best, best), None)


def take_position(new: Cache, old: Cache, n_fed: Array) -> Cache:
    """The cache after each row's first n_fed [B] verified tokens, from a verify pass run with
    `all_states` (GDN states per token) and the cache before it (rows with n_fed 0 keep it)."""
    idx = jnp.maximum(n_fed - 1, 0)
    fed = n_fed > 0

    def pick(n, o):
        return jnp.where(fed.reshape((-1,) + (1,) * (o.ndim - 1)), _rows(n, idx), o)

    layers = [GDNState(conv=pick(n.conv, o.conv), ssm=pick(n.ssm, o.ssm)) if isinstance(o, GDNState) else n
              for n, o in zip(new.layers, old.layers)]
    return old.replace(layers=tuple(layers), lengths=old.lengths + n_fed)


def draft(params: Params, st: SpecState, tok0: Array, sp: Sampler, k: int, cfg: Config):
    """k drafts per row after tok0 [B]: (drafts [B, k], q [B, k, vocab], new MTP KV). The first
    MTP pass also writes the pairs of the tokens accepted at the last step; the other k - 1 run
    one position each, in a scan (one compiled copy of the layer, not k)."""
    b = tok0.shape[0]
    n = st.cache.lengths  # tok0 goes at position n; the MTP pair (h_{n-1}, tok0) at n - 1
    tokens = st.tokens.at[jnp.arange(b), st.last].set(tok0)
    out, kv = mtp_hidden(params, st.hidden, tokens, st.mtp, n - 1 - st.last, cfg)
    out = _rows(out, st.last)  # the LM head only where a row drafts from
    d, q = draft_token(lm_logits(params, out), sp.params, _keys(sp, _DRAFT))

    def more(carry, j):  # the head's own output and its last draft make the next pair, at n + j
        h, d, kv = carry
        logits, h, kv = mtp_forward(params, h[:, None], d[:, None], kv, n + j, cfg)
        d, q = draft_token(logits[:, 0], sp.params, _keys(sp, _DRAFT + 1 + j))
        return (h[:, 0], d, kv), (d, q)

    (_, _, kv), (ds, qs) = jax.lax.scan(more, (out, d, kv), jnp.arange(k - 1))
    drafts = jnp.concatenate([d[:, None], jnp.moveaxis(ds, 0, 1)], axis=1)  # [B, k]
    return drafts, jnp.concatenate([q[:, None], jnp.moveaxis(qs, 0, 1)], axis=1), kv


def spec_step(params: Params, st: SpecState, sampler: Sampler, active: Array, budget: Array, stop_ids: Array,
              k: int, cfg: Config, rollback: str = "states"):
    """One speculative step for rows `active` [B] with `budget` [B] tokens still allowed.

    Returns (emitted tokens [B, K+1], emitted count [B], stopped [B] (a stop token or the budget
    reached), new SpecState, new sampler). Rows not active are left as they are.
    """
    b = active.shape[0]
    # 1. the first token: drawn from the logits, or the residual a rejection drew last step
    tok0, sampler, going = first_token(st, sampler, active, budget, stop_ids)
    proposing = going

    # 2. draft, 3. verify [t0, d_1 .. d_k] in one forward
    drafts, qs, mtp_kv = draft(params, st, tok0, sampler, k, cfg)
    fed = jnp.concatenate([tok0[:, None], drafts], axis=1)  # [B, K+1]
    counts = jnp.where(active, k + 1, 0).astype(jnp.int32)
    hidden, verified = forward_hidden(params, fed, st.cache, cfg, token_counts=counts, all_states=rollback == "states")
    logits = lm_logits(params, hidden)  # [B, K+1, vocab]

    # 4. accept the longest passing prefix, token by token (penalties see the accepted ones)
    def judge_next(carry, xs):
        sampler, n_acc, forced, going, stopped = carry
        target, d, q, j = xs
        pen = apply_penalties(target, sampler.params, sampler.seen, sampler.out_counts)
        ok, resid = judge(pen, d, q, sampler.params, _keys(sampler, _ACCEPT), _keys(sampler, _RESIDUAL))
        acc, rej = going & ok, going & ~ok
        sampler = _record(sampler, d, acc)
        end = acc & (_is_stop(d, stop_ids) | (budget <= j + 2))
        return (sampler, n_acc + acc, jnp.where(rej, resid, forced), acc & ~end, stopped | end), None

    xs = (jnp.moveaxis(logits[:, :k], 1, 0), drafts.T, jnp.moveaxis(qs, 1, 0), jnp.arange(k))
    init = (sampler, jnp.zeros((b,), jnp.int32), jnp.full((b,), -1, jnp.int32), going, active & ~going)
    (sampler, n_acc, forced, _, stopped), _ = jax.lax.scan(judge_next, init, xs)

    # 5. the state after the last accepted token
    n_fed = jnp.where(active, n_acc + 1, 0)
    if rollback == "states":
        cache = take_position(verified, st.cache, n_fed)
    else:
        _, cache = forward_hidden(params, fed, st.cache, cfg, token_counts=n_fed, last_only=True)
    keep = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
    new = SpecState(
        cache=cache, mtp=mtp_kv,
        hidden=keep(hidden, st.hidden),
        tokens=keep(jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1), st.tokens),
        last=keep(n_acc, st.last),
        logits=keep(_rows(logits, jnp.maximum(n_fed - 1, 0)), st.logits),
        forced=keep(forced, st.forced),
        drafted=st.drafted + jnp.where(proposing, k, 0),
        accepted=st.accepted + n_acc,
        rate=st.rate, steps=st.steps + 1, probe_at=st.probe_at, probe_gap=st.probe_gap,
    )
    rate = jnp.where(jnp.any(proposing), 0.5 * st.rate + 0.5 * jnp.sum(n_acc) / jnp.maximum(k * jnp.sum(proposing), 1),
                     st.rate)
    low = rate < MIN_RATE[k]  # a failed probe: wait twice as long for the next one
    gap = jnp.where(low, jnp.minimum(2 * st.probe_gap, MAX_PROBE_GAP), _base_probe_gap(n_acc.shape[0], k))
    new = new.replace(rate=rate, probe_gap=gap, probe_at=jnp.where(low, st.steps + gap, st.probe_at))
    return fed, n_fed, stopped, new, sampler


def first_token(st: SpecState, sampler: Sampler, active: Array, budget: Array, stop_ids: Array):
    """The step's first token [B] (drawn from the logits as `next_token` draws, or the residual a
    rejection drew), the sampler after it, and which rows go on (no stop token, budget left)."""
    pen = apply_penalties(st.logits, sampler.params, sampler.seen, sampler.out_counts)
    drawn = jax.lax.cond(_any_sampling(sampler.params),
                         lambda _: _sample_rows(pen, sampler), lambda _: jnp.argmax(pen, -1).astype(jnp.int32), None)
    tok0 = jnp.where(st.forced >= 0, st.forced, drawn)
    return tok0, _record(sampler, tok0, active), active & ~_is_stop(tok0, stop_ids) & (budget > 1)


def plain_step(params: Params, st: SpecState, sampler: Sampler, active: Array, budget: Array, stop_ids: Array,
               k: int, cfg: Config):
    """A step without drafts (`spec_step`'s signature and results): one token fed. The MTP layer
    is skipped too (it would cost a layer per token), so its KV misses these positions' pairs:
    later drafts attend over stale keys there, which only lowers acceptance."""
    b = active.shape[0]
    tok0, sampler, going = first_token(st, sampler, active, budget, stop_ids)
    hidden, cache = forward_hidden(params, tok0[:, None], st.cache, cfg, token_counts=active.astype(jnp.int32))
    keep = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
    new = st.replace(
        cache=cache,
        hidden=keep(jnp.zeros_like(st.hidden).at[:, 0].set(hidden[:, 0]), st.hidden),
        tokens=keep(jnp.zeros_like(st.tokens), st.tokens),
        last=keep(jnp.zeros_like(st.last), st.last),
        logits=keep(lm_logits(params, hidden[:, 0]), st.logits),
        forced=keep(jnp.full_like(st.forced, -1), st.forced),
        steps=st.steps + 1,
    )
    fed = jnp.concatenate([tok0[:, None], jnp.zeros((b, k), jnp.int32)], axis=1)
    return fed, active.astype(jnp.int32), active & ~going, new, sampler


def _is_stop(tok: Array, stop_ids: Array) -> Array:
    return jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)


def _sample_rows(logits: Array, s: Sampler) -> Array:
    """`sampling.sample` at the row's current step key (the plain draw of `next_token`)."""
    return sample(logits, s.params, jax.vmap(jax.random.fold_in)(s.keys, s.step))


def prefill(params: Params, tokens: Array, counts: Array, cache: Cache, k: int, cfg: Config) -> SpecState:
    """Run right-padded prompts [B, T] (counts [B]) and the MTP layer over their pairs
    (h_p, x_{p+1}); the state a first speculative step starts from. The MTP KV starts empty at
    `cache`'s length: a cache holding earlier context has no MTP pairs for it (drafts are then
    worse there, never wrong)."""
    b, t = tokens.shape
    starts = cache.lengths
    hidden, cache = forward_hidden(params, tokens, cache, cfg, token_counts=counts)
    last_h = _rows(hidden, jnp.maximum(counts - 1, 0))  # [B, D]
    mtp_kv = init_mtp_state(cfg, b, cache.capacity, params.embed.dtype)
    if t > 1:  # pads write keys past a row's end that the first step overwrites
        _, mtp_kv = mtp_hidden(params, hidden[:, :-1], tokens[:, 1:], mtp_kv, starts, cfg)
    d = hidden.shape[-1]
    return SpecState(
        cache=cache, mtp=mtp_kv,
        hidden=jnp.zeros((b, k + 1, d), hidden.dtype).at[:, 0].set(last_h),
        tokens=jnp.zeros((b, k + 1), jnp.int32), last=jnp.zeros((b,), jnp.int32),
        logits=lm_logits(params, last_h), forced=jnp.full((b,), -1, jnp.int32),
        drafted=jnp.zeros((b,), jnp.int32), accepted=jnp.zeros((b,), jnp.int32),
        rate=jnp.float32(1.0), steps=jnp.int32(0), probe_at=jnp.int32(0), probe_gap=jnp.int32(_base_probe_gap(b, k)),
    )


def speculate_now(st: SpecState, k: int) -> Array:
    """Adaptive mode: draft this step if the acceptance estimate says drafting pays (above
    MIN_RATE[k], measured by benchmarks/bench_speculative.py), or to probe it again."""
    return (st.rate >= MIN_RATE[k]) | (st.steps >= st.probe_at)


@functools.partial(jax.jit, static_argnames=("cfg", "out_len", "k", "rollback", "adaptive"))
def generate_speculative(params, tokens, counts, cache, sampler, stop_ids, max_new, cfg, out_len, k, rollback="states",
                         adaptive=False):
    """The speculative twin of `generate._generate`: (out [B, out_len], n_generated [B], final
    SpecState). The final cache covers the prompt and every generated token, as there.
    adaptive: steps without drafts while the acceptance estimate is too low (`speculate_now`)."""
    st = prefill(params, tokens, counts, cache, k, cfg)
    b = tokens.shape[0]
    out = jnp.zeros((b, out_len), jnp.int32)
    done = max_new <= 0
    cols = jnp.arange(out_len)[None, :]

    def cond(c):
        return ~jnp.all(c[-1])

    def advance(c, step):
        st, sampler, out, n_gen, done = c
        fed, n_fed, stopped, st, sampler = step(params, st, sampler, ~done, max_new - n_gen, stop_ids)
        for i in range(k + 1):  # token i of the step goes to column n_gen + i
            out = jnp.where((cols == (n_gen + i)[:, None]) & (i < n_fed)[:, None], fed[:, i : i + 1], out)
        return st, sampler, out, n_gen + n_fed, done | stopped

    def drafting(*a):
        return spec_step(*a, k, cfg, rollback)

    def body(c):
        if adaptive:  # plain steps in an inner loop (a lax.cond per step would copy the carried caches)
            plain = lambda c: advance(c, lambda *a: plain_step(*a, k, cfg))  # noqa: E731
            c = jax.lax.while_loop(lambda c: cond(c) & ~speculate_now(c[0], k), plain, c)
        return advance(c, drafting)

    st, _, out, n_gen, _ = jax.lax.while_loop(cond, body, (st, sampler, out, jnp.zeros((b,), jnp.int32), done))
    return out, n_gen, st
