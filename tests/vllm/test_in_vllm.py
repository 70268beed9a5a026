"""HAMburger's drafts inside vLLM itself, on its CPU backend: the output is vLLM's plain greedy output, the drafts
are taken, and `hamburger vllm serve` answers the openai client. Skipped, with the reason, where vLLM does not
import (`make setup` and CI do not install it: `pip install "hamburger[vllm]"`). Each vLLM runs in a process of its
own, on one thread, unbound (`launch.one_thread_env`): minutes on a 2-core machine."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from hamburger.errors import HamburgerError
from hamburger.evaluation.bench_prompts import shipped
from hamburger.vllm.launch import check_vllm, one_thread_env


def vllm_problem() -> str | None:
    try:
        check_vllm()
    except HamburgerError as exc:
        return str(exc)
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(vllm_problem() is not None, reason=f"{vllm_problem()}")]


def offline(drafts: str, prompts, max_tokens: int) -> dict:
    spec = {"prompts": prompts, "drafts": drafts, "max_tokens": max_tokens, "concurrency": 1}
    proc = subprocess.run([sys.executable, "-m", "hamburger.vllm.offline", json.dumps(spec)], capture_output=True,
                          text=True, timeout=1500, env=one_thread_env())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("HAMBURGER_RESULT ")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


@pytest.fixture(scope="module")
def plain_and_prompts():
    prompts = [m for name in ("code", "math", "chat") for m in shipped(name, 4)]  # 12, none trained on
    plain = offline("none", prompts, 64)
    assert plain["spec"]["drafts"] == 0 and len(plain["tokens"]) == 12 and all(plain["tokens"])
    return plain, prompts


@pytest.mark.parametrize("drafts", ["lookup", "micro"])
def test_hamburgers_drafts_give_vllms_plain_greedy_output_on_held_out_prompts(plain_and_prompts, drafts):
    plain, prompts = plain_and_prompts
    drafted = offline(drafts, prompts, 64)
    differ = [i for i, (a, b) in enumerate(zip(plain["tokens"], drafted["tokens"])) if a != b]
    assert not differ, f"prompts {differ} differ from vLLM's plain greedy output"
    assert len(drafted["tokens"]) == 12
    spec = drafted["spec"]
    assert spec["drafts"] > 0 and spec["accepted"] > 0, spec  # vLLM asked for, checked and kept our drafts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hamburger_vllm_serve_answers_the_openai_client(tmp_path):
    openai = pytest.importorskip("openai")
    port = free_port()
    log = (tmp_path / "vllm.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "hamburger.cli", "vllm", "serve", "--port", str(port), "--vllm-args",
         "--max-model-len 1024 --enforce-eager --gpu-memory-utilization 0.15"],
        stdout=log, stderr=subprocess.STDOUT, env=one_thread_env())
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "vLLM did not answer in 600 s"
                time.sleep(2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        reply = client.chat.completions.create(
            model="default", max_tokens=48, temperature=0,
            messages=[{"role": "user", "content": "Repeat exactly: red, green, blue, red, green, blue, red, green"}])
        assert reply.choices[0].message.content.strip() and reply.usage.completion_tokens > 0
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        drafts = [ln for ln in metrics.splitlines() if ln.startswith("vllm:spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].split()[-1]) > 0, drafts  # the server drafted with our proposer
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
