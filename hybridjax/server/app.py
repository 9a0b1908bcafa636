"""The HTTP API: /v1/chat/completions, /v1/completions (SSE streaming or not), /v1/responses
(server.responses), /v1/models, /v1/models/{id}, /health, /metrics. Errors use OpenAI's body shape
`{"error": {message, type, param, code}}`: 400 invalid JSON or parameter (named in `param`,
unsupported ones included), 401 bad API key, 404 unknown model, 400 prompt over the context,
413 body over the size limit, 429 queue full; never a stack trace, and an unexpected error
keeps the connection open.

Every check runs before a stream starts (a bad value is a 400, never a 200 and an error event).
Rendering and tokenizing run in a worker thread, after a length bound computed from the
characters alone, so a huge prompt neither blocks the event loop nor gets tokenized.
A client that goes away cancels its request, streaming or not.

Heavy work runs in lanes of its own (hybridjax.server.lanes): large bodies are parsed, and
prompts scored for echo + logprobs, off the event loop and off the tokenizing threads, each lane
bounded (429 past it), so a burst of one kind cannot hold up the others. A body must arrive
within `body_timeout_s` (408, connection closed); slow or silent connections and the number of
open connections are bounded in the HTTP protocol itself (hybridjax.server.connections).
With a cache directory the app holds its lock (prefix_cache.DirectoryLock) from creation until
shutdown, and the store writes each snapshot as it is stored and keeps evicted ones on disk
(hybridjax.snapshot_disk).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import signal
import threading
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import jax
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from hybridjax import engine_programs
from hybridjax.engine import Engine, GenerationRequest, QueueFull, RequestHandle
from hybridjax.generate import sampling_params
from hybridjax.pages import page_bytes
from hybridjax.prefix_cache import DirectoryLock, SnapshotStore, history_boundary, model_identity
from hybridjax.server import lanes
from hybridjax.snapshot_disk import FormatRefused, attach_disk, detach_disk
from hybridjax.server import openai_format as fmt
from hybridjax.grammar import GrammarError
from hybridjax.server import responses, structured
from hybridjax.server.chat_reuse import needs_prefill, next_turn_prefix
from hybridjax.server.connections import bind
from hybridjax.server.metrics import render_metrics
from hybridjax.server.schemas import ChatCompletionRequest, CompletionRequest, Message, SamplingFields

log = logging.getLogger("hybridjax.server")

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
DEFAULT_BODY_TIMEOUT_S = 60.0
# The idle-time prefill of a chat's next turn starts this long after the answer: a client that
# sends its next request sooner (an agent whose tool returned at once) finds the engine free; its
# request then runs that prefill itself (hybridjax.engine.Engine.prefill_in_background).
NEXT_TURN_DELAY_S = 0.25
# Template variables a client may not set through chat_template_kwargs (the server sets them).
_RESERVED_TEMPLATE_KWARGS = {"messages", "add_generation_prompt", "tools", "documents",
                             "bos_token", "eos_token", "pad_token", "unk_token"}


@dataclasses.dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    slots: int = 4
    max_len: int = 4096
    max_queue: int = 64
    prefix_cache: bool = True
    cache_mb: float = 1024.0
    cache_entries: int = 256
    cache_eviction: str = "gdsf"  # or "lru" (hybridjax.eviction)
    cache_ttl_s: float = 3600.0
    checkpoint_interval: int = 256
    cache_dir: str | None = None
    cache_disk_mb: float = 4096.0  # the disk tier's budget under cache_dir (hybridjax.snapshot_disk)
    api_key: str | None = None
    api_keys: tuple[str, ...] = ()  # several keys (--api-key-file), each its own cache namespace
    page_size: int = 64
    kv_pages: int | None = None  # None: from kv_mb, else room for every slot at max_len, twice
    kv_mb: float | None = None  # the KV pool's memory budget, when kv_pages is not given
    prefill_chunk: int = 256
    warmup: bool = True  # compile the covering programs before serving, the rest behind
    executable_dir: str | None = None  # keep compiled programs here between runs (engine_programs)
    # A name for this launch's model and settings: the engine notes its programs under it in
    # executable_dir, and the next launch of that name loads them while its weights load.
    launch: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get a 413
    speculative_tokens: int = 0  # K drafts of the MTP head per decode step (0: plain decoding)
    speculative_adaptive: bool = False  # plain steps while drafting does not pay (scheduler.SpecPolicy)
    # Slow and silent clients (hybridjax.server.connections): seconds to send a request's headers,
    # its body, and to send the next request on a kept-alive connection; open connections at most.
    header_timeout_s: float = 10.0
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_s: float = 5.0
    max_connections: int = 1000


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers


def error_response(status: int, message: str, param=None, code=None, type_="invalid_request_error",
                   headers=None) -> JSONResponse:
    # A message may quote the client's text: lone surrogates are escaped so that it can be encoded.
    param = lanes.printable(param) if isinstance(param, str) else param
    return JSONResponse({"error": {"message": lanes.printable(message), "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


def build_engine(sc: ServerConfig, cfg, params, tokenizer, name: str, calls=None):
    """(engine, store) for a loaded model and a ServerConfig (`calls`: see Engine)."""
    if tokenizer is None:
        raise ValueError(f"{name}: the server needs a tokenizer.json in the model directory")
    max_len = min(sc.max_len, cfg.max_position_embeddings)
    store = None
    if sc.prefix_cache:
        # A speculative engine's snapshots carry a hidden state more: their files are kept apart.
        ident = model_identity(name, cfg, params) + ("-mtp" if sc.speculative_tokens else "")
        store = SnapshotStore(ident, max_bytes=int(sc.cache_mb * 2**20),
                              max_entries=sc.cache_entries, ttl_s=sc.cache_ttl_s, policy=sc.cache_eviction,
                              disk_bytes=int(sc.cache_disk_mb * 2**20))
    num_pages = sc.kv_pages
    if num_pages is None and sc.kv_mb is not None:
        num_pages = max(1, int(sc.kv_mb * 2**20 // page_bytes(cfg, sc.page_size, params.embed.dtype,
                                                                mtp=sc.speculative_tokens > 0)))
    engine = Engine(cfg, params, tokenizer, slots=sc.slots, max_len=max_len, store=store,
                    checkpoint_interval=sc.checkpoint_interval, max_queue=sc.max_queue, page_size=sc.page_size,
                    num_pages=num_pages, prefill_chunk=sc.prefill_chunk, speculative_tokens=sc.speculative_tokens,
                    speculative_adaptive=sc.speculative_adaptive, calls=calls,
                    executable_dir=sc.executable_dir if calls is None else None)
    if sc.launch and sc.executable_dir and engine.programs is not None:
        # The next such launch loads these beside its weights (those it serves from, then the
        # others): a first long prompt after a restart found its wide chunks still loading behind.
        engine_programs.note_launch(sc.executable_dir, sc.launch, engine.programs.key, engine.programs_of.loading())
    return engine, store


class _CatchAll:
    """ASGI middleware: an unexpected error becomes an OpenAI-shaped 500 on a connection that
    stays open. (Starlette's handler for `Exception` answers, then re-raises, and the server
    closes the connection.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:  # gone before its whole body came: nobody to answer
            log.info("%s %s: the client disconnected before sending its whole body", scope["method"], scope["path"])
        except Exception:
            log.exception("internal error")
            if started:
                raise
            await error_response(500, "internal server error", type_="server_error")(scope, receive, send)


def _key_namespaces(api_key: str | None, api_keys) -> dict[str, str]:
    keys = ([api_key] if api_key else []) + [k for k in api_keys if k]
    return {k: hashlib.sha256(k.encode()).hexdigest()[:16] for k in keys}


def create_app(engine: Engine, model_name: str, *, api_key: str | None = None, api_keys=(),
               cache_dir: str | None = None, warmup: bool = True,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> FastAPI:
    """The app; its start-up loads persisted snapshots and starts the engine, which first has the
    programs that serve every request (`warmup`: loaded from disk or compiled; the rest compile
    behind) while /health answers 503 "loading". Each API key (`api_key`, `api_keys`) is its own
    cache namespace. With `cache_dir` (and a store) it locks the directory now (`DirectoryInUse`
    if another server has it) and releases it after the shutdown save."""
    store, tok = engine.store, engine.tokenizer
    created = int(time.time())
    keys = _key_namespaces(api_key, api_keys)
    lock = DirectoryLock(cache_dir) if store is not None and cache_dir else None
    # Each lane holds as many requests as the engine's queue: past that, a 429 at once.
    scoring = lanes.Lane("score prompts", 1, engine.max_queue)
    parsing = lanes.Lane("parse bodies", 1, engine.max_queue)

    @asynccontextmanager
    async def lifespan(app):
        if lock is not None:
            lock.acquire()  # again, after an earlier shutdown released it
            try:
                tier = attach_disk(engine, cache_dir)
                log.info("prefix cache: %d snapshots on disk in %s (%.1f MB)", len(tier.index.entries), tier.root,
                         tier.index.nbytes / 2**20)
            except FormatRefused as e:  # left untouched: serve from memory only
                log.error("prefix cache: %s", e)
            except Exception as e:  # an unreadable directory: serve without its snapshots
                log.warning("prefix cache: could not open %s: %s", cache_dir, e)
        engine.start(warmup=warmup, progress=warmup)
        try:
            yield
        finally:
            engine.stop(wait=False)  # a compile under way is not waited for (serve exits past it)
            if lock is not None:
                try:
                    tier = detach_disk(engine)  # what is queued becomes durable
                    if tier is not None:
                        log.info("prefix cache: %d snapshots on disk in %s", len(tier.index.entries), tier.root)
                except Exception as e:  # a read-only directory, a full disk: one line, no traceback
                    log.error("prefix cache: could not save snapshots to %s: %s", cache_dir, e)
                finally:
                    lock.release()

    app = FastAPI(title="hybridjax", lifespan=lifespan)
    app.add_middleware(_CatchAll)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, e.type, e.headers)

    def check_auth(request: Request) -> str:
        """The caller's namespace part from its key ('' with auth off)."""
        if not keys:
            return ""
        header = request.headers.get("authorization", "")
        given = header[len("Bearer "):] if header.startswith("Bearer ") else ""
        for key, namespace in keys.items():
            if hmac.compare_digest(given.encode(), key.encode()):
                return namespace
        raise APIError(401, "invalid or missing API key", code="invalid_api_key", type_="authentication_error")

    async def read_body(request: Request) -> bytes:
        too_big = APIError(413, f"the request body is larger than the limit of {max_body_bytes} bytes",
                           code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_body_bytes:
            raise too_big
        chunks, size = [], 0
        try:
            async with asyncio.timeout(body_timeout_s):  # a trickling client is dropped, not held
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_body_bytes:
                        raise too_big
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {body_timeout_s:g} s",
                           code="request_timeout", headers={"connection": "close"}) from None
        return b"".join(chunks)

    # A body's JSON values bound its parsing time (json.loads holds the GIL: no thread helps):
    # the largest honest body is a token-id prompt of the whole context.
    max_values = 4 * engine.max_len + 65536

    async def parse(request: Request, model_cls):
        raw = await read_body(request)
        try:
            if len(raw) <= lanes.INLINE_BODY_BYTES:
                body = lanes.decode_body(raw)
            else:
                if raw.count(b",") + raw.count(b"[") + raw.count(b"{") > max_values:
                    raise APIError(413, f"the request body has more than {max_values} JSON values",
                                   code="request_too_large")
                body = await parsing.run(lanes.decode_body, raw)
        except lanes.BodyError as e:
            raise APIError(400, str(e), param=e.param) from None
        except lanes.LaneFull as e:
            raise APIError(429, str(e), code="queue_full", type_="rate_limit_error") from None
        try:
            req = model_cls.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            msg = err["msg"].removeprefix("Value error, ")
            raise APIError(400, f"invalid parameter '{param}': {msg}", param=param) from None
        unsupported = req.unsupported_fields()
        if unsupported:
            raise APIError(400, f"unsupported parameter '{unsupported[0]}': this server does not implement it",
                           param=unsupported[0], code="unsupported_parameter")
        if req.model != model_name:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        return req

    def check_length(chars: int, param: str) -> None:
        """Reject, without tokenizing, a text that cannot fit: it has at least chars /
        (longest token's characters) tokens."""
        least = -(-chars // tok.max_token_chars)
        if least >= engine.max_len:
            raise APIError(400, f"the prompt has at least {least} tokens; this model's context is {engine.max_len} tokens",
                           param=param, code="context_length_exceeded")

    def engine_requests(req: SamplingFields, prompt_ids: list[int], max_tokens: int | None, namespace: str,
                        history_len: int | None = None, logprobs: int | None = None,
                        grammar: str | None = None) -> list[GenerationRequest]:
        n, limit = len(prompt_ids), engine.max_len
        param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        if n >= limit:
            raise APIError(400, f"the prompt has {n} tokens; this model's context is {limit} tokens",
                           param=param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - n
        elif n + max_tokens > limit:
            raise APIError(400, f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the context of {limit} tokens",
                           param="max_tokens", code="context_length_exceeded")
        vocab = engine.cfg.vocab_size
        bad = [t for t in prompt_ids if t >= vocab] if prompt_ids and max(prompt_ids) >= vocab else []  # max: in C
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary", param="prompt")
        for param, ids in (("stop_token_ids", req.stop_token_ids or ()), ("logit_bias", [t for t, _ in req.bias_pairs()])):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise APIError(400, f"invalid parameter '{param}': token id {bad[0]} is outside the vocabulary "
                               f"[0, {vocab})", param=param)
        if req.min_tokens > max_tokens:
            raise APIError(400, f"invalid parameter 'min_tokens': {req.min_tokens} is more than max_tokens "
                           f"({max_tokens})", param="min_tokens")
        eos = () if req.ignore_eos else tuple(tok.eos_token_ids) + tuple(engine.cfg.eos_token_id)
        stop_ids = tuple(dict.fromkeys(eos + tuple(req.stop_token_ids or ())))
        out = []
        for i in range(req.n):
            # No seed, or -1: random. A given seed makes choice i use seed + i.
            seed = (int.from_bytes(uuid.uuid4().bytes[:4], "little") if req.seed in (None, -1)
                    else (req.seed + i) % 2**32)
            out.append(GenerationRequest(
                prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                top_k=max(req.top_k, 0), min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, seed=seed,
                stop_ids=stop_ids, stop_strings=tuple(req.stop or ()),
                namespace=namespace + ":" + (req.cache_salt or ""), history_len=history_len, logprobs=logprobs,
                min_tokens=req.min_tokens, logit_bias=req.bias_pairs(), grammar=grammar))
        return out

    async def request_grammar(req: SamplingFields, tools=None, tool_choice=None) -> str | None:
        """The request's grammar (server.structured), compiled once here: a 400 names what fails."""
        try:
            g = structured.grammar_for(req.response_format, tools, tool_choice,
                                       xml_calls=bool(tok.chat_template and "<function=" in tok.chat_template))
            return await asyncio.to_thread(structured.checked, engine, g)
        except GrammarError as e:
            param = getattr(e, "param", None) or ("tool_choice" if "tool_choice" in str(e) else "response_format")
            raise APIError(400, f"invalid parameter '{param}': {e}", param=param) from None

    def submit(greqs: list[GenerationRequest]) -> list[RequestHandle]:
        handles = []
        try:
            for g in greqs:
                handles.append(engine.submit(g, loop=asyncio.get_running_loop()))
        except (QueueFull, ValueError) as e:
            for h in handles:  # all the choices or none
                h.cancel()
            if isinstance(e, QueueFull):
                raise APIError(429, str(e), code="queue_full", type_="rate_limit_error") from None
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None
        return handles

    def usage(handles: list[RequestHandle]) -> dict:
        h0, completion = handles[0], sum(len(h.token_ids) for h in handles)
        return {"prompt_tokens": h0.prompt_tokens, "completion_tokens": completion,
                "total_tokens": h0.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": h0.cached_tokens,
                                          "prefix_cache": h0.cache_report.as_dict()}}

    def scored(h: RequestHandle) -> list[tuple[int, tuple]]:
        """(token, logprobs) of the tokens in the text (not the stop token)."""
        stops = set(h.request.stop_ids)
        return [(t, lp) for t, lp in zip(h.token_ids, h.logprobs) if t not in stops]

    def log_request(kind: str, handles, t0: float, first: float | None) -> None:
        gen = sum(len(h.token_ids) for h in handles)
        now = time.perf_counter()
        ttft = (first - t0) if first else float("nan")
        # The decode rate counts the tokens after each choice's first, over the time since the first:
        # a reply of one token per choice has none (it was logged as thousands of tok/s).
        decoded = gen - len(handles)
        rate = f", {decoded / (now - first):.1f} tok/s" if first and decoded > 0 and now > first else ""
        report = handles[0].cache_report
        log.info("%s: prompt %d tokens (cached %d from %s: %s), generated %d, ttft %.3f s%s, %s", kind,
                 handles[0].prompt_tokens, handles[0].cached_tokens, report.source, report.reason, gen, ttft, rate,
                 ",".join(str(h.finish_reason) for h in handles))

    async def drain(request: Request, handles: list[RequestHandle]) -> float | None:
        """Wait for every handle to finish; a client that disconnects meanwhile cancels them.
        Returns when the first token came (perf_counter), for the log."""
        first = None

        async def consume(h):
            nonlocal first
            async for ev in h.aevents():
                first = first or time.perf_counter()

        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            for h in handles:
                h.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await asyncio.gather(*(consume(h) for h in handles))
        finally:
            watcher.cancel()
            for h in handles:
                h.cancel()  # no-op when finished; frees the slot if this handler was cancelled
        if any(h.finish_reason == "error" for h in handles):
            raise APIError(500, "generation failed", type_="server_error")
        return first

    async def merged(handles: list[RequestHandle]):
        """(choice index, event) of every handle, as they come."""
        q: asyncio.Queue = asyncio.Queue()

        async def forward(i, h):
            async for ev in h.aevents():
                await q.put((i, ev))

        tasks = [asyncio.create_task(forward(i, h)) for i, h in enumerate(handles)]
        try:
            for _ in handles:
                while True:
                    i, ev = await q.get()
                    yield i, ev
                    if ev.finish_reason is not None:
                        break
        finally:
            for t in tasks:
                t.cancel()

    async def remember_next_turn(messages, answer: dict, prompt_ids, h: RequestHandle, namespace: str, kwargs):
        """Chat reuse through the template (see chat_reuse): prefill the next turn's prefix in idle time."""
        if store is None or h.finish_reason not in ("stop", "length"):
            return

        def work():
            prefix = next_turn_prefix(tok.scoped(namespace), messages, answer, **kwargs)
            if prefix and len(prefix) < engine.max_len and needs_prefill(prefix, list(prompt_ids) + h.token_ids):
                engine.prefill_in_background(prefix, namespace, delay_s=NEXT_TURN_DELAY_S)

        await asyncio.to_thread(work)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        t0 = time.perf_counter()
        namespace = check_auth(request)
        req = await parse(request, ChatCompletionRequest)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "invalid parameter 'top_logprobs': it needs logprobs: true", param="top_logprobs")
        messages = [m.for_template() for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise APIError(400, f"invalid parameter 'chat_template_kwargs': '{reserved[0]}' is set by the server",
                           param="chat_template_kwargs")
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        if tools:
            if not tok.renders_tools:
                raise APIError(400, "invalid parameter 'tools': this model's chat template does not render tools, "
                                    "so the model would never see them", param="tools")
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        # tool_choice "required" / a named function: the prompt ends with the call's opening, which
        # then counts as the response's start (parsed with it; the cache holds it as prompt tokens).
        opening = fmt.forced_tool_opening(tok.chat_template, req.tool_choice) if tools else ""

        def encode():
            try:
                text = tok.render_chat(messages, add_generation_prompt=True, **kwargs)
            except (ValueError, TypeError) as e:
                raise APIError(400, str(e), param="messages") from None
            if opening:
                text += fmt.close_thinking(text) + opening
            check_length(len(text), "messages")
            ids = tok.encode(text, scope=ns)
            engine.prefetch(ids, ns)  # a disk-tier hit is read here, not on the engine thread
            return ids, history_boundary(tok.scoped(ns), messages, ids, **kwargs)

        grammar = await request_grammar(req, tools, req.tool_choice)
        ns = namespace + ":" + (req.cache_salt or "")  # the cache namespace: the tokenizer's segments' too
        prompt_ids, history = await asyncio.to_thread(encode)
        handles = submit(engine_requests(req, prompt_ids, req.max_completion_tokens or req.max_tokens, namespace,
                                         history, (req.top_logprobs or 0) if req.logprobs else None, grammar))
        rid, now = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def finish(h, calls):
            reason = _finish(h.finish_reason)
            return "tool_calls" if calls and reason == "stop" else reason

        def answer_of(content, calls) -> dict:
            return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}

        def chunk(i, delta, finish_reason, logprobs=None):
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                    "choices": [{"index": i, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}

        if not req.stream:
            first = await drain(request, handles)
            choices = []
            for i, h in enumerate(handles):
                content, calls = fmt.split_tool_calls(h.text, tools, opening) if tools else (h.text, [])
                choices.append({"index": i, "message": answer_of(content, calls), "finish_reason": finish(h, calls),
                                "logprobs": fmt.chat_logprobs(tok, scored(h)) if req.logprobs else None})
            log_request("chat", handles, t0, first)
            await remember_next_turn(messages, Message.model_validate(choices[0]["message"]).for_template(),
                                     prompt_ids, handles[0], ns, kwargs)
            return JSONResponse({"id": rid, "object": "chat.completion", "created": now, "model": model_name,
                                 "choices": choices, "usage": usage(handles)})

        include = bool(req.stream_options and req.stream_options.include_usage)

        async def sse():
            streams = [fmt.ToolCallStream(tools, opening) if tools else None for _ in handles]
            texts, first = [""] * len(handles), None
            try:
                for i in range(len(handles)):  # chat streams open with the role
                    yield _sse(chunk(i, {"role": "assistant", "content": ""}, None))
                async for i, ev in merged(handles):
                    h, ts = handles[i], streams[i]
                    first = first or time.perf_counter()
                    if ev.finish_reason == "error":
                        yield _sse({"error": {"message": "generation failed", "type": "server_error", "param": None,
                                              "code": None}})
                        return
                    content, calls = ts.push(ev.text) if ts else (ev.text, [])
                    if ev.finish_reason is not None and ts:
                        rest, more = ts.flush()
                        content, calls = content + rest, calls + more
                    lp = None
                    if req.logprobs and ev.logprob is not None and ev.token_id not in h.request.stop_ids:
                        lp = fmt.chat_logprobs(tok, [(ev.token_id, (ev.logprob, ev.top_logprobs))])
                    texts[i] += content
                    if content or lp:
                        yield _sse(chunk(i, {"content": content}, None, lp))
                    for c in calls:
                        k = ts.calls.index(c)
                        yield _sse(chunk(i, {"tool_calls": [{"index": k, **c}]}, None))
                    if ev.finish_reason is not None:
                        final = chunk(i, {}, finish(h, ts.calls if ts else []))
                        final["usage"] = usage([h])
                        yield _sse(final)
                if include:
                    tail = chunk(0, {}, None)
                    tail["choices"], tail["usage"] = [], usage(handles)
                    yield _sse(tail)
                log_request("chat stream", handles, t0, first)
                ts0 = streams[0]
                content0 = (texts[0].strip() or None) if ts0 and ts0.calls else texts[0]
                answer = Message.model_validate(answer_of(content0, ts0.calls if ts0 else [])).for_template()
                await remember_next_turn(messages, answer, prompt_ids, handles[0], ns, kwargs)
                yield "data: [DONE]\n\n"
            finally:
                for h in handles:
                    h.cancel()  # a client that went away frees its slot at the next step

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()
        namespace = check_auth(request)
        req = await parse(request, CompletionRequest)
        if isinstance(req.prompt, list):
            prompt_ids = list(req.prompt)
        else:
            check_length(len(req.prompt), "prompt")
            prompt_ids = await asyncio.to_thread(tok.encode, req.prompt, scope=namespace + ":" + (req.cache_salt or ""))
        if store is not None and store.disk is not None:  # a disk-tier hit is read here, not on the engine thread
            await asyncio.to_thread(engine.prefetch, prompt_ids, namespace + ":" + (req.cache_salt or ""))
        grammar = await request_grammar(req)
        greqs = engine_requests(req, prompt_ids, req.max_tokens, namespace, logprobs=req.logprobs, grammar=grammar)
        echo = ((req.prompt if isinstance(req.prompt, str) else await asyncio.to_thread(tok.decode, prompt_ids))
                if req.echo else "")
        echo_lp = None
        if echo and req.logprobs is not None and jax.process_count() > 1:
            # Scoring runs beside the engine; across processes the followers would not take part.
            raise APIError(400, "invalid parameter 'echo': echo with logprobs is not supported when serving "
                           "across processes", param="echo")
        if echo and req.logprobs is not None:  # the prompt's own tokens, scored as generated ones are
            sp = sampling_params(1, temperature=req.temperature, repetition_penalty=req.repetition_penalty)
            try:  # in its own lane: a burst of these waits behind itself, not in front of others
                scores = await scoring.run(engine.prompt_logprobs, prompt_ids, sp, req.logprobs)
            except lanes.LaneFull as e:
                raise APIError(429, str(e), code="queue_full", type_="rate_limit_error") from None
            echo_lp = fmt.completion_logprobs(tok, [(prompt_ids[0], (None, None)), *zip(prompt_ids[1:], scores)])
        handles = submit(greqs)
        rid, now = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(i, text, finish_reason, logprobs=None):
            return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [{"index": i, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}]}

        if not req.stream:
            first = await drain(request, handles)
            log_request("completion", handles, t0, first)
            lps = [fmt.completion_logprobs(tok, scored(h), len(echo)) if req.logprobs is not None else None
                   for h in handles]
            choices = [{"index": i, "text": echo + h.text, "finish_reason": _finish(h.finish_reason),
                        "logprobs": fmt.joined_logprobs(echo_lp, lp) if echo_lp else lp}
                       for i, (h, lp) in enumerate(zip(handles, lps))]
            return JSONResponse({"id": rid, "object": "text_completion", "created": now, "model": model_name,
                                 "choices": choices, "usage": usage(handles)})

        include = bool(req.stream_options and req.stream_options.include_usage)

        async def sse():
            offsets, first = [len(echo)] * len(handles), None
            try:
                if echo:
                    for i in range(len(handles)):
                        yield _sse(chunk(i, echo, None, echo_lp))
                async for i, ev in merged(handles):  # completions streams open with the first text
                    h = handles[i]
                    first = first or time.perf_counter()
                    if ev.finish_reason == "error":
                        yield _sse({"error": {"message": "generation failed", "type": "server_error", "param": None,
                                              "code": None}})
                        return
                    lp = None
                    if req.logprobs is not None and ev.logprob is not None and ev.token_id not in h.request.stop_ids:
                        lp = fmt.completion_logprobs(tok, [(ev.token_id, (ev.logprob, ev.top_logprobs))], offsets[i])
                    if ev.text or lp:
                        yield _sse(chunk(i, ev.text, None, lp))
                        offsets[i] += len(ev.text)
                    if ev.finish_reason is not None:
                        final = chunk(i, "", _finish(ev.finish_reason))
                        final["usage"] = usage([h])
                        yield _sse(final)
                if include:
                    tail = chunk(0, "", None)
                    tail["choices"], tail["usage"] = [], usage(handles)
                    yield _sse(tail)
                log_request("completion stream", handles, t0, first)
                yield "data: [DONE]\n\n"
            finally:
                for h in handles:
                    h.cancel()

        return StreamingResponse(sse(), media_type="text/event-stream")

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "hybridjax",
                "max_model_len": engine.max_len}

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        check_auth(request)
        if model_id != model_name:
            raise APIError(404, f"the model '{model_id}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        return model_card()

    # /v1/responses (server.responses): over the same helpers as the chat endpoint
    responses.install(app, SimpleNamespace(
        engine=engine, tok=tok, model_name=model_name, APIError=APIError, check_auth=check_auth, parse=parse,
        check_length=check_length, engine_requests=engine_requests, request_grammar=request_grammar, submit=submit,
        drain=drain, merged=merged, usage=usage, remember_next_turn=remember_next_turn))

    @app.get("/health")
    async def health():
        alive = engine._thread is not None and engine._thread.is_alive()
        status = ("ok" if engine.ready.is_set() else "loading") if alive else "down"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(engine), media_type="text/plain; version=0.0.4")

    _locate_endpoints_now(app)
    return app


