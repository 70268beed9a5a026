"""The fast engine: greedy output equals the reference path (HAMburger) and HF `generate` (plain base)."""

from __future__ import annotations

import pytest
import torch

from conftest import PAD, hamburger
from hamburger import HamburgerError, HamburgerModel, SamplingParams, generate
from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache

PROMPTS = [[5, 17, 33, 8, 60, 12, 9], [40, 41], [7, 90, 23, 23, 51]]


def reference(model, prompts, **kw):
    return generate(model, prompts, **kw)


@pytest.mark.parametrize("slot_rank", [0, 4])
def test_engine_equals_reference_path(arch, slot_rank):
    model = hamburger(arch, k=4, slot_adapter_rank=slot_rank)
    torch.nn.init.normal_(model.embedder.o_proj.weight, std=0.2)
    engine = Engine(model)
    for confidence in (0.3, 0.8, 1.0):
        ref = reference(model, PROMPTS, max_new_tokens=20, confidence=confidence)
        fast = engine.generate(PROMPTS, max_new_tokens=20, confidence=confidence)
        assert fast.tokens == ref.tokens and fast.steps == ref.steps
        assert fast.stats.macro_steps == ref.stats.macro_steps
        assert fast.stats.generated_tokens == ref.stats.generated_tokens


def test_engine_multi_token_steps_happen():
    model = hamburger("llama", k=4)
    out = Engine(model).generate([PROMPTS[0]], max_new_tokens=24, confidence=0.05)
    assert max(out.steps[0]) > 1 and out.stats.tokens_per_step > 1.0


def test_plain_base_in_engine_equals_hf_generate(arch):
    model = HamburgerModel.plain(hamburger(arch).base, None)
    engine = Engine(model)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        hf = model.base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                 eos_token_id=1, pad_token_id=PAD)[0, len(prompt):].tolist()
        out = engine.generate([prompt], max_new_tokens=20)
        assert out.tokens[0] == hf and set(out.steps[0]) == {1}


def test_engine_batched_equals_unbatched(arch):
    model = hamburger(arch, k=4)
    engine = Engine(model)
    together = engine.generate(PROMPTS, max_new_tokens=16, confidence=0.4)
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], max_new_tokens=16, confidence=0.4)
        assert alone.tokens[0] == together.tokens[i] and alone.steps[0] == together.steps[i]


def test_engine_forced_steps_and_limits():
    model = hamburger("llama", k=4)
    engine = Engine(model)
    forced = [[2, 4, 1, 3], [1, 1, 4]]
    ref = reference(model, PROMPTS[:2], max_new_tokens=9, forced_steps=forced, eos_token_ids=set())
    fast = engine.generate(PROMPTS[:2], max_new_tokens=9, forced_steps=forced, eos_token_ids=set())
    assert fast.tokens == ref.tokens and fast.steps == ref.steps
    assert fast.steps[0][:3] == [2, 4, 1] and all(len(t) == 9 for t in fast.tokens)


def test_tokens_per_forward_is_per_sequence_at_any_batch_size():
    # Rows that end at different steps: a batch pass counts once for each row still generating, so the figure
    # is each sequence's tokens per base forward (here = tokens per step), not the batch's.
    model = hamburger("llama", k=4)
    forced = [[2, 4, 1, 3], [1, 1, 4]]
    for out in (reference(model, PROMPTS[:2], max_new_tokens=9, forced_steps=forced, eos_token_ids=set()),
                Engine(model).generate(PROMPTS[:2], max_new_tokens=9, forced_steps=forced, eos_token_ids=set())):
        assert len(out.steps[0]) != len(out.steps[1])
        assert out.stats.base_forwards == max(map(len, out.steps))
        assert out.stats.row_forwards == sum(map(len, out.steps))
        assert out.stats.tokens_per_forward == pytest.approx(out.stats.tokens_per_step)


def test_engine_streams_and_counts():
    model = hamburger("llama", k=4)
    gen = Engine(model).stream(PROMPTS, max_new_tokens=10, confidence=0.3)
    events = list(gen)
    out = gen.output()
    for b in range(len(PROMPTS)):
        assert [t for e in events for t in e.tokens[b]] == out.tokens[b]
    assert events[-1].finished == [True] * len(PROMPTS)
    s = out.stats
    assert s.generated_tokens == sum(map(len, out.tokens)) and s.macro_steps == sum(map(len, out.steps))
    assert s.prefill_s > 0 and s.decode_s > 0


