"""Lookup drafts: verify and compress rows draft what followed their last tokens earlier, without a micro-step;
the base still checks every draft, so verify mode stays exactly the base's output."""

from __future__ import annotations

import math
import random

import pytest
import torch

from conftest import PAD, base_greedy, exact_marginals, hamburger, random_merger, run_staggered, tv
from hamburger import HamburgerError, SamplingParams
from hamburger.cli import main
from hamburger.inference import verify
from hamburger.inference.core import Limits, macro_step
from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache
from hamburger.inference.lookup import NgramIndex
from hamburger.inference.scheduler import Scheduler
from hamburger.model.config import HamburgerConfig

# Prompts that repeat themselves, so lookups find matches; and one that does not.
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [40, 41, 42, 40, 41], [7, 90, 23, 23, 51]]


# --- the index, no model ---------------------------------------------------------------------------------------

def test_the_index_drafts_what_followed_the_latest_longest_match():
    index = NgramIndex([1, 2, 3, 9, 1, 2, 4, 7, 3, 1, 2], min_ngram=1, max_ngram=3)
    assert index.draft(3) == [4, 7, 3]  # "1 2" last followed by 4 (the latest occurrence, not the first)
    index.extend([3])
    assert index.draft(2) == [9, 1]  # "1 2 3" (3 tokens) beats "2 3"/"3" that follow elsewhere
    assert index.draft(0) == []
    assert NgramIndex([1, 2, 3], min_ngram=2).draft(3) == []  # nothing repeats
    assert NgramIndex([1, 2, 3, 1], min_ngram=2).draft(3) == []  # one token matches, two needed
    assert NgramIndex([1, 2, 3, 1], min_ngram=1).draft(5) == [2, 3, 1]  # runs up to the end of the history


def test_a_tail_is_matched_as_if_it_were_appended():
    """The scheduler looks up after token 0 before it is reported: the tail counts as the history's end."""
    rng = random.Random(0)
    for _ in range(2000):  # few symbols, so repeats and overlapping matches ("7 7 7") are common
        tokens = [rng.randint(0, 3) for _ in range(rng.randint(0, 12))]
        tail = [rng.randint(0, 3) for _ in range(rng.randint(0, 2))]
        low = rng.randint(1, 3)
        assert NgramIndex(tokens, low).draft(3, tail=tail) == NgramIndex(tokens + tail, low).draft(3), (tokens, tail)


def test_bad_settings_are_refused():
    for bad in (-1, 4, 1.5, True, "2"):
        with pytest.raises(HamburgerError, match="lookup"):
            HamburgerConfig(lookup=bad)
        with pytest.raises(HamburgerError, match="lookup"):
            Engine(hamburger("llama", k=4), lookup=bad)
    with pytest.raises(HamburgerError, match="n-gram"):
        NgramIndex([1], min_ngram=3, max_ngram=2)


