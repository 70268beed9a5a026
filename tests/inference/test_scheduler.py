"""Continuous batching: each request's output equals the fast engine's for it alone, whoever shares the batch."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import PAD, base_greedy, exact_marginals, greedy_no_eos, hamburger, random_merger, run_staggered, tv
from hamburger import HamburgerError, HamburgerModel, SamplingParams
from hamburger.inference import scheduler as scheduler_module
from hamburger.inference.admission import MAX_PASSED
from hamburger.inference.engine import Engine
from hamburger.inference.scheduler import Scheduler
from hamburger.model.merger import stepwise_forward

PROMPTS = [[5, 17, 33, 8, 60, 12, 9], [40, 41], [7, 90, 23, 23, 51], [11], [64, 3, 70, 22], [30, 31, 32, 33, 34, 35]]
LIMITS = [20, 7, 16, 12, 3, 18]


def check_equals_alone(model, confidence: float, rows: int) -> None:
    engine, sched = Engine(model, draft_rows=None), Scheduler(model, max_batch_size=rows, max_len=64, draft_rows=None)
    jobs = [(2 * j if j % 2 else j, p, n) for j, (p, n) in enumerate(zip(PROMPTS, LIMITS))]
    out = run_staggered(sched, jobs, confidence=confidence)
    for j, (_, prompt, limit) in enumerate(jobs):
        alone = engine.generate([prompt], max_new_tokens=limit, confidence=confidence)
        events = out[j]
        assert [t for e in events for t in e.tokens] == alone.tokens[0]
        assert [len(e.tokens) for e in events] == alone.steps[0]
        assert events[-1].finished and events[-1].finish_reason in ("stop", "length")
        assert events[-1].stats.macro_steps == len(alone.steps[0])
        assert events[-1].stats.generated_tokens == len(alone.tokens[0])
    assert sched.running == 0 and sched.kv_entries() == 0


@pytest.mark.parametrize("rows", [2, 4])
def test_hamburger_multi_token_steps_equal_alone(arch, rows):
    """With slot adapters: a batch's smashed rows take them at those rows only, a row alone at every position."""
    model = hamburger(arch, k=4, slot_adapter_rank=4)
    torch.nn.init.normal_(model.embedder.o_proj.weight, std=0.2)
    check_equals_alone(model, 0.3, rows)
    out = Engine(model, draft_rows=None).generate(PROMPTS, max_new_tokens=20, confidence=0.3)
    assert max(max(s) for s in out.steps) > 1  # the comparison covered multi-token steps


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("prefill_tokens", [4096, 12, 1])
def test_requests_prefilled_together_equal_alone(arch, prefill_tokens, interleave):
    # Six prompts of 7, 2, 5, 1, 4, 6 tokens arrive at once: prefilled right-padded in one pass (4096), in
    # passes of at most 12 padded tokens, or one by one (1: each alone), shortest first (1+2+4 | 5+6 | 7): all in
    # the first step, or interleaved, one pass per step.
    model = hamburger(arch, k=4)
    torch.nn.init.normal_(model.embedder.o_proj.weight, std=0.2)
    engine = Engine(model, draft_rows=None)
    sched = Scheduler(model, max_batch_size=6, max_len=64, draft_rows=None, prefill_tokens=prefill_tokens, interleave_prefill=interleave)
    calls = []
    prefill = sched._prefill
    sched._prefill = lambda reqs, rows: (calls.append(len(reqs)), prefill(reqs, rows))
    out = run_staggered(sched, [(0, p, n) for p, n in zip(PROMPTS, LIMITS)], confidence=0.3)
    assert sum(calls) == 6 and len(calls) == {4096: 1, 12: 3, 1: 6}[prefill_tokens]
    if prefill_tokens == 12:
        assert calls == [3, 2, 1]
    for j, (prompt, limit) in enumerate(zip(PROMPTS, LIMITS)):
        alone = engine.generate([prompt], max_new_tokens=limit, confidence=0.3)
        assert [t for e in out[j] for t in e.tokens] == alone.tokens[0]
        assert [len(e.tokens) for e in out[j]] == alone.steps[0]
    with pytest.raises(HamburgerError, match="prefill_tokens"):
        Scheduler(model, prefill_tokens=0)


