"""Fuzz `hamburger serve` on the embedded default from its own OpenAPI schema (issue 53, item 2).

Starts the server (`--model default`, 127.0.0.1, a free port), reads /openapi.json, and sends `--requests` requests
from a few concurrent clients: request bodies drawn from the documented request schemas of both completion
endpoints and often spoilt (wrong types, out-of-range numbers, huge strings, odd unicode, extra and refused fields,
fields removed, truncated JSON, JSON that is no object; streaming and not: tests/serving/schema_strategies.py, the
generator of the in-suite fuzz, tests/serving/test_openapi.py), GETs of every documented GET endpoint (and of
/openapi.json and the web page) with odd query strings, and methods the endpoints do not take. max_tokens is kept at
most `--max-tokens`, so it runs fast.

Checks: no 5xx; no traceback in the server's log; every answer valid against the document (a 200 against its
response model, each SSE chunk against the chunk model and the stream ending with [DONE], an error against the error
object; a body the schema refuses is refused, one it accepts is refused only for what a schema cannot know); then a
normal request answered within 2 s. Prints a table of requests by endpoint and status, and the totals.

    .venv/bin/python benchmarks/fuzz_server.py --requests 5000 --json results/fuzz-server-5000-2026-11-27.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "serving"), str(Path(__file__).resolve().parent)]

from schema_strategies import (  # noqa: E402
    answer_problem,
    cases,
    checkers,
    first_error,
    refusal_problem,
    request_schemas,
)
from server_process import ServerProcess  # noqa: E402

QUERIES = ["", "?", "?a=1", "?model=default&stream=true", "?x=" + "%F0%9F%8D%94" * 40, "?q=%00%ff%fe",
           "?" + "a=b&" * 500, "?%E2%80%AE=%EF%BB%BF"]
WRONG = {"GET": "DELETE", "POST": "GET"}  # a method each kind of endpoint does not take
UNDOCUMENTED_GETS = ["/openapi.json", "/"]  # the document itself and the web page: a 200 is all they promise
ODD_BODIES = [b"", b"{", b'{"model": "default"}', "\u202e\U0001f354".encode(), b"\xff\xfe\x00"]


def post_cases(doc: dict, n: int, seed_: int, max_tokens: int) -> list[tuple[str, str, bytes, bool]]:
    """`n` (method, path, raw body, stream) for the completion endpoints, drawn by hypothesis from the schema."""
    drawn: list[tuple[str, str, bytes, bool]] = []
    strategy = cases(request_schemas(doc), served="default", max_tokens=max_tokens, capped=True, streams=True)

    @seed(seed_)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def collect(case):
        path, raw, stream = case
        drawn.append(("POST", path, raw, stream))

    collect()
    return drawn[:n]


def all_cases(doc: dict, n: int, seed_: int, max_tokens: int) -> list[tuple[str, str, bytes, bool]]:
    """About 90 % completion requests, 8 % GETs of the documented GET endpoints with odd query strings, 2 % methods
    the endpoints do not take (with an odd body); shuffled with `seed_`."""
    rnd = random.Random(seed_)
    gets = [path for path, ops in doc["paths"].items() if "get" in ops] + UNDOCUMENTED_GETS
    n_get, n_wrong = n * 8 // 100, n * 2 // 100
    out = post_cases(doc, n - n_get - n_wrong, seed_, max_tokens)
    out += [("GET", rnd.choice(gets) + rnd.choice(QUERIES), b"", False) for _ in range(n_get)]
    paths = sorted(doc["paths"])
    for _ in range(n_wrong):
        path = rnd.choice(paths)
        method = WRONG["GET" if "get" in doc["paths"][path] else "POST"]
        out.append((method, path, rnd.choice(ODD_BODIES), False))
    rnd.shuffle(out)
    return out


def documented_get_problem(doc: dict, check_get: dict, path: str, resp: httpx.Response) -> str | None:
    """A GET's answer: a 200, and as JSON valid against the schema its path documents (if it documents one)."""
    if resp.status_code != 200:
        return f"status {resp.status_code}: {resp.text[:300]}"
    if "application/json" in resp.headers.get("content-type", "") and path in check_get:
        return first_error(check_get[path], resp.json())
    return None


def judge(doc, check, check_get, method: str, path: str, raw: bytes, stream: bool, resp) -> str | None:
    """What is wrong with one answer; None when nothing is."""
    base = path.split("?")[0]
    if resp.status_code >= 500:
        return f"status {resp.status_code}: {resp.text[:300]}"
    if method == "GET" and ("get" in doc["paths"].get(base, {}) or base in UNDOCUMENTED_GETS):
        return documented_get_problem(doc, check_get, base, resp)
    if method != "POST":  # a method the path does not take: 405, as an error object
        if resp.status_code != 405:
            return f"{method} answered {resp.status_code}"
        return first_error(check["ErrorResponse"], resp.json())
    return answer_problem(doc, check, base, resp, stream) or refusal_problem(check, base, raw, resp)


def get_checkers(doc: dict) -> dict:
    """A validator per documented GET path with a JSON schema for its 200 (through `checkers`' registry)."""
    out, validator = {}, next(iter(checkers(doc).values()))
    for path, ops in doc["paths"].items():
        schema = ops.get("get", {}).get("responses", {}).get("200", {}).get("content", {}).get("application/json")
        if schema and schema.get("schema"):
            pointer = "/paths/" + path.replace("~", "~0").replace("/", "~1") + "/get/responses/200/content/" \
                      "application~1json/schema"
            out[path] = validator.evolve(schema={"$ref": f"urn:openapi#{pointer}"})
    return out


