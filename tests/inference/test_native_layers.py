"""The decoder layers in one native call a pass (`inference/native_layers.py`): the module path's computation to
float32's rounding, each position of a pass exactly what a one-position step gives it (so verify mode is its base
exactly, 4-bit weights included), and used only where it applies (a hook or a replaced module sends a pass back to
the modules)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from conftest import hamburger, random_merger
from native_variant import every_variant, pytest_generate_tests, variant  # noqa: F401 - pytest finds them here
from hamburger.errors import HamburgerError
from hamburger.inference.core import MicroContext
from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache, RowSlots, layer_forward
from hamburger.inference.native_layers import (NATIVE_ROWS, NORMED, NativeLayers, RopeTable, layer_parts,
                                               rope_tables)
from hamburger.inference.merge import MergedMask
from hamburger.kernels import native
from hamburger.kernels import quantize
from hamburger.kernels.qlinear import Int8Linear
from hamburger.kernels.quantize import quantize_model
from hamburger.model.hamburger_model import HamburgerModel

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")


PROMPTS = [[5, 17, 33, 8, 60, 12, 9], [40, 41], [7, 90, 23, 23, 51]]


def packed(arch: str = "llama", scheme: str = "int4"):
    """A tiny model with packed base weights; "int4+a8": int4 with 8-bit inputs (`native.INT4_Q8`, --quantize +a8)."""
    model = hamburger(arch, k=4)
    quantize_model(model.base, scheme.removesuffix("+a8"))
    return inputs_in_8_bits(model, scheme.endswith("+a8"))


def inputs_in_8_bits(model, on: bool):
    """`--quantize ...+a8`'s switch: the 4-bit layers' native products take 8-bit inputs (fused groups' too)."""
    if on:
        assert quantize.inputs_in_8_bits(model) > 0
    return model


def random_cache(base, rows: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> KVCache:
    cache = KVCache.for_layers(base.layers, base.config, rows, 16, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    return cache


def module_pass(engine: Engine, x, rope, cache, start, mask, depth: int):
    """The reference: the model's own modules, one layer after another, over the same cache."""
    for i, layer in enumerate(engine.runner.base.layers[:depth]):
        x = layer_forward(layer, x, rope, cache, i, start, mask)
    return x


def first_layer_pairs(engine: Engine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Layer 0 module by module and natively on a random two-position pass at slots 3..4 over caches holding the
    same random earlier entries: [(modules, native)] for the output, the keys and the values."""
    base = engine.runner.base
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, base.config.hidden_size, generator=gen)
    mask = torch.ones(1, 1, 2, 5, dtype=torch.bool).tril(3)
    caches = [KVCache.for_layers(base.layers[:1], base.config, 1, 8, torch.float32, "cpu") for _ in range(2)]
    earlier = torch.randn(caches[0].k.shape, generator=gen)
    for cache in caches:
        cache.k.copy_(earlier)
        cache.v.copy_(earlier.flip(-1))
    with torch.inference_mode():
        rope = base.rotary_emb(x, torch.arange(3, 5)[None])
        slow = module_pass(engine, x, rope, caches[0], 3, mask, 1)
        quick = engine.runner.native(x.clone(), rope, caches[1], 3, mask, 0, 1)
    return [(slow, quick), (caches[0].k, caches[1].k), (caches[0].v, caches[1].v)]


def close(pairs, tolerance: float = 1e-3) -> bool:
    return all(bool((a - b).norm() <= tolerance * a.norm()) for a, b in pairs)


@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
@pytest.mark.parametrize("scheme", ["fp16", "int4", "int4+a8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_a_pass_is_the_module_paths_computation(arch, scheme, kv):
    """Over a float32 cache and over a float16 one (the default where the native layers run: both paths write the
    new keys and values rounded to float16 and read them back exactly)."""
    model = packed(arch, scheme)
    engine = Engine(model)
    assert engine.runner.native is not None
    base = engine.runner.base
    x = torch.randn(2, 3, base.config.hidden_size)
    mask = torch.ones(2, 1, 3, 8, dtype=torch.bool).tril(5)
    mask[1, ..., :2] = False  # the second row's first two slots are padding
    caches = [random_cache(base, 2, dtype=kv) for _ in range(2)]
    # float16: to float32's rounding; int4: its products quantize their inputs to int16 (`native.INT4_Q16`), a
    # last-bit difference in an input now and then rounding a code the other way
    # (+a8: 8-bit codes, where a code rounded the other way moves a product 258 times as far: one layer agrees to
    # 1e-3 (below), four layers of a tiny random model drift a few percent apart)
    depth, tolerance = len(base.layers), {"fp16": 1e-6, "int4": 1e-3}.get(scheme, 1e-1)
    if kv == torch.float16:  # a key or value a last bit apart in float32 can round to the next float16 (5e-4 of it)
        tolerance = max(tolerance, 2e-5)
    with torch.inference_mode():
        rope = base.rotary_emb(x, torch.arange(5, 8)[None].expand(2, -1))
        want = module_pass(engine, x, rope, caches[0], 5, mask, depth)
        got = engine.runner.native(x.clone(), rope, caches[1], 5, mask, 0, depth)
    assert (got - want).norm() <= tolerance * want.norm()
    assert (caches[0].k - caches[1].k).norm() <= tolerance * caches[0].k.norm()
    assert (caches[0].v - caches[1].v).norm() <= tolerance * caches[0].v.norm()
    if kv == torch.float16 and scheme == "fp16":  # keys and values to float32's rounding, then rounded as PyTorch
        for a, b in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):  # rounds them: all but a rare one
            assert (a != b).float().mean() < 0.01
    # A mutation that drops the last layer is far outside that
    with torch.inference_mode():
        short = engine.runner.native(x.clone(), rope, random_cache(base, 2, dtype=kv), 5, mask, 0, depth - 1)
    assert (short - want).norm() > min(10 * tolerance, 0.5) * want.norm()
    with torch.inference_mode():  # one layer, every scheme
        caches = [random_cache(base, 2, dtype=kv) for _ in range(2)]
        want = module_pass(engine, x, rope, caches[0], 5, mask, 1)
        got = engine.runner.native(x.clone(), rope, caches[1], 5, mask, 0, 1)
    assert (got - want).norm() <= 1e-3 * want.norm()


@every_variant
@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
@pytest.mark.parametrize("scheme", ["fp16", "int4", "int4+a8"])
def test_each_position_of_a_pass_is_what_a_one_position_step_gives_it_bit_for_bit(scheme, kv):
    model = packed("qwen2", scheme)  # q/k/v biases too
    engine = Engine(model)
    base, depth = engine.runner.base, len(engine.runner.base.layers)
    x = torch.randn(2, 4, base.config.hidden_size)
    slots = torch.tensor([[3, 4, 5, 6], [6, 7, 8, 9]])  # the rows at different lengths (verify mode's RowSlots)
    mask = torch.zeros(2, 1, 4, 12, dtype=torch.bool)
    for r in range(2):
        for t in range(4):
            mask[r, 0, t, : slots[r, t] + 1] = True
    mask[1, 0, :, :2] = False  # padding
    together, alone = random_cache(base, 2, dtype=kv), random_cache(base, 2, dtype=kv)
    with torch.inference_mode():
        rope = base.rotary_emb(x, slots)
        out = engine.runner.native(x.clone(), rope, together, RowSlots(slots, 10), mask[..., :10], 0, depth)
        for t in range(4):  # one position at a time, each against the whole cache's length
            one = (rope[0][:, t:t + 1], rope[1][:, t:t + 1])
            step = engine.runner.native(x[:, t:t + 1].clone(), one, alone, RowSlots(slots[:, t:t + 1], 12),
                                 mask[:, :, t:t + 1], 0, depth)
            assert torch.equal(step[:, 0], out[:, t]), t
    assert torch.equal(together.k, alone.k) and torch.equal(together.v, alone.v)


@every_variant
@pytest.mark.parametrize("scheme", ["fp16", "int4", "int4+a8"])
def test_verify_mode_is_its_base_exactly(scheme):
    model = packed("llama", scheme)
    engine, plain = Engine(model), Engine(HamburgerModel.plain(model.base, model.tokenizer))
    assert engine.runner.native is not None and plain.runner.native is not None
    assert engine.runner.kv_dtype == plain.runner.kv_dtype == torch.float16  # the default where the call runs
    kw = {"max_new_tokens": 24, "eos_token_ids": set()}
    assert engine.generate(PROMPTS, mode="verify", **kw).tokens == plain.generate(PROMPTS, **kw).tokens
    for prompt in PROMPTS:  # and batch 1
        assert engine.generate([prompt], mode="verify", **kw).tokens == plain.generate([prompt], **kw).tokens


def test_the_caches_are_float16_where_the_native_call_runs_and_float32_on_request():
    """The default cache holds float16 where the native layers run the passes (half the bytes a row takes, so a
    memory budget holds twice the rows), the model's dtype where they do not; `kv_dtype` "float32" keeps float32,
    and both decode verify mode to their own base exactly."""
    from hamburger.cli.serve import kv_bytes
    from hamburger.inference.rows import RowBatch, rows_in
    from hamburger.inference.stats import kv_bytes_per_entry

    model = packed("llama", "int4")
    half, full = Engine(model), Engine(model, kv_dtype="float32")
    assert half.runner.kv_dtype == torch.float16 and full.runner.kv_dtype == torch.float32
    assert Engine(model, native_layers=False).runner.kv_dtype == torch.float32  # the modules: the model's dtype
    assert Engine(hamburger("llama", k=4)).runner.kv_dtype == torch.float32  # float32 weights: no native call
    batch = RowBatch.for_model(half.runner, 2, 32)
    assert batch.cache.k.dtype == batch.micro_cache.k.dtype == torch.float16
    assert RowBatch.for_model(full.runner, 2, 32).cache.k.dtype == torch.float32
    assert rows_in(1 << 20, half.runner, 32) == 2 * rows_in(1 << 20, full.runner, 32)
    entry = kv_bytes_per_entry(model.base.config, torch.float16)  # `serve --kv-memory 1000entries`: the cache's dtype
    assert kv_bytes(model, (1000, "entries")) == 1000 * entry
    assert kv_bytes(model, (1000, "entries"), "float32") == 2000 * entry
    with pytest.raises(HamburgerError, match="KV cache dtype 'int8'"):
        Engine(model, kv_dtype="int8")
    plain = HamburgerModel.plain(model.base, model.tokenizer)
    kw = {"max_new_tokens": 24, "eos_token_ids": set()}
    for kv in ("float16", "float32"):
        want = Engine(plain, kv_dtype=kv).generate(PROMPTS, **kw).tokens
        assert Engine(model, kv_dtype=kv).generate(PROMPTS, mode="verify", **kw).tokens == want, kv


def test_used_for_steps_not_for_long_passes_nor_where_it_does_not_apply():
    model = packed("llama", "int4")
    engine = Engine(model)
    base = engine.runner.base
    cache = KVCache.for_layers(base.layers, base.config, 1, 200, torch.float32, "cpu")
    step = torch.zeros(1, 1, base.config.hidden_size)
    mask = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    assert engine.runner.native.takes(step, cache, 5, mask)
    long = torch.zeros(1, NATIVE_ROWS + 1, base.config.hidden_size)
    assert not engine.runner.native.takes(long, cache, 0, torch.ones(1, 1, NATIVE_ROWS + 1, NATIVE_ROWS + 1).bool())
    assert not engine.runner.native.takes(step, cache, 5, lambda i: mask)  # per-layer masks (compress mode's biases)
    assert not engine.runner.native.takes(step, cache, 5, mask.float())
    assert Engine(model, native_layers=False).runner.native is None
    assert Engine(hamburger("llama", k=4)).runner.native is None  # float weights: PyTorch's own
    with native.turned_off():
        assert Engine(packed("llama", "int4")).runner.native is None
    # weights replaced after the engine was made: not read through stale pointers
    qkv = engine.runner.native.parts[0].qkv
    qkv.tiles = qkv.tiles.clone()
    assert not engine.runner.native.usable() and not engine.runner.native.takes(step, cache, 5, mask)


def test_the_comparison_with_the_modules_catches_a_wrong_description():
    model = packed("llama", "fp16")
    engine = Engine(model)
    assert close(first_layer_pairs(engine))
    layer = engine.runner.native.layers[0]
    layer.norm1, layer.norm2 = layer.norm2, layer.norm1  # a mix-up of the two norms' weights
    torch.nn.init.normal_(engine.runner.base.layers[0].input_layernorm.weight)  # (they start equal: all ones)
    assert not close(first_layer_pairs(engine))
    assert ctypes.sizeof(engine.runner.native.layers[0]) == ctypes.sizeof(native.Layer)


def test_slots_outside_the_cache_are_refused_not_written():
    model = packed("llama", "fp16")
    engine = Engine(model)
    base = engine.runner.base
    cache = random_cache(base, 1)  # 16 slots
    before = cache.k.clone()
    x = torch.randn(1, 2, base.config.hidden_size)
    with torch.inference_mode():
        rope = base.rotary_emb(x, torch.tensor([[15, 16]]))
        with pytest.raises(IndexError, match="outside the cache"):
            engine.runner.native(x, rope, cache, 15, torch.ones(1, 1, 2, 17, dtype=torch.bool), 0, 1)
        with pytest.raises(IndexError, match="outside the cache"):
            engine.runner.native(x, rope, cache, RowSlots(torch.tensor([[3, 16]]), 17), torch.ones(1, 1, 2, 17).bool(), 0, 1)
    assert torch.equal(cache.k, before)


def micro_packed(arch: str, scheme: str):
    """A model whose micro-step decoder reads the base's entries (context gates open) with every layer quantized."""
    model = hamburger(arch, k=4, micro_context=4)
    quantize_model(model, scheme.removesuffix("+a8"))
    return inputs_in_8_bits(model, scheme.endswith("+a8"))


@pytest.mark.parametrize("scheme", ["fp16", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_micro_steps_in_one_native_call_are_the_module_path(arch, scheme):
    """The micro-step decoder's layers natively, their attention to the base's entries included: the module path's
    output and cache to the products' rounding, for rows at other positions, one that sees no base entry."""
    engine = Engine(micro_packed(arch, scheme))
    assert engine.runner.micro_native is not None and engine.runner.micro_native.gates is not None
    micro, config = engine.model.micro, engine.runner.base.config
    gen = torch.Generator().manual_seed(3)
    base_cache = random_cache(engine.runner.base, 2, seed=4)
    visible = torch.ones(2, 12, dtype=torch.bool)
    visible[0, :5] = False
    visible[1] = False  # sees no base entry: no context attention at all
    context = MicroContext(base_cache, visible, torch.tensor([11, 6]))
    tolerance = 1e-6 if scheme == "fp16" else 1e-3
    for start, t in ((0, 5), (5, 1), (6, 2)):
        x = torch.randn(2, t, config.hidden_size, generator=gen)
        caches = [KVCache.for_layers(micro.layers, config, 2, 8, torch.float32, "cpu") for _ in range(2)]
        with torch.inference_mode():
            quick = engine.runner._micro_native_pass(x, caches[0], start, context)
            slow = engine.runner._micro_layers(x, caches[1], start, context, native=False)
        for a, b in ((slow, quick), (caches[1].k, caches[0].k), (caches[1].v, caches[0].v)):
            assert (a - b).norm() <= tolerance * a.norm()


def micro_close(engine: Engine) -> bool:
    """The native micro pass against the module-by-module one on random inputs, caches and context (three new
    positions after two cached, some base entries hidden): output and cache within 1e-3 of their norm."""
    micro, config = engine.model.micro, engine.runner.base.config
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, config.hidden_size, generator=gen)
    caches = [KVCache.for_layers(micro.layers, config, 1, 8, torch.float32, "cpu") for _ in range(2)]
    base_cache = KVCache.for_layers(engine.runner.base.layers, config, 1, 8, torch.float32, "cpu")
    for t in (base_cache.k, base_cache.v, caches[0].k, caches[0].v):
        t.copy_(torch.randn(t.shape, generator=gen))
    caches[1].k.copy_(caches[0].k)
    caches[1].v.copy_(caches[0].v)
    visible = torch.tensor([[False, True, True, False, True, True, True, True]])
    context = MicroContext(base_cache, visible, torch.tensor([7])) if micro.context else None
    with torch.inference_mode():
        quick = engine.runner._micro_native_pass(x, caches[1], 2, context)
        slow = engine.runner._micro_layers(x, caches[0], 2, context, native=False)
    return quick is not None and close([(slow, quick), (caches[0].k, caches[1].k), (caches[0].v, caches[1].v)])


def test_the_micro_comparison_catches_a_wrong_gate_or_source():
    engine = Engine(micro_packed("llama", "int4"))
    good = engine.runner.micro_native
    assert micro_close(engine)
    sources = list(engine.model.micro.context_layers)
    for wrong in (NativeLayers(good.parts, -good.gates, sources), NativeLayers(good.parts, good.gates, sources[::-1]),
                  NativeLayers(good.parts, None, None)):
        engine.runner.micro_native = wrong
        assert not micro_close(engine)


@pytest.mark.parametrize("scheme", ["fp16", "int4", "int4+a8"])
def test_verify_mode_with_native_micro_steps_is_its_base_exactly(scheme):
    model = micro_packed("llama", scheme)
    engine = Engine(model, draft_policy=False, lookup=0, draft_rows=None)
    assert engine.runner.micro_native is not None
    base = Engine(HamburgerModel.plain(model.base, model.tokenizer))
    out = engine.generate(PROMPTS, max_new_tokens=24, mode="verify", confidence=0.05)
    assert out.stats.micro_steps > 0 and out.stats.drafted_tokens > 0
    assert out.tokens == base.generate(PROMPTS, max_new_tokens=24).tokens


@pytest.mark.parametrize("scheme", ["fp16", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compress_passes_run_natively_and_decode_as_the_module_path(arch, scheme):
    """Compress mode's check passes (their mask a function of the layer: the merger's bias on merged entries) in
    the native call: each pass to the products' rounding of the module path's (the bias's exact arithmetic is
    checked by a pass with large gates), and the same replies."""
    model = packed(arch, scheme)
    model.attach_merger(random_merger(model.base, channels=arch == "qwen2"))
    model.config.merge_window = 0  # every decided step merged at once
    native_engine = Engine(model, draft_rows=None, lookup=1)
    module_engine = Engine(model, draft_rows=None, lookup=1, native_layers=False)
    assert native_engine.runner.native is not None and module_engine.runner.native is None
    base = native_engine.runner.base
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
        quick = native_engine.runner.base_pass(x, positions, caches[0], 5, mask, last=False)
        slow = module_engine.runner.base_pass(x, positions, caches[1], 5, mask, last=False)
    tolerance = 1e-5 if scheme == "fp16" else 1e-3
    for a, b in [*zip(slow, quick), (caches[1].k, caches[0].k)]:
        assert (a - b).norm() <= tolerance * a.norm()
    kw = {"max_new_tokens": 32, "mode": "compress", "confidence": 0.2, "eos_token_ids": set()}
    ours, theirs = native_engine.generate(PROMPTS, **kw), module_engine.generate(PROMPTS, **kw)
    assert ours.stats.kv_entries < ours.stats.kv_entries_base  # steps were merged
    assert ours.tokens == theirs.tokens


def test_an_int8_heads_shortlist_of_any_length_keeps_the_heads_own_codes():
    """The micro-step shortlist's head: the int8 head's own rows, natively, however many (the last tile in part)."""
    model = hamburger("llama", k=4)
    quantize_model(model.base, "int4", head="int8")
    model.micro_vocab = torch.tensor([1, 7, 11, 20, 33, 50, 64, 80, 90])  # 9 rows
    engine = Engine(model)
    head = model.base.get_output_embeddings()
    assert isinstance(engine.runner._short, Int8Linear) and engine.runner._short.native and engine.runner._short.out_features == 9
    h = torch.randn(3, model.base.config.hidden_size)
    assert torch.equal(engine.runner.short_logits(h), head(h)[:, model.micro_vocab])


def test_not_used_where_the_native_call_does_not_take_the_layers():
    float_model = hamburger("llama", k=4)  # float layers: q/k/v are not fused
    assert layer_parts(float_model.base.model.layers, float_model.base.config) is None
    unfused = hamburger("llama", k=4)
    quantize_model(unfused.base, "int4", fuse=False)
    assert layer_parts(unfused.base.model.layers, unfused.base.config) is None and Engine(unfused).runner.native is None
    half = hamburger("llama", k=4)
    quantize_model(half.base, "int4")
    half.base.model.layers[-1].post_attention_layernorm.to(torch.bfloat16)  # not float32 (any layer's norm)
    assert Engine(half).runner.native is None


def test_a_hook_or_a_replaced_module_sends_the_pass_back_to_the_modules():
    model = packed("llama", "int4")
    engine = Engine(model, draft_policy=False)
    runs = [0]
    run = engine.runner.native.run

    def counted(*args, **kwargs):
        runs[0] += 1
        return run(*args, **kwargs)

    engine.runner.native.run = counted
    kw = {"max_new_tokens": 8, "mode": "verify", "eos_token_ids": set()}
    want = Engine(model, draft_policy=False, native_layers=False).generate(PROMPTS, **kw)
    seen = []
    handle = model.base.model.layers[2].mlp.down_proj.register_forward_hook(lambda m, a, out: seen.append(1))
    got = engine.generate(PROMPTS, **kw)
    assert runs[0] == 0 and seen  # the hooked module ran, through the module path
    assert got.tokens == want.tokens
    handle.remove()
    assert engine.generate(PROMPTS, **kw).tokens == want.tokens and runs[0] > 0
    mlp = model.base.model.layers[0].mlp
    mlp.down_proj = torch.nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
    runs[0] = 0
    engine.generate(PROMPTS, **kw)  # the next request's prefill looks again (`NativeLayers.recheck`)
    assert runs[0] == 0
    assert not engine.runner.native.usable()


@every_variant
@pytest.mark.parametrize("scheme", ["fp16", "int4"])
def test_the_final_norms_in_the_call_are_the_modules_norms(scheme):
    """The base's and the micro-step decoder's final norms, run at the end of the native call (`FinalNorm`): the
    modules' values to float32's rounding, at every position or each row's last; a mutation (another eps) is far
    outside that."""
    model = micro_packed("llama", scheme)
    runner = Engine(model).runner
    base, micro = runner.base, model.micro
    gen = torch.Generator().manual_seed(3)
    for norm in (base.norm, micro.norm):
        norm.weight.data.copy_(0.5 + torch.rand(norm.weight.shape, generator=gen))  # in place: the same tensor
    assert runner._norm.here() and runner._micro_norm.here()
    x = torch.randn(2, 3, base.config.hidden_size, generator=gen)
    mask = torch.ones(2, 1, 3, 8, dtype=torch.bool).tril(5)
    depth = len(base.layers)
    with torch.inference_mode():
        rope = base.rotary_emb(x, torch.arange(5, 8)[None].expand(2, -1))
        for last in (False, True):
            xs = runner.native.run(x.clone(), rope, random_cache(base, 2), 5, mask, [depth], norm=runner._norm,
                                   last=last)
            want = base.norm(xs[depth][:, -1] if last else xs[depth])
            torch.testing.assert_close(xs[NORMED], want, rtol=1e-5, atol=1e-6)
            assert not torch.equal(want, xs[depth][:, -1] if last else xs[depth])
        base.norm.variance_epsilon = 1e-1  # read at each call
        xs = runner.native.run(x.clone(), rope, random_cache(base, 2), 5, mask, [depth], norm=runner._norm, last=True)
        torch.testing.assert_close(xs[NORMED], base.norm(xs[depth][:, -1]), rtol=1e-5, atol=1e-6)
        base.norm.variance_epsilon = 1e-5
        assert (xs[NORMED] - base.norm(xs[depth][:, -1])).abs().max() > 1e-3
        # the micro-step decoder's pass, normed in its call and by its module
        h = torch.randn(2, 1, base.config.hidden_size, generator=gen)
        cache = KVCache.for_layers(micro.layers, base.config, 2, 8, torch.float32, "cpu")
        fused = runner._micro_layers(h, cache, 0, None)
        runner._micro_norm = None
        plain = runner._micro_layers(h, KVCache.for_layers(micro.layers, base.config, 2, 8, torch.float32, "cpu"), 0,
                                     None)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


@every_variant
@pytest.mark.parametrize("scheme", ["fp16", "int4"])
def test_the_heads_argmax_in_the_call_is_the_heads_own(scheme):
    """`base_pass(argmax=True)`: the head's greedy token of each final state from the layers' native call
    (`hb_pass.head`), the head's own call's (`head_argmax`) bit for bit, at every position or each row's last; with
    a hook on the head, from the head's own call (the hook sees it); a head without the final norm is refused."""
    model = packed("llama", scheme)
    runner = Engine(model).runner
    base, head = runner.base, model.base.get_output_embeddings()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, base.config.hidden_size, generator=gen)
    mask = torch.ones(2, 1, 3, 8, dtype=torch.bool).tril(5)
    calls = [0]
    direct = native.linear_argmax

    def counted(*args):
        calls[0] += 1
        return direct(*args)

    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "linear_argmax", counted)
        for last in (False, True):
            *states, tokens = runner.base_pass(x, torch.arange(5, 8)[None].expand(2, -1), random_cache(base, 2), 5,
                                               mask, last=last, argmax=True)
            assert calls[0] == 0 and tokens.shape == states[0].shape[:-1]
            assert torch.equal(tokens, runner.head_argmax(states[0])) and calls[0] == 1
            calls[0] = 0
        seen = []
        handle = head.register_forward_hook(lambda m, a, out: seen.append(out))
        *states, tokens = runner.base_pass(x, torch.arange(5, 8)[None].expand(2, -1), random_cache(base, 2), 5, mask,
                                           last=False, argmax=True)
        handle.remove()
        assert seen and torch.equal(tokens, seen[0].max(-1).indices)
        rope = base.rotary_emb(x, torch.arange(5, 8)[None].expand(2, -1))
        with pytest.raises(ValueError, match="final norm"):
            runner.native.run(x.clone(), rope, random_cache(base, 2), 5, mask, [len(base.layers)],
                              head=head.native_desc())


def test_a_hook_on_the_final_norm_runs_the_module_after_the_native_call():
    """A hook on the base's final norm, or the norm replaced, has the module norm the call's output (the layers stay
    native); the tokens do not change."""
    model = packed("llama", "int4")
    kw = {"max_new_tokens": 8, "mode": "verify", "eos_token_ids": set()}
    want = Engine(model, draft_policy=False).generate(PROMPTS, **kw)
    engine = Engine(model, draft_policy=False)
    seen, runs = [], [0]
    run = engine.runner.native.run

    def counted(*args, **kwargs):
        runs[0] += kwargs.get("norm") is None
        return run(*args, **kwargs)

    engine.runner.native.run = counted
    handle = model.base.model.norm.register_forward_hook(lambda m, a, out: seen.append(1))
    assert engine.generate(PROMPTS, **kw).tokens == want.tokens
    assert seen and runs[0] == len(seen)  # every native pass left the norm to the hooked module
    handle.remove()
    runs[0] = 0
    assert engine.generate(PROMPTS, **kw).tokens == want.tokens and runs[0] == 0
    old = model.base.model.norm
    model.base.model.norm = type(old)(old.weight.shape[0], old.variance_epsilon)
    model.base.model.norm.weight.data.copy_(old.weight)
    assert engine.generate(PROMPTS, **kw).tokens == want.tokens and runs[0] > 0


def test_the_rotary_tables_are_the_embeddings_own_values_at_every_position():
    """`RopeTable` reads rows of tables made once (and made again, longer, past their end): the rotary embedding's
    own values at those positions, as the native call takes them."""
    rotary = packed().base.base_model.rotary_emb
    table = RopeTable(rotary)
    for positions in (torch.tensor([[3]]), torch.tensor([[0, 1, 2], [700, 701, 702]]), torch.tensor([[2000], [5]])):
        cos, sin = table(positions)
        want = [t.reshape(cos.shape) for t in rope_tables(rotary(torch.empty(0), positions))]
        torch.testing.assert_close(cos, want[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, want[1], rtol=0, atol=1e-6)
    assert table.cos.shape[0] >= 2001
    for first, count in ((0, 1), (699, 4), (4094, 3)):  # a row's consecutive positions as a range: the same rows
        by_range = table(range(first, first + count))
        by_index = table(torch.arange(first, first + count)[None])
        assert all(torch.equal(a, b) and a.is_contiguous() for a, b in zip(by_range, by_index))
    rotary.rope_type = "dynamic"  # rescaled by the longest position of a call: computed per pass instead
    dynamic = RopeTable(rotary)
    positions = torch.tensor([[7, 8]])
    cos, sin = dynamic(positions)
    want = [t.reshape(cos.shape) for t in rope_tables(rotary(torch.empty(0), positions))]
    assert not dynamic.static and dynamic.cos is None and torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    assert all(torch.equal(a, b) for a, b in zip(dynamic(range(7, 9)), (cos, sin)))