def test_engine_sampling_is_seeded():
    model = hamburger("llama", k=4)
    engine = Engine(model)
    params = SamplingParams(temperature=1.0, top_k=20, seed=3)
    a = engine.generate(PROMPTS, max_new_tokens=12, sampling=params)
    b = engine.generate(PROMPTS, max_new_tokens=12, sampling=params)
    greedy = engine.generate(PROMPTS, max_new_tokens=12)
    assert a.tokens == b.tokens and a.tokens != greedy.tokens


def test_engine_bad_input():
    engine = Engine(hamburger("llama", k=4))
    with pytest.raises(HamburgerError, match="at least one token"):
        engine.stream([[]])
    with pytest.raises(HamburgerError, match="context"):
        engine.generate([[5] * 200], max_new_tokens=100)
    with pytest.raises(HamburgerError, match="confidence"):
        engine.stream([[5]], confidence=0.0)


def test_shortlist_of_the_whole_vocabulary_changes_nothing():
    model = hamburger("llama", k=4)
    ref = Engine(model).generate(PROMPTS, max_new_tokens=16, confidence=0.3)
    model.micro_vocab = torch.arange(model.base.config.vocab_size)
    fast = Engine(model).generate(PROMPTS, max_new_tokens=16, confidence=0.3)
    assert fast.tokens == ref.tokens and fast.steps == ref.steps


def test_micro_steps_choose_from_the_shortlist_only():
    model = hamburger("llama", k=4)
    model.micro_vocab = torch.tensor([1, 7, 11, 20, 33, 50, 64, 80])
    out = Engine(model).generate(PROMPTS, max_new_tokens=24, confidence=0.05)
    micro = [t for toks, steps in zip(out.tokens, out.steps) for t in _micro_tokens(toks, steps)]
    assert micro and set(micro) <= set(model.micro_vocab.tolist())
    full = Engine(model, shortlist=False).generate(PROMPTS, max_new_tokens=24, confidence=0.05)
    assert not set(t for toks, steps in zip(full.tokens, full.steps) for t in _micro_tokens(toks, steps)) <= set(
        model.micro_vocab.tolist())


def _micro_tokens(tokens, steps):
    out, i = [], 0
    for n in steps:
        out += tokens[i + 1:i + n]
        i += n
    return out


def _hooked(model) -> int:
    """Forward hooks on the base's linear layers (transformers may hook its decoder layers for its own outputs)."""
    return sum(len(m._forward_hooks) for m in model.base.modules() if isinstance(m, torch.nn.Linear))


def _adapted_passes(model, embeds, merged):
    """The base's final state and features over `embeds` (B, T, d) with the slot adapters at `merged`: by the
    engine (adapters inline, no gradients) and by the transformers path with gradients (hooks, one module each)."""
    b, t, _ = embeds.shape
    engine = Engine(model)
    cache = KVCache.for_layers(engine.runner.base.layers, model.base.config, b, t, torch.float32, "cpu")
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    pos = torch.arange(t).expand(b, -1)
    with torch.no_grad():
        fast = engine.runner.base_pass(embeds, pos, cache, 0, causal, merged, last=False)
    with torch.enable_grad():
        hidden = model.base_forward(embeds, torch.ones(b, t, dtype=torch.long), pos, merged=merged)
    return fast, [hidden[-1].detach()] + [hidden[i].detach() for i in model.micro.feature_layers]


