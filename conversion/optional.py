"""Which tensors of a checkpoint the text model needs, and what happens to the rest.

The text model loads whenever its own tensors are complete and correctly shaped; those are the
only hard requirement. Everything else is optional and never blocks loading:

- the MTP head (`mtp.*`) loads into `Params.mtp` when it is complete and every tensor has the
  shape the config implies; an absent, partial, mis-shaped or unrecognised head is reported in one
  warning line and its tensors are kept verbatim in `Params.extra` (speculative decoding is then
  unavailable; a round trip back to HF still writes them byte for byte);
- the vision tower (`model.visual.*`) and any other tensor outside the text model are kept
  verbatim in `Params.extra`;
- fp8 scales (`*.weight_scale_inv`) belong to their weight (`hybridjax.conversion.fp8`) and are
  kept verbatim too, so that the weights can be quantised back bit for bit.

Tensors under the text model's own names (`{root}layers.`, `{root}embed_tokens.`, `{root}norm.`)
that no rule reads stay an error: they mean config.json does not describe the checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from hybridjax.config import Config
from hybridjax.conversion.names import KEPT_PREFIXES, MTP_PREFIX, Rule, mtp_rules, rules_for

log = logging.getLogger("hybridjax.conversion")

SCALE_SUFFIX = "_scale_inv"  # fp8 block scales: `X.weight_scale_inv` beside `X.weight`
_ZERO_BYTES = np.dtype([])  # itemsize 0: shape-only probes through a rule's to_hf
_SHOWN = 6  # tensor names listed in a warning before "..."


@dataclasses.dataclass(frozen=True)
class Parts:
    """How a checkpoint's tensor names split: the rules that read them (the text model, plus the
    MTP head when it is usable), the text-model problems (errors), and the tensors kept verbatim."""

    rules: list[Rule]
    missing: list[str]  # text-model tensors the config needs and the checkpoint lacks
    unexpected: list[str]  # tensors under the text model's names that no rule reads
    kept: list[str]  # carried verbatim into Params.extra
    warning: str  # one line about optional parts that were not loaded ("" when none)


def _names_of(rules: list[Rule]) -> set[str]:
    return {n for r in rules for n in r.hf}


def expected_hf_shapes(rules: list[Rule], leaf_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> the shape the config implies, through each rule's exact inverse run on
    zero-byte stand-ins (no data is touched)."""
    out = {}
    for rule in rules:
        outs = rule.to_hf(*(np.zeros(leaf_shapes[p], _ZERO_BYTES) for p in rule.params))
        out.update({n: tuple(o.shape) for n, o in zip(rule.hf, outs, strict=True)})
    return out


def _listed(names) -> str:
    names = sorted(names)
    return ", ".join(names[:_SHOWN]) + (f" ... (+{len(names) - _SHOWN})" if len(names) > _SHOWN else "")


def mtp_problems(cfg: Config, names: set[str], shape_of, fused_experts: bool, leaf_shapes) -> list[str]:
    """What keeps the `mtp.*` tensors `names` from being a usable MTP head ([] when usable)."""
    rules = mtp_rules(cfg, fused_experts)
    expected = expected_hf_shapes(rules, leaf_shapes)
    problems = []
    if missing := set(expected) - names:
        problems.append(f"{len(missing)} missing ({_listed(missing)})")
    if unknown := names - set(expected):
        problems.append(f"{len(unknown)} unrecognised ({_listed(unknown)})")
    bad = [f"{n} {shape_of(n)} (expected {expected[n]})" for n in sorted(names & set(expected)) if shape_of(n) != expected[n]]
    if bad:
        problems.append(f"{len(bad)} mis-shaped ({', '.join(bad[:_SHOWN])}{' ...' if len(bad) > _SHOWN else ''})")
    return problems


def declared_mtp_layers(raw_config: dict) -> int:
    """`mtp_num_hidden_layers` from config.json (top level or text_config), 0 when absent."""
    text = raw_config.get("text_config") if isinstance(raw_config.get("text_config"), dict) else {}
    value = raw_config.get("mtp_num_hidden_layers", text.get("mtp_num_hidden_layers", 0))
    return value if isinstance(value, int) else 0


def split_parts(cfg: Config, names: set[str], root: str, fused_experts: bool, shape_of, leaf_shapes,
                raw_config: dict | None = None) -> Parts:
    """Classify a checkpoint's tensor names (see the module docstring). `shape_of(name)` gives a
    stored tensor's shape; `leaf_shapes(mtp)` the param leaf shapes (`hf.leaf_shapes`)."""
    text_rules = rules_for(cfg, root, fused_experts)
    read = _names_of(text_rules)
    missing = sorted(read - names)
    rest = names - read
    scales = {n for n in rest if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in names}
    rest -= scales
    mtp = {n for n in rest if n.startswith(MTP_PREFIX)}
    own = tuple(f"{root}{p}." for p in ("layers", "embed_tokens", "norm"))
    unexpected = sorted(n for n in rest - mtp if n.startswith(own) and not n.startswith(KEPT_PREFIXES))
    rules, notes = text_rules, []
    if mtp:
        problems = mtp_problems(cfg, mtp, shape_of, fused_experts, leaf_shapes(True))
        if problems:
            notes.append(f"MTP head not loaded, speculative decoding unavailable: of its {len(mtp)} mtp.* tensors, "
                         + "; ".join(problems) + "; they are kept verbatim in params.extra")
        else:
            rules = text_rules + mtp_rules(cfg, fused_experts)
    elif declared_mtp_layers(raw_config or {}):
        notes.append(f"config.json declares an MTP head (mtp_num_hidden_layers={declared_mtp_layers(raw_config)}) "
                     "but the checkpoint has no mtp.* tensors: speculative decoding unavailable")
    kept_mtp = mtp if rules is text_rules else set()
    other = rest - mtp - set(unexpected)
    unused = sorted(n for n in other if not n.startswith(KEPT_PREFIXES) and not (n == "lm_head.weight" and cfg.tie_word_embeddings))
    if unused:
        notes.append(f"{len(unused)} tensor(s) the text model does not use ({_listed(unused)}) are kept verbatim in params.extra")
    kept = sorted(kept_mtp | other | scales)
    return Parts(rules, missing, unexpected, kept, "; ".join(notes))
