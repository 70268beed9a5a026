"""Reference generation: exactness against the base, batching, limits, streaming, statistics."""

from __future__ import annotations

import pytest
import torch

from conftest import EOS, PAD, hamburger
from hamburger import (
    HamburgerError,
    SamplingParams,
    SegmentedExample,
    collate,
    generate,
    stream,
)
from hamburger.training.loss import hamburger_loss

PROMPTS = [[5, 17, 33, 8, 60, 12, 9], [40, 41], [7, 90, 23, 23, 51]]


def hf_greedy(base, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                        eos_token_id=EOS, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("k,confidence,slot_rank", [(1, 0.8, 0), (4, 1.0, 0), (4, 1.0, 4)])
def test_one_token_per_step_equals_base_greedy(arch, k, confidence, slot_rank):
    """With slot adapters too: they act only at merged slots, and one-token steps never merge."""
    model = hamburger(arch, k=k, slot_adapter_rank=slot_rank)
    for prompt in PROMPTS:
        out = generate(model, [prompt], max_new_tokens=24, confidence=confidence)
        assert out.tokens[0] == hf_greedy(model.base, prompt, 24)
        assert set(out.steps[0]) == {1}


def test_multi_token_steps_happen_and_differ_from_base():
    """Guards the test above: with a permissive stop head the output is not the base's one-token path."""
    model = hamburger("llama", k=4)
    out = generate(model, [PROMPTS[0]], max_new_tokens=24, confidence=0.05)
    assert max(out.steps[0]) > 1
    assert out.stats.tokens_per_step > 1.0


@pytest.mark.parametrize("stop_bias,expected", [(12.0, {1}), (-12.0, {4})])
def test_stop_head_decides_step_length(stop_bias, expected):
    model = hamburger("llama", k=4)
    with torch.no_grad():
        model.stop_head.net[-1].weight.zero_()
        model.stop_head.net[-1].bias.fill_(stop_bias)
    out = generate(model, PROMPTS, max_new_tokens=16, confidence=0.8, eos_token_ids=set())
    assert all(set(steps) == expected for steps in out.steps)


def test_generation_leaves_no_inference_mode_behind():
    model = hamburger("llama", k=4)
    for _ in stream(model, PROMPTS, max_new_tokens=6):
        assert not torch.is_inference_mode_enabled()


@pytest.mark.parametrize("slot_rank", [0, 4])
def test_teacher_forced_logits_equal_forced_step_generation(arch, slot_rank):
    """Training forward and step-by-step generation agree: same positions, same cache, same modules."""
    model = hamburger(arch, k=4, slot_adapter_rank=slot_rank)
    torch.nn.init.normal_(model.embedder.o_proj.weight, std=0.2)  # a merged slot is not mean pooling
    prompt, forced = PROMPTS[0], [2, 4, 1, 3, 3, 4, 2]
    out = generate(model, [prompt], max_new_tokens=19, forced_steps=[forced], return_logits=True,
                   eos_token_ids=set())
    assert out.steps[0] == [2, 4, 1, 3, 3, 4, 2]
    batch = collate([SegmentedExample(prompt + out.tokens[0], len(prompt), out.steps[0])], 4, PAD)
    with torch.no_grad():
        train = hamburger_loss(model, batch)
    assert train.logits.shape == out.logits[0].shape
    torch.testing.assert_close(train.logits, out.logits[0], atol=1e-4, rtol=1e-4)


def test_teacher_forced_consistency_is_sensitive_to_positions():
    """The check above must fail if a merged slot sits one position later (the reference code's bug)."""
    model = hamburger("llama", k=4)
    prompt = PROMPTS[0]
    out = generate(model, [prompt], max_new_tokens=12, forced_steps=[[3, 3, 3, 3]], return_logits=True)
    batch = collate([SegmentedExample(prompt + out.tokens[0], len(prompt), out.steps[0])], 4, PAD)
    batch.position_ids[0, len(prompt):] += 1
    with torch.no_grad():
        shifted = hamburger_loss(model, batch)
    assert not torch.allclose(shifted.logits, out.logits[0], atol=1e-4)


def test_batched_equals_unbatched(arch):
    model = hamburger(arch, k=4).double()
    single = [generate(model, [p], max_new_tokens=20, confidence=0.3) for p in PROMPTS]
    batched = generate(model, PROMPTS, max_new_tokens=20, confidence=0.3)
    for i, one in enumerate(single):
        assert batched.tokens[i] == one.tokens[0]
        assert batched.steps[i] == one.steps[0]
    assert any(max(s) > 1 for s in batched.steps)


def test_max_new_tokens_is_exact_and_stats_add_up():
    model = hamburger("llama", k=4)
    for limit in (1, 2, 5, 13):
        out = generate(model, PROMPTS, max_new_tokens=limit, confidence=0.05, eos_token_ids=set())
        assert [len(t) for t in out.tokens] == [limit] * len(PROMPTS)
        st = out.stats
        assert st.generated_tokens == limit * len(PROMPTS)
        assert st.macro_steps == sum(len(s) for s in out.steps)
        assert st.micro_steps == st.generated_tokens - st.macro_steps
        assert st.kv_entries == sum(map(len, PROMPTS)) + st.macro_steps
        assert st.base_forwards == max(len(s) for s in out.steps)  # prefill + one per later step
        assert all(sum(s) == len(t) for s, t in zip(out.steps, out.tokens))
        assert st.prefill_s > 0 and st.decode_s >= 0


def test_stops_right_after_eos():
    model = hamburger("llama", k=4)
    free = generate(model, [PROMPTS[1]], max_new_tokens=30, confidence=0.05, eos_token_ids=set())
    eos = free.tokens[0][5]  # pretend the sixth token is EOS
    out = generate(model, [PROMPTS[1]], max_new_tokens=30, confidence=0.05, eos_token_ids={eos})
    first = free.tokens[0].index(eos)
    assert out.tokens[0] == free.tokens[0][: first + 1]


def test_stream_yields_each_macro_step():
    model = hamburger("llama", k=4)
    gen = stream(model, PROMPTS, max_new_tokens=15, confidence=0.3)
    events = list(gen)
    out = gen.output()
    for b in range(len(PROMPTS)):
        pieces = [e.tokens[b] for e in events if e.tokens[b]]
        assert sum(pieces, []) == out.tokens[b]
        assert [len(p) for p in pieces] == out.steps[b]
    assert events[-1].finished == [True] * len(PROMPTS)


def test_forced_steps_are_followed_and_truncated():
    model = hamburger("llama", k=4)
    out = generate(model, [PROMPTS[0]], max_new_tokens=9, forced_steps=[[4, 1, 2, 4]], eos_token_ids=set())
    assert out.steps[0] == [4, 1, 2, 2]


def test_sampling_is_seeded_and_respects_top_k():
    model = hamburger("llama", k=4)
    params = SamplingParams(temperature=1.0, top_k=5, seed=123)
    a = generate(model, PROMPTS, max_new_tokens=16, sampling=params)
    b = generate(model, PROMPTS, max_new_tokens=16, sampling=params)
    assert a.tokens == b.tokens
    c = generate(model, PROMPTS, max_new_tokens=16, sampling=SamplingParams(temperature=1.0, top_k=5, seed=7))
    assert a.tokens != c.tokens
    top1 = generate(model, PROMPTS, max_new_tokens=16, sampling=SamplingParams(temperature=0.7, top_k=1, seed=1))
    greedy = generate(model, PROMPTS, max_new_tokens=16)
    assert top1.tokens == greedy.tokens


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[[]]), "at least one token"),
    (dict(prompts=[]), "at least one token"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(confidence=0.0), "confidence"),
    (dict(confidence=1.2), "confidence"),
    (dict(forced_steps=[[5]]), "forced_steps"),
])
def test_bad_input_is_a_clear_error(kwargs, match):
    model = hamburger("llama", k=4)
    args = dict(prompts=[[5, 6]], max_new_tokens=4) | kwargs
    with pytest.raises(HamburgerError, match=match):
        generate(model, args.pop("prompts"), **args)


