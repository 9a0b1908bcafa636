"""Token sampling with per-row parameters and explicit PRNG keys.

`SamplingParams` holds one value per batch row (arrays), so one compiled step serves a batch
whose requests ask for different settings. Greedy is temperature 0. Each row carries its own
key, so a seeded request gives the same tokens whatever else is in the batch.
Order of operations (as in HF / vLLM): penalties, then temperature, then top-k / top-p /
min-p masks, then a categorical draw.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybridjax import pytree

Array = jax.Array


@pytree.dataclass
class SamplingParams:
    temperature: Array  # [B] float32; 0 = greedy
    top_k: Array  # [B] int32; 0 = off
    top_p: Array  # [B] float32 in (0, 1]; 1 = off
    min_p: Array  # [B] float32 in [0, 1]; 0 = off
    repetition_penalty: Array  # [B] float32 > 0; 1 = off (HF semantics, prompt + output)
    presence_penalty: Array  # [B] float32; 0 = off (OpenAI semantics, output only)
    frequency_penalty: Array  # [B] float32; 0 = off


def _check(name: str, values: np.ndarray, ok, rule: str) -> None:
    bad = values[~ok(values)]
    if bad.size:
        raise ValueError(f"invalid sampling parameter '{name}': {bad[0].item()} ({rule})")  # a number, not np.float32(...)


def sampling_params(
    batch_size: int = 1,
    *,
    temperature: float | Sequence[float] = 0.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    min_p: float | Sequence[float] = 0.0,
    repetition_penalty: float | Sequence[float] = 1.0,
    presence_penalty: float | Sequence[float] = 0.0,
    frequency_penalty: float | Sequence[float] = 0.0,
) -> SamplingParams:
    """Validated per-row sampling parameters; scalars are broadcast to `batch_size` rows."""

    def arr(name, v, dtype):
        a = np.broadcast_to(np.asarray(v, dtype), (batch_size,))
        if not np.all(np.isfinite(a)):
            raise ValueError(f"invalid sampling parameter '{name}': must be finite")
        return a

    t = arr("temperature", temperature, np.float32)
    k = arr("top_k", top_k, np.int32)
    p = arr("top_p", top_p, np.float32)
    m = arr("min_p", min_p, np.float32)
    r = arr("repetition_penalty", repetition_penalty, np.float32)
    pres = arr("presence_penalty", presence_penalty, np.float32)
    freq = arr("frequency_penalty", frequency_penalty, np.float32)
    _check("temperature", t, lambda x: x >= 0, "must be >= 0")
    _check("top_k", k, lambda x: x >= 0, "must be >= 0; 0 disables it")
    _check("top_p", p, lambda x: (x > 0) & (x <= 1), "must be in (0, 1]")
    _check("min_p", m, lambda x: (x >= 0) & (x <= 1), "must be in [0, 1]")
    _check("repetition_penalty", r, lambda x: x > 0, "must be > 0")
    _check("presence_penalty", pres, lambda x: np.abs(x) <= 2, "must be in [-2, 2]")
    _check("frequency_penalty", freq, lambda x: np.abs(x) <= 2, "must be in [-2, 2]")
    return SamplingParams(*(jnp.asarray(a) for a in (t, k, p, m, r, pres, freq)))


def apply_penalties(logits: Array, sp: SamplingParams, seen: Array, out_counts: Array) -> Array:
    """logits [B, vocab] float32; seen [B, vocab] bool (prompt + output); out_counts [B, vocab]."""
    rp = sp.repetition_penalty[:, None]
    penalised = jnp.where(logits > 0, logits / rp, logits * rp)
    logits = jnp.where(seen, penalised, logits)
    counts = out_counts.astype(jnp.float32)
    return logits - sp.presence_penalty[:, None] * (counts > 0) - sp.frequency_penalty[:, None] * counts


def logprobs_of(logits: Array, sp: SamplingParams, seen: Array, out_counts: Array) -> Array:
    """Log-probabilities [B, vocab] as the sampler sees the logits: penalties applied, then divided
    by the temperature (1 for greedy), before any top-k / top-p / min-p cut."""
    pen = apply_penalties(logits, sp, seen, out_counts)
    return jax.nn.log_softmax(pen / jnp.where(sp.temperature > 0, sp.temperature, 1.0)[:, None], axis=-1)


def filter_logits(logits: Array, sp: SamplingParams) -> Array:
    """Temperature-scaled logits with top-k, top-p and min-p masked to -inf. [B, vocab]."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(sp.temperature, 1e-6)[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [B, vocab]
    # top-k: keep logits >= the k-th largest (k = 0 keeps all)
    k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    keep = scaled >= kth
    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches p
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    n_keep = jnp.sum(mass_before < sp.top_p[:, None], axis=-1)  # >= 1 always
    pth = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
    keep &= scaled >= pth
    # min-p: keep tokens with prob >= min_p * max prob
    probs = jax.nn.softmax(scaled, axis=-1)
    keep &= probs >= sp.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(keep, scaled, -jnp.inf)


