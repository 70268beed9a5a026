"""Soak `hamburger serve` on the embedded default: a long mixed load with faults, then SIGTERM under load (issue 53,
item 3).

Starts the server (`--model default`, a small `--max-queue` so that bursts exceed it, a small `--max-len` so that
some replies run out of KV entries) and, after a warm-up, runs `--minutes` of load from `--concurrency` clients:
chat and completions, streaming and not, every mode the server takes in a request's `mode` field (none, trust,
verify, compress), clients that disconnect mid-stream on purpose, requests with ignore_eos and no max_tokens that
fill their row (finish_reason "length"), and every `--burst-every` seconds a burst of `--burst` requests past the
queue (each must be served or refused with 429 and Retry-After; the steady clients that get a 429 wait that long).
At the end it stops starting requests, sends SIGTERM while the clients' requests are in flight, and waits: their
streams must end with [DONE] and the server must exit 0.

Every request is accounted for: served, refused with a status, disconnected on purpose, or an error of a named kind;
lost (a timeout, a connection closed without an answer, a stream without [DONE]) must be 0. Per minute: requests
served, errors by kind, p50/p99 latency and time to first token, the server's RSS (/proc/PID/status). Prints the
tables and writes a small JSON.

    .venv/bin/python benchmarks/soak.py --minutes 30 --json results/soak-30min-c32-2026-11-27.json
    .venv/bin/python benchmarks/soak.py --minutes 1 --warmup 10     # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_process import ServerProcess  # noqa: E402

from hamburger.evaluation.bench_serve import percentile  # noqa: E402
from hamburger.serving.openai_api import (  # noqa: E402
    ChatCompletion,
    ChatCompletionChunk,
    TextCompletion,
    TextCompletionChunk,
)

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Explain in two sentences why the sky is blue.", "Write a Python function that reverses a string.",
           "What is 17 times 23? Think step by step.", "Name three rivers in Europe.", "Say hello.",
           "Summarize the plot of Hamlet in one paragraph.", "def fibonacci(n):", "Translate 'good morning' to French.",
           "List the first ten prime numbers.", "Why do cats purr?", "Write a haiku about the sea.",
           "Give me a recipe for pancakes."]
MODES = [None, "trust", "verify", "compress"]
MODELS = {True: (ChatCompletion, ChatCompletionChunk), False: (TextCompletion, TextCompletionChunk)}


@dataclass
class Plan:
    """One request: what it asks and what the client will do with it."""

    chat: bool
    stream: bool
    mode: str | None
    exhaust: bool = False  # ignore_eos, no max_tokens: it must end with "length" when its row is full
    disconnect: int = 0  # leave after this many chunks (0: read to the end)
    burst: bool = False
    max_tokens: int = 32

    def body(self, prompt: str) -> dict:
        body = {"model": "default", "stream": self.stream}
        body.update({"messages": [{"role": "user", "content": prompt}]} if self.chat else {"prompt": prompt})
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.mode:
            body["mode"] = self.mode
        if self.exhaust:
            body["ignore_eos"] = True
        else:
            body["max_tokens"] = self.max_tokens
        return body


def plan(rnd: random.Random, args) -> Plan:
    """A steady client's next request: the mix the module docstring describes."""
    chat, stream, mode = rnd.random() < 0.6, rnd.random() < 0.5, rnd.choice(MODES)
    exhaust = rnd.random() < args.exhaust
    disconnect = rnd.randint(1, 3) if stream and not exhaust and rnd.random() < args.disconnect else 0
    return Plan(chat, stream, mode, exhaust, disconnect, max_tokens=rnd.randint(8, 64))


@dataclass
class Record:
    """One request's outcome: ok, refused, disconnected, error or lost, with its kind (a status, a reason)."""

    plan: Plan
    outcome: str
    kind: str
    start: float
    end: float
    ttft: float | None = None
    tokens: int = 0
    finish: str | None = None


@dataclass
class Tally:
    records: list[Record] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since the load began, bytes)
    started: int = 0


def finished(plan: Plan, finish: str | None, usage: dict | None) -> tuple[str, str, int]:
    """(outcome, kind, tokens) of an answer that reached its end."""
    tokens = (usage or {}).get("completion_tokens", 0)
    if finish not in ("stop", "length"):
        return "error", f"finish_reason {finish}", tokens
    if plan.exhaust and finish != "length":
        return "error", f"a row-filling request ended with {finish}", tokens
    return "ok", finish, tokens


def refusal(resp: httpx.Response) -> tuple[str, str]:
    """A non-200 answer: 429 with Retry-After is a refusal; anything else, for these well-formed requests, an error."""
    if resp.status_code == 429:
        return ("refused", "429") if resp.headers.get("retry-after") else ("error", "429 without Retry-After")
    try:
        code = resp.json()["error"].get("code") or resp.json()["error"].get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        code = "no error object"
    return "error", f"{resp.status_code} {code}"


