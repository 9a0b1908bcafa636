"""OpenAI's Responses API: POST /v1/responses (streaming or not), GET and DELETE /v1/responses/{id}.

The server keeps the conversation: a stored response holds its rendered conversation (the
messages, the answer included, as the chat template reads them) and the token ids of the next
turn's stable prefix, whose snapshot the engine keeps (prefilled in idle time from the response's
own snapshot, as chat reuse does: server.chat_reuse). A request naming `previous_response_id`
renders that conversation plus its new `input`, so its prompt is token for token what chat
completions would get for the whole conversation, and the engine's exact-prefix lookup finds the
snapshot: it prefills only the new input. The snapshot is reached through the store by those
tokens, not pinned: if the store evicted it, the continuation is recomputed, never wrong.

Stored responses are bounded by count and TTL (the snapshot store's, `--cache-entries`,
`--cache-ttl-s`) and isolated by API key and `cache_salt`: an unknown, expired or foreign id is a
404 in OpenAI's error shape. GET / DELETE of a response stored with a cache_salt name it as the
query parameter `cache_salt`. `instructions` apply to their own request only (as OpenAI's do).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import threading
import time
import uuid
from typing import Literal, Union

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from hybridjax.server import openai_format as fmt
from hybridjax.server.schemas import IGNORED_FIELDS, SEED_LIMIT, ChatCompletionRequest, Message

DEFAULT_ENTRIES, DEFAULT_TTL_S = 256, 3600.0


class FunctionTool(BaseModel):
    """A Responses function tool (flat, unlike chat's {"function": {...}})."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str
    input: Union[str, list[dict]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    seed: int | None = Field(default=None, ge=-1, lt=SEED_LIMIT)
    cache_salt: str | None = Field(default=None, max_length=256)

    @field_validator("input")
    @classmethod
    def _input(cls, v):
        if isinstance(v, str) and not v:
            raise ValueError("the input is empty")
        if isinstance(v, list) and not v:
            raise ValueError("the input has no items")
        return v

    def unsupported_fields(self) -> list[str]:
        accepted = IGNORED_FIELDS | {"truncation", "reasoning", "include", "text"}
        return sorted(k for k in (self.model_extra or {}) if k not in accepted)

    def chat_tool_choice(self):
        """tool_choice in chat's form ({"type": "function", "function": {"name": N}} for a named one)."""
        c = self.tool_choice
        if isinstance(c, dict) and c.get("type") == "function" and "function" not in c:
            return {"type": "function", "function": {"name": c.get("name")}}
        return c


def _text_of(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or any(not isinstance(p, dict) for p in content):
        raise ValueError("a message's content is a string or a list of parts")
    bad = [p.get("type") for p in content if p.get("type") not in ("input_text", "output_text", "text")]
    if bad:
        raise ValueError(f"content parts of type '{bad[0]}' are not supported (text only)")
    return "".join(str(p.get("text", "")) for p in content)


def input_messages(items: Union[str, list[dict]]) -> list[dict]:
    """Responses `input` -> chat messages (as Message.for_template gives them). ValueError if bad."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"input.{i}: role must be user, assistant, system or developer")
            out.append(Message(role=role, content=_text_of(item.get("content"))).for_template())
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant":  # calls of one turn join its message
                prev = Message.model_validate(out[-1] | {"tool_calls": (out[-1].get("tool_calls") or []) + [call]})
                out[-1] = prev.for_template()
            else:
                out.append(Message(role="assistant", content="", tool_calls=[call]).for_template())
        elif kind == "function_call_output":
            out.append(Message(role="tool", content=str(item.get("output", "")),
                               tool_call_id=item.get("call_id")).for_template())
        else:
            raise ValueError(f"input.{i}: items of type '{kind}' are not supported")
    return out


@dataclasses.dataclass
class Stored:
    namespace: str  # the API key's namespace + ":" + cache_salt
    messages: list[dict]  # the conversation, this response's answer last
    body: dict  # the response object as GET returns it
    last_used: float


class ResponseStore:
    """id -> Stored, bounded by count (least recently used goes) and TTL."""

    def __init__(self, max_entries: int = DEFAULT_ENTRIES, ttl_s: float | None = DEFAULT_TTL_S, clock=time.monotonic):
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._entries: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, entry: Stored) -> None:
        with self._lock:
            self._entries[rid] = entry
            self._entries.move_to_end(rid)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, rid: str, namespace: str) -> Stored | None:
        """The entry if it exists, has not expired and belongs to `namespace`."""
        with self._lock:
            e = self._entries.get(rid)
            now = self.clock()
            if e is not None and self.ttl_s is not None and now - e.last_used > self.ttl_s:
                del self._entries[rid]
                e = None
            if e is None or e.namespace != namespace:
                return None
            e.last_used = now
            self._entries.move_to_end(rid)
            return e

    def delete(self, rid: str, namespace: str) -> bool:
        with self._lock:
            e = self._entries.get(rid)
            if e is None or e.namespace != namespace:
                return False
            del self._entries[rid]
            return True

    def __len__(self) -> int:
        return len(self._entries)


def install(app, h) -> ResponseStore:
    """Add the /v1/responses routes to `app`; `h` holds create_app's helpers (see app.py)."""
    engine, tok, model_name = h.engine, h.tok, h.model_name
    store = engine.store
    responses = ResponseStore(store.max_entries if store is not None else DEFAULT_ENTRIES,
                              store.ttl_s if store is not None else DEFAULT_TTL_S)
    app.state.responses = responses

    def not_found(rid: str, param: str | None = None):
        return h.APIError(404, f"No response found with id '{rid}'.", param=param, code="response_not_found")

    def namespace_of(request: Request, salt: str | None) -> str:
        return h.check_auth(request) + ":" + (salt or "")

    @app.post("/v1/responses")
    async def create(request: Request):
        key_ns = h.check_auth(request)
        req: ResponsesRequest = await h.parse(request, ResponsesRequest)
        ns = key_ns + ":" + (req.cache_salt or "")
        history: list[dict] = []
        if req.previous_response_id is not None:
            prev = responses.get(req.previous_response_id, ns)
            if prev is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            history = prev.messages
        try:
            new = input_messages(req.input)
        except ValueError as e:
            raise h.APIError(400, f"invalid parameter 'input': {e}", param="input") from None
        conversation = history + new
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        chat_body = {"model": req.model, "messages": system + conversation, "temperature": req.temperature,
                     "top_p": req.top_p, "seed": req.seed, "cache_salt": req.cache_salt,
                     "max_tokens": req.max_output_tokens}
        if req.tools:
            chat_body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                                  for t in req.tools]
        if req.tool_choice is not None:
            chat_body["tool_choice"] = req.chat_tool_choice()
        try:
            chat = ChatCompletionRequest.model_validate(chat_body)
        except Exception as e:  # pydantic's ValidationError: name the Responses parameter
            err = e.errors()[0] if hasattr(e, "errors") else {"loc": (), "msg": str(e)}
            loc = [str(p) for p in err["loc"]]
            param = {"max_tokens": "max_output_tokens", "messages": "input"}.get(loc[0] if loc else "", ".".join(loc))
            raise h.APIError(400, f"invalid parameter '{param}': {err['msg'].removeprefix('Value error, ')}",
                             param=param) from None
        tools = chat.tools if chat.tools and chat.tool_choice != "none" else None
        kwargs = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools else {}
        opening = fmt.forced_tool_opening(tok.chat_template, chat.tool_choice) if tools else ""
        grammar = await h.request_grammar(chat, tools, chat.tool_choice)
        messages = system + conversation

        def encode():
            try:
                text = tok.render_chat(messages, add_generation_prompt=True, **kwargs)
            except (ValueError, TypeError) as e:
                raise h.APIError(400, str(e), param="input") from None
            if opening:
                text += fmt.close_thinking(text) + opening
            h.check_length(len(text), "input")
            return tok.encode(text, scope=ns)

        prompt_ids = await asyncio.to_thread(encode)
        (handle,) = h.submit(h.engine_requests(chat, prompt_ids, req.max_output_tokens, key_ns, grammar=grammar))
        rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        msg_id = f"msg_{uuid.uuid4().hex[:24]}"

        def body(status: str, text: str = "", calls=(), usage=None) -> dict:
            output = []
            if text or not calls:
                output.append({"type": "message", "id": msg_id, "status": status,
                               "role": "assistant",
                               "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
            for c in calls:
                output.append({"type": "function_call", "id": "fc_" + c["id"].removeprefix("call_"),
                               "call_id": c["id"], "name": c["function"]["name"],
                               "arguments": c["function"]["arguments"], "status": "completed"})
            incomplete = status == "incomplete"
            return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model_name,
                    "output": output if status != "in_progress" else [], "error": None,
                    "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                    "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                    "previous_response_id": req.previous_response_id, "temperature": req.temperature,
                    "top_p": req.top_p, "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
                    "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": True, "store": req.store,
                    "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": {},
                    "usage": usage}

        def usage_of() -> dict:
            u = h.usage([handle])
            return {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
                    "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": u["total_tokens"]}

        async def finish(text: str, calls: list) -> dict:
            status = "incomplete" if handle.finish_reason == "length" else "completed"
            out = body(status, text, calls, usage_of())
            answer = Message.model_validate({"role": "assistant", "content": text or None,
                                             **({"tool_calls": calls} if calls else {})}).for_template()
            if req.store and handle.finish_reason in ("stop", "length"):
                responses.put(rid, Stored(ns, conversation + [answer], out, responses.clock()))
            await h.remember_next_turn(messages, answer, prompt_ids, handle, ns, kwargs)
            return out

        if not req.stream:
            await h.drain(request, [handle])
            if handle.finish_reason == "error":
                raise h.APIError(500, "generation failed", type_="server_error")
            content, calls = fmt.split_tool_calls(handle.text, tools, opening) if tools else (handle.text, [])
            return JSONResponse(await finish(content or "", calls))

        async def sse():
            seq = 0

            def event(kind: str, **fields) -> str:
                nonlocal seq
                seq += 1
                return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields}, ensure_ascii=False)}\n\n"

            stream = fmt.ToolCallStream(tools, opening) if tools else None
            text, opened = "", False
            item = lambda t, status: {"type": "message", "id": msg_id, "status": status, "role": "assistant",  # noqa: E731
                                      "content": [{"type": "output_text", "text": t, "annotations": [], "logprobs": []}]}
            try:
                yield event("response.created", response=body("in_progress"))
                yield event("response.in_progress", response=body("in_progress"))
                async for _, ev in h.merged([handle]):
                    if ev.finish_reason == "error":
                        yield event("error", code="server_error", message="generation failed", param=None)
                        return
                    piece, _ = stream.push(ev.text) if stream else (ev.text, [])
                    if ev.finish_reason is not None and stream:
                        rest, _ = stream.flush()
                        piece += rest
                    if piece and not opened:
                        opened = True
                        yield event("response.output_item.added", output_index=0, item=item("", "in_progress"))
                        yield event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                    if piece:
                        text += piece
                        yield event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                                    delta=piece, logprobs=[])
                calls = stream.calls if stream else []
                if calls:
                    text = text.strip()
                if opened:
                    yield event("response.output_text.done", item_id=msg_id, output_index=0, content_index=0,
                                text=text, logprobs=[])
                    yield event("response.content_part.done", item_id=msg_id, output_index=0, content_index=0,
                                part={"type": "output_text", "text": text, "annotations": [], "logprobs": []})
                    yield event("response.output_item.done", output_index=0, item=item(text, "completed"))
                final = await finish(text, calls)
                for i, out_item in enumerate(final["output"]):
                    if out_item["type"] == "function_call":
                        yield event("response.output_item.added", output_index=i, item=out_item)
                        yield event("response.function_call_arguments.done", item_id=out_item["id"], output_index=i,
                                    arguments=out_item["arguments"])
                        yield event("response.output_item.done", output_index=i, item=out_item)
                kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                yield event(kind, response=final)
            finally:
                handle.cancel()

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.get("/v1/responses/{rid}")
    async def get(rid: str, request: Request, cache_salt: str | None = None):
        e = responses.get(rid, namespace_of(request, cache_salt))
        if e is None:
            raise not_found(rid)
        return e.body

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str, request: Request, cache_salt: str | None = None):
        if not responses.delete(rid, namespace_of(request, cache_salt)):
            raise not_found(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}

    return responses
