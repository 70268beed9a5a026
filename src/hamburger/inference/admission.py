"""Requests of the continuous batch, and the rules that admit waiting ones into free rows.

A request waits in the scheduler's queue until a row is free; its prompt is then prefilled (right-padded,
beside others) in a pass of at most `prefill_tokens` padded tokens. Two rules choose which prompts go:

* `take_shortest` (interleaved admission, the server's default): one pass per scheduler step, of the shortest
  waiting prompts, so the short half of a burst gets its first tokens while the long prompts wait, and running
  requests wait for one pass per step; a request passed over `MAX_PASSED` times goes first.
* `prefill_groups` (all at once): every request that has a free row now, prefilled shortest first in as many
  passes as the budget needs; all get their first token in this step.

On a burst of requests the first rule gives the lower median time to the first token and the second the lower
slowest tenth (benchmarks/scheduler_prefill.py; docs/server.md, "Prefill in groups").
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
from hamburger.inference.modes import BY_NAME, TRUST, Mode, parse_mode
from hamburger.inference.sampling import SamplingParams
from hamburger.inference.stats import GenerationStats

# Padded prompt tokens per prefill pass: passes of a few hundred tokens beat prompts one by one, much larger ones
# pad too much; with interleaved admission this gives the lowest median time to the first token
# (benchmarks/scheduler_prefill.py, a burst of chat prompts).
PREFILL_TOKENS = 256
# Interleaved admission takes the shortest waiting prompts first, but a request passed over this many times goes
# first (no prompt waits forever behind a stream of shorter ones).
MAX_PASSED = 8
# Learning the rate from served replies: once a mode has MIN_SAMPLES measured replies (of at least MIN_TOKENS tokens
# past its window), requests are admitted at the QUANTILE-th percentile of their rates (the last SAMPLES_KEPT): most
# replies then fit their estimate, and one that does not ends where its row's entries run out ("length").
MIN_SAMPLES, MIN_TOKENS, QUANTILE, SAMPLES_KEPT = 8, 16, 90, 256


class EntriesEstimate:
    """The KV entries a reply of T tokens is expected to take, per mode: one per token in a mode that keeps one per
    token (`Mode.per_token`: verify); in the others `rate(mode)` per token, after a merging mode's first `window`
    tokens (the checkpoint's merge window: its recent steps stay unmerged, one entry per token). The rate is the
    prior (`Mode.entries_prior`, or `fixed`) until the mode has MIN_SAMPLES measured replies (`observe`), then the
    QUANTILE-th percentile of their rates; modes given in `fixed` (by name) keep their rate. A mode is a `Mode` or
    its name."""

    def __init__(self, window: int = 0, fixed: dict[str, float] | None = None) -> None:
        for mode, rate in (fixed or {}).items():
            if mode not in BY_NAME or not 0 < rate <= 1:
                raise HamburgerError(f"entries_per_token: a rate in (0, 1] for trust, verify or compress, got "
                                     f"{mode}={rate}")
        self.window, self.fixed = max(0, window), dict(fixed or {})
        self.samples: dict[str, deque[float]] = {m.name: deque(maxlen=SAMPLES_KEPT) for m in BY_NAME.values()
                                                 if not m.per_token}
        self._lock = threading.Lock()  # the model thread observes while the server's thread reads the rate

    def rate(self, mode: Mode | str) -> float:
        """Entries per generated token (past the window) that a request of `mode` is admitted at."""
        mode = parse_mode(mode)
        if mode.name in self.fixed:
            return self.fixed[mode.name]
        with self._lock:
            ranked = sorted(self.samples.get(mode.name, ()))
        if len(ranked) < MIN_SAMPLES:
            return mode.entries_prior
        return ranked[min(len(ranked) - 1, math.ceil(QUANTILE / 100 * len(ranked)) - 1)]

    def _window(self, mode: Mode | str) -> int:
        return self.window if parse_mode(mode).merged else 0

    def reply_entries(self, mode: Mode | str, tokens: int) -> int:
        """The entries expected of a reply of `tokens` tokens."""
        w = min(tokens, self._window(mode))
        return w + math.ceil((tokens - w) * self.rate(mode))

    def need(self, prompt_len: int, tokens: int, mode: Mode | str) -> int:
        """The entries a request is expected to take: its prompt's and its reply's."""
        return prompt_len + self.reply_entries(mode, tokens)

    def room(self, entries: int, mode: Mode | str) -> int:
        """The longest reply expected to fit in `entries` entries."""
        w = min(entries, self._window(mode))
        return w + math.floor((entries - w) / self.rate(mode) + 1e-9)

    def observe(self, mode: Mode | str, tokens: int, entries: int) -> None:
        """A finished reply of `tokens` tokens that took `entries` KV entries (its prompt's excluded)."""
        mode = parse_mode(mode)
        past = tokens - self._window(mode)
        if mode.name in self.samples and past >= MIN_TOKENS:
            with self._lock:
                self.samples[mode.name].append(min(1.0, max(0.05, (entries - (tokens - past)) / past)))


@dataclass
class RequestEvent:
    """What one macro-step gave a request. finish_reason: "stop" (EOS), "length" or "cancelled"."""

    id: int
    tokens: list[int]
    finished: bool
    finish_reason: str | None
    stats: GenerationStats
    mode: Mode


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    confidence: float
    sampling: SamplingParams
    eos: set[int]
    mode: Mode = TRUST
    row: int = -1
    tokens: list[int] = field(default_factory=list)
    drafting: RowDrafts = field(default_factory=RowDrafts)  # verify mode: whether its drafts pay (draft_policy.py)
    steps: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    started: float = 0.0  # when its prefill began
    rng: torch.Generator | None = None
    warpers: object = None
    window_steps: list = field(default_factory=list)  # compress mode: its steps not merged yet (`merge.Window`)
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
