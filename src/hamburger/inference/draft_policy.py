"""When drafts pay: verify mode's per-row choice between a drafting step and a plain base step.

A drafting step costs more than a plain one: the micro-step decoder's calls, and a base pass over more positions.
It pays only when enough drafts are kept. How much more it costs depends on the machine and the weights (on a CPU
with fp16-packed weights a pass of 4 positions costs about 1.1x one of 1; in float32 nearly 2.5x; a micro-step
call about a sixth of a base pass), so it is measured, not assumed:

- `StepCosts` learns the wall time of a decode step as a + b * (drafts in the pass) + c * (micro-step calls), from
  the steps actually run (a ridge fit with forgetting, pulled towards a prior shape until enough steps are seen);
- `RowDrafts` keeps per row, for each source of drafts (lookup; the micro-step decoder), a running mean of the
  drafts made and kept per drafting step, and drafts from it while the expected tokens per second of such a
  step, (1 + kept) / cost(drafting), beat a plain step's, 1 / cost(plain). A source that stops paying is probed
  again after a wait that doubles with every probe that does not pay (1, 2, 4 .. 16 steps), so a reply that
  turns repetitive (where lookup drafts are kept) drafts again.

The output never depends on the choice (the base decides every token); only the speed does. Nothing here touches
a tensor: the engine and the scheduler time their steps and report what each row drafted and kept.
"""

from __future__ import annotations

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
KEPT_PRIOR = 1.0  # a new row expects this many kept drafts per drafting step (it drafts first, then learns)
KEPT_RATE = 0.35  # the running mean's weight on the latest drafting step
MAX_WAIT = 16  # the longest wait between probes of a row that stopped drafting


def _solve3(m: list[list[float]], v: list[float]) -> list[float]:
    """m x = v for a 3x3 symmetric positive definite m (Cramer's rule: no numpy/torch for a 3x3)."""
    def det(a: list[list[float]]) -> float:
        return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1]) - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))

    d = det(m)
    out = []
    for j in range(3):
        mj = [[v[i] if c == j else m[i][c] for c in range(3)] for i in range(3)]
        out.append(det(mj) / d)
    return out


@dataclass
class StepCosts:
    """Seconds per decode step as a + b * drafts + c * micro_calls, fitted online (ridge towards `PRIOR_SHAPE`
    scaled by the first step timed). `plain_seen`: whether a step without drafts has been timed yet."""

    forget: float = FORGET
    xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    xty: list[float] = field(default_factory=lambda: [0.0] * 3)
    prior: list[float] | None = None
    plain_seen: bool = False
    theta: list[float] | None = None

    def observe(self, drafts: float, micro_calls: float, seconds: float) -> None:
        """One step: the drafts its base pass checked (the widest row's), its micro-step calls, its wall time."""
        x = (1.0, float(drafts), float(micro_calls))
        if self.prior is None:
            scale = seconds / sum(s * xi for s, xi in zip(PRIOR_SHAPE, x))
            self.prior = [s * scale for s in PRIOR_SHAPE]
        self.plain_seen |= drafts == 0 and micro_calls == 0
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
    """One row's record of one source of drafts (the micro-step decoder, or lookup): running means over the steps
    it drafted of the drafts made and kept, and the wait before its next probe once it stopped paying."""

    kept: float = KEPT_PRIOR
    drafted: float = 2.0 * KEPT_PRIOR
    wait: int = 0
    backoff: int = 1

    def wants(self) -> bool:
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def observe(self, drafted: int, kept: int, paid: Callable[[SourceRecord], bool]) -> None:
        self.kept += KEPT_RATE * (kept - self.kept)
        self.drafted += KEPT_RATE * (drafted - self.drafted)
        if paid(self):
            self.backoff = 1
        else:
            self.wait, self.backoff = self.backoff, min(2 * self.backoff, MAX_WAIT)


@dataclass
class RowDrafts:
    """A verify row's two sources of drafts, judged apart: lookup drafts cost only the wider pass, micro-step
    drafts also their micro-step calls (one per draft), so a row may keep one and drop the other."""

    micro: SourceRecord = field(default_factory=SourceRecord)
    lookup: SourceRecord = field(default_factory=SourceRecord)

    def wants(self, costs: StepCosts) -> tuple[bool, bool]:
        """(lookup drafts, micro-step drafts) this step? Call once per step: a waiting source counts its wait
        down. Before any step has been timed, neither, once, so the costs can tell a plain step from others."""
        if costs.prior is None:
            return False, False
        return self.lookup.wants(), self.micro.wants()

    def observe(self, drafted: int, kept: int, from_lookup: bool, costs: StepCosts) -> None:
        """After a drafting step: what the row drafted and kept, and from which source; that source stops for a
        while if it no longer pays (`pays`), each time waiting twice as long as the last."""
        source = self.lookup if from_lookup else self.micro
        source.observe(drafted, kept, lambda rec: pays(rec, costs, micro=not from_lookup))


def pays(source: SourceRecord, costs: StepCosts, micro: bool) -> bool:
    """Whether a source's drafting steps are expected to give more tokens per second than plain steps:
    (1 + kept) / cost(drafted, micro-step calls) > 1 / cost(0, 0), a micro-step call per micro draft. True while
    nothing is timed."""
    plain = costs.predict(0, 0)
    drafting = costs.predict(source.drafted, source.drafted if micro else 0)
    if plain is None or drafting is None:
        return True
    return (1.0 + source.kept) * plain > drafting