async def send_all(url: str, doc: dict, todo: list, concurrency: int, timeout: float) -> tuple[Counter, list, float]:
    """Every case from `concurrency` clients; (answers by (endpoint, status), problems, seconds)."""
    check, check_get = checkers(doc), get_checkers(doc)
    seen, problems, queue = Counter(), [], list(reversed(todo))
    headers = {"Content-Type": "application/json"}

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            method, path, raw, stream = queue.pop()
            endpoint = f"{method} {path.split('?')[0]}" + (" (stream)" if stream else "")
            try:
                resp = await client.request(method, path, content=raw or None, headers=headers)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                seen[endpoint, type(exc).__name__] += 1
                problems.append((endpoint, raw[:300], f"no answer: {type(exc).__name__}: {exc}"))
                continue
            seen[endpoint, resp.status_code] += 1
            try:
                problem = judge(doc, check, check_get, method, path, raw, stream, resp)
            except Exception as exc:  # noqa: BLE001 - a body its model or JSON refuses is a violation, not a crash
                problem = f"{type(exc).__name__}: {str(exc)[:300]}"
            if problem:
                problems.append((endpoint, raw[:300], problem))

    began = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return seen, problems, time.perf_counter() - began


def normal_request(url: str) -> tuple[int, float]:
    """A plain chat request after the fuzz: (status, seconds)."""
    body = {"model": "default", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
    began = time.perf_counter()
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    return resp.status_code, time.perf_counter() - began


def table(seen: Counter) -> str:
    """Requests by endpoint (rows) and status (columns), with totals."""
    statuses = sorted({status for _, status in seen}, key=str)
    endpoints = sorted({endpoint for endpoint, _ in seen})
    lines = ["| endpoint | " + " | ".join(str(s) for s in statuses) + " | all |",
             "| --- | " + " | ".join("---:" for _ in statuses) + " | ---: |"]
    for endpoint in endpoints:
        counts = [seen.get((endpoint, s), 0) for s in statuses]
        lines.append(f"| {endpoint} | " + " | ".join(str(c) for c in counts) + f" | {sum(counts)} |")
    totals = [sum(seen.get((e, s), 0) for e in endpoints) for s in statuses]
    lines.append("| all | " + " | ".join(str(c) for c in totals) + f" | {sum(totals)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=8, help="clients sending at once (8: the server's rows)")
    p.add_argument("--max-tokens", type=int, default=8, help="the generated requests' max_tokens at most")
    p.add_argument("--seed", type=int, default=53)
    p.add_argument("--model", default="default")
    p.add_argument("--timeout", type=float, default=120, help="seconds a request may take before it counts as lost")
    p.add_argument("--log", type=Path, default=ROOT / "runs" / "fuzz-server.log", help="the server's stderr")
    p.add_argument("--json", type=Path, default=None, help="write the figures here (results/...)")
    args = p.parse_args(argv)
    server = ServerProcess(args.model, ["--no-access-log"], args.log)
    startup = server.start()
    try:
        doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
        began = time.perf_counter()
        todo = all_cases(doc, args.requests, args.seed, args.max_tokens)
        generated = time.perf_counter() - began
        seen, problems, seconds = asyncio.run(send_all(server.url, doc, todo, args.concurrency, args.timeout))
        status, after = normal_request(server.url)
    finally:
        server.terminate()
        exit_code = server.wait()
    others = server.other_lines()
    print(f"server log lines other than the start line: {len(others)}", *sorted(set(others))[:10], sep="\n  ")
    return report(args, seen, problems, seconds, generated, startup, (status, after), server.tracebacks(), exit_code)


def report(args, seen: Counter, problems: list, seconds: float, generated: float, startup: float,
           normal: tuple[int, float], tracebacks: int, exit_code: int | None) -> int:
    """Prints the table and the totals, writes the JSON; exit 1 if any check failed."""
    five = sum(n for (_, status), n in seen.items() if isinstance(status, int) and status >= 500)
    lost = sum(n for (_, status), n in seen.items() if not isinstance(status, int))
    ok_after = normal[0] == 200 and normal[1] <= 2.0
    print(table(seen))
    print(f"\nrequests {sum(seen.values())}, schema violations {len(problems)}, 5xx {five}, no answer {lost}, "
          f"tracebacks in the server log {tracebacks}; sent in {seconds:.1f} s ({sum(seen.values()) / seconds:.1f}/s; "
          f"generated in {generated:.1f} s, server up in {startup:.1f} s); a normal request afterwards: "
          f"{normal[0]} in {normal[1]:.2f} s; exit code after SIGTERM {exit_code}")
    for endpoint, raw, problem in problems[:20]:
        print(f"  {endpoint} {raw[:160]!r}: {problem}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "requests": sum(seen.values()), "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "seed": args.seed, "by_endpoint_and_status": {f"{e} {s}": n for (e, s), n in sorted(seen.items(), key=str)},
            "violations": len(problems),
            "examples": [[e, r.decode("utf-8", "replace"), p] for e, r, p in problems[:50]],
            "5xx": five, "no_answer": lost, "tracebacks": tracebacks, "seconds": round(seconds, 1),
            "normal_after": {"status": normal[0], "seconds": round(normal[1], 3)}, "exit_code": exit_code,
        }, indent=1) + "\n")
    return 0 if not problems and not five and not lost and not tracebacks and ok_after and exit_code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
