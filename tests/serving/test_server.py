"""The OpenAI-compatible server on loopback: the official client, load, bad input, a soak, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest
import torch

from conftest import hamburger, random_merger
from hamburger import HamburgerError
from hamburger.inference.engine import Engine
from hamburger.model.base import encode_chat
from hamburger.serving.server import BackgroundServer, Service

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


def wait_up(proc: subprocess.Popen, url: str) -> None:
    deadline = time.time() + 60
    while True:
        assert proc.poll() is None and time.time() < deadline, "server did not start"
        try:
            httpx.get(url + "/health", timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.1)


def raw_post(url: str, path: str, body: bytes, length: int | None = None) -> socket.socket:
    """A connection that has sent `POST path` with `body`, under a Content-Length of `length` (default: its own)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body) if length is None else length}\r\n\r\n")
    sock.sendall(head.encode() + body)
    return sock


def outcomes(url: str) -> dict[str, int]:
    """hamburger_requests_total by outcome."""
    lines = httpx.get(url + "/metrics").text.splitlines()
    return {line.split('"')[1]: int(line.split()[-1]) for line in lines if line.startswith("hamburger_requests_total{")}


def until(condition, seconds: float = 3.0) -> bool:
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline:
        time.sleep(0.01)
    return condition()


def slow_steps(monkeypatch, sched) -> None:
    """20 ms a step: long enough that a request is surely still running when its client leaves."""
    step = sched.step

    def slow_step():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(sched, "step", slow_step)


def messages(i: int) -> list[dict]:
    rnd = random.Random(i)
    return [{"role": "user", "content": " ".join(f"w{rnd.randrange(90)}" for _ in range(rnd.randrange(1, 8)))}]


def alone(model, engine: Engine, msgs: list[dict], max_tokens: int, confidence: float = CONFIDENCE) -> tuple[str, int]:
    """The reply to one request served alone by the fast engine: (text, tokens)."""
    from hamburger.model.base import encode_chat

    out = engine.generate([encode_chat(model.tokenizer, msgs)], max_new_tokens=max_tokens, confidence=confidence)
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