def test_interleaved_admission_takes_the_shortest_but_lets_no_prompt_wait_forever():
    """Interleaved admission, one row and one pass per step: the shortest waiting prompt goes first, but a long
    one passed over MAX_PASSED times goes next although shorter ones keep arriving."""
    model = hamburger("llama", k=4)
    sched = Scheduler(model, max_batch_size=1, max_len=64, draft_rows=None, interleave_prefill=True)
    order = []
    prefill = sched._prefill
    sched._prefill = lambda reqs, rows: (order.extend(len(r.prompt) for r in reqs), prefill(reqs, rows))
    sched.submit(list(range(2, 12)), 1)  # 10 tokens
    for _ in range(MAX_PASSED + 3):  # a 2-token prompt arrives every step, each done in its first step
        sched.submit([3, 4], 1)
        sched.step()
    assert order[:MAX_PASSED] == [2] * MAX_PASSED and order[MAX_PASSED] == 10 and order[MAX_PASSED + 1] == 2


def test_decode_threads_switch_for_decode_passes_only(monkeypatch):
    """decode_threads: prefill passes run on the threads torch had, decode passes on fewer; outputs unchanged."""
    model = hamburger("llama", k=4)
    torch.nn.init.normal_(model.embedder.o_proj.weight, std=0.2)
    before = torch.get_num_threads()
    seen: dict[str, set] = {"admit": set(), "macro": set()}
    try:
        sched = Scheduler(model, max_batch_size=2, max_len=64, draft_rows=None, decode_threads=1)
        for name, key in (("_admit", "admit"), ("_macro_step", "macro")):
            inner = getattr(sched, name)

            def spy(inner=inner, key=key):
                seen[key].add(torch.get_num_threads())
                return inner()
            monkeypatch.setattr(sched, name, spy)
        jobs = [(j, p, n) for j, (p, n) in enumerate(zip(PROMPTS[:3], LIMITS[:3]))]
        out = run_staggered(sched, jobs, confidence=0.3)
    finally:
        torch.set_num_threads(before)
    assert seen == {"admit": {before}, "macro": {1}}
    engine = Engine(model, draft_rows=None)
    for j, (_, prompt, limit) in enumerate(jobs):
        assert [t for e in out[j] for t in e.tokens] == engine.generate([prompt], max_new_tokens=limit,
                                                                        confidence=0.3).tokens[0]
    with pytest.raises(HamburgerError, match="decode_threads must be >= 1"):
        Scheduler(model, max_batch_size=2, max_len=64, draft_rows=None, decode_threads=0)
    # Larger decode passes run on all threads: with the bound at 1 row, steps of 2 running rows use them.
    monkeypatch.setattr(scheduler_module, "DECODE_THREADS_ROWS", 1)
    seen_rows: set = set()
    try:
        sched = Scheduler(model, max_batch_size=2, max_len=64, draft_rows=None, decode_threads=1)
        inner = sched._macro_step

        def spy_rows():
            seen_rows.add((sched.running, torch.get_num_threads()))
            return inner()
        monkeypatch.setattr(sched, "_macro_step", spy_rows)
        run_staggered(sched, [(0, PROMPTS[0], 6), (0, PROMPTS[1], 3)], confidence=0.3)
    finally:
        torch.set_num_threads(before)
    assert {threads for rows, threads in seen_rows if rows == 2} == {before}
    assert {threads for rows, threads in seen_rows if rows == 1} == {1}


def test_plain_base_equals_alone(arch):
    check_equals_alone(HamburgerModel.plain(hamburger(arch).base, None), 1.0, 3)


