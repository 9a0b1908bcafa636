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

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

SEED_LIMIT = 2**32  # the sampler's key is a uint32; -1 means "random"
TOP_K_LIMIT = 2**31  # an int32 on the device
MAX_LOGPROBS = 20  # alternatives per token the engine computes at most
MAX_N = 16
TOP_P_FLOOR = 1.1754943508222875e-38  # float32's smallest normal number
TEMPERATURE_FLOOR = 1e-6  # the least temperature hybridjax.sampling.filter_logits divides by
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
MAX_STOP_TOKEN_IDS = 64

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


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: Union[dict, bool] = Field(default=True, alias="schema")  # True: any JSON value
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`text`, `json_object` (any JSON object) or `json_schema` (a value matching the schema);
    both JSON kinds are enforced by constrained decoding (hybridjax.grammar), strict or not."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.json_schema is None and self.type == "json_schema":
            raise ValueError("type 'json_schema' needs a json_schema object")
        return self

    def constraint_schema(self) -> dict | bool | None:
        """The schema to constrain to (None: any object); only for the JSON kinds."""
        if self.type == "json_object":
            return None
        if self.json_schema is None:  # a json_schema without one is rejected by the validator
            raise ValueError("response_format 'json_schema' needs a json_schema")
        return self.json_schema.schema_


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
    # What benchmark clients and vLLM users send (vLLM's names and semantics):
    ignore_eos: bool = False  # EOS does not end the response (stop_token_ids still do)
    min_tokens: int = Field(default=0, ge=0)  # no EOS / stop token id before this many tokens
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    logit_bias: dict[str, float] | None = None  # OpenAI: token id -> bias in [-100, 100]; -100 bans

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

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if v and any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative integers")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if not v:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for k, b in v.items():
            if not k.isdigit():
                raise ValueError(f"'{k}' is not a token id (a non-negative integer)")
            if not -100 <= b <= 100:
                raise ValueError(f"the bias of token {k} is {b}; it must be in [-100, 100]")
        return v

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items())

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
