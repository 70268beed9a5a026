"""Caches sized and requests admitted in KV entries: a row of N entries holds a longer reply in a mode that keeps one
entry per step than in one that keeps one per token; a row admitted on an estimate that turns out short ends where
its entries run out; `kv_memory` sizes the rows from bytes."""

from __future__ import annotations

import pytest
import torch

from conftest import hamburger
from hamburger import HamburgerError
from hamburger.inference.scheduler import Scheduler
from hamburger.inference.stats import kv_bytes_per_entry

PROMPT = [5, 17, 33, 8, 60, 12, 9]


def run(sched: Scheduler, **kw) -> tuple[list[int], str, int]:
    """One request to its end: (tokens, finish reason, the most entries in use any step saw)."""
    sched.submit(PROMPT, eos_token_ids=set(), **kw)
    tokens, most, reason = [], 0, None
    while sched.has_work():
        for event in sched.step():
            tokens += event.tokens
            reason = event.finish_reason or reason
        most = max(most, int(sched.batch.cache_len.max()))
    return tokens, reason, most


def test_a_row_holds_a_longer_reply_where_each_step_is_one_entry():
    """Trust mode at a low confidence takes K tokens a step, one entry each: 40 tokens need 7 + 10 entries, so a
    row of 27 entries holds them, where a verify request (one entry a token) of that length is refused."""
    model = hamburger("llama", k=4)
    sched = Scheduler(model, max_batch_size=1, max_len=27, entries_per_token={"trust": 0.3})
    with pytest.raises(HamburgerError, match="KV entries"):
        sched.submit(PROMPT, 40, mode="verify")
    tokens, reason, most = run(sched, max_new_tokens=40, mode="trust", confidence=0.01)
    assert len(tokens) == 40 and reason == "length"
    assert most <= 27 and most < len(PROMPT) + 40  # fewer entries than prompt + reply tokens


def test_a_row_whose_estimate_was_short_ends_where_its_entries_run_out():
    """Admitted at 0.3 entries a token, the request takes one token a step (confidence 1.0): it ends, finish reason
    "length", when its 27 entries are used, before its max_new_tokens; the cache never holds more."""
    model = hamburger("llama", k=4)
    sched = Scheduler(model, max_batch_size=1, max_len=27, entries_per_token={"trust": 0.3})
    tokens, reason, most = run(sched, max_new_tokens=60, mode="trust", confidence=1.0)
    assert reason == "length" and most <= 27
    assert len(tokens) == 27 - len(PROMPT) + 1  # one entry per token; the last token is never fed


def test_requests_past_the_models_context_are_refused():
    model = hamburger("llama", k=4)
    sched = Scheduler(model, max_batch_size=1)
    with pytest.raises(HamburgerError, match="context"):
        sched.submit(PROMPT, sched.context, mode="trust")


def test_kv_memory_sizes_the_rows():
    model = hamburger("llama", k=4)
    per_entry = kv_bytes_per_entry(model.base.config, torch.float32)
    probe = Scheduler(model, max_batch_size=1, max_len=32)
    row = probe.batch.cache.k.shape[3] * per_entry  # a row's slots: its entries and the spare draft slots
    assert probe.kv_bytes() == row
    sched = Scheduler(model, max_len=32, kv_memory=5 * row + row // 2)
    assert sched.batch.size == 5 and sched.kv_bytes() == 5 * row
    with pytest.raises(HamburgerError, match="kv_memory"):
        Scheduler(model, max_len=32, kv_memory=row - 1)
