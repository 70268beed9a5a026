"""A request alone on host integers (`solo.py`) is the batched step: the same events, stats and row state at every
step, the draft policy's decisions included (on a clock that both paths read alike)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from conftest import base_greedy, hamburger, run_staggered
from hamburger import HamburgerModel
from hamburger.inference import solo
from hamburger.inference.scheduler import Scheduler
from hamburger.kernels.quantize import quantize_model

# Repeats, so lookup drafts are found and kept; the others leave drafting to the micro-step decoder.
PROMPTS = [[5, 17, 33, 8, 60, 12, 9, 5, 17, 33, 8, 60], [40, 41], [7, 90, 23, 23, 51, 7, 90, 23]]
ROW_STATE = ("states", "step_tok", "step_len", "cache_len", "gen_len", "n_drafts", "next_t0", "live")


class Clocks:
    """One seeded clock per scheduler (steps of 1-5 ms), so the draft policy's measured step costs, and with them
    its decisions, are the same for both paths as long as each reads its clock the same number of times."""

    def __init__(self, names) -> None:
        self.now = {n: 0.0 for n in names}
        self.rng = {n: random.Random(7) for n in names}
        self.current = names[0]

    def __call__(self) -> float:
        self.now[self.current] += self.rng[self.current].uniform(1e-3, 5e-3)
        return self.now[self.current]


def lockstep(model, prompt, limit, monkeypatch, policy: bool, **submit):
    """Steps a scheduler with `alone` and one without through one request side by side, comparing at every step.
    Returns the solo scheduler's events."""
    clocks = Clocks(["alone", "batched"])
    monkeypatch.setattr(time, "perf_counter", clocks)
    scheds = {name: Scheduler(model, max_batch_size=2, max_len=64, draft_rows=None, draft_policy=policy,
                              alone=name == "alone") for name in clocks.now}
    for s in scheds.values():
        s.submit(prompt, limit, **submit)
    events, solo_steps = [], 0
    while scheds["batched"].has_work():
        got = {}
        for name, s in scheds.items():
            clocks.current = name
            solo_steps += name == "alone" and s._alone(s.batch.span())
            got[name] = s.step()
        a, b = got["alone"], got["batched"]
        assert [(e.tokens, e.finished, e.finish_reason) for e in a] == [(e.tokens, e.finished, e.finish_reason)
                                                                         for e in b]
        for ea, eb in zip(a, b):
            sa, sb = vars(ea.stats).copy(), vars(eb.stats).copy()
            for timing in ("prefill_s", "decode_s"):
                sa.pop(timing), sb.pop(timing)
            assert sa == sb
        rows = {name: s.batch for name, s in scheds.items()}
        if scheds["batched"].running:
            for field in ROW_STATE:
                assert torch.equal(getattr(rows["alone"], field)[0], getattr(rows["batched"], field)[0]), field
            used = int(rows["batched"].cache_len[0])
            for part in ("k", "v"):
                assert torch.equal(getattr(rows["alone"].cache, part)[:, 0, :, :used],
                                   getattr(rows["batched"].cache, part)[:, 0, :, :used])
            assert rows["alone"].pending == rows["batched"].pending
        assert scheds["alone"].runner.step_costs(1) == scheds["batched"].runner.step_costs(1)
        events += a
    assert not scheds["alone"].has_work()
    assert solo_steps >= len(events) - 1  # every step after the prefill's ran alone
    return events


