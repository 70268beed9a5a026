"""The base's decoder layers in one native call a pass (`inference/native_layers.py`): the fast layers' computation
to float32's rounding, each position of a pass exactly what a one-position step gives it (so verify mode is its
base exactly, 4-bit weights included), and used only where it applies."""

from __future__ import annotations

import ctypes

import pytest
import torch

from conftest import hamburger, random_merger
from native_variant import every_variant, pytest_generate_tests, variant  # noqa: F401 - pytest finds them here
from hamburger.inference.core import MicroContext
from hamburger.inference.engine import Engine
from hamburger.inference.fast_layer import rope_tables
from hamburger.inference.kv import KVCache, RowSlots
from hamburger.inference.native_layers import NATIVE_ROWS, NativeLayers, _close_to
from hamburger.inference.merge import MergedMask
from hamburger.kernels import native
from hamburger.kernels.qlinear import Int8Linear
from hamburger.kernels.quantize import quantize_model
from hamburger.model.hamburger_model import HamburgerModel

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")


PROMPTS = [[5, 17, 33, 8, 60, 12, 9], [40, 41], [7, 90, 23, 23, 51]]


def packed(arch: str = "llama", scheme: str = "int4"):
    model = hamburger(arch, k=4)
    quantize_model(model.base, scheme)
    return model