def test_lookup_rows_take_the_lookup_drafts_and_run_no_micro_step(monkeypatch):
    """`macro_step` with a proposer: a row with its drafts takes them (capped by its room) and only the other
    rows run micro-steps; when every row has some, the micro-step decoder never runs."""
    model = hamburger("llama", k=4)
    engine = Engine(model, draft_rows=None)
    states = [torch.randn(2, model.base.config.hidden_size) for _ in range(1 + model.micro.num_features)]
    micro_cache = KVCache.for_layers(model.micro.layers, model.base.config, 2, model.micro.num_features + 4,
                                     engine.runner.dtype, engine.runner.device)
    calls = []
    real = engine.runner.micro_pass
    monkeypatch.setattr(engine.runner, "micro_pass", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def pick(h, active, micro):
        return torch.full((h.shape[0],), 3) if not micro else h.argmax(-1) % 90

    for found, micro_runs in (([[11, 12, 13], []], True), ([[11, 12, 13], [21, 22]], False)):
        calls.clear()
        drafts = torch.tensor([f + [0] * (3 - len(f)) for f in found])

        class Found:  # a proposer that found `found` for the rows
            def propose(self, tok, rows, room, drafts=drafts, found=found):
                return drafts, torch.tensor([len(f) for f in found])

        limits = Limits(torch.full((1, 1), -1), torch.tensor([4, 10]), 0.0001, drafting=True)  # row 0: room for 2
        gen_len = torch.zeros(2, dtype=torch.long)
        step = macro_step(engine.runner, states, torch.ones(2, dtype=torch.bool), gen_len, limits, pick, micro_cache,
                          proposer=Found())
        tok = step.tokens
        assert tok[0, :3].tolist() == [3, 11, 12] and step.drafts[0] == 2  # the proposer's drafts, cut to the room
        assert step.emitted.tolist() == [1, 1] and gen_len.tolist() == [1, 1]  # drafts are not emitted tokens
        if micro_runs:
            assert len(calls) == 3 and step.drafts[1] == 3 and step.micro_calls == 3  # row 1: micro-steps drafted
        else:
            assert not calls and tok[1, :3].tolist() == [3, 21, 22] and step.drafts[1] == 2


# --- verify and compress mode on tiny models ----------------------------------------------------------------------

@pytest.mark.parametrize("lookup", [1, 2])
def test_verify_with_lookup_equals_the_base_greedy_output(arch, lookup):
    model = hamburger(arch, k=4)
    engine = Engine(model, draft_rows=None, lookup=lookup)
    for confidence in (0.05, 1.0):  # 1.0: lookup drafts only
        out = engine.generate(PROMPTS, max_new_tokens=24, confidence=confidence, mode="verify")
        for i, prompt in enumerate(PROMPTS):
            assert out.tokens[i] == base_greedy(model, prompt, 24), (arch, lookup, confidence, i)
            alone = engine.generate([prompt], max_new_tokens=24, confidence=confidence, mode="verify")
            assert alone.tokens[0] == out.tokens[i]
        s = out.stats
        assert 0 <= s.lookup_kept <= s.lookup_drafts <= s.drafted_tokens
        assert s.lookup_drafts > 0 or lookup > 1  # (a random model's outputs rarely repeat two tokens of a prompt)
        if confidence == 1.0:
            assert s.lookup_drafts == s.drafted_tokens  # no micro drafts at 1.0
    off = Engine(model, draft_rows=None, lookup=0).generate(PROMPTS, max_new_tokens=24, confidence=1.0, mode="verify")
    assert off.stats.drafted_tokens == 0 and off.stats.lookup_drafts == 0


def test_the_checkpoints_lookup_is_the_engines_default():
    model = hamburger("llama", k=4)
    model.config.lookup = 2
    assert Engine(model).runner.lookup == 2 and Engine(model, lookup=0).runner.lookup == 0


def test_lookup_drafts_are_point_masses_when_sampling(monkeypatch):
    """A sampled lookup draft is a draw from a point mass: `draft` returns that distribution for acceptance."""
    model = hamburger("llama", k=4)
    seen = []
    real = Scheduler._macro_step

    def record(self):
        events = real(self)
        for i, req in enumerate(self.rows):
            if req is not None and req.looked:
                seen.append((self.batch.step_tok[i, 1 : 1 + req.looked].clone(), self.batch.q[i].clone()))
        return events

    monkeypatch.setattr(Scheduler, "_macro_step", record)
    Engine(model, draft_rows=None, lookup=1).generate([PROMPTS[0]], max_new_tokens=12, confidence=0.05,
                                                      sampling=SamplingParams(temperature=1.0, seed=3), mode="verify")
    assert seen
    for drafts, q in seen:
        for j, d in enumerate(drafts.tolist()):
            assert q[j, d] == 1.0 and q[j].sum() == 1.0


def test_sampled_verify_with_lookup_follows_the_base_distribution():
    """Seeded: sampled continuations in verify mode with lookup drafts have the base's exact marginals."""
    torch.manual_seed(0)
    model = hamburger("llama", k=4)
    prompt, n = list(range(3, 90, 2)) + list(range(3, 90, 2)), 2000  # most tokens 0 may take have a match
    exact = exact_marginals(model, prompt, 1.0)
    engine = Engine(model, draft_rows=None, lookup=1)
    out = engine.generate([prompt] * n, max_new_tokens=3, confidence=1.0, sampling=SamplingParams(temperature=1.0, seed=5),
                          mode="verify")
    assert out.stats.lookup_drafts > 0.5 * n
    toks = torch.tensor([t + [PAD] * (3 - len(t)) for t in out.tokens])
    for i, p in enumerate(exact):
        got = torch.bincount(toks[:, i], minlength=p.numel()).float()
        noise = 0.5 * sum(math.sqrt(2 * x * (1 - x) / (math.pi * n)) for x in p.tolist())
        assert tv(got, p) < 2.0 * noise + 0.01, (i, tv(got, p), noise)


def test_compress_with_lookup_keeps_one_entry_per_step_and_a_long_window_is_the_base():
    model = hamburger("llama", k=4)
    model.attach_merger(random_merger(model.base))
    engine = Engine(model, lookup=1)
    out = engine.generate(PROMPTS, max_new_tokens=20, confidence=1.0, mode="compress")
    s = out.stats
    assert s.lookup_drafts > 0 and s.kv_entries == s.prompt_tokens + s.macro_steps <= s.kv_entries_base
    model.config.merge_window = 1000  # nothing merged: compress is verify, exactly the base
    out = engine.generate(PROMPTS, max_new_tokens=20, confidence=1.0, mode="compress")
    assert out.tokens == [base_greedy(model, p, 20) for p in PROMPTS] and out.stats.lookup_drafts > 0


# --- the scheduler --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["verify", "compress"])
def test_scheduler_lookup_rows_equal_the_engine_alone(mode):
    """Verify and compress requests with lookup drafts, staggered beside trust requests, get what the engine gives
    each alone: the same tokens, the same steps, the same lookup counts."""
    model = hamburger("llama", k=4)
    model.attach_merger(random_merger(model.base))
    model.config.lookup = 1
    engine, sched = Engine(model, draft_rows=None), Scheduler(model, max_batch_size=2, max_len=64, draft_rows=None)
    jobs = [(0, PROMPTS[0], 20, mode), (1, PROMPTS[2], 9, "trust"), (2, PROMPTS[1], 16, mode)]
    out = run_staggered(sched, jobs, confidence=0.3)
    looked = 0
    for j, (_, prompt, limit, m) in enumerate(jobs):
        alone = engine.generate([prompt], max_new_tokens=limit, confidence=0.3, mode=m)
        assert [t for e in out[j] for t in e.tokens] == alone.tokens[0], j
        assert [len(e.tokens) for e in out[j]] == alone.steps[0], j
        stats = out[j][-1].stats
        assert (stats.lookup_drafts, stats.lookup_kept) == (alone.stats.lookup_drafts, alone.stats.lookup_kept)
        looked += stats.lookup_drafts
    assert looked > 0


def test_cli_refuses_a_bad_lookup(checkpoint, capsys):
    assert main(["generate", "w5", "--model", str(checkpoint), "--raw", "--lookup", "7"]) == 2
    err = capsys.readouterr().err
    assert "lookup" in err and "Traceback" not in err
    assert main(["generate", "w5", "--model", str(checkpoint), "--raw", "--lookup", "1", "--mode", "verify",
                 "--max-new-tokens", "6"]) == 0


def test_verify_lookup_drafts_run_past_k_minus_1_and_compress_keeps_k_minus_1():
    """Verify mode takes up to `lookup_drafts` lookup tokens per pass (a repeating prompt offers many); compress
    mode keeps K-1 (its merger's steps); both engine and scheduler give the base's output."""
    model = hamburger("llama", k=3)
    model.attach_merger(random_merger(model.base))
    model.config.lookup = 1
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6]
    engine = Engine(model, draft_rows=None)
    assert engine.runner.lookup_drafts > model.config.max_step_tokens - 1
    widest = {}
    original = verify.check_pass

    def spy(engine_, embeds, *args, **kwargs):
        widest[mode] = max(widest.get(mode, 0), embeds.shape[1])
        return original(engine_, embeds, *args, **kwargs)

    verify.check_pass = spy
    try:
        for mode in ("verify", "compress"):
            out = engine.generate([prompt], max_new_tokens=30, confidence=1.0, mode=mode)
            if mode == "verify":
                assert out.tokens[0] == base_greedy(model, prompt, 30)
    finally:
        verify.check_pass = original
    assert widest["compress"] <= 3 < widest["verify"]  # t0 + K-1; verify: more lookup drafts than K-1
    sched = Scheduler(model, max_batch_size=2, max_len=64, draft_rows=None)
    out = run_staggered(sched, [(0, prompt, 30, "verify")], confidence=1.0)
    assert [t for e in out[0] for t in e.tokens] == base_greedy(model, prompt, 30)