def test_shortlist_respected():
    model = hamburger("llama", k=4)
    model.micro_vocab = torch.tensor([1, 7, 11, 20, 33, 50, 64, 80])
    check_equals_alone(model, 0.05, 3)


def test_sampled_request_equals_alone_with_its_seed():
    model = hamburger("llama", k=4)
    params = SamplingParams(temperature=1.0, top_k=20, seed=3)
    alone = Engine(model, draft_rows=None).generate([PROMPTS[0]], max_new_tokens=16, confidence=0.3, sampling=params)
    sched = Scheduler(model, max_batch_size=3, max_len=64, draft_rows=None)
    rid = sched.submit(PROMPTS[0], 16, confidence=0.3, sampling=params)
    sched.submit(PROMPTS[1], 9, confidence=0.3)  # a greedy neighbour
    tokens = []
    while sched.has_work():
        tokens += [t for e in sched.step() if e.id == rid for t in e.tokens]
    assert tokens == alone.tokens[0]


def test_cancel_frees_the_row_and_queue_drains():
    model = hamburger("llama", k=4)
    sched = Scheduler(model, max_batch_size=2, max_len=64, draft_rows=None)
    first = sched.submit(PROMPTS[0], 30, eos_token_ids=set())
    ids = [sched.submit(p, n) for p, n in zip(PROMPTS[1:], LIMITS[1:])]
    sched.step()
    assert sched.running == 2 and sched.waiting == len(ids) - 1
    sched.cancel(first)
    events = sched.step()
    assert [e.finish_reason for e in events if e.id == first] == ["cancelled"]
    assert sched.running == 2  # the freed row went to the next waiting request in the same step
    finished = {first}
    while sched.has_work():
        finished |= {e.id for e in sched.step() if e.finished}
    assert finished == {first, *ids} and sched.running == 0 and sched.waiting == 0


def test_submit_rejects_what_cannot_fit():
    sched = Scheduler(hamburger("llama", k=4), max_batch_size=1, max_len=32, draft_rows=None)
    with pytest.raises(HamburgerError, match="KV entries"):
        sched.submit([5] * 30, 3)
    with pytest.raises(HamburgerError, match="at least one"):
        sched.submit([], 3)
    with pytest.raises(HamburgerError, match=">= 1"):
        sched.submit([5], 0)
    with pytest.raises(HamburgerError, match="confidence"):
        sched.submit([5], 3, confidence=1.5)


def test_rows_are_compacted_when_a_request_leaves():
    # Three requests; the one in row 0 ends first: the highest running request moves down into row 0, so the
    # passes cover exactly the running rows, and every output still equals the engine's alone.
    model = hamburger("llama", k=4)
    torch.nn.init.normal_(model.embedder.o_proj.weight, std=0.2)
    engine, sched = Engine(model, draft_rows=None), Scheduler(model, max_batch_size=3, max_len=64, draft_rows=None)
    jobs = [(0, PROMPTS[1], 8), (0, PROMPTS[0], 20), (0, PROMPTS[2], 16)]
    ids = [sched.submit(p, n, confidence=0.3) for _, p, n in jobs]
    out: dict[int, list] = {}
    passes = []  # (rows a one-slot feeding pass computed, requests running); prompts here are >= 2 tokens
    base = sched.runner.base_pass

    def counted(embeds, *args, **kw):
        if embeds.shape[1] == 1:
            passes.append((embeds.shape[0], sched.running))
        return base(embeds, *args, **kw)

    sched.runner.base_pass = counted
    while sched.has_work():
        for ev in sched.step():
            out.setdefault(ev.id, []).append(ev)
    assert all(rows <= running for rows, running in passes)
    assert (3, 3) in passes and (2, 2) in passes  # the first request left while the others ran on
    for rid, (_, prompt, limit) in zip(ids, jobs):
        alone = engine.generate([prompt], max_new_tokens=limit, confidence=0.3)
        assert [t for e in out[rid] for t in e.tokens] == alone.tokens[0]
        assert [len(e.tokens) for e in out[rid]] == alone.steps[0]


