"""A checkpoint whose base learnt to read smashed steps (`train --base-training lora`): trust mode decodes with the
base's LoRA on, verify and compress mode with it off, so they still give exactly the untouched base's output,
also beside trust rows in one batch."""

from __future__ import annotations

import torch

from conftest import base_greedy, hamburger, run_staggered
from hamburger.inference.engine import Engine
from hamburger.inference.scheduler import Scheduler

PROMPTS = [[5, 17, 33, 8, 60, 12, 9], [40, 41], [7, 90, 23, 23, 51]]


def with_lora(arch: str = "llama"):
    model = hamburger(arch, k=4)
    model.attach_lora(4)
    with torch.no_grad():
        for layer in model.lora.layers:
            torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.5)
    return model


def test_verify_decodes_the_untouched_base_and_trust_the_adapted_one(arch):
    model = with_lora(arch)
    with model.base_lora(False):
        plain = [base_greedy(model, p, 12) for p in PROMPTS]
    adapted = [base_greedy(model, p, 12) for p in PROMPTS]
    assert plain != adapted  # the LoRA changes the base: the test can tell the two apart
    engine = Engine(model, draft_rows=None)
    assert engine.generate(PROMPTS, max_new_tokens=12, confidence=0.05, mode="verify").tokens == plain
    # trust mode at confidence 1.0 (one token a step, nothing smashed): the base with its LoRA
    assert engine.generate(PROMPTS, max_new_tokens=12, confidence=1.0, mode="trust").tokens == adapted


def test_a_mixed_batch_switches_the_lora_per_row():
    model = with_lora()
    with model.base_lora(False):
        plain = base_greedy(model, PROMPTS[0], 10)
    adapted = base_greedy(model, PROMPTS[1], 10)
    sched = Scheduler(model, max_batch_size=2, max_len=64, draft_rows=None)
    out = run_staggered(sched, [(0, PROMPTS[0], 10, "verify"), (0, PROMPTS[1], 10, "trust")], confidence=1.0)
    assert [t for e in out[0] for t in e.tokens] == plain
    assert [t for e in out[1] for t in e.tokens] == adapted


def test_a_plain_model_over_a_lora_checkpoints_base_decodes_the_untouched_base():
    """`HamburgerModel.plain(model.base)` (eval's and bench's "base" system) shares the base's modules, LoRA included:
    it decodes with the LoRA off, in trust mode too."""
    from hamburger import HamburgerModel

    model = with_lora()
    with model.base_lora(False):
        plain = [base_greedy(model, p, 10) for p in PROMPTS]
    base = HamburgerModel.plain(model.base, model.tokenizer)
    assert Engine(base).generate(PROMPTS, max_new_tokens=10, mode="trust").tokens == plain