async def read_stream(resp: httpx.Response, plan: Plan, began: float) -> tuple:
    """(outcome, kind, ttft, tokens, finish) of a 200 stream, validating each chunk against its documented model."""
    chunk_model, ttft, chunks, finish, usage = MODELS[plan.chat][1], None, 0, None, None
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return (*finished(plan, finish, usage)[:2], ttft, (usage or {}).get("completion_tokens", 0), finish)
        event = json.loads(line[6:])
        if "error" in event:
            return "error", f"error mid-stream ({event['error'].get('type')})", ttft, 0, None
        chunk = chunk_model.model_validate(event)
        ttft = time.perf_counter() - began if ttft is None else ttft
        chunks += 1
        usage = event.get("usage") or usage
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if plan.disconnect and chunks >= plan.disconnect and finish is None:
            return "disconnected", "on purpose", ttft, 0, None
    return "lost", "stream ended without [DONE]", ttft, 0, finish


async def send(client: httpx.AsyncClient, plan: Plan, prompt: str) -> tuple:
    """(outcome, kind, ttft, tokens, finish, retry-after seconds) of one request."""
    began = time.perf_counter()
    path = "/v1/chat/completions" if plan.chat else "/v1/completions"
    async with client.stream("POST", path, json=plan.body(prompt)) as resp:
        if resp.status_code != 200:
            await resp.aread()
            outcome, kind = refusal(resp)
            return outcome, kind, None, 0, None, float(resp.headers.get("retry-after") or 0)
        if plan.stream:
            return (*await read_stream(resp, plan, began), 0.0)
        reply = MODELS[plan.chat][0].model_validate_json(await resp.aread())
        finish = reply.choices[0].finish_reason
        outcome, kind, tokens = finished(plan, finish, reply.usage.model_dump())
        return outcome, kind, time.perf_counter() - began, tokens, finish, 0.0


async def one(client: httpx.AsyncClient, plan: Plan, prompt: str, tally: Tally, t0: float, timeout: float) -> float:
    """Sends one request and records exactly one outcome for it, whatever happens; returns its Retry-After."""
    tally.started += 1
    began, ttft, tokens, finish, retry = time.perf_counter(), None, 0, None, 0.0
    try:
        outcome, kind, ttft, tokens, finish, retry = await asyncio.wait_for(send(client, plan, prompt), timeout)
    except asyncio.TimeoutError:
        outcome, kind = "lost", f"no answer in {timeout:.0f} s"
    except httpx.HTTPError as exc:  # a connection closed or refused without an answer
        outcome, kind = "lost", type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - a body its documented model refuses: an error, counted by kind
        outcome, kind = "error", f"invalid answer ({type(exc).__name__})"
    tally.records.append(Record(plan, outcome, kind, began - t0, time.perf_counter() - t0, ttft, tokens, finish))
    return retry


async def steady(client, rnd: random.Random, args, tally: Tally, t0: float, stop: asyncio.Event) -> None:
    """One steady client: a request after another until `stop`; after a 429 it waits the Retry-After."""
    while not stop.is_set():
        retry = await one(client, plan(rnd, args), rnd.choice(PROMPTS), tally, t0, args.timeout)
        if retry:
            await asyncio.sleep(retry)


async def bursts(client, rnd: random.Random, args, tally: Tally, t0: float, stop: asyncio.Event) -> None:
    """Every `--burst-every` seconds (the first after half of it), `--burst` short plain requests at once."""
    wait = args.burst_every / 2
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), wait)
            return
        except asyncio.TimeoutError:
            pass
        burst = [Plan(rnd.random() < 0.5, False, rnd.choice(MODES), burst=True, max_tokens=4)
                 for _ in range(args.burst)]
        await asyncio.gather(*(one(client, p, rnd.choice(PROMPTS), tally, t0, args.timeout) for p in burst))
        wait = args.burst_every


async def sample_rss(server: ServerProcess, tally: Tally, t0: float, every: float = 5.0) -> None:
    while True:
        tally.rss.append((time.perf_counter() - t0, server.rss()))
        await asyncio.sleep(every)