class OracleScheduler(Scheduler):
    """Verify rows draft the base's own continuation, 30 % of drafts spoiled (seeded): rows keep different
    numbers of drafts per pass, and a wrong draft must never reach the output."""

    def __init__(self, model, expected: dict[tuple[int, ...], list[int]], **kw) -> None:
        super().__init__(model, **kw)
        self.expected, self.depth, self.noise = expected, 0, torch.Generator().manual_seed(0)
        self.row_picker, self.picker = self.picker, self.pick

    def pick(self, h, active, micro):
        tok = self.row_picker(h, active, micro)
        self.depth = self.depth + 1 if micro else 0
        if micro:
            for i, req in enumerate(self.rows[: len(h)]):
                if req is not None and req.mode.per_token:
                    want = self.expected[tuple(req.prompt)]
                    j = len(req.tokens) + len(self.batch.pending[i]) + self.depth  # emitted so far, then token 0
                    if j < len(want):
                        spoiled = bool(torch.rand(1, generator=self.noise) < 0.3)
                        tok[i] = (want[j] + 1) % 96 if spoiled else want[j]
        return tok


@pytest.mark.parametrize("rows", [2, 4])
def test_verify_requests_equal_the_base_beside_trust_requests(arch, rows):
    """Verify and trust requests share the batch (one pass: smashed slots and drafts at per-row slots). Each
    verify request gets exactly the base's greedy output, with drafts kept; each trust request its output alone
    (with slot adapters, which act at the trust rows' smashed position of such a pass only)."""
    model = hamburger(arch, k=4, slot_adapter_rank=4)
    torch.nn.init.normal_(model.embedder.o_proj.weight, std=0.2)
    expected = {tuple(p): base_greedy(model, p, n) for p, n in zip(PROMPTS, LIMITS)}
    sched = OracleScheduler(model, expected, max_batch_size=rows, max_len=64, draft_rows=None)
    engine, ids, out, step = Engine(model, draft_rows=None), {}, {}, 0
    modes = ["verify", "trust", "verify", "verify", "trust", "verify"]
    while len(ids) < len(PROMPTS) or sched.has_work():
        for j, (prompt, limit) in enumerate(zip(PROMPTS, LIMITS)):
            if j == step:  # one arrives per step
                ids[sched.submit(prompt, limit, confidence=0.01 if modes[j] == "verify" else 0.3, mode=modes[j])] = j
        for ev in sched.step():
            out.setdefault(ids[ev.id], []).append(ev)
        held = [r for r in sched.rows if r is not None]  # verify rows hold an entry per token, trust rows per step
        assert sched.kv_entries() == sum(len(r.prompt) + (len(r.tokens) if r.mode.per_token else len(r.steps))
                                         for r in held)
        step += 1
        assert step < 500
    for j, (prompt, limit) in enumerate(zip(PROMPTS, LIMITS)):
        events = out[j]
        tokens = [t for e in events for t in e.tokens]
        assert events[-1].finished and events[-1].finish_reason in ("stop", "length")
        if modes[j] == "trust":
            assert tokens == engine.generate([prompt], max_new_tokens=limit, confidence=0.3).tokens[0]
        else:
            assert tokens == expected[tuple(prompt)]
            stats = events[-1].stats
            assert stats.row_forwards == len(events)  # the prefill, then one pass per later event
            assert stats.generated_tokens == len(tokens) and stats.kv_entries == len(prompt) + len(tokens)
    verify_stats = [out[j][-1].stats for j in range(len(PROMPTS)) if modes[j] == "verify"]
    assert max(len(e.tokens) for j in range(len(PROMPTS)) if modes[j] == "verify" for e in out[j]) >= 3
    assert 0 < sum(s.micro_steps for s in verify_stats) < sum(s.drafted_tokens for s in verify_stats)
    assert sched.running == 0 and sched.kv_entries() == 0


