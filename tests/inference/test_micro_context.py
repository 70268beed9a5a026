"""A micro-step decoder with context (`micro_context`): in the engines it drafts exactly what it learnt to draft.

Training (`train-drafter --micro-context`) runs the decoder teacher-forced over unmerged text, each position's
inputs attending to the base's keys and values up to that position. Verify mode reads an unmerged cache, so
its drafts must be the training forward's predictions at the same positions, whatever the batch's padding.
"""

from __future__ import annotations

import pytest
import torch

from conftest import base_greedy, hamburger, run_staggered
from hamburger.inference.engine import Engine, ReferenceEngine
from hamburger.inference.scheduler import Scheduler
from hamburger.training.drafter import draft_batch, draft_forward, drafted

PROMPTS = [[5, 17, 33, 8, 60, 12, 9], [40, 41], [7, 90, 23, 23, 51]]
K = 4


def teacher_forced_drafts(model, prompt: list[int], output: list[int]) -> dict[int, list[int]]:
    """{position s: the drafter's K-1 predictions after s}, teacher-forced on prompt + output (padded so that
    every position has K-1 inputs; a padding token is only ever an input after the output's end)."""
    ids = prompt + output + [0] * K
    b = draft_batch(model, ids, len(prompt), None)
    with torch.no_grad():
        preds = drafted(model, draft_forward(model, b)[0])
    return dict(zip(b.s.tolist(), preds.tolist()))


@pytest.mark.parametrize("window", [3, 64])
def test_verify_drafts_with_context_are_the_trained_forwards(arch, window, monkeypatch):
    model = hamburger(arch, k=K, micro_layers=2, micro_context=window)
    calls = []  # per macro-step: each prompt's drafts (its micro tokens of the step) and their number
    real = Scheduler._macro_step

    def record(self):
        events = real(self)
        b, drafts, n = self.batch, [[] for _ in PROMPTS], [0] * len(PROMPTS)
        for i, req in enumerate(self.rows):
            if req is not None:
                n[req.id] = int(b.n_drafts[i])
                drafts[req.id] = b.step_tok[i, 1 : 1 + n[req.id]].tolist()
        calls.append((drafts, n))
        return events

    monkeypatch.setattr(Scheduler, "_macro_step", record)
    out = Engine(model, draft_rows=None, draft_policy=False).generate(PROMPTS, max_new_tokens=20, confidence=0.01,
                                                                      mode="verify")
    checked = 0
    for row, prompt in enumerate(PROMPTS):
        output = out.tokens[row]
        assert output == base_greedy(model, prompt, 20)
        expected = teacher_forced_drafts(model, prompt, output)
        j = 0  # the output index of this pass's token 0
        for drafts, n in calls:
            if j >= len(output) - 1:
                break
            s = len(prompt) + j - 1  # the position of the state that produced token 0
            mine = drafts[row][: n[row]]
            for i, d in enumerate(mine):
                assert d == expected[s][i], (arch, window, row, j, i)
                checked += 1
                if j + 1 + i >= len(output) or d != output[j + 1 + i]:
                    break
            kept = next((i for i, d in enumerate(mine) if j + 1 + i >= len(output) or d != output[j + 1 + i]),
                        len(mine))
            j += 1 + kept
    assert checked > 20


def test_scheduler_with_context_equals_the_engine_alone(arch):
    """Trust and verify requests staggered in the scheduler's rows (right-padded, each at its own length) equal
    the engine's output for each alone (left-padded batch of one): the context each row sees is its own."""
    model = hamburger(arch, k=K, micro_layers=2, micro_context=5)
    torch.nn.init.normal_(model.embedder.o_proj.weight, std=0.2)
    engine = Engine(model, draft_rows=None, draft_policy=False)
    sched = Scheduler(model, max_batch_size=2, max_len=64, draft_rows=None, draft_policy=False)
    jobs = [(0, PROMPTS[0], 14, "trust"), (1, PROMPTS[1], 12, "verify"), (2, PROMPTS[2], 10, "trust")]
    out = run_staggered(sched, jobs, confidence=0.3)
    for j, (_, prompt, limit, mode) in enumerate(jobs):
        alone = engine.generate([prompt], max_new_tokens=limit, confidence=0.3, mode=mode)
        assert [t for e in out[j] for t in e.tokens] == alone.tokens[0], (arch, mode)
        if mode == "trust":
            assert [len(e.tokens) for e in out[j]] == alone.steps[0]
    together = engine.generate(PROMPTS, max_new_tokens=14, confidence=0.3)  # left padding: each row its own
    for i, prompt in enumerate(PROMPTS):
        assert together.tokens[i] == engine.generate([prompt], max_new_tokens=14, confidence=0.3).tokens[0]
    assert max(max(s) for s in together.steps) > 1


@pytest.mark.parametrize("window", [3, 64])
def test_the_reference_path_with_context_equals_the_engine(arch, window):
    """Trust mode with a context decoder on the transformers reference path (no micro cache, the whole step
    recomputed each micro-step, the base's DynamicCache as context) equals the fast engine: tokens and steps, a
    left-padded batch of three. The context matters here: the same model without it decodes differently."""
    model = hamburger(arch, k=K, micro_layers=2, micro_context=window)
    torch.nn.init.normal_(model.embedder.o_proj.weight, std=0.2)
    with torch.no_grad():
        model.micro.context_gate.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
    ref = ReferenceEngine(model).generate(PROMPTS, max_new_tokens=16, confidence=0.3)
    fast = Engine(model, shortlist=False).generate(PROMPTS, max_new_tokens=16, confidence=0.3)
    assert ref.tokens == fast.tokens and ref.steps == fast.steps, arch
    assert max(max(s) for s in ref.steps) > 1  # micro-steps ran
    with torch.no_grad():
        model.micro.context_gate.zero_()
    assert ReferenceEngine(model).generate(PROMPTS, max_new_tokens=16, confidence=0.3).tokens != ref.tokens
