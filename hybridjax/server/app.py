"""The HTTP API: /v1/chat/completions, /v1/completions (SSE streaming or not), /v1/models,
/health, /metrics. Errors use OpenAI's body shape `{"error": {message, type, param, code}}`:
400 invalid JSON or parameter (named in `param`), 401 bad API key, 404 unknown model,
400 prompt over the context, 429 queue full; never a stack trace.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from hybridjax.engine import Engine, GenerationRequest, QueueFull, RequestHandle
from hybridjax.pages import page_bytes
from hybridjax.prefix_cache import SnapshotStore, history_boundary, model_identity
from hybridjax.server.metrics import render_metrics
from hybridjax.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

log = logging.getLogger("hybridjax.server")


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
    cache_ttl_s: float = 3600.0
    checkpoint_interval: int = 256
    cache_dir: str | None = None
    api_key: str | None = None
    page_size: int = 64
    kv_pages: int | None = None  # None: from kv_mb, else room for every slot at max_len, twice
    kv_mb: float | None = None  # the KV pool's memory budget, when kv_pages is not given
    prefill_chunk: int = 256
    warmup: bool = True  # compile every shape before serving


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def error_response(status: int, message: str, param=None, code=None, type_="invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status)


def build_engine(sc: ServerConfig, cfg, params, tokenizer, name: str):
    """(engine, store) for a loaded model and a ServerConfig."""
    if tokenizer is None:
        raise ValueError(f"{name}: the server needs a tokenizer.json in the model directory")
    max_len = min(sc.max_len, cfg.max_position_embeddings)
    store = None
    if sc.prefix_cache:
        store = SnapshotStore(model_identity(name, cfg, params), max_bytes=int(sc.cache_mb * 2**20),
                              max_entries=sc.cache_entries, ttl_s=sc.cache_ttl_s)
    num_pages = sc.kv_pages
    if num_pages is None and sc.kv_mb is not None:
        num_pages = max(1, int(sc.kv_mb * 2**20 // page_bytes(cfg, sc.page_size, params.embed.dtype)))
    engine = Engine(cfg, params, tokenizer, slots=sc.slots, max_len=max_len, store=store,
                    checkpoint_interval=sc.checkpoint_interval, max_queue=sc.max_queue, page_size=sc.page_size,
                    num_pages=num_pages, prefill_chunk=sc.prefill_chunk)
    return engine, store


def create_app(engine: Engine, model_name: str, *, api_key: str | None = None, cache_dir: str | None = None,
               warmup: bool = True) -> FastAPI:
    """The app; its start-up loads persisted snapshots and starts the engine, which compiles every
    shape first (`warmup`) while /health answers 503 "loading"."""
    store = engine.store
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        if store is not None and cache_dir:
            n = engine.load_snapshots(cache_dir)
            log.info("prefix cache: loaded %d snapshots from %s", n, cache_dir)
        engine.start(warmup=warmup, progress=warmup)
        yield
        engine.stop()
        if store is not None and cache_dir:
            n = engine.save_snapshots(cache_dir)
            log.info("prefix cache: saved %d snapshots to %s", n, cache_dir)

    app = FastAPI(title="hybridjax", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, e.type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        return _pydantic_error(e.errors())

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("internal error")
        return error_response(500, "internal server error", type_="server_error")

    def check_auth(request: Request) -> str:
        """The caller's namespace part from its key ('' with auth off)."""
        if api_key is None:
            return ""
        header = request.headers.get("authorization", "")
        if header != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key", code="invalid_api_key", type_="authentication_error")
        return hashlib.sha256(api_key.encode()).hexdigest()[:16]

    async def parse(request: Request, model_cls):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"invalid JSON body: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            req = model_cls.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            raise APIError(400, f"invalid parameter '{param}': {err['msg']}", param=param) from None
        if req.model != model_name:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        return req

    def engine_request(req: SamplingFields, prompt_ids: list[int], max_tokens: int | None, namespace: str,
                       history_len: int | None = None) -> GenerationRequest:
        n, limit = len(prompt_ids), engine.max_len
        if n >= limit:
            raise APIError(400, f"the prompt has {n} tokens; this model's context is {limit} tokens",
                           param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - n
        elif n + max_tokens > limit:
            raise APIError(400, f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the context of {limit} tokens",
                           param="max_tokens", code="context_length_exceeded")
        bad = [t for t in prompt_ids if t >= engine.cfg.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary", param="prompt")
        tok = engine.tokenizer
        return GenerationRequest(
            prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
            top_k=max(req.top_k, 0), min_p=req.min_p, repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            seed=req.seed if req.seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "little"),
            stop_ids=tuple(tok.eos_token_ids) + tuple(engine.cfg.eos_token_id), stop_strings=tuple(req.stop or ()),
            namespace=namespace + ":" + (req.cache_salt or ""), history_len=history_len,
        )

    def submit(greq: GenerationRequest) -> RequestHandle:
        try:
            return engine.submit(greq, loop=asyncio.get_running_loop())
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full", type_="rate_limit_error") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def usage(h: RequestHandle) -> dict:
        return {"prompt_tokens": h.prompt_tokens, "completion_tokens": len(h.token_ids),
                "total_tokens": h.prompt_tokens + len(h.token_ids),
                "prompt_tokens_details": {"cached_tokens": h.cached_tokens}}

    async def run(h: RequestHandle, make_body, make_chunk, include_usage: bool, stream: bool, chat: bool):
        if not stream:
            try:
                async for ev in h.aevents():
                    pass
            finally:
                h.cancel()  # no-op when finished; frees the slot if this handler was cancelled
            if h.finish_reason == "error":
                raise APIError(500, "generation failed", type_="server_error")
            return JSONResponse(make_body(h))

        async def sse():
            try:
                if chat:  # chat streams open with the role; completions streams with the first text
                    yield _sse(make_chunk(h, {"role": "assistant", "content": ""}, None))
                async for ev in h.aevents():
                    if ev.finish_reason is None:
                        if ev.text:
                            yield _sse(make_chunk(h, {"content": ev.text}, None))
                        continue
                    if ev.finish_reason == "error":
                        yield _sse({"error": {"message": "generation failed", "type": "server_error", "param": None, "code": None}})
                        break
                    final = make_chunk(h, {}, _finish(ev.finish_reason))
                    final["usage"] = usage(h)
                    yield _sse(final)
                    if include_usage:
                        tail = make_chunk(h, {}, None)
                        tail["choices"], tail["usage"] = [], usage(h)
                        yield _sse(tail)
                yield "data: [DONE]\n\n"
            finally:
                h.cancel()  # a client that went away frees its slot at the next step

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        namespace = check_auth(request)
        req = await parse(request, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt_ids = engine.tokenizer.encode_chat(messages, add_generation_prompt=True)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        history = history_boundary(engine.tokenizer, messages, prompt_ids)
        greq = engine_request(req, prompt_ids, req.max_completion_tokens or req.max_tokens, namespace, history)
        h = submit(greq)
        rid, now = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def body(h):
            return {"id": rid, "object": "chat.completion", "created": now, "model": model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": h.text},
                                 "finish_reason": _finish(h.finish_reason), "logprobs": None}],
                    "usage": usage(h)}

        def chunk(h, delta, finish):
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

        include = bool(req.stream_options and req.stream_options.include_usage)
        return await run(h, body, chunk, include, req.stream, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        namespace = check_auth(request)
        req = await parse(request, CompletionRequest)
        prompt_ids = req.prompt if isinstance(req.prompt, list) else engine.tokenizer.encode(req.prompt)
        h = submit(engine_request(req, list(prompt_ids), req.max_tokens, namespace))
        rid, now = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def body(h):
            return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [{"index": 0, "text": h.text, "finish_reason": _finish(h.finish_reason), "logprobs": None}],
                    "usage": usage(h)}

        def chunk(h, delta, finish):
            return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [{"index": 0, "text": delta.get("content", ""), "finish_reason": finish, "logprobs": None}]}

        include = bool(req.stream_options and req.stream_options.include_usage)
        return await run(h, body, chunk, include, req.stream, chat=False)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "hybridjax", "max_model_len": engine.max_len}]}

    @app.get("/health")
    async def health():
        alive = engine._thread is not None and engine._thread.is_alive()
        status = ("ok" if engine.ready.is_set() else "loading") if alive else "down"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(engine), media_type="text/plain; version=0.0.4")

    return app


def _pydantic_error(errors) -> JSONResponse:
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or None
    return error_response(400, f"invalid parameter '{param}': {err.get('msg')}", param=param)


def _finish(reason: str | None) -> str | None:
    return {"cancelled": "stop", "error": "stop"}.get(reason, reason)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def serve(sc: ServerConfig, cfg, params, tokenizer, name: str) -> int:
    """Run the server for a loaded model until interrupted (uvicorn)."""
    import uvicorn

    engine, _ = build_engine(sc, cfg, params, tokenizer, name)
    if sc.cache_dir:
        Path(sc.cache_dir).mkdir(parents=True, exist_ok=True)
    app = create_app(engine, name, api_key=sc.api_key, cache_dir=sc.cache_dir if sc.prefix_cache else None,
                     warmup=sc.warmup)
    log.info("serving %s on http://%s:%d", name, sc.host, sc.port)
    uvicorn.run(app, host=sc.host, port=sc.port, log_level="info", timeout_graceful_shutdown=5)
    return 0