def test_verify_requests_with_the_models_own_drafts_equal_the_base(arch):
    model = hamburger(arch, k=4)
    sched = Scheduler(model, max_batch_size=3, max_len=64, draft_rows=None)
    jobs = [(j, p, n) for j, (p, n) in enumerate(zip(PROMPTS, LIMITS))]
    out = run_staggered(sched, jobs, confidence=0.05, mode="verify")
    for j, (_, prompt, limit) in enumerate(jobs):
        assert [t for e in out[j] for t in e.tokens] == base_greedy(model, prompt, limit)
    assert sum(out[j][-1].stats.drafted_tokens for j in out) > 0


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("rows", [2, 4])
def test_compress_requests_equal_compress_mode_alone(arch, rows, window):
    """Compress requests (drafts checked by a base that reads each decided step as one merged entry), staggered
    and beside trust and verify requests, each get exactly what `Engine.generate(mode="compress")` gives them
    alone: the same tokens, the same steps, one KV entry per step (with a merge window, plus the entries of the
    latest steps, not merged yet). Trust and verify requests are unchanged."""
    model = hamburger(arch, k=4)
    model.attach_merger(random_merger(model.base, channels=arch == "qwen2"))
    model.config.merge_window = window
    windowed = 0
    engine, sched = Engine(model, draft_rows=None), Scheduler(model, max_batch_size=rows, max_len=64, draft_rows=None)
    modes = ["compress", "trust", "compress", "verify", "compress", "trust"]
    conf = {"compress": 0.05, "verify": 0.05, "trust": 0.3}
    ids, out, step = {}, {}, 0
    while len(ids) < len(PROMPTS) or sched.has_work():
        for j, (prompt, limit) in enumerate(zip(PROMPTS, LIMITS)):
            if (2 * j if j % 2 else j) == step:
                ids[sched.submit(prompt, limit, confidence=conf[modes[j]], mode=modes[j])] = j
        for ev in sched.step():
            out.setdefault(ids[ev.id], []).append(ev)
        # entries held: the prompt's, then one per step (trust, compress) or one per token (verify)
        held = [r for r in sched.rows if r is not None]
        assert sched.kv_entries() == sum(len(r.prompt) + (len(r.tokens) if r.mode.per_token else len(r.steps))
                                         + r.stats.window_entries for r in held)
        windowed += sum(r.stats.window_entries for r in held)
        step += 1
    for j, (prompt, limit) in enumerate(zip(PROMPTS, LIMITS)):
        alone = engine.generate([prompt], max_new_tokens=limit, confidence=conf[modes[j]], mode=modes[j])
        assert [t for e in out[j] for t in e.tokens] == alone.tokens[0], modes[j]
        assert [len(e.tokens) for e in out[j]] == alone.steps[0], modes[j]
    assert sum(out[j][-1].stats.drafted_tokens for j in range(len(PROMPTS)) if modes[j] == "compress") > 0
    assert (windowed > 0) == (window > 1)
    assert sched.running == 0 and sched.kv_entries() == 0


class CompressOracle(Scheduler):
    """Compress rows draft the merger's reference decoder's own next tokens (`stepwise_forward` over the steps
    merged so far), a third spoiled: passes keep different numbers of drafts, so steps of several lengths merge."""

    def __init__(self, model, **kw) -> None:
        super().__init__(model, **kw)
        self.noise, self.open = torch.Generator().manual_seed(0), {}
        self.row_picker, self.picker = self.picker, self.pick

    def pick(self, h, active, micro):
        tok = self.row_picker(h, active, micro)
        for i, req in enumerate(self.rows[: len(h)]):
            if req is None or not req.mode.merged or not bool(active[i]):
                continue
            if not micro:  # token 0: the base's own; this macro-step's open step starts with it
                self.open[i] = [int(tok[i])]
                continue
            # merged so far: each pass merged [token 0, kept drafts], i.e. each reported step after the first,
            # and the last pass's (its kept drafts are still pending)
            closed = req.steps[1:] + ([len(self.batch.pending[i]) + 1] if req.steps else [])
            toks = req.tokens + self.batch.pending[i] + self.open[i]
            steps = closed + [len(toks) - sum(closed) + 1]
            logits = stepwise_forward(self.model.base, self.model.merger, req.prompt + toks + [0], len(req.prompt),
                                      steps)[0]
            want = int(logits[-1].argmax())
            tok[i] = (want + 1) % 96 if bool(torch.rand(1, generator=self.noise) < 0.3) else want
            self.open[i].append(int(tok[i]))
        return tok


