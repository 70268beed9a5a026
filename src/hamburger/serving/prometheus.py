"""The server's `/metrics` in the Prometheus text format: counters, gauges read at scrape time, histograms.

Written by hand (a few lines) rather than adding prometheus_client as a dependency. Per-request figures
come from `stats.GenerationStats`, the one definition of tokens per step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hamburger.inference.stats import GenerationStats

TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STEP_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 8.0)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help, buckets
        self.counts, self.sum, self.count = [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        out += [f'{self.name}_bucket{{le="{edge}"}} {n}' for edge, n in zip(self.buckets, self.counts)]
        out += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum}",
                f"{self.name}_count {self.count}"]
        return out


class ServerMetrics:
    """What the server exposes; `gauges` are read from the scheduler when scraped."""

    def __init__(self, gauges: dict[str, tuple[str, Callable[[], float]]]) -> None:
        self.gauges = gauges
        self.requests: dict[str, int] = {}
        self.tokens = {"prompt": 0, "completion": 0, "macro_steps": 0}
        self.ttft = Histogram("hamburger_time_to_first_token_seconds", "arrival to the first macro-step's tokens",
                              TIME_BUCKETS)
        self.tpot = Histogram("hamburger_time_per_output_token_seconds",
                              "(last token time - first token time) / (completion tokens - 1), per request",
                              TIME_BUCKETS)
        self.tps = Histogram("hamburger_tokens_per_step", "generated tokens / macro-steps, per request", STEP_BUCKETS)
        self._lock = threading.Lock()

    def finished(self, outcome: str, stats: GenerationStats | None, ttft: float | None, last: float | None) -> None:
        """One request ended: outcome is its finish reason or "error"; times in seconds from its arrival."""
        with self._lock:
            self.requests[outcome] = self.requests.get(outcome, 0) + 1
            if stats is None or not stats.generated_tokens:
                return
            self.tokens["prompt"] += stats.prompt_tokens
            self.tokens["completion"] += stats.generated_tokens
            self.tokens["macro_steps"] += stats.macro_steps
            self.tps.observe(stats.tokens_per_step)
            if ttft is not None:
                self.ttft.observe(ttft)
                if last is not None and stats.generated_tokens > 1:
                    self.tpot.observe((last - ttft) / (stats.generated_tokens - 1))

    def render(self) -> str:
        with self._lock:
            out = ["# HELP hamburger_requests_total requests finished, by outcome",
                   "# TYPE hamburger_requests_total counter"]
            out += [f'hamburger_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.requests.items())]
            out += ["# HELP hamburger_tokens_total prompt and completion tokens, and macro-steps, of finished requests",
                    "# TYPE hamburger_tokens_total counter"]
            out += [f'hamburger_tokens_total{{kind="{k}"}} {v}' for k, v in self.tokens.items()]
            for name, (help, read) in self.gauges.items():
                out += [f"# HELP {name} {help}", f"# TYPE {name} gauge", f"{name} {read()}"]
            for hist in (self.ttft, self.tpot, self.tps):
                out += hist.lines()
        return "\n".join(out) + "\n"