def _locate_endpoints_now(app: FastAPI) -> None:
    """Have FastAPI find each endpoint's source file and line now, not on its first request.
    FastAPI (0.165 here; older versions not checked) looks them up for its error messages on an endpoint's first call,
    where `inspect.getsourcelines` tokenizes the whole function: 4-5 ms for the chat endpoint, paid
    by the first request of each kind (profiled: benchmarks/README.md). Its own function does it, so
    the cache it keeps (by function) is the one requests read; a FastAPI without it has no such cost."""
    import fastapi.routing

    locate = getattr(fastapi.routing, "_extract_endpoint_context", None)
    if locate is None:
        return
    for route in app.routes:
        endpoint = getattr(getattr(route, "dependant", None), "call", None)
        if endpoint is not None:
            locate(endpoint)


def _finish(reason: str | None) -> str | None:
    return {"cancelled": "stop", "error": "stop"}.get(reason, reason)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def freeze_what_start_up_made(engine: Engine, poll_s: float = 1.0) -> threading.Thread:
    """Move the objects made so far out of Python's full collections (`gc.freeze`): now, once the
    engine is ready, and once its programs behind are made (a thread watches). A full collection
    scans every tracked object: 80-210 ms in a served process (JAX, the app, the model's trees,
    the programs' Python side), a stall of the engine thread and of every request, which landed in
    whichever request came then; after freezing, 1-2 ms. None of those objects was garbage when
    measured (`gc.collect` found 0). A choice for a server's process (`serve`, and the benchmarks
    that stand for it), not for `create_app`: a process that makes many apps (the tests) needs
    their objects collectable."""
    import gc

    gc.freeze()

    def watch():
        engine.ready.wait()
        gc.freeze()
        while engine.compiling:
            time.sleep(poll_s)
        gc.freeze()

    thread = threading.Thread(target=watch, name="hybridjax-gc-freeze", daemon=True)
    thread.start()
    return thread


