"""The draft policy without a model: step costs fitted from given timings, and the per-row decision."""

from __future__ import annotations

import pytest

from hamburger.inference.draft_policy import (
    MAX_WAIT,
    MICRO_START,
    LookupRecord,
    RowDrafts,
    SourceRecord,
    StepCosts,
    _solve3,
    best_length,
    pays,
)


def fitted(a: float, b: float, c: float, shapes=((0, 0), (3, 3), (1, 0), (2, 1), (3, 0), (0, 0))) -> StepCosts:
    """Costs fitted to exact timings a + b * drafts + c * micro_calls over a few step shapes, repeated."""
    costs = StepCosts()
    for _ in range(20):
        for d, m in shapes:
            costs.observe(d, m, a + b * d + c * m)
    return costs


def test_costs_recover_a_linear_cost_model():
    costs = fitted(0.030, 0.002, 0.005)
    assert costs.predict(0, 0) == pytest.approx(0.030, rel=0.02)
    assert costs.predict(3, 3) == pytest.approx(0.030 + 0.006 + 0.015, rel=0.02)


def test_costs_before_any_step_and_after_one_take_the_prior_shape():
    costs = StepCosts()
    assert costs.predict(0, 0) is None
    costs.observe(0, 0, 0.02)
    assert costs.predict(0, 0) == pytest.approx(0.02, rel=0.05)
    assert costs.predict(3, 0) > costs.predict(0, 0)  # the prior's slope until drafting steps are timed


def test_a_new_row_runs_a_plain_step_first_then_drafts():
    costs, row = StepCosts(), RowDrafts()
    assert row.wants(costs, 7, 3) == (0, 0)  # nothing timed yet: one plain step
    costs.observe(0, 0, 0.03)
    for _ in range(MICRO_START):  # lookup at once; micro-step drafts only after MICRO_START steps
        lookup, micro = row.wants(costs, 7, 3)
        assert lookup > 0 and micro == 0
    assert row.wants(costs, 7, 3)[1] == 1  # then a micro-step probe of one token


@pytest.mark.parametrize(("kept", "b", "c", "expected"), [
    (2.0, 0.001, 0.004, True),   # fp16-like costs, well-kept micro drafts: drafting pays
    (0.1, 0.001, 0.004, False),  # micro drafts rarely kept: 1.1 tokens for 1.5x the time
    (1.0, 0.020, 0.004, False),  # float32-like costs: 3 drafted positions cost 3x a plain step
    (3.0, 0.001, 0.004, True),
])
def test_micro_drafts_pay_when_they_give_more_tokens_per_second(kept, b, c, expected):
    costs = fitted(0.030, b, c)
    source = SourceRecord(kept=kept, drafted=3.0)
    # (1 + kept) / (a + 3b + 3c) against 1 / a
    assert pays(source, costs) is expected
    assert ((1 + kept) * 0.030 > 0.030 + 3 * b + 3 * c) is expected


@pytest.mark.parametrize(("q", "b", "expected"), [
    (0.5, 0.0015, 4),   # b/a = 0.05: 0.5^4 = 0.0625 > 0.05 > 0.5^5
    (0.9, 0.0015, 7),   # capped at 7
    (0.3, 0.0015, 2),   # 0.3^2 = 0.09 > 0.05 > 0.027
    (0.04, 0.0015, 0),  # below b/a: no draft is worth its position
    (0.5, 0.0300, 0),   # a position costs as much as a plain step
])
def test_lookup_drafts_are_as_long_as_their_positions_are_worth(q, b, expected):
    costs = fitted(0.030, b, 0.004)
    assert best_length(q, costs, 7) == expected


def test_lookup_length_follows_how_often_its_tokens_are_kept_and_probes_when_none_pay():
    costs = fitted(0.030, 0.0015, 0.004)
    rec = LookupRecord()
    for _ in range(30):  # 7 drafted, all kept: q -> 1
        rec.observe(7, 7, costs, 7)
    assert rec.q > 0.95 and rec.length(costs, 7) == 7
    for _ in range(50):  # the first token always rejected: q -> 0
        rec.observe(3, 0, costs, 7)
    assert rec.q < 0.05
    waits, probes = 0, []
    for _ in range(40):
        n = rec.length(costs, 7)
        if n:
            probes.append(n)
            rec.observe(n, 0, costs, 7)
        else:
            waits += 1
    assert probes and set(probes) == {1} and waits >= 40 - 6  # one-token probes, ever rarer
    lengths = []
    for _ in range(MAX_WAIT + 8):  # repetitive again: the next probe is kept, and so is all that follows
        if n := rec.length(costs, 7):
            lengths.append(n)
            rec.observe(n, n, costs, 7)
    assert lengths[0] == 1 and lengths[-1] >= 4 and lengths == sorted(lengths)