@pytest.mark.parametrize("pattern", ["every", "some"])
def test_engine_slot_adapters_equal_the_training_path(arch, pattern):
    """The engine applies the slot adapters inline (sibling adapters share one down GEMM, the scale folded into the
    up weights); training hooks one module per adapter. Same states at every layer the model reads, where every
    position is merged (batch-1 decoding) and where some are; no hook stays on the base after either pass."""
    model = hamburger(arch, k=4, slot_adapter_rank=4)
    for p in model.slot_adapters.up.parameters():
        torch.nn.init.normal_(p, std=0.3)
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(2, 6, model.base.config.hidden_size, generator=g)
    merged = torch.ones(2, 6, dtype=torch.bool) if pattern == "every" else torch.rand(2, 6, generator=g) > 0.5
    fast, slow = _adapted_passes(model, embeds, merged)
    plain, _ = _adapted_passes(model, embeds, None)
    assert _hooked(model) == 0
    for a, b in zip(fast, slow):  # float32 rounding relative to the states' scale (the residual stream reaches ~300)
        torch.testing.assert_close(a, b, atol=1e-4 * a.abs().max().item(), rtol=1e-5)
    assert not torch.allclose(fast[0], plain[0], atol=1e-3)  # the adapters did act


def test_engine_slot_adapters_use_no_hooks(monkeypatch):
    """The engine's smashed passes apply the adapters in its own layer code, never through the hooks."""
    model = hamburger("llama", k=4, slot_adapter_rank=4)

    def refuse(merged):
        raise AssertionError("the engine installed the slot adapters' hooks")

    monkeypatch.setattr(model.slot_adapters, "gated", refuse)
    out = Engine(model).generate(PROMPTS, max_new_tokens=12, confidence=0.3)
    assert max(max(s) for s in out.steps) > 1  # smashed steps ran


def test_engine_slot_adapters_follow_weight_changes():
    """A state dict loaded (in place, or assigning new parameters), or a move to another dtype, after a pass: the
    engine's next pass reads the new weights, not the inline copies made before."""
    model = hamburger("llama", k=4, slot_adapter_rank=4)
    embeds = torch.randn(1, 3, model.base.config.hidden_size, generator=torch.Generator().manual_seed(0))
    merged = torch.ones(1, 3, dtype=torch.bool)
    before = _adapted_passes(model, embeds, merged)[0][0]
    state = {k: torch.randn_like(v) for k, v in model.slot_adapters.state_dict().items()}
    for loaded, assign in ((state, False), ({k: v * 2 for k, v in state.items()}, True)):
        model.slot_adapters.load_state_dict(loaded, assign=assign)
        fast, slow = _adapted_passes(model, embeds, merged)
        assert not torch.allclose(before, fast[0], atol=1e-3)
        torch.testing.assert_close(fast[0], slow[0], atol=1e-4 * slow[0].abs().max().item(), rtol=1e-5)
        before = fast[0]
    model.to(torch.float64)
    with torch.no_grad():
        wide = model.slot_adapters.inline(merged)[0].groups[("q_proj", "k_proj", "v_proj")][0]
    assert wide.dtype == torch.float64


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_a_prefill_is_causal_attention_as_the_mask_writes_it(kv):
    """A prompt's prefill hands SDPA `is_causal` (`layers.CAUSAL`, which skips the masked half) instead of the
    written-out mask: the same states and cache entries, module by module, over either cache; a causal pass whose
    keys are not its queries is refused."""
    from hamburger.model.layers import CAUSAL, attention

    model = hamburger("llama", k=4)
    runner = Engine(model, native_layers=False, kv_dtype=kv).runner
    prompts = [[(7 * i) % 90 + 3 for i in range(40)], [(5 * i) % 80 + 3 for i in range(23)]]
    width = max(map(len, prompts))
    ids = torch.zeros(2, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    positions = torch.arange(width)[None].expand(2, -1)
    caches = [KVCache.for_layers(runner.base.layers, runner.base.config, 2, width, runner.kv_dtype, "cpu")
              for _ in range(2)]
    with torch.inference_mode():
        quick = runner.base_pass(model.embed(ids), positions, caches[0], 0, CAUSAL, last=False)
        slow = runner.base_pass(model.embed(ids), positions, caches[1], 0, CAUSAL.tensor(width, "cpu"), last=False)
    for a, b in zip(quick, slow, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert torch.allclose(caches[0].k.float(), caches[1].k.float(), atol=1e-3)
    with pytest.raises(ValueError, match="causal pass of 3 queries over 5 keys"):
        attention(runner.base.layers[0], torch.zeros(1, 4, 3, 16), torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16),
                  CAUSAL)
