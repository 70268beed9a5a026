"""Verify mode: the base checks the micro-step decoder's drafts, so the output is exactly the base's."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from conftest import PAD, base_greedy, exact_marginals, greedy_no_eos, hamburger, tv
from hamburger import HamburgerError, SamplingParams
from hamburger.inference.engine import Engine, make_engine
from hamburger.inference.sampling import greedy_tokens
from hamburger.inference.verify import accept_greedy, accept_sampled
from hamburger.kernels.qlinear import fp16_unavailable
from hamburger.kernels.quantize import quantize_model
from hamburger.model.config import DRAFT_ROWS

PROMPTS = [[5, 17, 33, 8, 60, 12, 9], [40, 41], [7, 90, 23, 23, 51]]


# --- acceptance on hand-built logits, no model --------------------------------------------------------------

def test_accept_greedy_keeps_the_longest_agreeing_prefix():
    v = 8
    base = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6]])  # the base's argmax after t0, d1, d2, d3
    logits = torch.nn.functional.one_hot(base, v).float()
    drafts = torch.tensor([[3, 4, 7], [2, 4, 5], [3, 4, 5]])
    kept, nxt = accept_greedy(drafts.tolist(), [3, 3, 2], greedy_tokens(logits).tolist())
    assert kept == [2, 0, 2]  # row 2 drafted only two tokens: its third is not looked at
    assert nxt == [5, 3, 5]


def test_accept_sampled_follows_the_target_distribution():
    """Whatever the draft distribution q, the emitted tokens follow p: the first exactly p[0], and the second,
    given the first, the target's distribution after it (built here as a table indexed by the first)."""
    gen = torch.Generator().manual_seed(0)
    n, v = 200_000, 5
    p0 = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    p1_table = torch.softmax(torch.randn(v, v, generator=gen) * 2, -1)  # p(second | first)
    q0 = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3])
    q1 = torch.full((v,), 1 / v)
    d1 = torch.multinomial(q0, n, replacement=True, generator=gen)
    d2 = torch.multinomial(q1, n, replacement=True, generator=gen)
    drafts = torch.stack([d1, d2], 1)
    q = torch.stack([q0.expand(n, v), q1.expand(n, v)], 1)
    p = torch.stack([p0.expand(n, v), p1_table[d1], torch.full((n, v), 1 / v)], 1)
    kept, nxt = accept_sampled(drafts, torch.full((n,), 2), q, p, gen)
    first = torch.where(kept >= 1, d1, nxt)
    assert torch.allclose(torch.bincount(first, minlength=v) / n, p0, atol=0.005)
    second = torch.where(kept >= 2, d2, nxt)[kept >= 1]  # rows whose first token was the draft d1
    for t in range(v):
        rows = d1[kept >= 1] == t
        emp = torch.bincount(second[rows], minlength=v) / rows.sum()
        assert torch.allclose(emp, p1_table[t], atol=0.02), t
    assert 0.3 < (kept >= 1).float().mean() < 0.9  # the test sees both accepted and rejected drafts