def test_a_micro_source_that_does_not_pay_waits_twice_as_long_each_time_then_resumes_when_it_pays():
    costs = fitted(0.030, 0.002, 0.005)
    row = RowDrafts(micro=SourceRecord(wait=0, backoff=1))
    waits = []
    for _ in range(7):  # every micro-step probe keeps nothing
        assert row.wants(costs, 7, 3)[1]
        row.observe(3, 0, False, costs, 7)
        wait = 0
        while not row.wants(costs, 7, 3)[1]:
            wait += 1
        waits.append(wait)
    assert waits == [1, 2, 4, 8, 16, MAX_WAIT, MAX_WAIT]  # each probe (one token) rejected
    assert row.lookup.wait == 0  # lookup drafts are judged apart
    row.observe(1, 1, False, costs, 7)  # the micro drafts turned good: the next probe is kept
    for _ in range(3):  # and then all three at every step
        row.observe(3, 3, False, costs, 7)
    assert row.micro.backoff == 1 and row.micro.wait == 0 and row.wants(costs, 7, 3)[1] == 3  # no probe now


def test_the_running_mean_follows_the_kept_drafts():
    costs = fitted(0.030, 0.002, 0.005)
    row = RowDrafts()
    for _ in range(30):
        row.observe(3, 2, False, costs, 7)
    assert row.micro.kept == pytest.approx(2.0, abs=1e-3) and row.micro.drafted == pytest.approx(3.0, abs=1e-3)
    assert row.lookup.q == 0.5  # untouched
    assert pays(row.micro, costs)


# --- the policy in the engine and the scheduler (tiny random models) -----------------------------------------

def _costly_drafts(monkeypatch, runner, rows: int) -> None:
    """Step costs where a drafted position costs 10x a plain step, frozen (real timings ignored)."""
    runner._step_costs[rows] = fitted(0.01, 0.1, 0.1)
    monkeypatch.setattr(StepCosts, "observe", lambda self, *a: None)


def test_engine_rows_stop_drafting_when_drafts_do_not_pay_and_keep_the_base_output(monkeypatch):
    import torch

    from conftest import base_greedy, hamburger
    from hamburger.inference.engine import Engine

    model = hamburger(k=4)
    prompts = [[5, 17, 33, 8, 60, 12, 9]]
    with torch.inference_mode():
        always = Engine(model, draft_rows=None, draft_policy=False).generate(prompts, max_new_tokens=40,
                                                                            confidence=0.01, mode="verify")
        engine = Engine(model, draft_rows=None, draft_policy=True)
        _costly_drafts(monkeypatch, engine.runner, 1)
        policed = engine.generate(prompts, max_new_tokens=40, confidence=0.01, mode="verify")
    assert policed.tokens == always.tokens == [base_greedy(model, prompts[0], 40)]
    assert always.stats.drafted_tokens > 40  # at confidence 0.01 every step drafts K-1 tokens
    # probes at waits of 0, 1, 2, 4, 8, 16 steps: at most 6 drafting steps of 3 drafts in 40 tokens
    assert 0 < policed.stats.drafted_tokens <= 6 * 3


def test_scheduler_rows_stop_drafting_when_drafts_do_not_pay_and_keep_the_base_output(monkeypatch):
    import torch

    from conftest import base_greedy, hamburger
    from hamburger.inference.scheduler import Scheduler

    model = hamburger(k=4)
    prompt = [5, 17, 33, 8, 60, 12, 9]

    def run(policy: bool):
        sched = Scheduler(model, max_batch_size=2, max_len=64, draft_rows=None, draft_policy=policy)
        if policy:
            _costly_drafts(monkeypatch, sched.runner, 1)
        sched.submit(prompt, 40, confidence=0.01, mode="verify")
        tokens, stats = [], None
        with torch.inference_mode():
            while sched.has_work():
                for event in sched.step():
                    tokens += event.tokens
                    stats = event.stats
        return tokens, stats

    (always, s_always), (policed, s_policed) = run(False), run(True)
    assert policed == always == base_greedy(model, prompt, 40)
    assert s_always.drafted_tokens > 40
    assert 0 < s_policed.drafted_tokens <= 6 * 3


def test_verify_with_the_policy_on_real_timings_is_the_base_output(arch):
    import torch

    from conftest import base_greedy, hamburger
    from hamburger.inference.engine import Engine

    model = hamburger(arch, k=4)
    model.config.lookup = 1
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [7, 90, 23, 23, 51]]
    engine = Engine(model, draft_rows=None, draft_policy=True)
    with torch.inference_mode():
        for _ in range(2):  # the second time with the costs the first one measured
            out = engine.generate(prompts, max_new_tokens=24, confidence=0.05, mode="verify")
            assert out.tokens == [base_greedy(model, p, 24) for p in prompts]


def test_the_3x3_solve_is_the_systems_solution():
    m = [[4.0, 1.0, 2.0], [1.0, 3.0, 0.5], [2.0, 0.5, 5.0]]
    x = [1.5, -2.0, 0.25]
    v = [sum(m[r][c] * x[c] for c in range(3)) for r in range(3)]
    assert _solve3(m, v) == pytest.approx(x, rel=1e-12)
