"""The model side of the server: `Service` owns the model thread that steps the scheduler, and hands each request's
events to its asyncio consumer through a `Handle` (cancel on disconnect included)."""

from __future__ import annotations

import asyncio
import hmac
import sys
import threading
import time
import traceback
from typing import TypeVar

import torch
from fastapi import Request

from hamburger.errors import HamburgerError
from hamburger.inference.admission import PREFILL_TOKENS, RequestEvent
from hamburger.inference.engine import resolve_mode
from hamburger.inference.modes import BY_NAME, Mode, parse_mode
from hamburger.inference.sampling import SamplingParams
from hamburger.inference.scheduler import Scheduler
from hamburger.model.base import encode_chat
from hamburger.model.config import check_confidence, check_lookup
from hamburger.model.hamburger_model import HamburgerModel
from hamburger.serving.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    check_limits,
)
from hamburger.serving.prometheus import ServerMetrics

T = TypeVar("T")
# Seconds a refused client is told to wait (429's Retry-After): about the time a full batch frees a row on a CPU. The
# OpenAI clients' retries wait that long instead of their own short backoff (soak: benchmarks/soak.py).
RETRY_AFTER = 1


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


def decode_threads(requested: int | None, device) -> int | None:
    """torch threads for the server's small decode passes (`Scheduler.decode_threads`): `requested` if given (0:
    all of torch's, no switching); by default, on a CPU, one fewer than torch's (at least 1), so the HTTP side
    keeps a core. Such passes are bound by reading the weights, not by
    threads, and one request's time per token drops (benchmarks/scheduler_decode.py; docs/server.md). Prefill and large decode passes keep all
    threads. None on other devices."""
    if requested is not None:
        if requested < 0:
            raise HamburgerError(f"--decode-threads must be >= 0, got {requested}")
        return requested or None
    if torch.device(device).type != "cpu":
        return None
    return max(1, torch.get_num_threads() - 1)


class Service:
    """The model, its scheduler and decode thread, and what the HTTP layer needs to know about them."""

    def __init__(self, model: HamburgerModel, name: str, max_batch_size: int = 8, max_queue: int = 64,
                 max_len: int | None = None, default_confidence: float | None = None, api_key: str | None = None,
                 prefill_tokens: int = PREFILL_TOKENS, interleave_prefill: bool = True,
                 decode_threads: int | None = None, draft_rows: int | str | None = "auto",
                 default_mode: str | None = None, lookup: int | None = None, kv_memory: int | None = None,
                 kv_dtype: str | None = None) -> None:
        """`default_mode`: the mode of requests that name none (None: the checkpoint's); compress needs the
        checkpoint's KV merger, checked here. `lookup`: verify and compress requests' lookup drafts (`Engine`;
        None: the checkpoint's). `kv_memory`: bytes of base KV cache, rows of `max_len` entries: as many rows as fit
        (instead of `max_batch_size`). `kv_dtype`: what the KV cache holds (`ModelRunner`; None: auto)."""
        self.model, self.tokenizer = model, model.tokenizer
        self.names = list(dict.fromkeys([name, "default"]))
        # compress needs the checkpoint's merger: checked before the caches are allocated (every request would fail)
        self.default_mode = resolve_mode(model, default_mode)[0]
        self.scheduler = Scheduler(model, max_batch_size, max_len, prefill_tokens, interleave_prefill, decode_threads,
                                   draft_rows, lookup=None if lookup is None else check_lookup(lookup),
                                   kv_memory=kv_memory, kv_dtype=kv_dtype)
        self.max_queue, self.api_key = max_queue, api_key
        self.default_confidence = check_confidence(
            model.config.default_confidence if default_confidence is None else default_confidence)
        self.verify_confidence = model.config.verify_confidence  # drafts in verify mode
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
            "hamburger_kv_bytes": ("bytes the base's KV cache takes (all rows, allocated at start)", s.kv_bytes),
            **{f"hamburger_kv_entries_per_token_{m}": (f"KV entries per generated token a {m} request is admitted at",
                                                       lambda m=m: s.entries.rate(m))
               for m in BY_NAME if not BY_NAME[m].per_token},
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
        if not prompt:  # a prompt of no tokens (an empty string, or one the tokenizer makes nothing of)
            raise ApiError(400, f"the {param} must have at least one token", param)
        mode, confidence = self.resolve(body.mode, body.confidence)
        sched = self.scheduler
        limit = check_limits(len(prompt), body.limit(), sched.max_len, param, sched.token_room(len(prompt), mode), mode)
        if self.scheduler.waiting >= self.max_queue:
            raise ApiError(429, f"the server is busy ({self.max_queue} requests waiting); retry later",
                           kind="rate_limit_error", code="queue_full", retry_after=RETRY_AFTER)
        sampling = SamplingParams(body.temperature or 0.0, 1.0 if body.top_p is None else body.top_p, 0, body.seed)
        arrival = time.perf_counter()
        try:  # the admission estimate may have moved since `limit` was checked (a reply finished meanwhile)
            # no max_tokens: until EOS or the row's entries run out (a compress row holds more than its estimate)
            rid = self.scheduler.submit(prompt, limit if body.limit() is not None else None, confidence, sampling,
                                        eos_token_ids=set() if body.ignore_eos else None, mode=mode)
        except HamburgerError as exc:
            raise ApiError(400, str(exc), "max_tokens", "context_length_exceeded") from None
        self.queues[rid] = queue = asyncio.Queue()
        self.wake.set()
        return Handle(self, rid, queue, arrival)

    def modes(self) -> list[str]:
        """The modes this server's model runs (compress mode needs a KV merger in the checkpoint)."""
        runs = []
        for name in BY_NAME:
            try:
                self.resolve(name, None)
                runs.append(name)
            except ApiError:
                pass
        return runs

    def resolve(self, mode: str | None, confidence: float | None) -> tuple[Mode, float]:
        """A request's mode and confidence by the one rule (`engine.resolve_mode`), with this server's defaults (its
        mode, and its confidence for the unchecked mode, trust); a problem becomes a 400 naming the field at fault."""
        try:
            mode = parse_mode(mode or self.default_mode)
        except HamburgerError as exc:
            raise ApiError(400, f"mode={mode}: {exc}", "mode") from None
        if confidence is None and not mode.checked:
            confidence = self.default_confidence  # the server's --confidence (verify and compress: the model's)
        try:
            return resolve_mode(self.model, mode, confidence)
        except HamburgerError as exc:
            try:  # the mode alone resolves (compress: a merger): the confidence is at fault
                resolve_mode(self.model, mode)
            except HamburgerError:
                raise ApiError(400, f"mode={mode}: {exc}", "mode") from None
            raise ApiError(400, str(exc), "confidence") from None

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