@pytest.mark.parametrize("policy", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_a_verify_row_alone_is_the_batched_step(arch, policy, packed, monkeypatch):
    model = hamburger(arch, k=4, micro_context=4, lookup=2)
    if packed:  # the native layers (and the native micro-step passes) run the passes
        quantize_model(model, "int4")
    runner = Scheduler(model, max_batch_size=1, max_len=8).runner
    assert (runner.native is not None and runner.micro_native is not None) == packed
    for prompt in PROMPTS:
        for confidence in (0.05, 0.5):
            for limit in (3, 30):
                events = lockstep(model, prompt, limit, monkeypatch, policy, confidence=confidence, mode="verify")
                assert [t for e in events for t in e.tokens] == base_greedy(model, prompt, limit)[: sum(
                    len(e.tokens) for e in events)]


def test_the_steps_draft_by_lookup_and_by_micro_steps(monkeypatch):
    """The comparisons above see both sources of drafts, kept and rejected ones, and EOS inside kept drafts."""
    model = hamburger("llama", k=4, micro_context=4, lookup=2)
    seen = {"lookup": 0, "micro": 0, "kept": 0, "rejected": 0}
    events = lockstep(model, PROMPTS[0], 40, monkeypatch, False, confidence=0.05, mode="verify")
    stats = events[-1].stats
    seen["lookup"], seen["kept"] = stats.lookup_drafts, stats.lookup_kept
    seen["micro"] = stats.drafted_tokens - stats.lookup_drafts
    seen["rejected"] = stats.drafted_tokens - (stats.generated_tokens - stats.macro_steps)
    assert all(v > 0 for v in seen.values()), seen


def test_the_plain_base_alone_is_the_batched_step(monkeypatch):
    model = hamburger("qwen2", k=4)
    plain = HamburgerModel.plain(model.base, model.tokenizer)
    for prompt in PROMPTS:
        events = lockstep(plain, prompt, 20, monkeypatch, False)
        assert [t for e in events for t in e.tokens] == base_greedy(plain, prompt, 20)[: sum(len(e.tokens)
                                                                                           for e in events)]


def test_not_taken_for_sampled_compress_trust_or_a_custom_drafter():
    model = hamburger("llama", k=4, lookup=2)
    sched = Scheduler(model, max_batch_size=2, max_len=64, draft_rows=None)
    cases = {"verify": (True, {}), "trust": (False, {}),
             "sampled": (False, {"sampling": __import__("hamburger").SamplingParams(temperature=0.8, seed=1)})}
    for name, (expected, kw) in cases.items():
        sched.submit(PROMPTS[1], 8, mode="verify" if name == "sampled" else name, **kw)
        sched.step()  # the prefill
        assert solo.takes(sched.runner, sched.batch, False) is expected, name
        assert not solo.takes(sched.runner, sched.batch, True)  # a custom drafter: the batched step
        while sched.has_work():
            sched.step()


def test_a_request_arriving_hands_the_row_to_the_batched_step():
    """One request decodes alone, a second arrives mid-reply: both replies are each one's own greedy output."""
    model = hamburger("llama", k=4, micro_context=4, lookup=2)
    sched = Scheduler(model, max_batch_size=2, max_len=64, draft_rows=None)
    first = sched.submit(PROMPTS[0], 30, confidence=0.05, mode="verify")
    out: dict[int, list[int]] = {first: []}
    alone = []
    for step in range(200):
        if step == 6:
            out[sched.submit(PROMPTS[2], 20, confidence=0.05, mode="verify")] = []
        alone.append(sched._alone(sched.batch.span()))
        for e in sched.step():
            out[e.id] += e.tokens
        if not sched.has_work():
            break
    assert any(alone[:6]) and not all(alone)
    assert out[first] == base_greedy(model, PROMPTS[0], 30)[: len(out[first])] and len(out[first]) > 0
    second = next(i for i in out if i != first)
    assert out[second] == base_greedy(model, PROMPTS[2], 20)[: len(out[second])] and len(out[second]) > 0


def test_requests_coming_and_going_get_the_batched_steps_events(monkeypatch):
    """A short request beside a long one, then a third arriving while the long one runs alone: the hand-overs both
    ways (batched to alone when the short one ends, alone to batched when the third arrives) change no event."""
    model = hamburger("qwen2", k=4, micro_context=4, lookup=2)
    lone_steps, check = [], solo.check
    monkeypatch.setattr(solo, "check", lambda *a: lone_steps.append(1) or check(*a))
    jobs = [(0, PROMPTS[0], 40, "verify"), (0, PROMPTS[1], 4, "verify"), (14, PROMPTS[2], 12, "verify")]
    got = {}
    for alone in (True, False):
        sched = Scheduler(model, max_batch_size=3, max_len=64, draft_rows=None, alone=alone)
        events = run_staggered(sched, jobs, confidence=0.05)
        got[alone] = {j: [(e.tokens, e.finished, e.finish_reason, e.stats.drafted_tokens) for e in evs]
                      for j, evs in events.items()}
    assert got[True] == got[False] and 3 <= len(lone_steps) < len(got[True][0]) - 1  # alone, then batched again
    assert sum(len(e[0]) for e in got[True][0]) == 40 or got[True][0][-1][2] == "stop"
