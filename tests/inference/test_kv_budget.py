"""Caches sized and requests admitted in KV entries: a row of N entries holds a longer reply in a mode that keeps one
entry per step than in one that keeps one per token; a row admitted on an estimate that turns out short ends where
its entries run out; `kv_memory` sizes the rows from bytes."""

from __future__ import annotations

import pytest
import torch

from conftest import hamburger
from hamburger import HamburgerError
from hamburger.inference.admission import MIN_SAMPLES, EntriesEstimate
from hamburger.inference.modes import COMPRESS
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


def test_the_estimate_is_the_prior_until_replies_are_measured_then_their_high_percentile():
    est = EntriesEstimate(window=48)
    assert est.rate("compress") == COMPRESS.entries_prior and est.rate("verify") == 1.0
    # compress: the window's 48 tokens one entry each, then the rate
    assert est.reply_entries("compress", 40) == 40
    assert est.reply_entries("compress", 148) == 48 + 75
    assert est.reply_entries("trust", 100) == 100 and est.reply_entries("verify", 100) == 100
    for i in range(MIN_SAMPLES - 1):
        est.observe("compress", 48 + 100, 48 + 40 + i)  # rates 0.40..0.46
    assert est.rate("compress") == COMPRESS.entries_prior
    est.observe("compress", 48 + 10, 48 + 1)  # too short past the window to teach anything
    est.observe("compress", 48 + 100, 48 + 50)
    assert est.rate("compress") == pytest.approx(0.50)  # 8 rates: the 90th percentile (nearest rank) is the highest
    est.observe("compress", 148, 88)
    est.observe("compress", 148, 88)
    assert est.rate("compress") == pytest.approx(0.46)  # of 0.40, 0.40, 0.40..0.46, 0.50: the 9th of 10
    assert est.rate("trust") == 1.0  # each mode learns its own
    for entries in (30, 48, 60, 200):  # the longest reply expected to fit `entries` does fit, one more does not
        room = est.room(entries, "compress")
        assert est.reply_entries("compress", room) <= entries < est.reply_entries("compress", room + 1)
    with pytest.raises(HamburgerError, match="entries_per_token"):
        EntriesEstimate(fixed={"compress": 0.0})


def test_the_scheduler_learns_a_modes_entries_per_token_from_its_replies():
    """Trust mode at a low confidence takes K = 4 tokens a step: after MIN_SAMPLES replies the room a row gives a
    trust request grows from one token per entry (the prior) to about three."""
    model = hamburger("llama", k=4)
    sched = Scheduler(model, max_batch_size=4, max_len=64)
    before = sched.token_room(len(PROMPT), "trust")
    assert before == 64 - len(PROMPT)
    for _ in range(MIN_SAMPLES):
        sched.submit(PROMPT, 32, eos_token_ids=set(), mode="trust", confidence=0.01)
    while sched.has_work():
        sched.step()
    assert sched.entries.rate("trust") <= 1 / 3  # 10 steps for 32 tokens: the first step is token 0 alone
    assert sched.token_room(len(PROMPT), "trust") >= 3 * before
    sched.submit(PROMPT, 3 * before, mode="trust")  # admitted now; refused before (see the first test)


def test_a_request_without_max_new_tokens_runs_until_its_row_is_full():
    """No max_new_tokens: admitted on its prompt alone, the reply runs until its row's entries run out ("length"):
    one token an entry in verify mode, about K a step (one entry) in trust mode at a low confidence."""
    model = hamburger("llama", k=4)
    verify, reason, most = run(Scheduler(model, max_batch_size=1, max_len=27), max_new_tokens=None, mode="verify")
    assert reason == "length" and most <= 27 and len(verify) == 27 - len(PROMPT) + 1
    trust, reason, most = run(Scheduler(model, max_batch_size=1, max_len=27), max_new_tokens=None, mode="trust",
                              confidence=0.01)
    assert reason == "length" and most <= 27 and len(trust) > 2 * len(verify)