def sample(logits: Array, sp: SamplingParams, keys: Array) -> Array:
    """One token per row. logits [B, vocab] (penalties already applied); keys [B] PRNG keys."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        filtered = filter_logits(logits, sp)
        drawn = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        return jnp.where(sp.temperature > 0, drawn, greedy)

    # The filters sort the vocabulary (slow on XLA:CPU, ~15 ms at 32k): skip them when no row samples.
    return jax.lax.cond(jnp.any(sp.temperature > 0), draw, lambda _: greedy, None)


def row_keys(seeds: Sequence[int]) -> Array:
    """One PRNG key per row from integer seeds: a row's draws depend on its seed alone."""
    return jax.vmap(jax.random.PRNGKey)(jnp.asarray(np.asarray(seeds, np.uint32)))


# --- sampler state -----------------------------------------------------------------------


@pytree.dataclass
class Sampler:
    """Per-row sampling state carried between steps."""

    params: SamplingParams
    keys: Array  # [B] PRNG keys, one per row (from the row's seed)
    step: Array  # [B] int32: tokens drawn so far (folded into the key)
    seen: Array  # [B, vocab] bool: prompt and output tokens (repetition penalty)
    out_counts: Array  # [B, vocab] int32: output tokens (presence / frequency penalties)


def init_sampler(sp: SamplingParams, seeds: Sequence[int], vocab: int, tokens=None, counts=None) -> Sampler:
    """A sampler for len(seeds) rows; `tokens [B, T]` / `counts [B]` mark the prompt as seen."""
    b = len(seeds)
    seen = jnp.zeros((b, vocab), bool)
    if tokens is not None:
        valid = np.arange(tokens.shape[1])[None] < np.asarray(counts)[:, None]
        seen = seen.at[np.arange(b)[:, None], np.asarray(tokens)].max(jnp.asarray(valid))
    return Sampler(sp, row_keys(seeds), jnp.zeros((b,), jnp.int32), seen, jnp.zeros((b, vocab), jnp.int32))


def next_token(logits: Array, s: Sampler) -> tuple[Array, Sampler]:
    """Draw one token per row from logits [B, vocab]; returns (tokens [B], new sampler)."""
    logits = apply_penalties(logits, s.params, s.seen, s.out_counts)
    keys = jax.vmap(jax.random.fold_in)(s.keys, s.step)
    tok = sample(logits, s.params, keys)
    rows = jnp.arange(tok.shape[0])
    return tok, s.replace(
        step=s.step + 1, seen=s.seen.at[rows, tok].set(True), out_counts=s.out_counts.at[rows, tok].add(1)
    )


# --- per-row logit adjustments: logit_bias, min_tokens, grammar masks ---------------------

BANNED = -100.0  # a logit_bias of -100 bans the token (OpenAI: "should result in a ban")


def bias_row(vocab: int, logit_bias: Sequence[tuple[int, float]] = ()) -> np.ndarray:
    """One row's dense additive bias [vocab] float32 from (token id, bias) pairs; -100 is -inf."""
    row = np.zeros((vocab,), np.float32)
    for tid, b in logit_bias:
        row[tid] = -np.inf if b <= BANNED else b
    return row


def unpack_bitmask(bits: Array, vocab: int) -> Array:
    """bits [B, ceil(vocab / 32)] int32 (bit j of word w allows token 32 w + j, as llguidance and
    xgrammar write them) -> allowed [B, vocab] bool."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    allowed = (jnp.right_shift(bits[:, :, None], shifts) & 1).astype(bool)  # [B, words, 32]
    return allowed.reshape(bits.shape[0], -1)[:, :vocab]


def adjust_logits(logits: Array, bias: Array, bits: Array | None, stops: Array, ban_stops: Array) -> Array:
    """Logits [B, vocab] with each row's additive bias [B, vocab] (-inf bans), its grammar mask
    `bits` (unpack_bitmask; None: no masks) and, where ban_stops [B], its stop ids stops [B, S]
    (-1 = none) banned (min_tokens not reached yet)."""
    logits = logits + bias
    if bits is not None:
        logits = jnp.where(unpack_bitmask(bits, logits.shape[-1]), logits, -jnp.inf)
    rows = jnp.arange(logits.shape[0])[:, None]
    banned = ban_stops[:, None] & (stops >= 0)
    return logits.at[rows, jnp.where(banned, stops, logits.shape[-1])].set(-jnp.inf, mode="drop")
