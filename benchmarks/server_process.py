"""`hamburger serve` as a child process, for the benchmarks that attack it from outside (fuzz_server.py, soak.py).

A real server, not the in-process one of the tests: its own process (so its RSS is its own, read from
/proc/PID/status), its own port, its stderr kept in a log file that the benchmarks search for tracebacks, and
SIGTERM to end it, as an operator would.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TRACEBACK_MARKS = ("Traceback (most recent call last)", "Exception in ASGI application")
ACCESS_LINE = re.compile(r"^[A-Z]+ /\S* \d{3}( \d+ tokens)? \d+\.\d+ s$")  # `AccessLog`'s line per request


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`hamburger serve --model MODEL` plus `flags` on 127.0.0.1 and a free port; stderr into `log`."""

    def __init__(self, model: str, flags: list[str], log: Path) -> None:
        self.port, self.log = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "hamburger.cli", "serve", "--model", model, "--host", "127.0.0.1",
                        "--port", str(self.port), *flags]
        self.proc: subprocess.Popen | None = None

    def start(self, ready_s: float = 600) -> float:
        """Starts it and waits for /health; returns the seconds that took (loading, perhaps converting, the model)."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        began = time.perf_counter()
        with open(self.log, "wb") as stderr:
            self.proc = subprocess.Popen(self.command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}; see {self.log}")
            if time.perf_counter() - began > ready_s:
                self.kill()
                raise SystemExit(f"the server did not answer /health in {ready_s:.0f} s; see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - began
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def rss(self) -> int:
        """The server's resident memory in bytes (VmRSS of /proc/PID/status); 0 once it has gone."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tracebacks(self) -> int:
        """Tracebacks and ASGI exceptions in its log so far."""
        text = self.log_text()
        return sum(text.count(mark) for mark in TRACEBACK_MARKS)

    def other_lines(self) -> list[str]:
        """Its log's lines other than the start line and the access log's: warnings, errors, tracebacks."""
        return [line for line in self.log_text().splitlines()
                if line.strip() and not ACCESS_LINE.match(line) and not line.startswith("hamburger: serving ")]

    def terminate(self) -> None:
        """SIGTERM: uvicorn stops taking connections and lets requests in flight finish (--shutdown-timeout)."""
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 120) -> int | None:
        """Its exit code, or None if it had not exited within `timeout` (it is then killed)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