# --- stored replies ----------------------------------------------------------------------------------------------

def test_the_reply_store_drafts_the_latest_longest_match_within_one_reply():
    from hamburger.inference.lookup import ReplyStore

    store = ReplyStore(torch.tensor([1, 2, 3, 4, 5, -1, 9, 2, 3, 7, 8, -1, 1, 2, 6, -1], dtype=torch.int32))
    assert store.draft([0, 2, 3], 5) == [7, 8]  # "2 3": the latest occurrence, cut at its reply's end
    assert store.draft([1, 2, 3], 2) == [4, 5]  # "1 2 3" (3 tokens) beats "2 3"
    assert store.draft([5, 9], 3) == []  # "5 9" only across two replies: no match
    assert store.draft([3], 3) == []  # one token: shorter than min_ngram


def test_verify_drafts_from_stored_replies_and_stays_the_base_output():
    """A row whose own history offers nothing drafts from the stored replies: here the base's own greedy reply to
    another prompt that shares its continuation, so most drafts are kept."""
    model = hamburger("llama", k=4)
    model.config.lookup = 2
    prompt, other = [7, 90, 23, 23, 51], [9, 7, 90, 23, 23, 51]
    reply = base_greedy(model, prompt, 30)
    engine = Engine(model, draft_rows=None)
    without = engine.generate([prompt], max_new_tokens=30, confidence=1.0, mode="verify")
    model.reply_tokens = torch.tensor(base_greedy(model, other, 40) + [1, -1] + reply + [1, -1], dtype=torch.int32)
    engine = Engine(model, draft_rows=None)
    with_store = engine.generate([prompt], max_new_tokens=30, confidence=1.0, mode="verify")
    assert with_store.tokens[0] == without.tokens[0] == reply
    assert with_store.stats.lookup_kept > without.stats.lookup_kept + 10
    assert with_store.stats.base_forwards < without.stats.base_forwards - 5
    sched = Scheduler(model, max_batch_size=2, max_len=64, draft_rows=None)
    out = run_staggered(sched, [(0, prompt, 30, "verify")], confidence=1.0)
    assert [t for e in out[0] for t in e.tokens] == reply
    assert out[0][-1].stats.lookup_kept == with_store.stats.lookup_kept