def test_compress_requests_follow_the_mergers_stepwise_reference():
    """With drafts that the base keeps (steps of several lengths merged), every token a compress request emits is
    the greedy choice of the merger's reference decoder over the steps it merged, beside a trust request."""
    model = hamburger("llama", k=4)
    model.attach_merger(random_merger(model.base))
    sched = CompressOracle(model, max_batch_size=3, max_len=64)
    jobs = [(0, PROMPTS[0], 16), (1, PROMPTS[1], 12), (2, PROMPTS[2], 14), (3, PROMPTS[5], 10)]
    ids, out, step = {}, {}, 0
    while len(ids) < len(jobs) or sched.has_work():
        for j, (at, prompt, limit) in enumerate(jobs):
            if at == step:
                ids[sched.submit(prompt, limit, confidence=0.01, mode="trust" if j == 1 else "compress")] = j
        for ev in sched.step():
            out.setdefault(ids[ev.id], []).append(ev)
        step += 1
    lengths = []
    for j, (_, prompt, limit) in enumerate(jobs):
        if j == 1:
            continue
        tokens, steps = [t for e in out[j] for t in e.tokens], [len(e.tokens) for e in out[j]]
        merged = steps[1:] + [1]  # pass j merged [token 0, kept drafts] = reported step j + 1; the last is open
        logits = stepwise_forward(model.base, model.merger, prompt + tokens, len(prompt), merged)[0]
        assert logits.argmax(-1).tolist() == tokens, steps
        assert out[j][-1].stats.generated_tokens == len(tokens) and not out[j][-1].stats.unmerged
        lengths += steps[1:]
    assert len(set(lengths)) >= 3, lengths


@pytest.mark.parametrize("mode", ["verify", "compress"])
def test_sampled_checked_request_does_not_depend_on_its_neighbours(mode):
    """A seeded sampled verify or compress request (drafts drawn and accepted by speculative sampling) gets the
    same tokens beside a greedy verify request (which drafts more or fewer tokens per pass) and a sampled trust
    request as alone in the scheduler: it draws its random numbers for its own drafts only."""
    model = hamburger("llama", k=4)
    model.attach_merger(random_merger(model.base))
    params = SamplingParams(temperature=1.0, seed=5)

    def run(neighbours: bool) -> list[int]:
        sched = Scheduler(model, max_batch_size=3, max_len=64, draft_rows=None)
        rid = sched.submit(PROMPTS[2], 16, confidence=0.05, sampling=params, mode=mode)
        if neighbours:
            sched.submit(PROMPTS[0], 12, confidence=0.05, mode="verify")
            sched.submit(PROMPTS[1], 9, confidence=0.3, sampling=SamplingParams(temperature=0.7, seed=1))
        tokens, drafted = [], 0
        while sched.has_work():
            for e in sched.step():
                if e.id == rid:
                    tokens += e.tokens
                    drafted = e.stats.drafted_tokens
        assert drafted > 0
        return tokens

    assert run(True) == run(False)


def test_compress_needs_a_merger():
    sched = Scheduler(hamburger("llama", k=4), max_batch_size=2, max_len=64, draft_rows=None)
    with pytest.raises(HamburgerError, match="compress mode needs a KV merger"):
        sched.submit([5, 6], 4, mode="compress")
    with pytest.raises(HamburgerError, match="mode must be one of trust, verify, compress"):
        sched.submit([5, 6], 4, mode="fast")