def test_accept_sampled_without_drafts_draws_from_the_target():
    gen = torch.Generator().manual_seed(1)
    n, v = 50_000, 4
    p = torch.tensor([0.7, 0.1, 0.1, 0.1]).expand(n, 1, v)
    kept, nxt = accept_sampled(torch.zeros(n, 0, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                               torch.zeros(n, 0, v), p, gen)
    assert kept.eq(0).all()
    assert torch.allclose(torch.bincount(nxt, minlength=v) / n, p[0, 0], atol=0.01)


# --- end to end on tiny models -------------------------------------------------------------------------------

def test_verify_equals_the_base_greedy_output(arch):
    model = hamburger(arch, k=4)
    engine = Engine(model, draft_rows=None)
    for confidence in (0.05, 0.3, 1.0):
        together = engine.generate(PROMPTS, max_new_tokens=24, confidence=confidence, mode="verify")
        for i, prompt in enumerate(PROMPTS):
            assert together.tokens[i] == base_greedy(model, prompt, 24), (arch, confidence, i)
            alone = engine.generate([prompt], max_new_tokens=24, confidence=confidence, mode="verify")
            assert alone.tokens[0] == together.tokens[i]
        stats = together.stats
        assert stats.unmerged and stats.kv_entries == stats.kv_entries_base
        if confidence == 1.0:
            assert stats.drafted_tokens == 0  # confidence 1.0 drafts nothing: the plain base


def test_verify_keeps_long_agreeing_drafts_with_rows_at_different_lengths(monkeypatch):
    """An oracle drafter (right 70% of the time) makes rows accept different numbers of tokens per forward;
    the output is still the base's, and far fewer base forwards are needed."""
    model = hamburger("llama", k=4)
    prompts = [PROMPTS[0], PROMPTS[2]]
    n = 30
    expected = [base_greedy(model, p, n) for p in prompts]
    noise = torch.Generator().manual_seed(0)

    def oracle(ids, histories, room):
        # The base's continuation after the tokens emitted so far (t0 included), 30% of tokens spoiled.
        rows = [expected[b][len(h): len(h) + min(r, model.config.max_step_tokens - 1)]
                for b, h, r in zip(ids, histories, room)]
        return [[(t + 1) % 96 if bool(torch.rand(1, generator=noise) < 0.3) else t for t in r] for r in rows]

    gen = Engine(model, draft_rows=None, drafter=oracle).stream(prompts, max_new_tokens=n, confidence=0.5,
                                                                mode="verify")
    for _ in gen:
        pass
    out = gen.output()
    assert out.tokens == expected
    assert max(max(s) for s in out.steps) == 4  # some forwards kept all three drafts
    assert out.steps[0] != out.steps[1]  # the rows took different paths
    assert out.stats.tokens_per_forward > 1.6
    assert out.stats.row_forwards == sum(map(len, out.steps))  # each row: its prefill and one pass per later step
    assert out.stats.micro_steps > 0 and out.stats.acceptance < 1.0


def test_a_row_that_ends_early_does_not_outgrow_the_cache(monkeypatch):
    """One row drafts perfectly and ends after a few forwards, the other drafts nothing and needs one forward
    per token: the finished row must not keep taking cache slots while the other goes on."""
    model = hamburger("llama", k=4)
    prompts = [PROMPTS[0], PROMPTS[2]]
    n = 40
    expected = [base_greedy(model, p, n) for p in prompts]

    def oracle(ids, histories, room):
        width = model.config.max_step_tokens - 1
        return [expected[0][len(h): len(h) + min(width, r)] if b == 0 else [] for b, h, r in zip(ids, histories, room)]

    gen = Engine(model, draft_rows=None, drafter=oracle).stream(prompts, max_new_tokens=n, confidence=0.5,
                                                                mode="verify")
    for _ in gen:
        pass
    out = gen.output()
    assert out.tokens == expected
    assert len(out.steps[0]) < len(out.steps[1]) - model.config.max_step_tokens


def test_verify_respects_eos_and_the_token_budget():
    model = hamburger("llama", k=4)
    engine = Engine(model, draft_rows=None)
    for n in (1, 2, 5):
        out = engine.generate(PROMPTS, max_new_tokens=n, confidence=0.05, mode="verify")
        for i, prompt in enumerate(PROMPTS):
            assert out.tokens[i] == base_greedy(model, prompt, n)
            assert sum(out.steps[i]) == len(out.tokens[i]) <= n


def test_verify_errors_are_clear():
    model = hamburger("llama", k=4)
    with pytest.raises(HamburgerError, match="mode"):
        Engine(model, draft_rows=None).stream(PROMPTS, mode="bogus")
    with pytest.raises(HamburgerError, match="forced steps"):
        Engine(model, draft_rows=None).stream(PROMPTS, mode="verify", forced_steps=[[2], [2], [2]])
    with pytest.raises(HamburgerError, match="fast engine"):
        make_engine(model, "reference").stream(PROMPTS, mode="verify")


def test_verify_drafts_only_while_few_rows_decode():
    """`draft_rows`: while more rows decode than that, a verify step is a plain base step (no drafts); the output
    is the base's either way. No EOS here, so all three rows decode together to the budget."""
    model = hamburger("llama", k=4)
    expected = [greedy_no_eos(model, p, 12) for p in PROMPTS]
    for rows, drafts in ((0, False), (1, False), (2, False), (3, True), (None, True)):
        out = Engine(model, draft_rows=rows).generate(PROMPTS, max_new_tokens=12, confidence=0.01, mode="verify",
                                                      eos_token_ids=set())
        assert out.tokens == expected, rows
        assert (out.stats.drafted_tokens > 0) == drafts, rows
        if not drafts:
            assert out.stats.micro_steps == 0 and out.stats.tokens_per_forward == 1.0
    alone = Engine(model, draft_rows=1).generate([PROMPTS[0]], max_new_tokens=12, confidence=0.01, mode="verify",
                                                 eos_token_ids=set())
    assert alone.tokens == expected[:1] and alone.stats.drafted_tokens > 0
    # "auto": no drafts with float weights on a CPU (a pass of 2-3 positions costs 1.5-1.9x one there), DRAFT_ROWS
    # with packed ones (fp16: 1.03-1.08x; int8/int4 in bfloat16)
    assert Engine(model).runner.draft_rows == 0
    for scheme in ("int4", "fp16") if fp16_unavailable("cpu") is None else ("int4",):
        packed = copy.deepcopy(model)
        quantize_model(packed.base, scheme)
        assert Engine(packed).runner.draft_rows == DRAFT_ROWS, scheme
    for bad in (-1, 1.5, True, "2", "all"):
        with pytest.raises(HamburgerError, match="draft_rows"):
            Engine(model, draft_rows=bad)




def test_verify_sampling_follows_the_base_distribution():
    """Seeded: N sampled continuations in verify mode have the base's exact marginals for tokens 1..3 (within
    sampling noise), while trust mode with the same drafts (kept blindly) measurably does not."""
    torch.manual_seed(0)
    model = hamburger("llama", k=4)
    prompt, n, temperature = PROMPTS[2], 3000, 1.0
    exact = exact_marginals(model, prompt, temperature)
    sampling = SamplingParams(temperature=temperature, seed=123)
    engine = Engine(model, draft_rows=None)

    def marginals(mode):
        out = engine.generate([prompt] * n, max_new_tokens=3, confidence=0.05, sampling=sampling, mode=mode)
        toks = torch.tensor([t + [PAD] * (3 - len(t)) for t in out.tokens])
        return [torch.bincount(toks[:, i], minlength=exact[0].numel()).float() for i in range(3)], out.stats

    got, stats = marginals("verify")
    trusted, _ = marginals("trust")
    assert stats.micro_steps > 0.1 * n  # drafts were accepted: the acceptance rule is exercised
    for i, p in enumerate(exact):
        noise = 0.5 * sum(math.sqrt(2 * x * (1 - x) / (math.pi * n)) for x in p.tolist())  # E[TV] of N samples
        assert tv(got[i], p) < 2.0 * noise + 0.01, (i, tv(got[i], p), noise)
        if i > 0:
            assert tv(trusted[i], p) > 2.0 * noise + 0.01  # the test tells a wrong sampler apart


def test_drafts_go_on_while_the_whole_draft_is_likely_kept():
    """A draft is worth its micro-step only if every draft before it is kept too: verify rows (`path`) go on
    while the product of the stop head's P(go on) over the step exceeds the confidence, trust rows while each
    token's own P(go on) does. With P(go on) 0.6 everywhere and confidence 0.3: 0.6, 0.36 pass and 0.216
    does not, so a path row drafts 2 tokens where a trust row takes all K-1 = 3."""
    from hamburger.inference.core import Limits, macro_step
    from hamburger.inference.kv import KVCache

    model = hamburger("llama", k=4)
    with torch.no_grad():
        model.stop_head.net[-1].weight.zero_()
        model.stop_head.net[-1].bias.fill_(-math.log(0.6 / 0.4))  # stop logit: P(go on) = 0.6
    engine = Engine(model, draft_rows=None)
    cfg, m, n = model.base.config, model.micro.num_features, 3
    states = [torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(i)) for i in range(m + 1)]

    def pick(h, active, micro):
        return model.lm_head(h).argmax(-1)

    def step_lengths(drafting, confidence=0.3):  # token 0 and the micro tokens (emitted, or drafts)
        cache = KVCache.for_layers(model.micro.layers, cfg, n, m + engine.k, engine.runner.dtype, engine.runner.device)
        limits = Limits(torch.full((1, 1), -1), 100, confidence, drafting=drafting)
        with torch.inference_mode():
            step = macro_step(engine.runner, states, torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long),
                              limits, pick, cache)
        return (step.emitted + step.drafts).tolist()

    assert step_lengths(False) == [4, 4, 4]
    assert step_lengths(True) == [3, 3, 3]
    assert step_lengths(torch.tensor([True, False, True])) == [3, 4, 3]
    assert step_lengths(True, confidence=0.5) == [2, 2, 2]
    assert step_lengths(True, confidence=1.0) == step_lengths(False, confidence=1.0) == [1, 1, 1]


