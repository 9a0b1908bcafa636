"""OpenAI response pieces built from the engine's output: log-probabilities and tool calls.

Tool calls are read from the text the way Qwen's chat templates ask models to write them, in a
`<tool_call>...</tool_call>` block holding either
  - JSON `{"name": ..., "arguments": {...}}` (Qwen3, Qwen3-Next: the "hermes" format), or
  - `<function=NAME><parameter=P>value</parameter>...</function>` (Qwen3.5, Qwen3-Coder),
whose parameter values are JSON unless the tool's schema says the parameter is a string
(vLLM's qwen3_coder parser reads them the same way). A block that does not parse stays text.

`tool_choice` "required" or a named function is honoured without constrained decoding: the
prompt ends with the opening of a call (`forced_tool_opening`), and the response is read as if
the model had written that opening itself.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Sequence

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


# --- log-probabilities ---------------------------------------------------------------------

def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, entries: Sequence[tuple[int, tuple]]) -> dict:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]} from
    (token id, (logprob, ((id, logprob), ...))) pairs."""
    def one(tid, lp):
        t = token_text(tokenizer, tid)
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "replace"))}

    return {"content": [{**one(tid, lp), "top_logprobs": [one(i, v) for i, v in top]}
                        for tid, (lp, top) in entries]}


def completion_logprobs(tokenizer, entries: Sequence[tuple[int, tuple]], offset: int = 0) -> dict:
    """OpenAI completions `logprobs`: parallel lists of tokens, their logprobs, the top
    alternatives ({token: logprob}) and each token's character offset in the text. An entry
    (id, (None, None)) has neither (an echoed prompt's first token, which nothing predicts)."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, (lp, top) in entries:
        t = token_text(tokenizer, tid)
        tokens.append(t)
        lps.append(lp)
        tops.append(None if top is None else {token_text(tokenizer, i): v for i, v in top})
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def joined_logprobs(a: dict, b: dict) -> dict:
    """Completions `logprobs` of two consecutive pieces of text (an echoed prompt, then the answer)."""
    return {k: a[k] + b[k] for k in a}


# --- tool calls ----------------------------------------------------------------------------

def _string_params(tools) -> dict[str, set[str]]:
    """function name -> its parameters whose schema type is string."""
    out = {}
    for t in tools or ():
        props = (t.function.parameters or {}).get("properties") or {}
        out[t.function.name] = {k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"}
    return out


def parse_block(block: str, tools=None) -> dict | None:
    """One `<tool_call>` block's body -> an OpenAI tool call, or None if it does not parse."""
    body = block.strip()
    name, args = None, None
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
    else:
        m = _FUNCTION.search(body)
        if m:
            name, strings = m.group(1).strip(), _string_params(tools).get(m.group(1).strip(), set())
            args = {}
            for p, raw in _PARAMETER.findall(m.group(2)):
                value = raw.strip("\n")
                if p.strip() not in strings:
                    try:
                        value = json.loads(value)
                    except ValueError:
                        pass
                args[p.strip()] = value
    if not name:
        return None
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolCallStream:
    """Splits generated text, as it arrives, into content and tool calls. Text that may be the
    start of `<tool_call>` is held until it is known not to be."""

    def __init__(self, tools=None, opening: str = ""):
        self.tools = tools
        self.pending = ""
        self.inside = False
        self.calls: list[dict] = []
        self.push(opening)  # a forced opening (forced_tool_opening) reads as the model's own text

    def push(self, text: str) -> tuple[str, list[dict]]:
        """(content to send, tool calls completed) after `text`."""
        self.pending += text
        content, calls = "", []
        while True:
            if self.inside:
                end = self.pending.find(CLOSE)
                if end < 0:
                    break
                body, self.pending, self.inside = self.pending[:end], self.pending[end + len(CLOSE):], False
                call = parse_block(body, self.tools)
                if call is None:
                    content += OPEN + body + CLOSE
                else:
                    calls.append(call)
            else:
                start = self.pending.find(OPEN)
                if start < 0:
                    hold = _partial_tail(self.pending, OPEN)
                    content += self.pending[: len(self.pending) - hold]
                    self.pending = self.pending[len(self.pending) - hold:]
                    break
                content += self.pending[:start]
                self.pending, self.inside = self.pending[start + len(OPEN):], True
        self.calls += calls
        return content, calls

    def flush(self) -> tuple[str, list[dict]]:
        """At the end: an unterminated block is parsed if it can be (a stop token may end the
        text before `</tool_call>`), else it is text."""
        rest, calls = self.pending, []
        if self.inside:
            call = parse_block(rest, self.tools)
            rest = "" if call else OPEN + rest
            calls = [call] if call else []
        self.pending, self.inside = "", False
        self.calls += calls
        return rest, calls


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def forced_tool_opening(chat_template: str | None, tool_choice) -> str:
    """The text a response must start with for `tool_choice`: "required" opens a call block (the
    model names the function); {"type": "function", "function": {"name": N}} also names N, as the
    template writes calls (`<function=N>` in Qwen3.5's XML form, else Qwen3's JSON). "" otherwise."""
    if tool_choice == "required":
        return OPEN + "\n"
    if not isinstance(tool_choice, dict):
        return ""
    name = tool_choice["function"]["name"]
    if chat_template and "<function=" in chat_template:
        return f"{OPEN}\n<function={name}>\n"
    return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


def close_thinking(prompt: str) -> str:
    """What a prompt whose generation prompt opened a thinking block (Qwen3.5, thinking on) needs
    before a forced call: the block closed empty, as the templates write it with thinking off, so
    the call is the answer rather than part of the thought."""
    return "\n</think>\n\n" if prompt.endswith("<think>\n") else ""


def split_tool_calls(text: str, tools=None, opening: str = "") -> tuple[str | None, list[dict]]:
    """(content or None, tool calls) of a whole response that started with `opening`."""
    s = ToolCallStream(tools, opening)
    content, _ = s.push(text)
    rest, _ = s.flush()
    content += rest
    if not s.calls:
        return content, []
    return content.strip() or None, s.calls