def _announce_when_serving(server, engine: Engine, name: str, host: str, port: int) -> None:
    """Say "serving on URL" once the server answers /health with 200 (not when it is launched)."""
    import http.client

    client_host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    while not server.should_exit:
        if engine.ready.wait(0.2) and server.started:
            try:
                conn = http.client.HTTPConnection(client_host, port, timeout=5)
                conn.request("GET", "/health")
                ok = conn.getresponse().status == 200
                conn.close()
            except OSError:
                ok = False
            if ok:
                log.info("serving %s on http://%s:%d", name, host if ":" not in host else f"[{host}]", port)
                return


class _Interrupts:
    """SIGINT and SIGTERM from before uvicorn takes them (building the engine) to after it hands
    them back (it re-raises each into the handler it found): noted, not raised, and acted on at
    `check` (KeyboardInterrupt; SystemExit(128 + 15)) and by a running `server` (told to exit). Not
    raised in the handler: Python runs it wherever the main thread is, and a KeyboardInterrupt
    raised inside a garbage-collection callback (jax's `_xla_gc_callback`) is printed with a
    traceback and swallowed, after which the server started and served as if no signal had come
    (a Ctrl-C 0.5 s after loading, 2 times in 8). A Ctrl-C while the engine is built (about a
    second) thus takes effect when it is built."""

    def __init__(self):
        self.seen: list[int] = []
        self.server = None
        main = threading.current_thread() is threading.main_thread()  # (handlers: main thread only)
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}

    def _handle(self, signum, frame) -> None:
        self.seen.append(signum)
        if self.server is not None:
            self.server.should_exit = True

    def check(self) -> None:
        if self.seen:
            if self.seen[0] == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + self.seen[0])

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def serve(sc: ServerConfig, cfg, params, tokenizer, name: str, calls=None, sock=None) -> int:
    """Run the server for a loaded model until interrupted (uvicorn); `calls`: see Engine;
    `sock`: a socket `bind` made (else one is bound here). Interrupted (SIGINT), it returns 130;
    while the engine still compiles, the process leaves at once (`os._exit`: XLA aborts a
    process that finalizes beside a running compile)."""
    import os
    import sys

    import uvicorn

    from hybridjax.server.connections import uvicorn_options

    interrupts = _Interrupts()
    try:
        sock = sock or bind(sc.host, sc.port)
        engine, _ = build_engine(sc, cfg, params, tokenizer, name, calls)
        if sc.cache_dir:
            Path(sc.cache_dir).mkdir(parents=True, exist_ok=True)
        app = create_app(engine, name, api_key=sc.api_key, api_keys=sc.api_keys,
                         cache_dir=sc.cache_dir if sc.prefix_cache else None, warmup=sc.warmup,
                         max_body_bytes=sc.max_body_bytes, body_timeout_s=sc.body_timeout_s)
        freeze_what_start_up_made(engine)
        server = interrupts.server = uvicorn.Server(
            uvicorn.Config(app, **uvicorn_options(sc), log_level="info", timeout_graceful_shutdown=5))
        threading.Thread(target=_announce_when_serving, args=(server, engine, name, sc.host, sc.port),
                         name="hybridjax-announce", daemon=True).start()
        code = 0
        try:
            interrupts.check()  # one that came while the engine was built
            server.run(sockets=[sock])
            interrupts.check()  # one uvicorn handed back (re-raised into `_handle`)
        except KeyboardInterrupt:
            code = 130
            raise
        except SystemExit as e:
            code = e.code
            raise
        finally:
            if engine.compiling:
                logging.shutdown()
                sys.stderr.flush()
                os._exit(code)
        return code
    finally:
        interrupts.restore()
