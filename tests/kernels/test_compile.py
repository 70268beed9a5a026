"""`Engine(compile=True)`: the operators that keep a compiled pass whole (compiled_ops.py), and compiled decoding
equal to eager decoding in every mode, with fp16-packed weights and slot adapters, without a graph break."""

from __future__ import annotations

import gc
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import hamburger
from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache, RowSlots
from hamburger.kernels import compiled_ops
from hamburger.kernels.qlinear import Fp16Linear, fp16_unavailable
from hamburger.kernels.quantize import quantize_model

needs_fbgemm = pytest.mark.skipif(fp16_unavailable("cpu") is not None, reason=str(fp16_unavailable("cpu")))
needs_compiler = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                    reason="torch.compile needs a C++ compiler on a CPU")


def _cache(seed: int) -> KVCache:
    cache = KVCache(3, 2, 2, 10, 4, torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    return cache


def _written(seed: int, layer: int, slots: list[list[int]], k: torch.Tensor, v: torch.Tensor) -> KVCache:
    """The reference: entry by entry, row b's t-th new key and value into slot slots[b][t] of `layer`."""
    cache = _cache(seed)
    for b, row in enumerate(slots):
        for t, slot in enumerate(row):
            cache.k[layer, b, :, slot] = k[b, :, t]
            cache.v[layer, b, :, slot] = v[b, :, t]
    return cache


def test_cache_writes_eager_and_as_operators():
    """The same slots for every row, each row's own (verify), one slot a row (the scheduler): the cache's writes
    and the operators a compiled pass calls both write exactly the reference's entries."""
    k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    want = _written(0, 1, [[4, 5, 6], [4, 5, 6]], k, v)
    eager, op = _cache(0), _cache(0)
    eager.update(1, 4, k, v)
    compiled_ops.kv_write(op.k, op.v, 1, 4, k, v)
    for got in (eager, op):
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)

    slots = [[2, 3, 4], [6, 7, 8]]
    want = _written(1, 2, slots, k, v)
    eager, op = _cache(1), _cache(1)
    eager.update(2, RowSlots(torch.tensor(slots), 9), k, v)
    compiled_ops.kv_scatter(op.k, op.v, 2, torch.tensor(slots), k, v)
    for got in (eager, op):
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)

    one_k, one_v = k[:, :, :1], v[:, :, :1]
    want = _written(2, 0, [[5], [1]], one_k, one_v)
    eager = _cache(2)
    keys, _ = eager.update(0, RowSlots(torch.tensor([[5], [1]]), 6), one_k, one_v)
    assert torch.equal(eager.k, want.k) and torch.equal(eager.v, want.v) and keys.shape[2] == 6


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
