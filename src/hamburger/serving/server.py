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
import hmac
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
from typing import TypeVar

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
from hamburger.inference.sampling import SamplingParams
from hamburger.inference.scheduler import PREFILL_TOKENS, RequestEvent, Scheduler
from hamburger.model.base import encode_chat
from hamburger.model.config import check_confidence
from hamburger.model.hamburger_model import HamburgerModel
from hamburger.serving.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Reply,
    TextStream,
    check_limits,
    parse,
    usage,
)
from hamburger.serving.prometheus import ServerMetrics

DEFAULT_MAX_LEN = 2048  # per row: 8 rows of SmolLM2-135M then hold 0.7 GB of float32 keys and values
CLIENT_CLOSED = 499  # nginx's "client closed request": the status of an answer nobody is left to read
log = logging.getLogger("uvicorn.error")  # uvicorn's own: our one-line warnings look like its and share its level
T = TypeVar("T")


class Handle:
    """The asyncio side of one request: its queue of events, and cancelling it if the caller stops early."""

    def __init__(self, service: Service, rid: int, queue: asyncio.Queue, arrival: float) -> None:
        self.service, self.rid, self.queue, self.arrival = service, rid, queue, arrival
        self.first: float | None = None
        self.last: float | None = None
        self.stats = None
        self.done = False

    async def next(self) -> RequestEvent:
        event = await self.queue.get()
        if isinstance(event, Exception):
            self.done = True
            raise event
        self.last = time.perf_counter() - self.arrival
        self.first = self.last if self.first is None else self.first
        self.stats, self.done = event.stats, event.finished
        return event

    def close(self, outcome: str | None) -> None:
        """outcome: the finish reason, or None when the caller left before the end (the request is cancelled)."""
        self.service.queues.pop(self.rid, None)
        if not self.done:
            self.service.scheduler.cancel(self.rid)
            self.service.wake.set()
        self.service.metrics.finished(outcome or "cancelled", self.stats, self.first, self.last)


class Service:
    """The model, its scheduler and decode thread, and what the HTTP layer needs to know about them."""

    def __init__(self, model: HamburgerModel, name: str, max_batch_size: int = 8, max_queue: int = 64,
                 max_len: int | None = None, default_confidence: float | None = None, api_key: str | None = None,
                 prefill_tokens: int = PREFILL_TOKENS) -> None:
        self.model, self.tokenizer = model, model.tokenizer
        self.names = list(dict.fromkeys([name, "default"]))
        self.scheduler = Scheduler(model, max_batch_size, max_len, prefill_tokens)
        self.max_queue, self.api_key = max_queue, api_key
        self.default_confidence = check_confidence(
            model.config.default_confidence if default_confidence is None else default_confidence)
        self.queues: dict[int, asyncio.Queue] = {}
        self.wake, self._stop = threading.Event(), threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        s = self.scheduler
        self.metrics = ServerMetrics({
            "hamburger_requests_running": ("requests in the batch", lambda: s.running),
            "hamburger_queue_depth": ("requests waiting for a batch row", lambda: s.waiting),
            "hamburger_kv_entries": ("KV entries per layer held by running requests", s.kv_entries),
            "hamburger_kv_capacity": ("KV entries per layer the cache holds (rows x max_len)",
                                      lambda: len(s.rows) * s.max_len),
        })

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread = threading.Thread(target=self._run, name="hamburger-decode", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.scheduler.has_work():
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            try:
                events = self.scheduler.step()
            except Exception:  # noqa: BLE001 - a failed step fails its requests, never the server
                traceback.print_exc(file=sys.stderr)
                self.loop.call_soon_threadsafe(self._fail_all)
                continue
            self.loop.call_soon_threadsafe(self._dispatch, events)

    def _dispatch(self, events: list[RequestEvent]) -> None:
        for event in events:
            if (queue := self.queues.get(event.id)) is not None:
                queue.put_nowait(event)

    def _fail_all(self) -> None:
        for rid, queue in self.queues.items():
            self.scheduler.cancel(rid)
            queue.put_nowait(ApiError(500, "the model failed on this batch; see the server log", kind="server_error"))

    # --- requests ----------------------------------------------------------------------------------------------

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    def open(self, prompt: list[int], body, param: str) -> Handle:
        if body.model not in self.names:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server has {self.names}", "model",
                           "model_not_found")
        try:
            confidence = check_confidence(self.default_confidence if body.confidence is None else body.confidence)
        except HamburgerError as exc:
            raise ApiError(400, str(exc), "confidence") from None
        limit = check_limits(len(prompt), body.limit(), self.scheduler.max_len, param)
        if self.scheduler.waiting >= self.max_queue:
            raise ApiError(429, f"the server is busy ({self.max_queue} requests waiting); retry later",
                           kind="rate_limit_error", code="queue_full")
        sampling = SamplingParams(body.temperature or 0.0, 1.0 if body.top_p is None else body.top_p, 0, body.seed)
        arrival = time.perf_counter()
        rid = self.scheduler.submit(prompt, limit, confidence, sampling)
        self.queues[rid] = queue = asyncio.Queue()
        self.wake.set()
        return Handle(self, rid, queue, arrival)

    def chat_prompt(self, body: ChatRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
        try:
            return encode_chat(self.tokenizer, [{"role": m.role, "content": m.text()} for m in body.messages])
        except Exception as exc:  # noqa: BLE001 - the template's own complaint (e.g. roles must alternate)
            raise ApiError(400, f"the chat template rejected the messages: {exc}", "messages") from None

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt_value()
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        vocab = self.model.base.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return prompt


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
    model, trained = load_from_args(args)
    service = Service(model, args.model, args.max_batch_size, args.max_queue, args.max_len or DEFAULT_MAX_LEN,
                      args.default_confidence, args.api_key, args.prefill_tokens)
    config = uvicorn.Config(create_app(service), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    # uvicorn re-raises the SIGTERM it handled after its graceful shutdown; a no-op handler makes that a clean exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    kind = "HAMburger checkpoint" if trained else "base model, one token per step"
    print(f"hamburger: serving {args.model} ({kind}) on http://{args.host}:{args.port}/v1 "
          f"({args.max_batch_size} rows x {service.scheduler.max_len} tokens)", file=sys.stderr, flush=True)
    uvicorn.Server(config).run()
    return 0


def register(sub, add_model_args) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with streaming and continuous batching")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch-size", type=int, default=8, help="rows of the batch (requests decoded together)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a row; more get 429")
    p.add_argument("--max-len", type=int, default=None,
                   help=f"KV entries per row (prompt + max_tokens); default: the model's context, at most {DEFAULT_MAX_LEN}")
    p.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS,
                   help="newly admitted prompts are prefilled together, shortest first, in passes of at most this many "
                        "padded tokens (1: each alone)")
    p.add_argument("--default-confidence", type=float, default=None,
                   help="confidence for requests that do not send one (default: the checkpoint's)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are cancelled")
    p.set_defaults(func=cmd_serve)
