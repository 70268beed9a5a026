"""The OpenAI-compatible server on loopback: the official client, load, bad input, a soak, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from conftest import hamburger
from hamburger.engine import Engine
from hamburger.server import BackgroundServer, Service

CONFIDENCE = 0.3  # low: multi-token steps
KEY = "sk-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model():
    return hamburger("llama", k=4)


@pytest.fixture(scope="module")
def server(model):
    service = Service(model, "tiny", max_batch_size=8, max_queue=256, max_len=64, default_confidence=CONFIDENCE,
                      api_key=KEY)
    with BackgroundServer(service) as srv:
        yield srv


def messages(i: int) -> list[dict]:
    rnd = random.Random(i)
    return [{"role": "user", "content": " ".join(f"w{rnd.randrange(90)}" for _ in range(rnd.randrange(1, 8)))}]


def alone(model, engine: Engine, msgs: list[dict], max_tokens: int) -> tuple[str, int]:
    """The reply to one request served alone by the fast engine: (text, tokens)."""
    from hamburger.base import encode_chat

    out = engine.generate([encode_chat(model.tokenizer, msgs)], max_new_tokens=max_tokens, confidence=CONFIDENCE)
    return model.tokenizer.decode(out.tokens[0], skip_special_tokens=True), len(out.tokens[0])


def test_openai_client_plain_and_streaming(server, model):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert {m.id for m in client.models.list().data} == {"tiny", "default"}
    expected, n = alone(model, Engine(model), messages(1), 12)
    reply = client.chat.completions.create(model="tiny", messages=messages(1), max_tokens=12)
    assert reply.choices[0].message.content == expected
    assert reply.usage.completion_tokens == n and reply.usage.model_extra["macro_steps"] >= 1
    chunks = list(client.chat.completions.create(model="default", messages=messages(1), max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == n
    assert len([c for c in chunks if c.choices]) == chunks[-1].usage.model_extra["macro_steps"]  # a chunk per step
    text = client.completions.create(model="tiny", prompt="w3 w4 w5", max_tokens=5, extra_body={"confidence": 1.0})
    assert text.usage.completion_tokens <= 5 and text.usage.model_extra["tokens_per_step"] == 1.0


def test_stop_strings_end_the_reply(server, model):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    full = client.chat.completions.create(model="tiny", messages=messages(2), max_tokens=16).choices[0].message.content
    words = full.split()
    assert len(words) > 2
    cut = client.chat.completions.create(model="tiny", messages=messages(2), max_tokens=16, stop=[words[2]])
    assert cut.choices[0].finish_reason == "stop" and words[2] not in cut.choices[0].message.content
    assert full.startswith(cut.choices[0].message.content)


async def _stream_one(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[str, int]:
    body = {"model": "tiny", "messages": messages(i), "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    text, tokens, done = "", None, False
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                text += chunk["choices"][0]["delta"].get("content") or ""
            else:
                tokens = chunk["usage"]["completion_tokens"]
    assert done
    return text, tokens


def test_load_32_concurrent_streams_equal_alone(server, model):
    engine, limits = Engine(model), [3 + i % 6 for i in range(200)]

    async def main():
        headers = {"Authorization": f"Bearer {KEY}"}
        limits_ = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=server.url, headers=headers, limits=limits_, timeout=60) as client:
            gate = asyncio.Semaphore(32)

            async def one(i):
                async with gate:
                    return await _stream_one(client, i, limits[i])

            return await asyncio.gather(*(one(i) for i in range(200)))

    results = asyncio.run(main())
    for i, got in enumerate(results):
        assert got == alone(model, engine, messages(i), limits[i]), f"request {i}"
    metrics = httpx.get(server.url + "/metrics").text
    assert "hamburger_time_to_first_token_seconds_count" in metrics and "hamburger_kv_entries 0" in metrics


BAD = [  # (description, body or raw bytes, status, param)
    ("malformed JSON", b'{"model": "tiny", "messages": [', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("missing messages", {"model": "tiny"}, 400, "messages"),
    ("missing model", {"messages": [{"role": "user", "content": "w1"}]}, 400, "model"),
    ("wrong type", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": "5"}, 400,
     "max_tokens"),
    ("empty messages", {"model": "tiny", "messages": []}, 400, "messages"),
    ("max_tokens 0", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 0}, 400,
     "max_tokens"),
    ("max_tokens beyond context", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}],
                                   "max_tokens": 1000}, 400, "max_tokens"),
    ("prompt beyond context", {"model": "tiny", "messages": [{"role": "user", "content": "w1 " * 80}]}, 400,
     "messages"),
    ("unknown model", {"model": "gpt-5", "messages": [{"role": "user", "content": "w1"}]}, 404, "model"),
    ("confidence 0", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "confidence": 0}, 400,
     "confidence"),
    ("confidence 1.5", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "confidence": 1.5}, 400,
     "confidence"),
    ("n=2", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "n": 2}, 400, "n"),
    ("temperature -1", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "temperature": -1}, 400,
     "temperature"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_gets_4xx_and_openai_error(server, case):
    _, body, status, param = case
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(server.url + "/v1/chat/completions", content=raw, headers=headers)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_wrong_or_missing_api_key(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
    for headers in ({"Authorization": "Bearer nope"}, {}):
        resp = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_disconnect_mid_stream_frees_the_row(server, monkeypatch):
    sched = server.service.scheduler
    step = sched.step

    def slow_step():  # long enough that the request is surely still running when the client leaves
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(sched, "step", slow_step)
    body = {"model": "tiny", "messages": messages(5), "max_tokens": 40, "stream": True, "confidence": 1.0}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            next(resp.iter_lines())
            assert sched.running == 1
    deadline = time.time() + 2
    while sched.running and time.time() < deadline:
        time.sleep(0.01)
    assert sched.running == 0 and server.service.queues == {}
    assert 'hamburger_requests_total{outcome="cancelled"}' in httpx.get(server.url + "/metrics").text


def test_soak_500_short_requests_keeps_memory_flat(server):
    process = psutil.Process()
    headers = {"Authorization": f"Bearer {KEY}"}

    async def batch(client, start, count):
        body = lambda i: {"model": "tiny", "prompt": f"w{i % 90} w{(i * 7) % 90}", "max_tokens": 2}  # noqa: E731
        return await asyncio.gather(*(client.post("/v1/completions", json=body(i)) for i in range(start, start + count)))

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as client:
            await batch(client, 0, 50)  # warm-up: allocator pools and lazily built objects
            before = process.memory_info().rss
            for start in range(50, 500, 50):
                assert all(r.status_code == 200 for r in await batch(client, start, 50))
            return before, process.memory_info().rss

    before, after = asyncio.run(main())
    assert after - before < 200 * 2**20, f"RSS grew by {(after - before) / 2**20:.0f} MB over 450 requests"
    assert server.service.queues == {} and server.service.scheduler.running == 0


def test_sigterm_ends_streams_and_exits_0(checkpoint):
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "hamburger.cli", "serve", "--model", str(checkpoint), "--port",
                             str(port), "--max-len", "128"], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None and time.time() < deadline, "server did not start"
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        # Confidence 1.0: one token per chunk, so a long reply streams for many chunks after the signal.
        body = {"model": "default", "messages": messages(1), "max_tokens": 100, "stream": True, "confidence": 1.0}
        with httpx.Client(base_url=url, timeout=30) as client:
            with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                lines = resp.iter_lines()
                assert next(lines).startswith("data: ")
                proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and len(rest) > 10  # the stream went on after the signal
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")
        with pytest.raises(httpx.TransportError):  # and no new requests once it has stopped
            httpx.get(url + "/health", timeout=1)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
