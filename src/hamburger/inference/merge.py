"""Compress mode's merging of the KV cache: a decided step's entries become one (`merge_step`, by the model's KV
merger), optionally once the step has left a recent exact window (`Window`), and the attention mask that gives
merged entries the merger's bias (`MergedMask`). The verify step (`verify.py`) calls these after its check pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hamburger.inference.kv import KVCache

if TYPE_CHECKING:
    from hamburger.model.merger import KVMerger


class Window:
    """Compress mode with a recent exact window: each row's decided steps that are not merged yet (oldest
    first, as [first slot, tokens, position of the last token]). A step is merged into one entry once it lies
    `size` positions behind the next token (the next pass's t0), and the row's newer entries move down into the
    freed slots (keys are rotated when written, so an entry needs no position of its own).

    `first_pos` (B,): the position of each row's t0 in the pass being settled (set before `settle`)."""

    def __init__(self, size: int, rows: int) -> None:
        self.size, self.steps = size, [[] for _ in range(rows)]
        self.first_pos: torch.Tensor | None = None

    def close(self, merger: KVMerger, cache: KVCache, cache_len: torch.Tensor, merged_len: torch.Tensor,
              compress: torch.Tensor, kept: torch.Tensor) -> None:
        """Record each compress row's step just decided (its entries end at the row's advanced cache length)
        and merge the steps that have left the window. `cache_len` (B,) is updated in place."""
        lens, kept_l, pos_l = cache_len.tolist(), kept.tolist(), self.first_pos.tolist()
        dev = cache_len.device
        for b, on in enumerate(compress.tolist()):
            if not on:
                continue
            n, steps = 1 + kept_l[b], self.steps[b]
            steps.append([lens[b] - n, n, pos_l[b] + kept_l[b]])
            nxt = pos_l[b] + n  # the position of the row's next t0
            while steps and nxt - steps[0][2] >= self.size:
                start, m, _ = steps.pop(0)
                merge_step(merger, cache, torch.tensor([start], device=dev), torch.tensor([m], device=dev),
                           merged_len, torch.tensor([b], device=dev))
                if m > 1:  # move the newer entries down into the step's freed slots
                    tail = lens[b] - (start + m)
                    for t in (cache.k, cache.v):
                        t[:, b, :, start + 1 : start + 1 + tail] = t[:, b, :, start + m : start + m + tail].clone()
                    merged_len[b, start + 1 : lens[b]] = 0  # the window's entries are ordinary ones
                    lens[b] -= m - 1
                    for step in steps:
                        step[0] -= m - 1
        cache_len.copy_(torch.tensor(lens, device=dev))

    def extra_entries(self) -> int:
        """Entries the unmerged steps hold beyond one per step (what `GenerationStats.window_entries` counts)."""
        return sum(m - 1 for steps in self.steps for _, m, _ in steps)


class MergedMask:
    """The attention mask of layer i as a function of i (`mask(i)`): visible (B, 1, T, S) -> (B, H, T, S) floats,
    -inf where hidden and a*log k + c on entries that merge k tokens (`merged_len` (B, S), 0: an ordinary entry).
    Built one layer at a time: all layers at once would be layers x heads x T x S floats per row. The native layers
    take its parts instead (`visible`; `log_k` and `merged` (B, S), the merger's `a`, `c` (layers, heads))."""

    def __init__(self, merger: KVMerger, visible: torch.Tensor, merged_len: torch.Tensor, dtype) -> None:
        self.visible, self.dtype, self.a, self.c = visible, dtype, merger.a.detach(), merger.c.detach()
        self.floor = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
        self.log_k = torch.log(merged_len.clamp(min=1).to(self.a.dtype))  # (B, S)
        self.merged = (merged_len > 0).to(self.a.dtype)

    def native_parts(self) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(visible, (log_k, merged, a, c)): what `NativeLayers.run` takes for this mask."""
        return self.visible, (self.log_k, self.merged, self.a, self.c)

    def __call__(self, i: int) -> torch.Tensor:
        bias = (self.a[i][None, :, None] * self.log_k[:, None] + self.c[i][None, :, None]) * self.merged[:, None]
        return self.floor + bias.to(self.dtype)[:, :, None]


def merge_step(merger: KVMerger, cache: KVCache, start: torch.Tensor, lengths: torch.Tensor,
               merged_len: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Replace each row's entries start..start+length-1 (every layer) by the merger's one entry at `start`; the
    cache's rows 0..B-1, or the given `rows` (B,)."""
    rows = torch.arange(start.shape[0], device=start.device) if rows is None else rows
    width = int(lengths.max())
    idx = start[:, None] + torch.minimum(torch.arange(width, device=start.device)[None], lengths[:, None] - 1)
    # cache (L, B, kvh, S, hd)[:, rows, :, idx] -> (B, width, L, kvh, hd) -> (L, B, kvh, width, hd)
    k = cache.k[:, rows[:, None], :, idx].permute(2, 0, 3, 1, 4)
    v = cache.v[:, rows[:, None], :, idx].permute(2, 0, 3, 1, 4)
    dtype = next(merger.parameters()).dtype  # the merger's own (a float16 cache's entries read in float32)
    mk, mv = merger.merge_all_layers(k.to(dtype), v.to(dtype), lengths)  # (L, B, kvh, hd)
    cache.k[:, rows, :, start] = mk.transpose(0, 1).to(cache.k.dtype)
    cache.v[:, rows, :, start] = mv.transpose(0, 1).to(cache.v.dtype)
    merged_len[rows, start] = lengths