def test_verify_mode_answers_with_the_base_output(server, model):
    """mode=verify (a HAMburger field, through the OpenAI client's extra_body): the base's greedy reply, token for
    token, beside trust-mode requests; its usage counts the forwards it took."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    engine = Engine(model)
    for i in (1, 2, 3):
        base_text, n = alone(model, engine, messages(i), 16, confidence=1.0)
        reply = client.chat.completions.create(model="tiny", messages=messages(i), max_tokens=16,
                                               extra_body={"mode": "verify"})
        assert reply.choices[0].message.content == base_text and reply.usage.completion_tokens == n
    stream = client.chat.completions.create(model="tiny", messages=messages(4), max_tokens=16, stream=True,
                                            extra_body={"mode": "verify", "confidence": 0.05})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == alone(
        model, engine, messages(4), 16, confidence=1.0)[0]


def test_compress_mode_is_served_when_the_model_has_a_merger():
    """mode=compress on a model with a KV merger: the reply is what `Engine.generate(mode="compress")` gives alone,
    streamed or not; usage says the KV was merged. (Without a merger: a 400, in the bad-input table.)"""
    merged = hamburger("llama", k=4)
    merged.attach_merger(random_merger(merged.base))
    service = Service(merged, "tiny", max_batch_size=4, max_len=64)
    engine = Engine(merged)
    with BackgroundServer(service) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        for i, stream in ((1, False), (2, True), (3, False)):
            ids = encode_chat(merged.tokenizer, messages(i))
            out = engine.generate([ids], max_new_tokens=12, confidence=0.05, mode="compress")
            expected = merged.tokenizer.decode(out.tokens[0], skip_special_tokens=True)
            reply = client.chat.completions.create(model="tiny", messages=messages(i), max_tokens=12, stream=stream,
                                                   extra_body={"mode": "compress", "confidence": 0.05})
            if stream:
                assert "".join(c.choices[0].delta.content or "" for c in reply if c.choices) == expected
            else:
                assert reply.choices[0].message.content == expected
                assert reply.usage.completion_tokens == len(out.tokens[0])


def test_a_compress_request_may_ask_for_more_tokens_than_a_verify_one_in_the_same_rows():
    """Rows are sized in KV entries: a compress reply keeps about one entry per step (admitted at 0.75 entries a
    token), so a max_tokens that a verify request of the same prompt is refused (one entry a token) is served; a
    request past even that is a 400 that names the mode and the most new tokens. `kv_memory` sizes the rows."""
    merged = hamburger("llama", k=4)
    merged.attach_merger(random_merger(merged.base))
    probe = Service(merged, "tiny", max_batch_size=1, max_len=64).scheduler
    service = Service(merged, "tiny", max_len=64, kv_memory=3 * probe.kv_bytes())
    assert service.scheduler.batch.size == 3
    prompt = len(encode_chat(merged.tokenizer, messages(1)))
    asked = 64 - prompt + 4  # past a verify row, within a compress row
    with BackgroundServer(service) as srv:
        body = {"model": "tiny", "messages": messages(1), "max_tokens": asked, "confidence": 0.05}
        refused = httpx.post(srv.url + "/v1/chat/completions", json={**body, "mode": "verify"}, timeout=60)
        assert refused.status_code == 400 and "verify mode" in refused.json()["error"]["message"]
        assert refused.json()["error"]["param"] == "max_tokens"
        served = httpx.post(srv.url + "/v1/chat/completions", json={**body, "mode": "compress"}, timeout=60)
        assert served.status_code == 200, served.text
        too_many = httpx.post(srv.url + "/v1/chat/completions", json={**body, "mode": "compress", "max_tokens": 200},
                              timeout=60)
        assert too_many.status_code == 400 and "compress mode" in too_many.json()["error"]["message"]


def test_ignore_eos_goes_on_past_the_end_of_sequence_token(model):
    """vLLM's `ignore_eos`: with the reply's third token made an end-of-sequence token, a plain request stops there
    (finish reason "stop") and one with ignore_eos goes on to its max_tokens, the same tokens first."""
    service = Service(model, "tiny", max_batch_size=2, max_len=64)
    prompt = encode_chat(model.tokenizer, messages(3))
    plain = Engine(model).generate([prompt], max_new_tokens=12, confidence=CONFIDENCE, eos_token_ids=set()).tokens[0]
    service.scheduler.default_eos = {plain[2]}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "confidence": CONFIDENCE}
    with BackgroundServer(service) as srv:
        stopped = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        going = httpx.post(srv.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=60).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == plain.index(plain[2]) + 1
    assert going["choices"][0]["finish_reason"] == "length" and going["usage"]["completion_tokens"] == 12


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
    ("content null", {"model": "tiny", "messages": [{"role": "user", "content": None}]}, 400, "messages.0.content"),
    ("content missing", {"model": "tiny", "messages": [{"role": "system", "content": "w1"}, {"role": "user"}]}, 400,
     "messages.1.content"),
    ("image content part", {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages.0.content"),
    ("mode compress", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "mode": "compress"}, 400,
     "mode"),
    ("unknown mode", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "mode": "fast"}, 400, "mode"),
    ("tool calls in a message", {"model": "tiny", "messages": [
        {"role": "assistant", "content": "w1", "tool_calls": [{"id": "c", "type": "function",
                                                               "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "user", "content": "w2"}]}, 400, "messages.0.tool_calls"),
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


UNSUPPORTED = [  # (endpoint, field, a value that asks for something this server would otherwise silently ignore)
    ("chat", "logprobs", True), ("chat", "top_logprobs", 2), ("chat", "presence_penalty", 0.5),
    ("chat", "frequency_penalty", -1), ("chat", "logit_bias", {"7": 100}), ("chat", "n", 3),
    ("chat", "response_format", {"type": "json_object"}), ("chat", "tool_choice", "required"),
    ("chat", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("chat", "top_k", 5), ("chat", "repetition_penalty", 1.3), ("chat", "modalities", ["text", "audio"]),
    ("completions", "logprobs", 0), ("completions", "logprobs", 3), ("completions", "logprobs", True),
    ("completions", "echo", True), ("completions", "best_of", 2), ("completions", "suffix", "w9"),
    ("completions", "presence_penalty", 1),
]


def _post(server, endpoint: str, fields: dict) -> httpx.Response:
    base = {"model": "tiny", "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "w1"}]} if endpoint == "chat" else {"prompt": "w1 w2"})
    return httpx.post(f"{server.url}/v1/{'chat/' if endpoint == 'chat' else ''}completions", json={**base, **fields},
                      headers={"Authorization": f"Bearer {KEY}"})


@pytest.mark.parametrize("case", UNSUPPORTED, ids=[f"{e}-{f}={json.dumps(v)}" for e, f, v in UNSUPPORTED])
def test_unsupported_fields_are_refused_not_ignored(server, case):
    endpoint, field, value = case
    resp = _post(server, endpoint, {field: value})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == field and "not supported" in err["message"] and err["type"] == "invalid_request_error"


def test_neutral_values_of_unsupported_fields_are_accepted(server):
    chat = {"logprobs": False, "top_logprobs": 0, "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0,
            "logit_bias": {}, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
            "modalities": ["text"], "repetition_penalty": 1.0, "user": "u1", "metadata": {"k": "v"}, "store": False}
    nulls = {name: None for name in ("logprobs", "top_logprobs", "n", "presence_penalty", "logit_bias", "tools",
                                     "response_format", "stream", "stop", "seed")}
    completions = {"logprobs": None, "echo": False, "best_of": 1, "suffix": "", "n": 1, "frequency_penalty": 0}
    for endpoint, fields in (("chat", chat), ("chat", nulls), ("completions", completions)):
        resp = _post(server, endpoint, fields)
        assert resp.status_code == 200, (fields, resp.text)
        assert resp.json()["usage"]["completion_tokens"] >= 1
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1", "name": "me"}],
                                           max_tokens=2, logprobs=False, n=1, presence_penalty=0)
    assert reply.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.chat.completions.create(model="tiny", messages=messages(1), max_tokens=2, logprobs=True, top_logprobs=2)


def test_wrong_or_missing_api_key(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
    for headers in ({"Authorization": "Bearer nope"}, {}):
        resp = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_disconnect_mid_stream_frees_the_row(server, monkeypatch):
    sched = server.service.scheduler
    slow_steps(monkeypatch, sched)
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


def test_disconnect_before_a_plain_answer_cancels_it(server, monkeypatch):
    sched = server.service.scheduler
    slow_steps(monkeypatch, sched)
    before = outcomes(server.url)
    body = {"model": "tiny", "messages": messages(1), "max_tokens": 40, "confidence": 1.0}  # 40 steps: 0.8 s or more
    sock = raw_post(server.url, "/v1/chat/completions", json.dumps(body).encode())
    assert until(lambda: sched.running == 1)
    sock.close()
    assert until(lambda: sched.running == 0 and server.service.queues == {})
    after = outcomes(server.url)  # cancelled, where it used to run all its 40 steps and count as "length"
    assert after.get("cancelled", 0) == before.get("cancelled", 0) + 1
    assert (after.get("length"), after.get("stop")) == (before.get("length"), before.get("stop"))


def test_leaving_mid_stream_while_the_loop_lags_logs_nothing(server, caplog):
    body = {"model": "tiny", "messages": messages(1), "max_tokens": 40, "confidence": 1.0}
    assert _post(server, "chat", body).json()["choices"][0]["finish_reason"] == "length"  # a long reply: 40 chunks
    caplog.set_level(logging.WARNING)
    for _ in range(2):
        sock = raw_post(server.url, "/v1/chat/completions", json.dumps({**body, "stream": True}).encode())
        assert sock.recv(100).startswith(b"HTTP/1.1 200")
        server.service.loop.call_soon_threadsafe(time.sleep, 0.3)  # the loop falls behind: the chunks pile up
        time.sleep(0.05)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        sock.close()
        assert until(lambda: server.service.queues == {})
    # Without a turn of the loop between chunks, asyncio logged "socket.send() raised exception." per chunk.
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_clients_that_leave_early_leave_one_line_and_no_traceback(checkpoint, tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "hamburger.cli", "serve", "--model", str(checkpoint), "--port",
                                 str(port), "--max-len", "128", "--api-key", KEY, "--no-access-log"], env=env,
                                stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, url)
        start = log.stat().st_size  # what loading the model printed is not ours to count
        chat = json.dumps({"model": "default", "messages": messages(1), "max_tokens": 60, "confidence": 1.0}).encode()
        half, clients = 0, 3
        for path in ("/v1/chat/completions", "/v1/completions"):
            for sent in (0, 12):  # headers only, or a piece of the body, then gone
                raw_post(url, path, chat[:sent], length=len(chat)).close()
                half += 1
        raw_post(url, "/v1/chat/completions", chat).close()  # a whole request, gone before the answer
        stream = json.dumps({**json.loads(chat), "stream": True}).encode()
        raw_post(url, "/v1/chat/completions", stream).close()  # the same, streaming
        sock = raw_post(url, "/v1/chat/completions", stream)
        sock.recv(100)
        sock.close()  # gone mid-stream
        body = {"model": "default", "messages": messages(1), "max_tokens": 2}
        resp = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert resp.status_code == 200  # and the server is fine
        assert until(lambda: httpx.get(url + "/health").json()["running"] == 0)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log.read_bytes()[start:].decode()
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text
    lines = text.splitlines()  # one for each half body; the others may get one if they leave before it is read
    assert half <= len(lines) <= half + clients, text
    assert all("disconnected before its request body was read (POST /v1/" in line for line in lines), text


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
        wait_up(proc, url)
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
        # And no new requests once it has stopped: uvicorn closes its listener at its next tick (0.1 s) after the
        # signal, so a tiny model's reply can end first and a request sent at once may still be answered.
        deadline = time.time() + 10
        with pytest.raises(httpx.TransportError):
            while time.time() < deadline:
                httpx.get(url + "/health", timeout=1)
                time.sleep(0.05)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("flag", ["--max-batch-size", "--prefill-tokens"])
def test_serve_refuses_sizes_below_one_before_loading(flag, capsys):
    from hamburger.cli import main

    assert main(["serve", "--model", "no/such/model", flag, "0"]) == 2
    assert f"{flag} must be positive, got 0" in capsys.readouterr().err


def test_decode_threads_default_leaves_the_http_side_a_core():
    from hamburger.serving.service import decode_threads

    n = torch.get_num_threads()
    assert decode_threads(None, "cpu") == max(1, n - 1)
    assert decode_threads(0, "cpu") is None and decode_threads(3, "cpu") == 3  # 0: all threads, no switching
    assert decode_threads(None, "cuda") is None and decode_threads(None, "meta") is None
    with pytest.raises(HamburgerError, match="--decode-threads must be >= 0"):
        decode_threads(-1, "cpu")


@pytest.mark.parametrize("flags, interleave", [([], True), (["--interleave-prefill"], True),
                                               (["--no-interleave-prefill"], False)])
def test_serve_interleaves_the_prefill_unless_told_not_to(flags, interleave, monkeypatch):
    import hamburger.serving.server as server
    from hamburger.cli import main

    seen = {}

    class Stop(Exception):
        pass

    def service(*args, **kwargs):
        seen["interleave"] = kwargs["interleave_prefill"]
        raise Stop

    monkeypatch.setattr(server, "Service", service)
    monkeypatch.setattr("hamburger.cli.serve.load_model", lambda args, **kwargs: (None, True, "none"))
    with pytest.raises(Stop):
        main(["serve", *flags])
    assert seen["interleave"] is interleave


def test_serve_passes_its_mode_lookup_and_access_log_on(monkeypatch):
    import hamburger.serving.server as server
    from hamburger.cli import main

    seen = {}

    class Stop(Exception):
        pass

    def app(service, access_log):
        seen["access_log"] = access_log
        raise Stop

    monkeypatch.setattr(server, "Service", lambda *args, **kwargs: seen.update(kwargs))
    monkeypatch.setattr(server, "create_app", app)
    monkeypatch.setattr("hamburger.cli.serve.load_model", lambda args, **kwargs: (None, True, "none"))
    with pytest.raises(Stop):
        main(["serve"])
    assert seen["default_mode"] is None and seen["lookup"] is None and seen["access_log"] is True
    with pytest.raises(Stop):
        main(["serve", "--mode", "verify", "--lookup", "0", "--no-access-log"])
    assert seen["default_mode"] == "verify" and seen["lookup"] == 0 and seen["access_log"] is False


def test_the_servers_mode_and_lookup_are_its_own_not_the_checkpoints(model, monkeypatch):
    """`serve --mode verify`: requests that name no mode run verify; one that names trust runs trust. `--lookup`
    reaches the scheduler's runner and leaves the model's config alone. Compress without a merger: refused."""
    service = Service(model, "tiny", max_batch_size=2, max_len=64, default_mode="verify", lookup=2)
    assert service.scheduler.runner.lookup == 2 and model.config.lookup == 0
    modes = []
    submit = service.scheduler.submit
    monkeypatch.setattr(service.scheduler, "submit", lambda *a, **kw: modes.append(kw["mode"]) or submit(*a, **kw))
    with BackgroundServer(service) as srv:
        body = {"model": "tiny", "prompt": "w3 w4", "max_tokens": 3}
        assert httpx.post(srv.url + "/v1/completions", json=body).status_code == 200
        assert httpx.post(srv.url + "/v1/completions", json={**body, "mode": "trust"}).status_code == 200
    assert [m.name for m in modes] == ["verify", "trust"]  # resolved once, at the service, into `Mode`s
    assert Service(model, "tiny", max_len=64).default_mode.name == model.config.default_mode == "trust"
    with pytest.raises(HamburgerError, match="compress mode needs a KV merger"):
        Service(model, "tiny", max_len=64, default_mode="compress")


def test_access_log_has_one_line_per_request(model, capsys):
    service = Service(model, "tiny", max_batch_size=2, max_len=64)
    with BackgroundServer(service, access_log=True) as srv:
        capsys.readouterr()
        body = {"model": "tiny", "prompt": "w3 w4", "max_tokens": 4}
        plain = httpx.post(srv.url + "/v1/completions", json=body).json()["usage"]["completion_tokens"]
        stream = {"model": "tiny", "messages": messages(1), "max_tokens": 5, "stream": True,
                  "stream_options": {"include_usage": True}}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=stream) as resp:
            chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        streamed = chunks[-1]["usage"]["completion_tokens"]
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.post(srv.url + "/v1/completions", json={**body, "model": "nope"}).status_code == 404
    lines = capsys.readouterr().err.splitlines()  # the server has stopped: every request has been answered
    pattern = r"\d+\.\d\d s"
    assert len(lines) == 4, lines
    assert re.fullmatch(rf"POST /v1/completions 200 {plain} tokens {pattern}", lines[0]), lines
    assert re.fullmatch(rf"POST /v1/chat/completions 200 {streamed} tokens {pattern}", lines[1]), lines
    assert re.fullmatch(rf"GET /health 200 {pattern}", lines[2]), lines
    assert re.fullmatch(rf"POST /v1/completions 404 {pattern}", lines[3]), lines