async def run_load(server: ServerProcess, args) -> tuple[Tally, Tally, dict]:
    """Warm-up, then `--minutes` of load, then SIGTERM under it: (warm-up's tally, the load's, the shutdown's)."""
    rnd = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency + args.burst + 8)
    async with httpx.AsyncClient(base_url=server.url, timeout=args.timeout, limits=limits) as client:
        warm, stop = Tally(), asyncio.Event()
        t0 = time.perf_counter()
        workers = [asyncio.create_task(steady(client, random.Random(rnd.random()), args, warm, t0, stop))
                   for _ in range(args.concurrency)]
        await asyncio.sleep(args.warmup)
        stop.set()
        await asyncio.gather(*workers)
        await asyncio.sleep(2)  # the server settles: its RSS at rest after the warm-up is the start figure
        tally, stop, t0 = Tally(), asyncio.Event(), time.perf_counter()
        sampler = asyncio.create_task(sample_rss(server, tally, t0))
        tasks = [asyncio.create_task(steady(client, random.Random(rnd.random()), args, tally, t0, stop))
                 for _ in range(args.concurrency)]
        tasks.append(asyncio.create_task(bursts(client, random.Random(rnd.random()), args, tally, t0, stop)))
        await asyncio.sleep(args.minutes * 60)
        shutdown = await sigterm_under_load(server, tally, t0, stop, tasks)
        sampler.cancel()
    return warm, tally, shutdown


async def sigterm_under_load(server: ServerProcess, tally: Tally, t0: float, stop: asyncio.Event,
                             tasks: list) -> dict:
    """No new requests; a moment for those just sent to reach the server; SIGTERM while they run; their ends."""
    stop.set()
    await asyncio.sleep(0.5)
    before = len(tally.records)
    in_flight = tally.started - before
    rss_end = server.rss()
    signalled = time.perf_counter() - t0
    server.terminate()
    await asyncio.gather(*tasks)
    after = Counter(f"{r.outcome} {r.kind}" for r in tally.records[before:])
    code = await asyncio.to_thread(server.wait, 120)
    return {"in_flight_at_sigterm": in_flight, "their_outcomes": dict(after), "exit_code": code,
            "rss_end": rss_end, "at_s": round(signalled, 1),
            "drained_in_s": round(time.perf_counter() - t0 - signalled, 1)}


def pcts(values: list[float]) -> tuple[float | None, float | None]:
    return (round(percentile(values, 50), 3), round(percentile(values, 99), 3)) if values else (None, None)


def summary(records: list[Record]) -> dict:
    """Outcomes and kinds, tokens, and p50/p99 latency (served requests) and TTFT (served streams, steady clients)."""
    served = [r for r in records if r.outcome == "ok"]
    streams = [r.ttft for r in served if r.plan.stream and not r.plan.burst and r.ttft is not None]
    latency = pcts([r.end - r.start for r in served])
    ttft = pcts(streams)
    return {"requests": len(records), "outcomes": dict(Counter(r.outcome for r in records)),
            "by_kind": dict(Counter(f"{r.outcome}: {r.kind}" for r in records if r.outcome != "ok")),
            "served_finish": dict(Counter(r.finish for r in served)), "tokens": sum(r.tokens for r in served),
            "latency_p50_s": latency[0], "latency_p99_s": latency[1], "ttft_p50_s": ttft[0], "ttft_p99_s": ttft[1],
            "bursts": dict(Counter(f"{r.outcome}: {r.kind}" for r in records if r.plan.burst)),
            "row_filling": dict(Counter(f"{r.outcome}: {r.kind}" for r in records if r.plan.exhaust))}


def per_minute(tally: Tally, minutes: float) -> list[dict]:
    """The load's records by the minute they ended in (those after the last minute: the shutdown's), with the
    server's RSS at the minute's end."""
    rows = []
    for m in range(max(1, int(round(minutes)))):
        s = summary([r for r in tally.records if m * 60 <= r.end < (m + 1) * 60])
        rss = [b for t, b in tally.rss if t <= (m + 1) * 60]
        rows.append({"minute": m + 1, **{k: s[k] for k in ("requests", "outcomes", "by_kind", "tokens",
                                                           "latency_p50_s", "latency_p99_s", "ttft_p50_s",
                                                           "ttft_p99_s")},
                     "rss_mb": round(rss[-1] / 2**20, 1) if rss else None})
    return rows


def minute_table(rows: list[dict]) -> str:
    lines = ["| minute | requests | served | refused 429 | disconnected | errors | lost | tokens | latency p50 / p99 s "
             "| TTFT p50 / p99 s | RSS MB |", "| " + " | ".join(["---:"] * 11) + " |"]
    for r in rows:
        o = r["outcomes"]
        lines.append(f"| {r['minute']} | {r['requests']} | {o.get('ok', 0)} | {o.get('refused', 0)} | "
                     f"{o.get('disconnected', 0)} | {o.get('error', 0)} | {o.get('lost', 0)} | {r['tokens']} | "
                     f"{r['latency_p50_s']} / {r['latency_p99_s']} | {r['ttft_p50_s']} / {r['ttft_p99_s']} | "
                     f"{r['rss_mb']} |")
    return "\n".join(lines)


