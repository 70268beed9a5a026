"""`Engine(compile=True)`: the operators that keep a compiled pass whole (compiled_ops.py), and compiled decoding
equal to eager decoding in every mode, with fp16-packed weights and slot adapters, without a graph break."""

from __future__ import annotations

import gc
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import hamburger
from hamburger.inference import compiled_ops
from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache, RowSlots, SlotWrites
from hamburger.inference.qlinear import Fp16Linear, fp16_unavailable
from hamburger.inference.quantize import quantize_model

needs_fbgemm = pytest.mark.skipif(fp16_unavailable("cpu") is not None, reason=str(fp16_unavailable("cpu")))
needs_compiler = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                    reason="torch.compile needs a C++ compiler on a CPU")


def _cache(seed: int) -> KVCache:
    cache = KVCache(3, 2, 2, 10, 4, torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    return cache


def test_kv_operators_write_what_the_cache_writes():
    k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    ref, mine = _cache(0), _cache(0)
    ref.update(1, 4, k, v)
    compiled_ops.kv_write(mine.k, mine.v, 1, 4, k, v)
    assert torch.equal(ref.k, mine.k) and torch.equal(ref.v, mine.v)

    slots = torch.tensor([[2, 3, 4], [6, 7, 8]])
    ref, mine = _cache(1), _cache(1)
    ref.update(2, RowSlots(slots, 9), k, v)
    compiled_ops.kv_scatter(mine.k, mine.v, 2, slots, k, v)
    assert torch.equal(ref.k, mine.k) and torch.equal(ref.v, mine.v)

    one_k, one_v = k[:, :, :1], v[:, :, :1]  # the scheduler's rows: one entry each at its own slot
    ref, mine = _cache(2), _cache(2)
    SlotWrites(ref, torch.tensor([5, 1])).update(0, 0, one_k, one_v)
    compiled_ops.kv_scatter(mine.k, mine.v, 0, torch.tensor([[5], [1]]), one_k, one_v)
    assert torch.equal(ref.k, mine.k) and torch.equal(ref.v, mine.v)


@needs_fbgemm
def test_fp16_operator_reads_the_packed_weights_by_key():
    layer = Fp16Linear(torch.randn(6, 8), torch.randn(6))
    x = torch.randn(2, 3, 8)
    assert torch.equal(compiled_ops.fp16_linear(x, layer.key), layer(x))
    assert compiled_ops.fp16_linear(torch.empty(5, 8, device="meta"), layer.key).shape == (5, 6)
    key = layer.key
    del layer
    gc.collect()
    assert key not in compiled_ops._packed  # the registry does not keep dropped weights alive


@needs_fbgemm
@needs_compiler
def test_compiled_engine_equals_eager_in_every_mode():
    """fp16 weights (the packed GEMM by key), slot adapters (hooked smashed passes), verify mode's multi-position
    passes at each row's own slots: the same tokens as eager, and the compiler never broke a graph or gave up."""
    def build():
        model = hamburger("llama", k=4, slot_adapter_rank=4)
        torch.nn.init.normal_(model.embedder.o_proj.weight, std=0.2, generator=torch.Generator().manual_seed(1))
        quantize_model(model, "fp16")
        return model

    eager, compiled = Engine(build(), draft_rows=None), Engine(build(), compile=True, draft_rows=None)
    prompts = [[5, 17, 33, 8, 60, 12, 9], [40, 41]]
    counters.clear()
    for kw in ({"confidence": 0.3}, {"mode": "verify", "confidence": 0.3}):
        want = eager.generate(prompts, max_new_tokens=12, **kw)
        got = compiled.generate(prompts, max_new_tokens=12, **kw)
        assert got.tokens == want.tokens and got.steps == want.steps
        assert max(max(s) for s in want.steps) > 1  # smashed steps / kept drafts: the adapters and drafts ran
    assert compiled.compiled, "the compiled engine fell back to eager"
    assert not counters["graph_break"], dict(counters["graph_break"])
