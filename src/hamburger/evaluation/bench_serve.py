"""`hamburger bench-serve`: load on the OpenAI-compatible server, the base and HAMburger served the same way.

For each model (`--models`, e.g. `default,SmolLM2-135M-Instruct`: the shipped HAMburger and its plain base)
the server runs in-process on a loopback port (or `--url` targets one already running), and `--requests`
streaming chat requests on the built-in held-out prompts go out at each concurrency of `--concurrency`.
Per request, measured by the client: TTFT = arrival of the first streamed chunk (the first macro-step's
tokens) since sending; TPOT = (last chunk - first chunk) / (completion tokens - 1). Per run: requests/s and
output tokens/s over the wall time of the run, tokens per step = completion tokens / macro-steps, and KV entries per
generated token = (KV entries - prompt tokens) / completion tokens (all from the server's `usage`,
`stats.GenerationStats`); served in process, the same in bytes (`stats.kv_bytes_per_entry`) and per request.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
from dataclasses import dataclass

from hamburger.errors import HamburgerError


@dataclass(frozen=True)
class ServeBench:
    """What a bench-serve run sends (the requests) and, unless it targets a server at `url`, how it serves them in
    process (`loading.load`'s model options, the `Service`'s cache and threads)."""

    requests: int = 64  # at each concurrency level
    warmup: int = 1  # requests sent (at the level's concurrency) before each level's measured ones
    max_tokens: int = 128  # each request's max_tokens
    sets: tuple[str, ...] = ("chat", "code", "math")  # built-in prompt sets
    per_set: int | None = None  # the first this many prompts of each set (None: `requests` of each), cycled
    confidence: float | None = None  # sent with each request (None: the server's)
    modes: tuple[str, ...] = ("trust",)  # each model served in each mode
    url: str | None = None  # a server already running there instead of one in process
    api_key: str | None = None
    base: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    quantize: str = "auto"
    group_size: int = 32
    max_len: int = 1024  # KV entries per batch row
    decode_threads: int | None = None
    lookup: int | None = None
    verbose: bool = False  # the quantization's details
    quiet: bool = False  # no start line
    kv_memory: tuple[int, str] | None = None  # (amount, "bytes" or "entries"): rows of max_len as many as it holds,
    # and as many concurrent clients (in place of the levels)
    ignore_eos: bool = False  # requests go on past EOS (vLLM's ignore_eos): a capacity measurement's replies


COLUMNS = ("model", "conc", "req/s", "out tok/s", "tok/req", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99",
           "tok/step", "KV/gen token", "KV KB/gen token")


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (q in 0..100)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


async def _one(client, body: dict) -> dict:
    """One streaming request: its TTFT, TPOT, completion tokens and macro-steps."""
    sent = time.perf_counter()
    first = last = finish = None
    usage = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise HamburgerError(f"the server answered {resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                last = time.perf_counter()
                first = first or last
                finish = chunk["choices"][0].get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    tokens = usage.get("completion_tokens", 0)
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return {"ttft": first - sent, "tpot": tpot, "tokens": tokens, "steps": usage.get("macro_steps", 0),
            "kv_generated": usage.get("kv_entries", 0) - usage.get("prompt_tokens", 0),
            "kv_entries": usage.get("kv_entries", 0), "length": finish == "length"}


async def _run(url: str, bodies: list[dict], concurrency: int, api_key: str | None, warmup: int = 1) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=600) as client:
        gate = asyncio.Semaphore(concurrency)

        async def limited(body):
            async with gate:
                return await _one(client, body)

        # Warm-up: first-call costs, and the server's admission estimates (learned from replies), are not its steady
        # state
        await asyncio.gather(*(limited(bodies[i % len(bodies)]) for i in range(warmup)))

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(b) for b in bodies))
        wall = time.perf_counter() - start
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    tokens, steps = sum(r["tokens"] for r in results), sum(r["steps"] for r in results)
    row = {"concurrency": concurrency, "requests": len(results), "wall_s": wall, "requests_per_s": len(results) / wall,
           "output_tokens_per_s": tokens / wall, "completion_tokens": tokens, "macro_steps": steps,
           "tokens_per_request": tokens / len(results), "ended_by_length": sum(r["length"] for r in results),
           "tokens_per_step": tokens / steps if steps else 0.0,
           # KV entries a request's reply added, per generated token, and a request's entries at its end (`usage`)
           "kv_entries_per_generated_token": sum(r["kv_generated"] for r in results) / tokens if tokens else 0.0,
           "kv_entries_per_request": sum(r["kv_entries"] for r in results) / len(results)}
    for name, xs in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_s"] = percentile(xs, q)
    return row


def _bodies(run: ServeBench, model_name: str, mode: str) -> list[dict]:
    from hamburger.evaluation.bench_systems import bench_messages
    from hamburger.inference.modes import parse_mode

    pool = [m for name in run.sets for m in bench_messages(name, run.per_set or run.requests)]
    if not pool:
        raise HamburgerError("no prompts: check --sets")
    extra = {"confidence": run.confidence} if run.confidence is not None else {}
    if parse_mode(mode).checked:  # the unchecked mode, trust, is the server's default
        extra["mode"] = mode
    if run.max_tokens:  # 0: none sent, the server gives what the row holds
        extra["max_tokens"] = run.max_tokens
    if run.ignore_eos:
        extra["ignore_eos"] = True
    return [{"model": model_name, "messages": pool[i % len(pool)], "stream": True,
             "stream_options": {"include_usage": True}, "temperature": 0, **extra} for i in range(run.requests)]


def bench_model(run: ServeBench, name: str, levels: list[int]) -> list[dict]:
    """The rows of one model: served in-process (or at `run.url`) in each of `run.modes` at each concurrency level."""
    from hamburger.inference.modes import TRUST, parse_mode

    modes = list(run.modes)
    label = lambda mode: name if [parse_mode(m) for m in modes] == [TRUST] else f"{name} [{mode}]"
    bodies = {m: _bodies(run, "default" if run.url is None else name, m) for m in modes}
    log = lambda s: print(f"bench-serve: {s}", file=sys.stderr, flush=True)
    if run.url is not None:
        return [dict(model=label(m), mode=m, **asyncio.run(_run(run.url, bodies[m], c, run.api_key, run.warmup)))
                for m in modes for c in levels]
    from hamburger.evaluation.bench_systems import entry_bytes
    from hamburger.loading import describe_run, load, resolve
    from hamburger.serving.server import BackgroundServer, Service
    from hamburger.serving.service import decode_threads

    device, scheme = resolve(run.device, run.quantize, run.dtype, run.group_size, name, run.base)
    threads = decode_threads(run.decode_threads, device)
    model, trained = load(name, run.base, run.dtype, str(device), scheme, run.group_size, quiet=not run.verbose)
    entry = entry_bytes(model)
    memory = None if run.kv_memory is None else run.kv_memory[0] * (entry if run.kv_memory[1] == "entries" else 1)
    service = Service(model, name, max_batch_size=max(levels), max_queue=run.requests + 1, max_len=run.max_len,
                      decode_threads=threads, lookup=run.lookup, kv_memory=memory)
    if memory is not None:  # as many clients as the memory holds rows
        levels = [len(service.scheduler.rows)]
    rows = []
    with BackgroundServer(service) as server:
        if not run.quiet:
            auto = run.quantize == "auto"
            log(f"{name} on {server.url}: {describe_run(model, trained, scheme, auto, ','.join(modes), run.lookup)}"
                + ("" if memory is None else f"; KV {service.scheduler.kv_bytes() / 1e6:.0f} MB: {levels[0]} rows of "
                   f"{run.max_len} entries"))
        for m in modes:
            for c in levels:
                rows.append(with_kv_bytes(dict(model=label(m), mode=m, hamburger=trained,
                                               **asyncio.run(_run(server.url, bodies[m], c, None, run.warmup))), entry))
                log(f"{label(m)} at concurrency {c}: {rows[-1]['requests_per_s']:.2f} req/s")
    del service, model
    gc.collect()
    return rows


def with_kv_bytes(row: dict, entry_bytes: int) -> dict:
    """The row's KV entries as bytes (`stats.kv_bytes_per_entry`): known for the in-process server only."""
    row["kv_bytes_per_entry"] = entry_bytes
    row["kv_bytes_per_generated_token"] = row["kv_entries_per_generated_token"] * entry_bytes
    row["kv_bytes_per_request"] = row["kv_entries_per_request"] * entry_bytes
    return row


def _format(row: dict) -> list[str]:
    ms = lambda s: f"{1000 * s:.0f} ms"
    return [row["model"], str(row["concurrency"]), f"{row['requests_per_s']:.2f}", f"{row['output_tokens_per_s']:.1f}",
            f"{row['tokens_per_request']:.0f}",
            *(ms(row[f"ttft_p{q}_s"]) for q in (50, 90, 99)), *(ms(row[f"tpot_p{q}_s"]) for q in (50, 90, 99)),
            f"{row['tokens_per_step']:.2f}", f"{row['kv_entries_per_generated_token']:.2f}",
            f"{row['kv_bytes_per_generated_token'] / 2**10:.1f}" if "kv_bytes_per_generated_token" in row else "-"]


def print_table(rows: list[dict]) -> None:
    body = [COLUMNS] + [tuple(_format(r)) for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(COLUMNS))]
    for line in body:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))))