def test_a_draft_stop_head_decides_drafts_and_the_trust_head_trust_steps(tmp_path):
    """A checkpoint with a draft stop head: verify rows (and compress rows) read it, trust rows the trust head, in
    the engine, per row in the scheduler's mixed batches, and after a save and load. Here the trust head always
    goes on and the draft head always stops: trust steps take K tokens, verify drafts nothing and is the base."""
    from hamburger.inference.scheduler import Scheduler
    from hamburger.model.hamburger_model import HamburgerModel

    model = hamburger("llama", k=4)
    draft = model.add_draft_stop_head()
    assert model.config.draft_stop_head
    with torch.no_grad():
        model.stop_head.net[-1].weight.zero_()
        model.stop_head.net[-1].bias.fill_(-20.0)  # P(go on) ~ 1
        draft.net[-1].weight.zero_()
        draft.net[-1].bias.fill_(20.0)  # P(go on) ~ 0
    model.save_pretrained(tmp_path / "ckpt")
    loaded = HamburgerModel.from_pretrained(tmp_path / "ckpt", base=model.base, tokenizer=model.tokenizer)
    assert torch.equal(loaded.draft_stop_head.net[-1].bias, draft.net[-1].bias)
    assert loaded.parameter_counts()["draft_stop_head"] == sum(p.numel() for p in draft.parameters())
    for m in (model, loaded):
        engine = Engine(m, draft_rows=None)
        trust = engine.generate(PROMPTS, max_new_tokens=12, confidence=0.5, mode="trust")
        assert all(s == 4 for steps in trust.steps for s in steps[:-1])
        verify = engine.generate(PROMPTS, max_new_tokens=12, confidence=0.5, mode="verify")
        assert verify.stats.drafted_tokens == 0
        assert verify.tokens == [base_greedy(m, p, 12) for p in PROMPTS]
    sched = Scheduler(loaded, max_batch_size=2, max_len=64, draft_rows=None)
    ids = {sched.submit(PROMPTS[0], 12, confidence=0.5, mode="trust"): "trust",
           sched.submit(PROMPTS[1], 12, confidence=0.5, mode="verify"): "verify"}
    drafted, steps = {}, {}
    while sched.has_work():
        for ev in sched.step():
            steps.setdefault(ids[ev.id], []).append(len(ev.tokens))
            drafted[ids[ev.id]] = ev.stats.drafted_tokens
    assert drafted["verify"] == 0 and drafted["trust"] == 0
    assert all(s == 4 for s in steps["trust"][:-1]) and all(s == 1 for s in steps["verify"])
    # With the heads the other way round, the trust rows take one token per step and verify drafts.
    with torch.no_grad():
        model.stop_head.net[-1].bias.fill_(20.0)
        draft.net[-1].bias.fill_(-20.0)
    engine = Engine(model, draft_rows=None)
    assert all(s == 1 for steps in engine.generate(PROMPTS, max_new_tokens=12, confidence=0.5).steps for s in steps)
    assert engine.generate(PROMPTS, max_new_tokens=12, confidence=0.5, mode="verify").stats.drafted_tokens > 0


