"""When drafts pay: verify mode's per-row choice between a drafting step and a plain base step.

A drafting step costs more than a plain one: the micro-step decoder's calls, and a base pass over more positions.
It pays only when enough drafts are kept. How much more it costs depends on the machine and the weights (a pass of
4 positions against one of 1, a micro-step call against a base pass: `benchmarks/verify_costs.py` measures them),
so it is measured, not assumed:

- `StepCosts` learns the wall time of a decode step as a + b * (drafts in the pass) + c * (micro-step calls), from
  the steps actually run (a ridge fit with forgetting, pulled towards a prior shape until enough steps are seen);
- `RowDrafts` judges a row's two sources of drafts apart. Micro-step drafts: a running mean of the drafts made
  and kept per drafting step; the row drafts while the expected tokens per second of such a step,
  (1 + kept) / cost(drafting), beat a plain step's, 1 / cost(plain), and probes with one micro-step (the first
  costs the most: it also reads the base's features) before drafting more. Lookup drafts cost only their positions: the
  row estimates how often a drafted token is kept (once those before it were) and drafts as many as are worth
  their positions (`LookupRecord`). A source that stops paying is probed again after a wait that doubles with
  every probe that does not pay (1, 2, 4 .. 16 steps), so a reply that turns repetitive drafts again.

The output never depends on the choice (the base decides every token); only the speed does. Nothing here touches
a tensor: the engine and the scheduler time their steps and report what each row drafted and kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

# Engines and schedulers built without saying use the policy when this is True (the test suite turns it off for
# tests about other things, whose step lengths must not depend on timings; tests/inference/test_draft_policy.py
# turns it on).
ON_BY_DEFAULT = True
# Before any measurement: a drafted position costs 5 % of a plain step, a micro-step call 15 %. The first steps
# replace these (a plain step is run first where none has been timed, so the fit can tell a from b and c).
PRIOR_SHAPE = (1.0, 0.05, 0.15)
PRIOR_WEIGHT = 2.0  # the prior counts as this many steps
FORGET = 0.98  # each new step's weight against the old ones: about the last 50 steps count
KEPT_PRIOR = 1.0  # a new row's micro-step record starts at this many kept drafts per drafting step
KEPT_RATE = 0.35  # the running mean's weight on the latest drafting step
MAX_WAIT = 16  # the longest wait between probes of a row that stopped drafting
# A new row probes micro-step drafts only after this many steps: a probe costs about a quarter of a plain step and
# short replies rarely repay it (`make demo`'s short reply was slower than the base with the first probe at once,
# not from the fourth step; benchmarks/verify_ab.py measures a reply beside its base).
MICRO_START = 4
LOOKUP_RATE = 0.15  # the lookup record's decay per drafting step: about the last 7 count


def _solve3(m: list[list[float]], v: list[float]) -> list[float]:
    """m x = v for a 3x3 symmetric positive definite m, by Cramer's rule written out: no numpy/torch for a 3x3, and
    few Python operations (it runs once a decode step, right after a pass has streamed the weights through the
    caches, where each Python operation costs several times its usual time)."""
    (a, b, c), (d, e, f), (g, h, i) = m
    x, y, z = v
    ei_fh, di_fg, dh_eg = e * i - f * h, d * i - f * g, d * h - e * g
    det = a * ei_fh - b * di_fg + c * dh_eg
    yi_fz, yh_ez = y * i - f * z, y * h - e * z
    dz_yg = d * z - y * g
    return [(x * ei_fh - b * yi_fz + c * yh_ez) / det,
            (a * yi_fz - x * di_fg + c * dz_yg) / det,
            (a * (e * z - y * h) - b * dz_yg + x * dh_eg) / det]


@dataclass
class StepCosts:
    """Seconds per decode step as a + b * drafts + c * micro_calls, fitted online (ridge towards `PRIOR_SHAPE`
    scaled by the first step timed)."""

    forget: float = FORGET
    xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    xty: list[float] = field(default_factory=lambda: [0.0] * 3)
    prior: list[float] | None = None
    theta: list[float] | None = None

    def observe(self, drafts: float, micro_calls: float, seconds: float) -> None:
        """One step: the drafts its base pass checked (the widest row's), its micro-step calls, its wall time."""
        x = (1.0, float(drafts), float(micro_calls))
        if self.prior is None:
            scale = seconds / sum(s * xi for s, xi in zip(PRIOR_SHAPE, x))
            self.prior = [s * scale for s in PRIOR_SHAPE]
        f = self.forget
        for i in range(3):
            self.xty[i] = f * self.xty[i] + x[i] * seconds
            for j in range(3):
                self.xtx[i][j] = f * self.xtx[i][j] + x[i] * x[j]
        self.theta = None

    def predict(self, drafts: float, micro_calls: float) -> float | None:
        """Expected seconds of a step (None before any step is timed). The fitted slopes are kept >= 0."""
        if self.prior is None:
            return None
        if self.theta is None:
            lam = PRIOR_WEIGHT
            m = [[self.xtx[i][j] + (lam if i == j else 0.0) for j in range(3)] for i in range(3)]
            v = [self.xty[i] + lam * self.prior[i] for i in range(3)]
            a, b, c = _solve3(m, v)
            self.theta = [max(a, 1e-9), max(b, 0.0), max(c, 0.0)]
        a, b, c = self.theta
        return a + b * drafts + c * micro_calls


@dataclass
class SourceRecord:
    """One row's micro-step drafts: running means over the steps it drafted of the drafts made and kept, and the
    wait before its next probe once they stopped paying."""

    kept: float = KEPT_PRIOR
    drafted: float = 2.0 * KEPT_PRIOR
    wait: int = MICRO_START  # a new row's first micro-step probe comes after this many steps
    backoff: int = 2 * MICRO_START
    probe: bool = True  # the next drafting step is a probe of one token (a new row's first, or after a wait)

    def length(self, most: int) -> int:
        """Micro-step drafts at most this step: 0 while waiting, 1 for a probe, else `most`."""
        if self.wait > 0:
            self.wait -= 1
            return 0
        return 1 if self.probe else most

    def observe(self, drafted: int, kept: int, paid: Callable[[SourceRecord], bool]) -> None:
        self.kept += KEPT_RATE * (kept - self.kept)
        self.drafted += KEPT_RATE * (drafted - self.drafted)
        if (kept > 0) if self.probe else paid(self):  # a probe decides by its own one token
            self.backoff, self.probe = 1, False
        else:
            self.wait, self.backoff, self.probe = self.backoff, min(2 * self.backoff, MAX_WAIT), True


@dataclass
class LookupRecord:
    """One row's lookup drafts. Each drafted token is kept with probability q once the ones before it were (a
    running estimate: tokens kept over tokens checked up to the first rejection). The n-th token of a draft is
    worth its position in the pass while q^n, its chance to be kept, beats what that position costs as a share of
    a plain step (b / a): the draft's length is the largest such n. A row whose q falls below b / a stops looking
    up, and probes again with one token after a wait that doubles with each probe that does not pay."""

    hits: float = 1.0  # prior q = 0.5, worth two checked tokens
    trials: float = 2.0
    wait: int = 0
    backoff: int = 1

    @property
    def q(self) -> float:
        return self.hits / self.trials

    def length(self, costs: StepCosts, most: int) -> int:
        """The draft length this step (0: none), at most `most`. Call once per step."""
        if self.wait > 0:
            self.wait -= 1
            return 0
        return max(1, best_length(self.q, costs, most))  # a probe drafts one token at least

    def observe(self, drafted: int, kept: int, costs: StepCosts, most: int) -> None:
        self.hits = (1 - LOOKUP_RATE) * self.hits + kept
        self.trials = (1 - LOOKUP_RATE) * self.trials + kept + (kept < drafted)
        if best_length(self.q, costs, most) > 0:
            self.backoff = 1
        else:
            self.wait, self.backoff = self.backoff, min(2 * self.backoff, MAX_WAIT)


def best_length(q: float, costs: StepCosts, most: int) -> int:
    """The largest n <= most with q^n > b / a (a drafted position's cost over a plain step's); 0 when none.
    `most` while nothing is timed."""
    plain = costs.predict(0, 0)
    if plain is None:
        return most
    ratio = (costs.predict(1, 0) - plain) / plain
    if q <= ratio:
        return 0
    if q >= 1.0 or ratio <= 0.0:
        return most
    return max(0, min(most, math.floor(math.log(ratio) / math.log(q))))


@dataclass
class RowDrafts:
    """A verify row's two sources of drafts, judged apart: lookup drafts cost only their positions in the pass
    (their length adapts, `LookupRecord`), micro-step drafts also a micro-step call each (on while they pay,
    `SourceRecord`)."""

    micro: SourceRecord = field(default_factory=SourceRecord)
    lookup: LookupRecord = field(default_factory=LookupRecord)

    def wants(self, costs: StepCosts, most_lookup: int, most_micro: int) -> tuple[int, int]:
        """(lookup drafts, micro-step drafts) at most this step. Call once per step: a waiting source counts its
        wait down. Before any step has been timed, neither, once, so the costs can tell a plain step."""
        if costs.prior is None:
            return 0, 0
        return self.lookup.length(costs, most_lookup), self.micro.length(most_micro)

    def observe(self, drafted: int, kept: int, from_lookup: bool, costs: StepCosts, most_lookup: int) -> None:
        """After a drafting step: what the row drafted and kept, and from which source."""
        if from_lookup:
            self.lookup.observe(drafted, kept, costs, most_lookup)
        else:
            self.micro.observe(drafted, kept, lambda rec: pays(rec, costs))


def pays(source: SourceRecord, costs: StepCosts) -> bool:
    """Whether micro-step drafting steps are expected to give more tokens per second than plain steps:
    (1 + kept) / cost(drafted, drafted micro-step calls) > 1 / cost(0, 0). True while nothing is timed."""
    plain = costs.predict(0, 0)
    drafting = costs.predict(source.drafted, source.drafted)
    if plain is None or drafting is None:
        return True
    return (1.0 + source.kept) * plain > drafting
