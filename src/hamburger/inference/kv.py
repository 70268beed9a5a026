"""Preallocated KV caches and the decoder layer that reads and writes them.

One cache holds a stack of layers as (layers, B, kv_heads, max_len, head_dim). A pass writes its new keys and
values at slots `start..` (the same for every row) or at each row's own slots (`RowSlots`: the rows of the
running batch are at different lengths). `CacheView` takes the first rows of a cache as a cache of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hamburger.model.layers import attend, project
from hamburger.model.slot_adapters import AdapterPass


@dataclass
class RowSlots:
    """Per-row cache slots (B, T) of a multi-position pass, and `end`: one past the largest slot of any row."""

    slots: torch.Tensor
    end: int


class KVCache:
    """Preallocated keys and values of a stack of layers: (layers, B, kv_heads, max_len, head_dim)."""

    def __init__(self, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device) -> None:
        shape = (layers, batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_layers(cls, layers, config, batch: int, max_len: int, dtype, device) -> KVCache:
        """A cache for `layers` (decoder layers of the base's type) over `batch` rows of `max_len` slots."""
        return cls(len(layers), batch, config.num_key_value_heads, max_len, layers[0].self_attn.head_dim, dtype, device)

    def update(self, layer: int, start: int | RowSlots, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, h, T, hd) at slots start.. (the same for every row, or each row's own `RowSlots`) and
        return the keys and values of slots 0..end-1."""
        if isinstance(start, RowSlots):  # rows at different cache lengths (verify mode): each row's own slots
            rows = torch.arange(k.shape[0], device=k.device)[:, None]
            self.k[layer, rows, :, start.slots] = k.transpose(1, 2).to(self.k.dtype)
            self.v[layer, rows, :, start.slots] = v.transpose(1, 2).to(self.v.dtype)
            end = start.end
        else:  # the layer's views written and read with `narrow` (half the operators of indexing)
            keys, values = self.k.select(0, layer), self.v.select(0, layer)
            end = start + k.shape[2]
            keys.narrow(2, start, k.shape[2]).copy_(k)
            values.narrow(2, start, v.shape[2]).copy_(v)
            return keys.narrow(2, 0, end), values.narrow(2, 0, end)
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class CacheView(KVCache):
    """The first `rows` rows of a `KVCache` as a cache of their own (views: writes land in the parent)."""

    def __init__(self, parent: KVCache, rows: slice) -> None:
        self.k, self.v = parent.k[:, rows], parent.v[:, rows]


@dataclass
class MicroContext:
    """What a micro-step decoder with context (`micro_context` > 0) reads of the base: the base's cache (its
    rows those of the macro-step), the entries each row may see (n, end) and the position of the state the
    features come from (n,); the micro inputs take the positions after it. In trust mode the entries are
    smashed slots and in compress mode merged ones (read without the merger's bias): the decoder was trained
    on unmerged text, so there its drafts are an approximation, which verify and compress modes check."""

    cache: KVCache
    visible: torch.Tensor
    base_pos: torch.Tensor


def layer_forward(layer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache, index: int,
                  start: int | RowSlots, mask: torch.Tensor, adapters: AdapterPass | None = None) -> torch.Tensor:
    """One decoder layer of the base's own type over (B, T, d) at cache slots start..start+T-1 (with the slot
    adapters' deltas at merged positions, if `adapters`)."""
    q, k, v = project(layer, x, rope, adapters)
    keys, values = cache.update(index, start, k, v)
    return attend(layer, x, q, keys, values, mask, adapters)