def test_sampled_verify_requests_follow_the_base_distribution():
    """Seeded, each request its own seed: sampled verify requests in the scheduler have the base's exact marginals
    for tokens 1..3 (within sampling noise), with drafts accepted; trust requests with the same model do not."""
    model = hamburger("llama", k=4)
    prompt, n = PROMPTS[2], 1500
    exact = exact_marginals(model, prompt, 1.0)

    def marginals(mode):
        sched = Scheduler(model, max_batch_size=256, max_len=16, draft_rows=None)
        ids, out = {}, {}
        for j in range(n):
            ids[sched.submit(prompt, 3, confidence=0.05, sampling=SamplingParams(temperature=1.0, seed=j),
                             mode=mode)] = j
        while sched.has_work():
            for ev in sched.step():
                out.setdefault(ids[ev.id], []).extend(ev.tokens)
                if ev.finished:
                    kept.append(ev.stats.micro_steps)
        toks = torch.tensor([out[j] + [PAD] * (3 - len(out[j])) for j in range(n)])
        return [torch.bincount(toks[:, i], minlength=exact[0].numel()).float() for i in range(3)]

    kept: list[int] = []
    got = marginals("verify")
    assert sum(kept) > 0.1 * n  # drafts were accepted: the acceptance rule is exercised
    trusted = marginals("trust")
    for i, p in enumerate(exact):
        noise = 0.5 * sum(math.sqrt(2 * x * (1 - x) / (math.pi * n)) for x in p.tolist())  # E[TV] of N samples
        assert tv(got[i], p) < 2.0 * noise + 0.01, (i, tv(got[i], p), noise)
        if i > 0:
            assert tv(trusted[i], p) > 2.0 * noise + 0.01  # the test tells a wrong sampler apart


def test_sampled_verify_takes_token_0_from_the_acceptance(monkeypatch):
    """After a pass, a sampled verify row's next token is the one speculative-sampling acceptance drew (from the
    residual where a draft was rejected), not a fresh draw from the base at that position."""
    from hamburger.inference import verify as scheduler_mod  # where the scheduler checks drafts

    calls = []

    def reject_all(drafts, n_drafts, q, p, generator):
        calls.append(int(n_drafts[0]))
        return torch.zeros(1, dtype=torch.long), torch.tensor([77])

    monkeypatch.setattr(scheduler_mod, "accept_sampled", reject_all)
    sched = Scheduler(hamburger("llama", k=4), max_batch_size=2, max_len=64, draft_rows=None)
    sched.submit(PROMPTS[0], 6, confidence=0.01, sampling=SamplingParams(temperature=1.0, seed=0), mode="verify")
    tokens = []
    while sched.has_work():
        tokens += [t for ev in sched.step() for t in ev.tokens]
    assert len(tokens) == 6 and tokens[1:] == [77] * 5 and max(calls) > 0


def test_verify_requests_draft_only_while_few_run():
    """`draft_rows`: verify requests draft only while at most that many requests run (their output is the base's
    either way); compress requests always draft (their steps are what they merge)."""
    model = hamburger("llama", k=4)
    jobs = [(0, PROMPTS[0], 12), (0, PROMPTS[2], 12)]
    for rows, drafts in ((1, False), (2, True)):
        sched = Scheduler(model, max_batch_size=2, max_len=64, draft_rows=rows)
        out = run_staggered(sched, jobs, confidence=0.01, mode="verify", eos_token_ids=set())
        for j, (_, prompt, limit) in enumerate(jobs):
            assert [t for e in out[j] for t in e.tokens] == greedy_no_eos(model, prompt, limit)
        assert (sum(out[j][-1].stats.drafted_tokens for j in out) > 0) == drafts, rows
    model.attach_merger(random_merger(model.base))
    sched = Scheduler(model, max_batch_size=2, max_len=64, draft_rows=0)
    out = run_staggered(sched, jobs, confidence=0.01, mode="compress", eos_token_ids=set())
    assert sum(out[j][-1].stats.drafted_tokens for j in out) > 0
