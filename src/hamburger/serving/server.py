"""`hamburger serve`: an OpenAI-compatible HTTP server with streaming and continuous batching.

One background thread owns the model and calls `Scheduler.step()` in a loop; each step's events go to the
asyncio side with `loop.call_soon_threadsafe`, one queue per request. New requests join the batch at the
next macro-step, finished ones leave it, and a client that goes away before its answer is complete (streaming
or not) cancels its request.
Streaming sends one server-sent event per macro-step and ends with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from hamburger.errors import HamburgerError
from hamburger.inference.admission import RequestEvent
from hamburger.inference.stops import TextStream
from hamburger.serving.openai_api import (
    ERRORS,
    REF,
    ApiError,
    ChatCompletion,
    ChatCompletionChunk,
    ChatRequest,
    CompletionRequest,
    ErrorResponse,
    Reply,
    TextCompletion,
    TextCompletionChunk,
    parse,
    schemas,
    usage,
)
from hamburger.serving.service import Handle, Service, T

CLIENT_CLOSED = 499  # nginx's "client closed request": the status of an answer nobody is left to read
log = logging.getLogger("uvicorn.error")  # uvicorn's own: our one-line warnings look like its and share its level


async def _steps(handle: Handle, text: TextStream) -> AsyncIterator[tuple[str, str | None, RequestEvent]]:
    """(new text, finish reason once it ends, event) per macro-step; a stop string ends the request early."""
    outcome = None
    try:
        while True:
            event = await handle.next()
            delta = text.feed(event.tokens, final=event.finished)
            end = event.finished or text.stopped
            reason = ("stop" if text.stopped else event.finish_reason) if end else None
            yield delta, reason, event
            if end:
                outcome = reason
                return
    finally:
        handle.close(outcome)


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def _note_tokens(request: Request, event: RequestEvent | None) -> None:
    """The request's generated tokens, for its access log line (`AccessLog`)."""
    if event is not None:
        request.state.generated_tokens = event.stats.generated_tokens


