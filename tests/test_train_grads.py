"""Loss and gradients against torch autograd on the tiny HF checkpoints (dense, MoE, tied,
multimodal-prefixed), every parameter matched by name; the MTP loss term's gradients against
the torch MTP head of tests/hf_models.py.

Our gradients are mapped into HF names by the checkpoint rules of `hybridjax.conversion.names` (the
transforms are transposes, reshapes, splits and stacks, so they carry gradients exactly as they
carry weights). Through the Gated DeltaNet layers our gradients come from the delta rule's
custom VJP (XLA backward on CPU); torch differentiates its own chunked delta rule.

Tolerance: both sides float32, different op orders (chunked forms, fused matmuls): per
parameter, max|ours - torch| <= GRAD_RTOL * max|torch|. Measured: matrices and norms <= ~1e-5;
the gate vectors A_log and dt_bias up to 7e-5 (their gradients are sums, over every token, of
terms of both signs: the cancellation leaves a small max|torch| and a larger relative error),
hence their own bound, GATE_RTOL. The loss agrees to 1e-5 relative (measured ~2e-7).
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # checks against transformers: skipped without torch

import hf_models
import hybridjax
from hybridjax.conversion.hf import flat_leaves, has_fused_experts, text_root
from hybridjax.conversion.names import rules_for
from hybridjax.train import loss_terms

GRAD_RTOL = 1e-4
GATE_RTOL = 5e-4
LOSS_RTOL = 1e-5
B, T = 2, 33


def err_ratio(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def make_batch(vocab: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (B, T + 1)).astype(np.int32)
    mask = (rng.random((B, T)) < 0.8).astype(np.float32)
    mask[1, 20:] = 0.0  # a padded tail
    return {"tokens": tokens, "mask": mask}


def _objective(params, batch, cfg, mtp_weight):
    terms = loss_terms(params, batch, cfg, mtp=mtp_weight > 0)
    n = jnp.sum(batch["mask"])
    return terms["ce"] / n + mtp_weight * terms["mtp"] / jnp.sum(batch["mask"][:, 1:])


_value_and_grad = jax.jit(jax.value_and_grad(_objective), static_argnames=("cfg", "mtp_weight"))


def torch_loss(model, batch, head=None, mtp_weight=0.0):
    tokens = torch.as_tensor(batch["tokens"], dtype=torch.long)
    mask = torch.as_tensor(batch["mask"])
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    text = model.model.language_model if hasattr(model.model, "language_model") else model.model
    hidden = text(input_ids=inputs).last_hidden_state  # final-normed
    logits = model.lm_head(hidden).float()
    nll = -torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    loss = (nll * mask).sum() / mask.sum()
    if head is not None:
        pos = torch.arange(T - 1)[None].expand(B, T - 1)
        mtp_logits, _ = head(hidden[:, :-1], inputs[:, 1:], pos)
        nll2 = -torch.log_softmax(mtp_logits.float(), -1).gather(-1, targets[:, 1:, None])[..., 0]
        loss = loss + mtp_weight * (nll2 * mask[:, 1:]).sum() / mask[:, 1:].sum()
    return loss


def compare_grads(model, grads, cfg, head=None) -> dict[str, float]:
    """err ratio per HF tensor; asserts every param leaf of ours was compared."""
    named = {n: p for n, p in model.named_parameters() if not n.startswith("model.visual.")}
    if head is not None:
        named.update({f"mtp.{n}": p for n, p in head.named_parameters()})
    names = set(named)
    rules = rules_for(cfg, text_root(names), has_fused_experts(names), mtp=head is not None)
    ours = flat_leaves(grads)
    for path in [p for p in ours if p.startswith("extra.")]:  # the kept vision tower: unused by the text model
        assert not np.any(np.asarray(ours.pop(path))), path
    ratios, seen = {}, set()
    for rule in rules:
        theirs = rule.to_params(*(named[n].grad.numpy() for n in rule.hf))
        for path, g in zip(rule.params, theirs):
            ratios[path] = err_ratio(ours[path], g)
            seen.add(path)
    assert seen == set(ours), set(ours) ^ seen
    return ratios


@pytest.mark.parametrize("arch", ["qwen3_5_dense", "qwen3_next_moe", "qwen3_5_moe", "qwen3_5_multimodal"])
def test_loss_and_every_gradient_match_torch(arch, loaded, hf_dirs):
    cfg, params = loaded[arch]
    model = hf_models.load_torch(hf_dirs[arch])  # a fresh copy: its .grad fields are ours to fill
    batch = make_batch(cfg.vocab_size, seed=1)
    loss, grads = _value_and_grad(params, batch, cfg, 0.0)
    ref = torch_loss(model, batch)
    ref.backward()
    ref = ref.detach()
    assert abs(float(loss) - float(ref)) <= LOSS_RTOL * abs(float(ref)), (float(loss), float(ref))
    check_ratios(compare_grads(model, grads, cfg), f"{arch}: loss {float(loss):.7f} vs {float(ref):.7f}")


def check_ratios(ratios: dict[str, float], label: str) -> None:
    gates = {p: r for p, r in ratios.items() if p.endswith(("A_log", "dt_bias"))}
    rest = {p: r for p, r in ratios.items() if p not in gates}
    worst = max(rest, key=rest.get)
    worst_gate = max(gates, key=gates.get)
    print(f"{label}; worst gradient {worst} {rest[worst]:.1e}, worst gate {worst_gate} {gates[worst_gate]:.1e}")
    assert rest[worst] < GRAD_RTOL, (worst, rest[worst])
    assert gates[worst_gate] < GATE_RTOL, (worst_gate, gates[worst_gate])


def test_mtp_loss_gradients_match_torch(hf_dirs, tmp_path):
    d = tmp_path / "with_mtp"
    shutil.copytree(hf_dirs["qwen3_5_dense"], d)
    model = hf_models.load_torch(d)
    head = hf_models.add_mtp_head(d, model)
    cfg, params = hybridjax.load_hf(d)
    batch = make_batch(cfg.vocab_size, seed=2)
    loss, grads = _value_and_grad(params, batch, cfg, 0.3)
    ref = torch_loss(model, batch, head, 0.3)
    ref.backward()
    ref = ref.detach()
    assert abs(float(loss) - float(ref)) <= LOSS_RTOL * abs(float(ref)), (float(loss), float(ref))
    ratios = compare_grads(model, grads, cfg, head)
    assert sum(p.startswith("mtp.") for p in ratios) >= 10
    check_ratios(ratios, f"with MTP: loss {float(loss):.7f} vs {float(ref):.7f}")
