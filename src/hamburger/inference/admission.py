"""Requests of the continuous batch, and the rules that admit waiting ones into free rows.

A request waits in the scheduler's queue until a row is free; its prompt is then prefilled (right-padded,
beside others) in a pass of at most `prefill_tokens` padded tokens. Two rules choose which prompts go:

* `take_shortest` (interleaved admission, the server's default): one pass per scheduler step, of the shortest
  waiting prompts, so the short half of a burst gets its first tokens while the long prompts wait, and running
  requests wait for one pass per step; a request passed over `MAX_PASSED` times goes first.
* `prefill_groups` (all at once): every request that has a free row now, prefilled shortest first in as many
  passes as the budget needs; all get their first token in this step.

Measured on 2 CPU cores (docs/server.md, "Prefill in groups"): a burst of 32 gets its median first token in
1.44 s with the first rule and 1.99-2.07 s with the second, whose slowest tenth is served sooner (about 2.0 s
against 2.33 s).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from hamburger.errors import HamburgerError
from hamburger.inference.draft_policy import RowDrafts
from hamburger.inference.lookup import NgramIndex
from hamburger.inference.sampling import SamplingParams
from hamburger.inference.stats import GenerationStats

# Padded prompt tokens per prefill pass. Measured on 2 CPU cores, 32 chat prompts at once
# (benchmarks/scheduler_prefill.py): 256-1024 -> 1.5x faster than one by one; 4096 pads 62 % and is slower; with
# interleaved admission 256 gives the lowest median time to the first token.
PREFILL_TOKENS = 256
# Interleaved admission takes the shortest waiting prompts first, but a request passed over this many times goes
# first (no prompt waits forever behind a stream of shorter ones).
MAX_PASSED = 8
# KV entries a reply is expected to take per generated token when a request is admitted, before any reply of its
# mode has been measured: one per token in verify mode; one per step in trust and compress mode, which is at most
# one per token (trust's default takes about one token a step: 1.0 is its safe bound) and 0.45-0.65 for compress
# on the default checkpoint past its exact window (docs/RESULTS.md), bounded up to 0.75.
ENTRIES_PER_TOKEN = {"trust": 1.0, "verify": 1.0, "compress": 0.75}
# Learning the rate from served replies: once a mode has MIN_SAMPLES measured replies (of at least MIN_TOKENS tokens
# past its window), requests are admitted at the QUANTILE-th percentile of their rates (the last SAMPLES_KEPT): most
# replies then fit their estimate, and one that does not ends where its row's entries run out ("length").
MIN_SAMPLES, MIN_TOKENS, QUANTILE, SAMPLES_KEPT = 8, 16, 90, 256


class EntriesEstimate:
    """The KV entries a reply of T tokens is expected to take, per mode: one per token in verify mode; in trust and
    compress mode `rate(mode)` per token, after compress mode's first `window` tokens (the checkpoint's merge
    window: its recent steps stay unmerged, one entry per token). The rate is the prior (ENTRIES_PER_TOKEN, or
    `fixed`) until the mode has MIN_SAMPLES measured replies (`observe`), then the QUANTILE-th percentile of their
    rates; modes given in `fixed` keep their rate."""

    def __init__(self, window: int = 0, fixed: dict[str, float] | None = None) -> None:
        for mode, rate in (fixed or {}).items():
            if mode not in ENTRIES_PER_TOKEN or not 0 < rate <= 1:
                raise HamburgerError(f"entries_per_token: a rate in (0, 1] for trust, verify or compress, got "
                                     f"{mode}={rate}")
        self.window, self.fixed = max(0, window), dict(fixed or {})
        self.samples: dict[str, deque[float]] = {m: deque(maxlen=SAMPLES_KEPT) for m in ("trust", "compress")}
        self._lock = threading.Lock()  # the model thread observes while the server's thread reads the rate

    def rate(self, mode: str) -> float:
        """Entries per generated token (past the window) that a request of `mode` is admitted at."""
        if mode in self.fixed:
            return self.fixed[mode]
        with self._lock:
            ranked = sorted(self.samples.get(mode, ()))
        if len(ranked) < MIN_SAMPLES:
            return ENTRIES_PER_TOKEN[mode]
        return ranked[min(len(ranked) - 1, math.ceil(QUANTILE / 100 * len(ranked)) - 1)]

    def _window(self, mode: str) -> int:
        return self.window if mode == "compress" else 0

    def reply_entries(self, mode: str, tokens: int) -> int:
        """The entries expected of a reply of `tokens` tokens."""
        w = min(tokens, self._window(mode))
        return w + math.ceil((tokens - w) * self.rate(mode))

    def need(self, prompt_len: int, tokens: int, mode: str) -> int:
        """The entries a request is expected to take: its prompt's and its reply's."""
        return prompt_len + self.reply_entries(mode, tokens)

    def room(self, entries: int, mode: str) -> int:
        """The longest reply expected to fit in `entries` entries."""
        w = min(entries, self._window(mode))
        return w + math.floor((entries - w) / self.rate(mode) + 1e-9)

    def observe(self, mode: str, tokens: int, entries: int) -> None:
        """A finished reply of `tokens` tokens that took `entries` KV entries (its prompt's excluded)."""
        past = tokens - self._window(mode)
        if mode in self.samples and past >= MIN_TOKENS:
            with self._lock:
                self.samples[mode].append(min(1.0, max(0.05, (entries - (tokens - past)) / past)))


@dataclass
class RequestEvent:
    """What one macro-step gave a request. finish_reason: "stop" (EOS), "length" or "cancelled"."""

    id: int
    tokens: list[int]
    finished: bool
    finish_reason: str | None
    stats: GenerationStats
    mode: str


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    confidence: float
    sampling: SamplingParams
    eos: set[int]
    mode: str = "trust"
    row: int = -1
    tokens: list[int] = field(default_factory=list)
    drafting: RowDrafts = field(default_factory=RowDrafts)  # verify mode: whether its drafts pay (draft_policy.py)
    steps: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    started: float = 0.0  # when its prefill began
    rng: torch.Generator | None = None
    warpers: object = None
    window_steps: list = field(default_factory=list)  # compress mode: its steps not merged yet (`verify.Window`)
    index: NgramIndex | None = None  # verify and compress mode with lookup drafts: its prompt and output, indexed
    looked: int = 0  # lookup drafts of its last macro-step, waiting for the pass that checks them
    passed: int = 0  # interleaved admission: prefill passes it waited through
    forced: list[int] | None = None  # trust mode: the lengths of its first steps (bench's forced-steps system)


def fits(group: list[Request], req: Request, budget: int) -> bool:
    """Whether `req` may join a prefill pass of `group`: the pass, right-padded to its widest prompt, stays within
    `budget` tokens (a pass of one always fits)."""
    widest = max([len(req.prompt)] + [len(r.prompt) for r in group])
    return not group or widest * (len(group) + 1) <= budget


def take_shortest(waiting: deque[Request], free: int, budget: int) -> list[Request]:
    """Interleaved admission: removes from `waiting` and returns (shortest first) the requests of one prefill pass
    for at most `free` rows: the shortest waiting prompts whose padded pass fits in `budget` tokens (at least one;
    requests passed over MAX_PASSED times first, oldest first). The others count one more pass over them."""
    overdue = [r for r in waiting if r.passed >= MAX_PASSED]
    order = overdue + sorted((r for r in waiting if r.passed < MAX_PASSED), key=lambda r: len(r.prompt))
    group: list[Request] = []
    for req in order[:free]:
        if not fits(group, req, budget):
            break
        group.append(req)
    for req in group:
        waiting.remove(req)
    for req in waiting if group else ():
        req.passed += 1
    return sorted(group, key=lambda r: len(r.prompt))


def prefill_groups(admitted: list[Request], budget: int) -> list[list[Request]]:
    """All at once: the admitted requests, shortest first, cut into passes of at most `budget` padded tokens
    (a longer prompt goes alone)."""
    groups: list[list[Request]] = []
    group: list[Request] = []
    for req in sorted(admitted, key=lambda r: len(r.prompt)):
        if not fits(group, req, budget):
            groups.append(group)
            group = []
        group.append(req)
    return groups + [group] if group else groups