def test_greedy_tokens_are_argmax_ties_and_nans_included():
    gen = torch.Generator().manual_seed(0)
    for shape in ((1, 49152), (3, 5, 1000), (16, 7244), (2, 8, 300)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(shape, generator=gen).to(dtype)
            tied = x.round()  # many equal maxima: the first one's index
            tied[..., 3] = tied[..., 7] = float("inf")
            nan = x.clone()
            nan[..., 5] = float("nan")
            for t in (x, tied, nan):
                assert torch.equal(greedy_tokens(t), t.argmax(-1)), (shape, dtype)


def test_a_checked_step_takes_token_0_from_its_check_pass_not_another_head(monkeypatch):
    """After a check pass every verify row's token 0 is the pass's own choice: one LM head fewer a pass than when
    the macro-step computes it again, the same text, the base's (batches mixing trust rows, whose token 0 needs
    the head: test_scheduler's mixed-mode tests)."""
    from hamburger.inference import verify
    model = hamburger("llama", k=4)
    heads = [0]
    lm_head = model.lm_head

    def counted(h):
        heads[0] += 1
        return lm_head(h)

    expected = base_greedy(model, PROMPTS[0], 20)

    def oracle(ids, histories, room):  # the base's own continuation, a third of the drafts spoiled
        noise = torch.Generator().manual_seed(len(histories[0]))
        drafts = expected[len(histories[0]): len(histories[0]) + min(room[0], 3)]
        return [[(t + 1) % 96 if bool(torch.rand(1, generator=noise) < 0.3) else t for t in drafts]]

    def run():
        heads[0] = 0
        engine = Engine(model, draft_policy=False, draft_rows=None, drafter=oracle)
        out = engine.generate(PROMPTS[:1], max_new_tokens=20, confidence=0.5, mode="verify", eos_token_ids=set())
        return out, heads[0]

    monkeypatch.setattr(model, "lm_head", counted)
    out, now = run()
    accept = verify.accept

    def accept_without_token_0(runner, rows, n, which, final, width):
        at = accept(runner, rows, n, which, final, width)
        rows.next_t0[:n] = -1
        return at

    monkeypatch.setattr(verify, "accept", accept_without_token_0)
    before, then = run()
    passes = out.stats.base_forwards - 1  # the prefill is one
    assert then - now == passes and passes < 12  # drafts were kept: fewer passes than tokens
    assert len(set(out.steps[0])) > 2  # passes kept 0, 1, 2 or 3 drafts: token 0 came from varied positions
    assert out.tokens == before.tokens and out.tokens[0] == expected
