"""Constrained decoding on the host: grammars from JSON schemas and tool definitions, and one
matcher per constrained request that gives the next token's allowed set as a bitmask.

Built on llguidance (a Rust grammar engine made for this: a token mask in tens of microseconds,
computed lazily over a token trie; chosen over xgrammar by measured per-token mask cost and
because xgrammar needs torch at run time: benchmarks/bench_grammar_mask.py, README "Structured
outputs"). The engine keeps the mask on the device (`engine_steps.set_bits`) and applies it before
sampling (`sampling.adjust_logits`); rows without a grammar skip that.

A grammar is a string (llguidance's serialized form): what `GenerationRequest.grammar` carries, so
a request stays plain data. The grammar ends where the schema's value ends; then only the stop
(EOS) tokens are allowed, so a constrained response ends by itself.
"""

from __future__ import annotations

import functools
import json
import threading

import numpy as np


class GrammarError(ValueError):
    """A schema or grammar the engine cannot compile; the message names the problem."""


class UnsupportedTokenizer(GrammarError):
    """llguidance cannot read this tokenizer (e.g. the tests' char-level one): no grammar applies."""


def _ll():
    import llguidance

    return llguidance


def json_schema_grammar(schema: dict | bool | None) -> str:
    """The grammar of a JSON value matching `schema` (None: any JSON object, `json_object`)."""
    ll = _ll()
    if schema is None:
        schema = {"type": "object"}
    try:
        # Compact separators as models write JSON; any whitespace would let a weak model wander.
        return ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the JSON schema cannot be compiled: {e}") from None


def _json_embed(schema: dict) -> str:
    """A Lark rule body for a JSON value matching `schema` (llguidance's %json extension), written
    compactly (as `json_schema_grammar`)."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}}, ensure_ascii=False)


def tool_call_grammar(tools: list[dict], name: str | None, opening: str) -> str:
    """The grammar of the rest of a forced tool call in Qwen's hermes (JSON) layout, after the
    text `opening` that the prompt already ends with (openai_format.forced_tool_opening):
      named function N: the opening holds `{"name": "N", "arguments": `, so ARGS `}` and the close;
      "required": the opening is `<tool_call>\\n`, so `{"name": ..., "arguments": ARGS}` of any tool.
    ARGS match the tool's `parameters` schema (any object when it has none)."""
    def args(tool):
        return _json_embed(tool.get("parameters") or {"type": "object"})

    close = json.dumps("}\n</tool_call>")
    if name is not None:
        tool = next(t for t in tools if t["name"] == name)
        return _lark(f"start: {args(tool)} {close}\n")
    alts = []
    for i, t in enumerate(tools):
        head = json.dumps('{"name": ' + json.dumps(t["name"], ensure_ascii=False) + ', "arguments": ')
        alts.append(f"call{i}: {head} {args(t)} {close}")
    return _lark("start: " + " | ".join(f"call{i}" for i in range(len(tools))) + "\n" + "\n".join(alts) + "\n")


def _lark(text: str) -> str:
    return _ll().LLMatcher.grammar_from_lark(text)


class Compiler:
    """Matchers for one tokenizer. The llguidance tokenizer is built once, lazily (about a second
    for a 150k-token vocabulary), and shared by every matcher."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]):
        self._json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, tuple(eos_ids)
        self._lock = threading.Lock()

    @functools.cached_property
    def _built(self):
        with self._lock:
            try:
                return _ll().LLTokenizer(self._json, n_vocab=self.vocab_size, eos_token=list(self.eos_ids) or None)
            except ValueError as e:  # kept, so a tokenizer that fails is not parsed again per request
                return UnsupportedTokenizer(f"constrained decoding is not available with this tokenizer: {e}")

    @property
    def _tokenizer(self):
        if isinstance(self._built, UnsupportedTokenizer):
            raise self._built
        return self._built

    def check(self, grammar: str) -> None:
        """Raise GrammarError unless `grammar` compiles against this vocabulary."""
        is_error, messages = _ll().LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise GrammarError(f"the grammar cannot be compiled: {messages[0]}")

    def matcher(self, grammar: str) -> "Constraint":
        return Constraint(_ll().LLMatcher(self._tokenizer, grammar, log_level=0), self.vocab_size)


class Constraint:
    """One request's grammar state: `bits` allows the next token; `advance` takes the drawn one."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be compiled: {matcher.get_error()}")
        self.bits = np.full(((vocab_size + 31) // 32,), -1, np.int32)
        self._fill()

    def _fill(self) -> None:
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)

    def advance(self, token: int) -> bool:
        """Take the drawn token; False if the grammar rejects it (then the response must end)."""
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            return False
        if not self.matcher.is_stopped():
            self._fill()
        return True

    @property
    def finished(self) -> bool:
        """The grammar has matched a whole value and allows nothing but the end."""
        return self.matcher.is_stopped()