def random_cache(base, rows: int, seed: int = 0) -> KVCache:
    cache = KVCache.for_layers(base.layers, base.config, rows, 16, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    return cache


def fast_pass(engine: Engine, x, rope, cache, start, mask, depth: int):
    tables = rope_tables(rope)
    for i, layer in enumerate(engine.fast[:depth]):
        x = layer(x, *tables, cache, i, start, mask)
    return x


@pytest.mark.parametrize("scheme", ["fp16", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_a_pass_is_the_fast_layers_computation(arch, scheme):
    model = packed(arch, scheme)
    engine = Engine(model)
    assert engine.native is not None
    base = engine.base
    x = torch.randn(2, 3, base.config.hidden_size)
    mask = torch.ones(2, 1, 3, 8, dtype=torch.bool).tril(5)
    mask[1, ..., :2] = False  # the second row's first two slots are padding
    caches = [random_cache(base, 2) for _ in range(2)]
    # float16: to float32's rounding; int4: its products quantize their inputs to int16 (`native.INT4_Q16`), a
    # last-bit difference in an input now and then rounding a code the other way
    depth, tolerance = len(base.layers), (1e-6 if scheme == "fp16" else 1e-3)
    with torch.inference_mode():
        rope = base.rotary_emb(x, torch.arange(5, 8)[None].expand(2, -1))
        want = fast_pass(engine, x, rope, caches[0], 5, mask, depth)
        got = engine.native(x.clone(), rope, caches[1], 5, mask, 0, depth)
    assert (got - want).norm() <= tolerance * want.norm()
    assert (caches[0].k - caches[1].k).norm() <= tolerance * caches[0].k.norm()
    assert (caches[0].v - caches[1].v).norm() <= tolerance * caches[0].v.norm()
    # A mutation that drops the last layer is far outside that
    with torch.inference_mode():
        short = engine.native(x.clone(), rope, random_cache(base, 2), 5, mask, 0, depth - 1)
    assert (short - want).norm() > 10 * tolerance * want.norm()


@every_variant
@pytest.mark.parametrize("scheme", ["fp16", "int4"])
def test_each_position_of_a_pass_is_what_a_one_position_step_gives_it_bit_for_bit(scheme):
    model = packed("qwen2", scheme)  # q/k/v biases too
    engine = Engine(model)
    base, depth = engine.base, len(engine.base.layers)
    x = torch.randn(2, 4, base.config.hidden_size)
    slots = torch.tensor([[3, 4, 5, 6], [6, 7, 8, 9]])  # the rows at different lengths (verify mode's RowSlots)
    mask = torch.zeros(2, 1, 4, 12, dtype=torch.bool)
    for r in range(2):
        for t in range(4):
            mask[r, 0, t, : slots[r, t] + 1] = True
    mask[1, 0, :, :2] = False  # padding
    together, alone = random_cache(base, 2), random_cache(base, 2)
    with torch.inference_mode():
        rope = base.rotary_emb(x, slots)
        out = engine.native(x.clone(), rope, together, RowSlots(slots, 10), mask[..., :10], 0, depth)
        for t in range(4):  # one position at a time, each against the whole cache's length
            one = (rope[0][:, t:t + 1], rope[1][:, t:t + 1])
            step = engine.native(x[:, t:t + 1].clone(), one, alone, RowSlots(slots[:, t:t + 1], 12),
                                 mask[:, :, t:t + 1], 0, depth)
            assert torch.equal(step[:, 0], out[:, t]), t
    assert torch.equal(together.k, alone.k) and torch.equal(together.v, alone.v)


@every_variant
@pytest.mark.parametrize("scheme", ["fp16", "int4"])
def test_verify_mode_is_its_base_exactly(scheme):
    model = packed("llama", scheme)
    engine, plain = Engine(model), Engine(HamburgerModel.plain(model.base, model.tokenizer))
    assert engine.native is not None and plain.native is not None
    kw = {"max_new_tokens": 24, "eos_token_ids": set()}
    assert engine.generate(PROMPTS, mode="verify", **kw).tokens == plain.generate(PROMPTS, **kw).tokens
    for prompt in PROMPTS:  # and batch 1
        assert engine.generate([prompt], mode="verify", **kw).tokens == plain.generate([prompt], **kw).tokens


def test_used_for_steps_not_for_long_passes_nor_where_it_does_not_apply():
    model = packed("llama", "int4")
    engine = Engine(model)
    base = engine.base
    cache = KVCache.for_layers(base.layers, base.config, 1, 200, torch.float32, "cpu")
    step = torch.zeros(1, 1, base.config.hidden_size)
    mask = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    assert engine.native.takes(step, cache, 5, mask)
    long = torch.zeros(1, NATIVE_ROWS + 1, base.config.hidden_size)
    assert not engine.native.takes(long, cache, 0, torch.ones(1, 1, NATIVE_ROWS + 1, NATIVE_ROWS + 1).bool())
    assert not engine.native.takes(step, cache, 5, lambda i: mask)  # per-layer masks (compress mode's biases)
    assert not engine.native.takes(step, cache, 5, mask.float())
    assert Engine(model, native_layers=False).native is None and Engine(model, fast_layers=False).native is None
    assert Engine(hamburger("llama", k=4)).native is None  # float weights: PyTorch's own
    with native.turned_off():
        assert Engine(packed("llama", "int4")).native is None
    # weights replaced after the engine was made: not read through stale pointers
    qkv = engine.fast[0].qkv
    qkv.tiles = qkv.tiles.clone()
    assert not engine.native.usable() and not engine.native.takes(step, cache, 5, mask)


def test_the_first_layer_check_catches_a_wrong_description():
    model = packed("llama", "fp16")
    engine = Engine(model)
    assert _close_to(engine.native, engine.base)
    layer = engine.native.layers[0]
    layer.norm1, layer.norm2 = layer.norm2, layer.norm1  # a mix-up of the two norms' weights
    torch.nn.init.normal_(engine.base.layers[0].input_layernorm.weight)  # (they start equal: all ones)
    assert not _close_to(engine.native, engine.base)
    assert ctypes.sizeof(engine.native.layers[0]) == ctypes.sizeof(native.Layer)


def test_slots_outside_the_cache_are_refused_not_written():
    model = packed("llama", "fp16")
    engine = Engine(model)
    base = engine.base
    cache = random_cache(base, 1)  # 16 slots
    before = cache.k.clone()
    x = torch.randn(1, 2, base.config.hidden_size)
    with torch.inference_mode():
        rope = base.rotary_emb(x, torch.tensor([[15, 16]]))
        with pytest.raises(IndexError, match="outside the cache"):
            engine.native(x, rope, cache, 15, torch.ones(1, 1, 2, 17, dtype=torch.bool), 0, 1)
        with pytest.raises(IndexError, match="outside the cache"):
            engine.native(x, rope, cache, RowSlots(torch.tensor([[3, 16]]), 17), torch.ones(1, 1, 2, 17).bool(), 0, 1)
    assert torch.equal(cache.k, before)


def micro_packed(arch: str, scheme: str):
    """A model whose micro-step decoder reads the base's entries (context gates open) with every layer quantized."""
    model = hamburger(arch, k=4, micro_context=4)
    quantize_model(model, scheme)
    return model


@pytest.mark.parametrize("scheme", ["fp16", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_micro_steps_in_one_native_call_are_the_module_path(arch, scheme):
    """The micro-step decoder's layers natively, their attention to the base's entries included: the module path's
    output and cache to the products' rounding, for rows at other positions, one that sees no base entry."""
    engine = Engine(micro_packed(arch, scheme))
    assert engine.micro_native is not None and engine.micro_native.gates is not None
    micro, config = engine.model.micro, engine.base.config
    gen = torch.Generator().manual_seed(3)
    base_cache = random_cache(engine.base, 2, seed=4)
    visible = torch.ones(2, 12, dtype=torch.bool)
    visible[0, :5] = False
    visible[1] = False  # sees no base entry: no context attention at all
    context = MicroContext(base_cache, visible, torch.tensor([11, 6]))
    tolerance = 1e-6 if scheme == "fp16" else 1e-3
    for start, t in ((0, 5), (5, 1), (6, 2)):
        x = torch.randn(2, t, config.hidden_size, generator=gen)
        caches = [KVCache.for_layers(micro.layers, config, 2, 8, torch.float32, "cpu") for _ in range(2)]
        with torch.inference_mode():
            quick = engine._micro_native_pass(x, caches[0], start, context)
            slow = engine._micro_layers(x, caches[1], start, context, native=False)
        for a, b in ((slow, quick), (caches[1].k, caches[0].k), (caches[1].v, caches[0].v)):
            assert (a - b).norm() <= tolerance * a.norm()


def test_the_micro_check_catches_a_wrong_gate_or_source():
    engine = Engine(micro_packed("llama", "int4"))
    good = engine.micro_native
    assert engine._micro_native_close()
    sources = list(engine.model.micro.context_layers)
    for wrong in (NativeLayers(good.fast, -good.gates, sources), NativeLayers(good.fast, good.gates, sources[::-1]),
                  NativeLayers(good.fast, None, None)):
        engine.micro_native = wrong
        assert not engine._micro_native_close()


@pytest.mark.parametrize("scheme", ["fp16", "int4"])
def test_verify_mode_with_native_micro_steps_is_its_base_exactly(scheme):
    model = micro_packed("llama", scheme)
    engine = Engine(model, draft_policy=False, lookup=0, draft_rows=None)
    assert engine.micro_native is not None
    base = Engine(HamburgerModel.plain(model.base, model.tokenizer))
    out = engine.generate(PROMPTS, max_new_tokens=24, mode="verify", confidence=0.05)
    assert out.stats.micro_steps > 0 and out.stats.drafted_tokens > 0
    assert out.tokens == base.generate(PROMPTS, max_new_tokens=24).tokens


@pytest.mark.parametrize("scheme", ["fp16", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compress_passes_run_natively_and_decode_as_the_fast_layers(arch, scheme):
    """Compress mode's check passes (their mask a function of the layer: the merger's bias on merged entries) in
    the native call: each pass to the products' rounding of the fast layers' (the bias's exact arithmetic is
    checked by a pass with large gates), and the same replies."""
    model = packed(arch, scheme)
    model.attach_merger(random_merger(model.base, channels=arch == "qwen2"))
    model.config.merge_window = 0  # every decided step merged at once
    native_engine = Engine(model, draft_rows=None, lookup=1)
    fast_engine = Engine(model, draft_rows=None, lookup=1, native_layers=False)
    assert native_engine.native is not None and fast_engine.native is None
    base = native_engine.base
    merged_len = torch.tensor([[0, 3, 1, 0, 2, 0, 0, 0], [2, 0, 0, 4, 0, 0, 0, 0]])
    visible = torch.ones(2, 1, 3, 8, dtype=torch.bool).tril(5)
    visible[1, ..., :2] = False
    with torch.no_grad():
        model.merger.c.mul_(0).add_(3.0)  # a bias large enough that a wrong one shows
        mask = MergedMask(model.merger, visible, merged_len, torch.float32)
    x = torch.randn(2, 3, base.config.hidden_size)
    positions = torch.arange(5, 8)[None].expand(2, -1)
    caches = [random_cache(base, 2, seed=5) for _ in range(2)]
    with torch.inference_mode():
        quick = native_engine.base_pass(x, positions, caches[0], 5, mask, last=False)
        slow = fast_engine.base_pass(x, positions, caches[1], 5, mask, last=False)
    tolerance = 1e-5 if scheme == "fp16" else 1e-3
    for a, b in [*zip(slow, quick), (caches[1].k, caches[0].k)]:
        assert (a - b).norm() <= tolerance * a.norm()
    kw = {"max_new_tokens": 32, "mode": "compress", "confidence": 0.2, "eos_token_ids": set()}
    ours, theirs = native_engine.generate(PROMPTS, **kw), fast_engine.generate(PROMPTS, **kw)
    assert ours.stats.kv_entries < ours.stats.kv_entries_base  # steps were merged
    assert ours.tokens == theirs.tokens


def test_an_int8_heads_shortlist_of_any_length_keeps_the_heads_own_codes():
    """The micro-step shortlist's head: the int8 head's own rows, natively, however many (the last tile in part)."""
    model = hamburger("llama", k=4)
    quantize_model(model.base, "int4", head="int8")
    model.micro_vocab = torch.tensor([1, 7, 11, 20, 33, 50, 64, 80, 90])  # 9 rows
    engine = Engine(model)
    head = model.base.get_output_embeddings()
    assert isinstance(engine._short, Int8Linear) and engine._short.native and engine._short.out_features == 9
    h = torch.randn(3, model.base.config.hidden_size)
    assert torch.equal(engine.short_logits(h), head(h)[:, model.micro_vocab])