def test_export_stores_replies_that_load_with_the_checkpoint(checkpoint, tmp_path):
    import json as json_

    from hamburger.model.hamburger_model import REPLIES_NAME, HamburgerModel
    from hamburger.training.export import export_checkpoint

    data = tmp_path / "distilled.jsonl"
    rows = [{"messages": [{"role": "user", "content": "w5"}, {"role": "assistant", "content": text}]}
            for text in ("w7 w8 w9", "w10 w11")]
    data.write_text("".join(json_.dumps(r) + "\n" for r in rows))
    export_checkpoint(str(checkpoint), tmp_path / "out", replies=str(data))
    assert (tmp_path / "out" / REPLIES_NAME).is_file()
    tokens = HamburgerModel.from_pretrained(tmp_path / "out").reply_tokens.tolist()
    assert tokens.count(-1) == 2 and tokens[-1] == -1
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(HamburgerError, match="line 1"):
        export_checkpoint(str(checkpoint), tmp_path / "out2", replies=str(bad))


def test_the_reply_store_is_the_latest_match_of_every_ngram_and_survives_hash_collisions(monkeypatch):
    """Against a dict of every n-gram's latest continuation, on random replies; and with every key colliding (a
    constant hash), a match is still checked against the tokens: what is drafted followed the history's last
    tokens somewhere in the store, never tokens from elsewhere."""
    import random

    from hamburger.inference import lookup
    from hamburger.inference.lookup import ReplyStore

    rng = random.Random(0)
    toks = [t for _ in range(60) for t in [rng.randrange(6) for _ in range(rng.randrange(1, 12))] + [-1]]
    store = ReplyStore(torch.tensor(toks, dtype=torch.int32))

    def latest(history, limit):
        for n in range(4, 1, -1):
            at = max((j for j in range(n, len(toks)) if toks[j] >= 0 and toks[j - n:j] == history[-n:]), default=None)
            if len(history) >= n and at is not None:
                out = toks[at:at + limit]
                return out[:out.index(-1)] if -1 in out else out
        return []

    histories = [[rng.randrange(6) for _ in range(rng.randrange(1, 6))] for _ in range(300)]
    assert all(store.draft(h, 5) == latest(h, 5) for h in histories)
    assert sum(bool(store.draft(h, 5)) for h in histories) > 200  # most of them match something
    monkeypatch.setattr(lookup, "_ngram_keys", lambda w: torch.zeros(w.shape[0], dtype=torch.int64))
    monkeypatch.setattr(lookup, "_ngram_key", lambda t: 0)
    colliding = ReplyStore(torch.tensor(toks, dtype=torch.int32))
    def follows(history, got):
        return any(toks[j - n:j] == history[-n:] and toks[j:j + len(got)] == got
                   for n in range(2, 5) if len(history) >= n for j in range(n, len(toks)))

    drafted = [(h, colliding.draft(h, 5)) for h in histories]
    assert all(follows(h, got) for h, got in drafted if got) and any(got for _, got in drafted)
