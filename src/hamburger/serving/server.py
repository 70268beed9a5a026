"""`hamburger serve`: an OpenAI-compatible HTTP server with streaming and continuous batching.

One background thread owns the model and calls `Scheduler.step()` in a loop; each step's events go to the
asyncio side with `loop.call_soon_threadsafe`, one queue per request. New requests join the batch at the
next macro-step, finished ones leave it, and a client that goes away before its answer is complete (streaming
or not) cancels its request.
Streaming sends one server-sent event per macro-step and ends with `data: [DONE]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
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
from hamburger.inference.admission import PREFILL_TOKENS, RequestEvent
from hamburger.model.config import DRAFT_ROWS, check_confidence, parse_draft_rows
from hamburger.serving.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Reply,
    TextStream,
    parse,
    usage,
)
from hamburger.serving.service import Handle, Service, T, decode_threads

DEFAULT_MAX_LEN = 2048  # per row: 8 rows of SmolLM2-135M then hold 0.7 GB of float32 keys and values
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


async def _stream(steps: AsyncIterator, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
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


async def _complete(service: Service, request: Request, chat: bool) -> Response:
    service.check_key(request)
    body = parse(await request.body(), ChatRequest if chat else CompletionRequest)
    prompt = service.chat_prompt(body) if chat else service.completion_prompt(body)
    handle = service.open(prompt, body, "messages" if chat else "prompt")
    reply = Reply(chat, body.model)
    steps = _steps(handle, TextStream(service.tokenizer, body.stops()))
    if body.stream:
        include = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_stream(steps, reply, include), media_type="text/event-stream")
    if (done := await _unless_disconnected(request, _collect(steps))) is None:
        return Response(status_code=CLIENT_CLOSED)
    text, reason, event = done
    return JSONResponse(reply.full(text, reason, usage(event.stats)))


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start(asyncio.get_running_loop())
        yield
        service.stop()

    app = FastAPI(title="HAMburger", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

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

    @app.get("/health")
    async def health() -> dict:
        # The last two are for the web page: its slider's start and whether to ask for a key.
        return {"status": "ok", "running": service.scheduler.running, "waiting": service.scheduler.waiting,
                "default_confidence": service.default_confidence, "api_key_required": service.api_key is not None}

    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(resources.files("hamburger.serving").joinpath("web/index.html").read_text(encoding="utf-8"))

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(service.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        service.check_key(request)
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "hamburger"} for name in service.names]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _complete(service, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(service, request, chat=False)

    return app


class BackgroundServer:
    """The app on a free loopback port in a thread, for the benchmark and the tests: `with BackgroundServer(s) as srv`."""

    def __init__(self, service: Service, host: str = "127.0.0.1") -> None:
        import socket

        import uvicorn

        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(create_app(service), host=host, port=port, log_level="warning"))
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


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from hamburger.cli import load_from_args

    for name in ("port", "max_batch_size", "max_queue", "max_len", "prefill_tokens"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "port" else 1):
            raise HamburgerError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.default_confidence is not None:
        check_confidence(args.default_confidence)
    threads = decode_threads(args.decode_threads, args.device)
    model, trained = load_from_args(args)
    service = Service(model, args.model, args.max_batch_size, args.max_queue, args.max_len or DEFAULT_MAX_LEN,
                      args.default_confidence, args.api_key, prefill_tokens=args.prefill_tokens,
                      interleave_prefill=args.interleave_prefill, decode_threads=threads, draft_rows=args.draft_rows)
    config = uvicorn.Config(create_app(service), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    # uvicorn re-raises the SIGTERM it handled after its graceful shutdown; a no-op handler makes that a clean exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    kind = "HAMburger checkpoint" if trained else "base model, one token per step"
    print(f"hamburger: serving {args.model} ({kind}) on http://{args.host}:{args.port}/v1 "
          f"({args.max_batch_size} rows x {service.scheduler.max_len} tokens"
          + (f"; decode on {threads} of {service.scheduler.prefill_threads} threads" if threads else "") + ")",
          file=sys.stderr, flush=True)
    uvicorn.Server(config).run()
    return 0


def add_decode_threads_arg(p) -> None:
    p.add_argument("--decode-threads", type=int, default=None, metavar="N",
                   help="torch threads for decode passes (prefill passes use all); default on a CPU: one fewer than "
                        "torch's, so the HTTP side keeps a core; 0: all")


def register(sub, add_model_args) -> None:
    from hamburger.cli import add_lookup_arg  # noqa: PLC0415 - the CLI imports this module

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with streaming and continuous batching")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch-size", type=int, default=8, help="rows of the batch (requests decoded together)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a row; more get 429")
    p.add_argument("--max-len", type=int, default=None,
                   help=f"KV entries per row (prompt + max_tokens); default: the model's context, at most {DEFAULT_MAX_LEN}")
    p.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS,
                   help="waiting prompts are prefilled together, shortest first, in passes of at most this many padded "
                        "tokens (1: each alone)")
    p.add_argument("--interleave-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="one prefill pass per step between macro-steps (default), so a burst's shortest prompts get "
                        "their first tokens early and running requests never wait for a whole burst's prefill; "
                        "--no-interleave-prefill: prefill every waiting prompt that has a free row in one step")
    add_decode_threads_arg(p)
    add_lookup_arg(p)
    p.add_argument("--draft-rows", type=parse_draft_rows, default="auto", metavar="N",
                   help="verify-mode requests draft only while at most N requests run; beyond, their steps are plain "
                        f"base steps, their output the same. 'auto' (default): {DRAFT_ROWS} on a GPU and with fp16 "
                        "weights on a CPU, 0 with float weights on a CPU (measured on 2 cores); 'all': always")
    p.add_argument("--default-confidence", type=float, default=None,
                   help="confidence for requests that do not send one (default: the checkpoint's)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are cancelled")
    p.set_defaults(func=cmd_serve)