def report(args, server: ServerProcess, startup: float, warm: Tally, tally: Tally, shutdown: dict) -> dict:
    """The figures as a dict (the JSON), printed as tables; `ok`: every check passed."""
    total = summary(tally.records)
    rss_start = tally.rss[0][1] if tally.rss else 0
    growth = 100 * (shutdown["rss_end"] - rss_start) / rss_start if rss_start else None
    lost = total["outcomes"].get("lost", 0)
    accounted = tally.started == len(tally.records)
    figures = {
        "command": " ".join(sys.argv), "server": " ".join(server.command[2:]), "minutes": args.minutes,
        "concurrency": args.concurrency, "burst": args.burst, "burst_every_s": args.burst_every,
        "server_up_s": round(startup, 1), "warmup": summary(warm.records), "total": total,
        "started": tally.started, "accounted": accounted, "lost": lost,
        "rss_start_mb": round(rss_start / 2**20, 1), "rss_end_mb": round(shutdown["rss_end"] / 2**20, 1),
        "rss_peak_mb": round(max((b for _, b in tally.rss), default=0) / 2**20, 1),
        "rss_growth_pct": None if growth is None else round(growth, 2), "tracebacks": server.tracebacks(),
        "other_log_lines": len(server.other_lines()), "other_log_examples": sorted(set(server.other_lines()))[:10],
        "shutdown": shutdown, "per_minute": per_minute(tally, args.minutes)}
    figures["ok"] = (accounted and lost == 0 and not total["outcomes"].get("error") and figures["tracebacks"] == 0
                     and shutdown["exit_code"] == 0 and (growth is None or growth <= 5))
    print(minute_table(figures["per_minute"]))
    print(f"\nrequests {tally.started} (accounted for: {accounted}): {total['outcomes']}; lost {lost}")
    for kind, n in sorted(total["by_kind"].items()):
        print(f"  {kind}: {n}")
    print(f"served finish reasons {total['served_finish']}; row-filling requests {total['row_filling']}; bursts "
          f"{total['bursts']}")
    print(f"TTFT at concurrency {args.concurrency} p50 {total['ttft_p50_s']} s, p99 {total['ttft_p99_s']} s; latency "
          f"p50 {total['latency_p50_s']} s, p99 {total['latency_p99_s']} s; {total['tokens']} tokens served")
    print(f"RSS start {figures['rss_start_mb']} MB, end {figures['rss_end_mb']} MB (growth {figures['rss_growth_pct']} "
          f"%), peak {figures['rss_peak_mb']} MB; tracebacks {figures['tracebacks']}; other server log lines "
          f"{figures['other_log_lines']} {figures['other_log_examples'][:3]}")
    print(f"SIGTERM at {shutdown['at_s']} s with {shutdown['in_flight_at_sigterm']} in flight: "
          f"{shutdown['their_outcomes']}; exit code {shutdown['exit_code']} after {shutdown['drained_in_s']} s")
    print("all checks passed" if figures["ok"] else "SOME CHECK FAILED")
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30, help="minutes of load after the warm-up")
    p.add_argument("--warmup", type=float, default=30, help="seconds of the same load before the measured minutes")
    p.add_argument("--concurrency", type=int, default=32, help="steady clients")
    p.add_argument("--max-queue", type=int, default=32, help="the server's --max-queue (bursts go past it)")
    p.add_argument("--max-len", type=int, default=256, help="the server's --max-len: KV entries per row")
    p.add_argument("--burst", type=int, default=48, help="requests sent at once in each burst")
    p.add_argument("--burst-every", type=float, default=60, help="seconds between bursts")
    p.add_argument("--disconnect", type=float, default=0.1, help="share of streams left after 1-3 chunks")
    p.add_argument("--exhaust", type=float, default=0.05, help="share of requests that fill their row (ignore_eos)")
    p.add_argument("--shutdown-timeout", type=float, default=60, help="the server's --shutdown-timeout: 32 clients "
                   "on 8 rows of a 2-core CPU take about 20 s to drain, close to its default 30")
    p.add_argument("--timeout", type=float, default=300, help="seconds a request may take before it counts as lost")
    p.add_argument("--seed", type=int, default=53)
    p.add_argument("--model", default="default")
    p.add_argument("--log", type=Path, default=ROOT / "runs" / "soak-server.log", help="the server's stderr")
    p.add_argument("--json", type=Path, default=None, help="write the figures here (results/...)")
    args = p.parse_args(argv)
    flags = ["--max-queue", str(args.max_queue), "--max-len", str(args.max_len), "--shutdown-timeout",
             str(args.shutdown_timeout)]
    server = ServerProcess(args.model, flags, args.log)
    startup = server.start()
    try:
        warm, tally, shutdown = asyncio.run(run_load(server, args))
    finally:
        server.kill()  # a no-op once it has exited
    figures = report(args, server, startup, warm, tally, shutdown)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