async def _stream(request: Request, steps: AsyncIterator, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    first, event = True, None
    try:
        async for delta, reason, event in steps:
            chunk = reply.chunk(delta, reason, first)
            # Non-standard, ignored by OpenAI's clients: the web page colours and counts macro-steps with it.
            chunk["hamburger"] = {"tokens": len(event.tokens), "prompt_tokens": event.stats.prompt_tokens}
            yield _sse(chunk)
            first = False
            # Events pile up while the loop is busy; sent in one go to a client that has just gone, each write past
            # the fifth logs asyncio's "socket.send() raised exception.". A turn of the loop lets the disconnect land.
            await asyncio.sleep(0)
    except ApiError as exc:
        yield _sse(exc.body())
    finally:
        await steps.aclose()  # on a disconnect, cancels the request now rather than when collected
        _note_tokens(request, event)
    if include_usage and event is not None:
        yield _sse(reply.usage_chunk(usage(event.stats)))
    yield _sse("[DONE]")


async def _collect(steps: AsyncIterator) -> tuple[str, str, RequestEvent]:
    parts, reason, event = [], "stop", None
    try:
        async for delta, reason, event in steps:
            parts.append(delta)
    finally:
        await steps.aclose()  # on a cancel, cancels the request in the scheduler now rather than when collected
    return "".join(parts), reason, event


async def _disconnect(request: Request) -> None:
    """Returns once the client has gone away; its body has been read, so nothing else is left to receive."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """work's result, or None when the client goes away first: work is then cancelled (and waited for).

    A non-streaming answer is only sent at the end, so nothing else would notice that its reader has left.
    """
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # a no-op once it is done
    if task.done():
        return task.result()
    await asyncio.wait((task,))
    return None


async def _complete(service: Service, request: Request, schema: type[ChatRequest | CompletionRequest]) -> Response:
    """One completion request, its body parsed with `schema` (the body the OpenAPI schema documents)."""
    service.check_key(request)
    chat = schema is ChatRequest
    body = parse(await request.body(), schema)
    prompt = service.chat_prompt(body) if chat else service.completion_prompt(body)
    handle = service.open(prompt, body, "messages" if chat else "prompt")
    reply = Reply(chat, body.model)
    steps = _steps(handle, TextStream(service.tokenizer, body.stops()))
    if body.stream:
        include = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_stream(request, steps, reply, include), media_type="text/event-stream")
    if (done := await _unless_disconnected(request, _collect(steps))) is None:
        return Response(status_code=CLIENT_CLOSED)
    text, reason, event = done
    _note_tokens(request, event)
    return JSONResponse(reply.full(text, reason, usage(event.stats)))


class AccessLog:
    """ASGI middleware: one line per request on stderr once its answer has gone out (a stream at its end, not when
    its headers leave), e.g. `POST /v1/chat/completions 200 48 tokens 0.84 s`: method, path, status, generated
    tokens where the request generated any, seconds. Printed, not logged: uvicorn's loggers run at warning here."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [500]  # 500 unless an answer starts: the error handler's, outside us
        state = scope.setdefault("state", {})  # what `request.state` of the handlers reads and writes

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            tokens = state.get("generated_tokens")
            print(f"{scope['method']} {scope['path']} {status[0]}" + (f" {tokens} tokens" if tokens is not None else "")
                  + f" {time.perf_counter() - start:.2f} s", file=sys.stderr, flush=True)


def create_app(service: Service, access_log: bool = False) -> FastAPI:
    """The HTTP side of `service`; `access_log`: one line per request on stderr (`AccessLog`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start(asyncio.get_running_loop())
        yield
        service.stop()

    app = FastAPI(title="HAMburger", lifespan=lifespan)
    if access_log:
        app.add_middleware(AccessLog)
    add_error_handlers(app)
    add_routes(app, service)
    add_schemas(app, service.names, service.modes(), service.model.base.config.vocab_size)
    return app


def add_schemas(app: FastAPI, names: list[str], modes: list[str], vocab: int) -> None:
    """/openapi.json with the request and response models among its components, where the completion routes' request
    bodies and answers refer to them (`_documented`): FastAPI only adds the models of parameters it parses itself.
    A request's `model` is one of this server's `names` (another is a 404) and its `mode` one of the `modes` its model
    runs (another is a 400), so the schema lists them, and a prompt's token ids are below its model's `vocab`."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            components = schemas()
            for request in (ChatRequest, CompletionRequest):
                props = components[request.__name__]["properties"]
                props["model"]["enum"] = list(names)
                for option in props["mode"]["anyOf"]:
                    if "enum" in option:
                        option["enum"] = [m for m in option["enum"] if m in modes]
            ids = next(o for o in components[CompletionRequest.__name__]["properties"]["prompt"]["anyOf"]
                       if o.get("items", {}).get("type") == "integer")
            ids["items"]["maximum"] = vocab - 1
            generate().setdefault("components", {}).setdefault("schemas", {}).update(components)
        return app.openapi_schema

    app.openapi = openapi


def _documented(schema: type, reply: type, chunk: type) -> dict:
    """A completion route's OpenAPI: its request body, `schema` (the model its handler parses the body with, not a
    FastAPI parameter: the project's own 400s answer a bad body), `reply` as JSON or, with stream, `chunk` events
    (then data: [DONE]; an error object mid-stream is an event too), and the error statuses it answers with."""
    def ref(model: type) -> dict:
        return {"$ref": REF.format(model=model.__name__)}

    # One event (OpenAPI before 3.2 has a stream's `schema` describe each event): its data is a chunk or an error
    # object as JSON, or the closing [DONE].
    data = {"type": "string", "anyOf": [{"const": "[DONE]"}, {
        "contentMediaType": "application/json", "contentSchema": {"anyOf": [ref(chunk), ref(ErrorResponse)]}}]}
    events = {"type": "object", "description": f"server-sent events, `data: ` and a {chunk.__name__} (or an "
              f"{ErrorResponse.__name__}) as JSON each, then `data: [DONE]`", "properties": {"data": data},
              "required": ["data"]}
    ok = {"description": f"a {reply.__name__}, or with stream: true a stream of {chunk.__name__} events",
          "content": {"application/json": {"schema": ref(reply)}, "text/event-stream": {"schema": events}}}
    errors = {status: {"description": why, "content": {"application/json": {"schema": ref(ErrorResponse)}}}
              for status, why in ERRORS.items()}
    errors[429]["headers"] = {"Retry-After": {"description": "seconds to wait before retrying",
                                              "schema": {"type": "integer"}}}
    body = {"required": True, "content": {"application/json": {"schema": ref(schema)}}}
    return {"responses": {200: ok, **errors}, "openapi_extra": {"requestBody": body}}


def add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style JSON answer (a client that left early: an empty 499)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code,
                            headers=exc.headers)  # a 405's Allow

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, exc: ClientDisconnect) -> Response:
        # The client closed the connection before its body was read (most often: before sending all of it). Its
        # own doing, not the server's: one line, not a traceback, and an answer that no one will read.
        who = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        log.warning("%s disconnected before its request body was read (%s %s)", who, request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        traceback.print_exception(exc, file=sys.stderr)
        return JSONResponse(ApiError(500, "internal server error; see the server log", kind="server_error").body(),
                            status_code=500)


def add_routes(app: FastAPI, service: Service) -> None:
    """/health, the web page, /metrics, /v1/models and the two completion endpoints."""

    @app.get("/health")
    async def health() -> dict:
        # The last three are for the web page: its mode and slider's start, and whether to ask for a key.
        return {"status": "ok", "running": service.scheduler.running, "waiting": service.scheduler.waiting,
                "default_mode": service.default_mode.name, "default_confidence": service.default_confidence,
                "api_key_required": service.api_key is not None}

    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(resources.files("hamburger.serving").joinpath("web/index.html").read_text(encoding="utf-8"))

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus' text format", "content": {"text/plain": {}}}})
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(service.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        service.check_key(request)
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "hamburger"} for name in service.names]
        return {"object": "list", "data": data}

    add_completion_route(app, service, "/v1/chat/completions", ChatRequest, ChatCompletion, ChatCompletionChunk)
    add_completion_route(app, service, "/v1/completions", CompletionRequest, TextCompletion, TextCompletionChunk)


def add_completion_route(app: FastAPI, service: Service, path: str, schema: type, reply: type, chunk: type) -> None:
    """POST `path`: its body parsed with `schema`, the very model its documented request body is generated from, so
    the two cannot differ."""

    @app.post(path, name=path.removeprefix("/v1/").replace("/", "_"), **_documented(schema, reply, chunk))
    async def complete(request: Request) -> Response:
        return await _complete(service, request, schema)


class BackgroundServer:
    """The app on a free loopback port in a thread, for the benchmark and the tests: `with BackgroundServer(s) as srv`."""

    def __init__(self, service: Service, host: str = "127.0.0.1", access_log: bool = False) -> None:
        import socket

        import uvicorn

        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(create_app(service, access_log), host=host, port=port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="hamburger-http", daemon=True)
        self.service, self.url = service, f"http://{host}:{port}"

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise HamburgerError("the in-process server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
