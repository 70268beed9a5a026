"""The KV cache's writes: the same slots for every row, each row's own slots (verify mode), one slot a row (the
scheduler), each against a reference that writes entry by entry."""

from __future__ import annotations

import torch

from hamburger.inference.kv import KVCache, RowSlots


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


def test_cache_writes_are_the_references():
    k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    want, got = _written(0, 1, [[4, 5, 6], [4, 5, 6]], k, v), _cache(0)
    keys, values = got.update(1, 4, k, v)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    assert torch.equal(keys, want.k[1, :, :, :7]) and torch.equal(values, want.v[1, :, :, :7])

    slots = [[2, 3, 4], [6, 7, 8]]
    want, got = _written(1, 2, slots, k, v), _cache(1)
    got.update(2, RowSlots(torch.tensor(slots), 9), k, v)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)

    one_k, one_v = k[:, :, :1], v[:, :, :1]
    want, got = _written(2, 0, [[5], [1]], one_k, one_v), _cache(2)
    keys, _ = got.update(0, RowSlots(torch.tensor([[5], [1]]), 6), one_k, one_v)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v) and keys.shape[2] == 6
