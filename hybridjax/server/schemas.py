"""Request bodies of the OpenAI-style endpoints, validated by pydantic.

Ranges follow OpenAI's API where it defines them; hybridjax extensions (top_k, min_p,
repetition_penalty, cache_salt, chat_template_kwargs) follow vLLM's names. A field this server
does not implement is an error that says so (`unsupported_fields`), never silently ignored;
only fields that change nothing about the output (`user`, `metadata`, ...) are accepted and
ignored. Floats must be finite.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

SEED_LIMIT = 2**32  # the sampler's key is a uint32; -1 means "random"
TOP_K_LIMIT = 2**31  # an int32 on the device
MAX_LOGPROBS = 20  # alternatives per token the engine computes at most
MAX_N = 16
TOP_P_FLOOR = 1.1754943508222875e-38  # float32's smallest normal number
TEMPERATURE_FLOOR = 1e-6  # the least temperature hybridjax.sampling.filter_logits divides by

# Accepted and ignored: they do not change what is generated.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: Union[str, dict] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # a tool's answer
    reasoning_content: str | None = None  # an assistant's thinking, for templates that render it

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """The message as chat templates read it. Tool-call arguments become objects: Qwen3.5's
        template iterates them (`arguments|items`), Qwen3's prints a string or `tojson`s an
        object (vLLM does the same conversion)."""
        m: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                m[key] = getattr(self, key)
        if self.tool_calls:
            m["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in self.tool_calls]
        return m


def _arguments(a):
    if isinstance(a, dict):
        return a
    try:
        v = json.loads(a)
    except ValueError:
        return a
    return v if isinstance(v, dict) else a


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class SamplingFields(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, lt=TOP_K_LIMIT)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # vLLM accepts any value > 0; a tiny one divides logits into infinities. 0.01..100 is wider
    # than any useful setting (1.0..1.5 in practice).
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=100.0)
    seed: int | None = Field(default=None, ge=-1, lt=SEED_LIMIT)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    cache_salt: str | None = Field(default=None, max_length=256)
    response_format: ResponseFormat | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        """0 is greedy; the sampler divides by at least TEMPERATURE_FLOOR, and the log-probabilities
        it reports must use the same (1e-40, a float32 subnormal, made them NaN: a 500)."""
        return max(v, TEMPERATURE_FLOOR) if v > 0 else v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        """The sampler holds top_p in float32, where a tiny value (1e-300) rounds to 0, which it
        refuses. Any top_p at or below the top token's probability (>= 1 / vocab) keeps the top
        token alone, so raising a tiny one to float32's smallest normal number changes nothing."""
        return max(v, TOP_P_FLOOR)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop strings")
        return stops

    @field_validator("response_format")
    @classmethod
    def _format(cls, v):
        if v is not None and v.type != "text":
            raise ValueError(f"response_format type '{v.type}' is not supported by this server "
                             "(no constrained decoding); only 'text'")
        return v

    def unsupported_fields(self) -> list[str]:
        """Fields the client sent that this server does not implement."""
        return sorted(k for k in (self.model_extra or {}) if k not in IGNORED_FIELDS)


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    chat_template_kwargs: dict | None = None  # e.g. {"enable_thinking": false} for Qwen3.5 templates

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v, info: ValidationInfo):
        """A "required" or named tool_choice needs tools, and a named one must be among them (the
        server forces the call's opening: openai_format.forced_tool_opening)."""
        if v in (None, "none", "auto"):
            return v
        names = [t.function.name for t in info.data.get("tools") or ()]
        if not names:
            raise ValueError("tool_choice 'required' or a function needs tools")
        if v == "required":
            return v
        function = v.get("function") if v.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ValueError('a named tool_choice is {"type": "function", "function": {"name": ...}}')
        if name not in names:
            raise ValueError(f"the function '{name}' is not among the tools")
        return {"type": "function", "function": {"name": name}}


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and (not v or any(t < 0 for t in v)):
            raise ValueError("a token-id prompt must be a non-empty list of non-negative integers")
        if isinstance(v, str) and not v:
            raise ValueError("the prompt is empty")
        return v