def test_bad_sampling_params():
    for kwargs in (dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)):
        with pytest.raises(HamburgerError):
            SamplingParams(**kwargs)


def test_a_vanishing_temperature_is_greedy():
    """Logits divided by a temperature of 1e-40 overflow to infinities and the sampler fails: below 1e-5 is greedy
    (the server's fuzzing found it), with the same tokens as temperature 0."""
    model = hamburger("llama", k=4)
    assert SamplingParams(1e-40).greedy and not SamplingParams(1e-4).greedy
    kw = dict(max_new_tokens=6, eos_token_ids=set())
    assert (generate(model, [PROMPTS[0]], sampling=SamplingParams(1e-40), **kw).tokens
            == generate(model, [PROMPTS[0]], **kw).tokens)



def test_slot_adapters_act_on_merged_slots_only():
    """Zeroing the adapters changes logits after merged steps, and nothing before the first merge."""
    model = hamburger("llama", k=4, slot_adapter_rank=4)
    prompt, forced = PROMPTS[0], [1, 1, 3, 2, 4]
    kw = dict(max_new_tokens=11, forced_steps=[forced], return_logits=True, eos_token_ids=set())
    with_adapters = generate(model, [prompt], **kw)
    with torch.no_grad():
        for p in model.slot_adapters.up.parameters():
            p.zero_()
    without = generate(model, [prompt], forced_steps=[forced], max_new_tokens=11, return_logits=True,
                       eos_token_ids=set())
    a, b = with_adapters.logits[0], without.logits[0]
    n = min(len(a), len(b))
    first_after_merge = 1 + 1 + 3  # tokens up to and including the first merged step's last token
    torch.testing.assert_close(a[:first_after_merge], b[:first_after_merge])
    assert not torch.allclose(a[first_after_merge:n], b[first_after_merge:n], atol=1e-4)


def test_truncated_slot_adapters_keep_their_scale(tmp_path):
    from hamburger import HamburgerModel

    model = hamburger("llama", k=4, slot_adapter_rank=4)
    forced = dict(max_new_tokens=12, forced_steps=[[3, 2, 4, 3]], return_logits=True, eos_token_ids=set())
    before = generate(model, [PROMPTS[0]], **forced).logits[0]
    assert model.truncate_slot_adapters(4) < 1e-5  # full rank: the same adapters
    torch.testing.assert_close(generate(model, [PROMPTS[0]], **forced).logits[0], before, atol=1e-4, rtol=1e-4)
    error = model.truncate_slot_adapters(2)
    assert 0 < error < 1 and model.config.slot_adapter_rank == 2 and model.config.slot_adapter_alpha == 16.0
    cut = generate(model, [PROMPTS[0]], **forced).logits[0]
    model.save_pretrained(tmp_path / "cut")
    loaded = HamburgerModel.from_pretrained(tmp_path / "cut", base=model.base, tokenizer=model.tokenizer)
    torch.testing.assert_close(generate(loaded, [PROMPTS[0]], **forced).logits[0], cut)
