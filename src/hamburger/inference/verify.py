"""Verify mode: the micro-step decoder drafts, the base checks, the output is exactly the base's.

After the base's own token t0, the micro-step decoder drafts up to K-1 tokens (its stop head may end a draft
early: a draft goes on while the stop head's P(every draft so far is right), the product of its P(go on)
over the step, exceeds `confidence`). The next base forward takes [t0, d1, .., dn] as separate positions
(one KV entry each), keeps the longest prefix of drafts that the base agrees with, and adds the base's own
next token, so every forward emits 1..n+1 tokens. Greedy: a draft is kept when it is the base's argmax.
Sampling: speculative-sampling acceptance (keep d with probability min(1, p(d)/q(d)), else draw from
max(p - q, 0)), so the output follows the base's distribution exactly.

Rows accept different numbers of tokens, so each row keeps its own cache length: a pass writes at each
row's own slots (`RowSlots`) and a rejected draft's entries are simply overwritten by the next pass.

This file holds the rules (acceptance, the check pass, settling a pass, merging); the decode loop that applies
them is the scheduler's (`checked_rows.feed_checked`). Compress mode is the same loop with a KV merger: each decided step is then merged into one KV entry, and the
drafts are checked against a base whose past steps are merged (`merge_step`, `MergedMask`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hamburger.inference.kv import KVCache, RowSlots
from hamburger.inference.sampling import greedy_tokens

if TYPE_CHECKING:
    from hamburger.inference.runner import ModelRunner
    from hamburger.model.merger import KVMerger


def accept_greedy(drafts: torch.Tensor, n_drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts (B, D), n_drafts (B,), the base's logits (B, D+1, V) after t0, d1..dD.

    Returns how many drafts each row keeps (B,) and the base's own token after them (B,).
    """
    choice = greedy_tokens(logits)
    d = drafts.shape[1]
    ok = (drafts == choice[:, :d]) & (torch.arange(d, device=drafts.device)[None] < n_drafts[:, None])
    kept = ok.long().cumprod(1).sum(1)
    return kept, choice.gather(1, kept[:, None]).squeeze(1)


def accept_sampled(drafts: torch.Tensor, n_drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative-sampling acceptance. q (B, D, V): the draft distributions the drafts were drawn from;
    p (B, D+1, V): the base's (warped) distributions at t0, d1..dD. Returns (kept (B,), next token (B,))."""
    b, d = drafts.shape
    live = torch.arange(d, device=drafts.device)[None] < n_drafts[:, None]
    p_d = p[:, :d].gather(-1, drafts[..., None]).squeeze(-1)
    q_d = q.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(b, d, generator=generator, device=drafts.device)
    ok = (u * q_d <= p_d) & live  # accept with probability min(1, p/q)
    kept = ok.long().cumprod(1).sum(1)
    # At the first rejection draw from max(p - q, 0); after the last kept draft (no rejection) from p itself.
    q_pad = torch.cat([q * live[..., None], q.new_zeros(b, 1, p.shape[-1])], 1)
    at = kept[:, None, None].expand(-1, 1, p.shape[-1])
    residual = (p.gather(1, at) - q_pad.gather(1, at)).squeeze(1).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p.gather(1, at).squeeze(1))
    return kept, torch.multinomial(residual, 1, generator=generator).squeeze(1)


def check_pass(runner: ModelRunner, embeds: torch.Tensor, first_pos: torch.Tensor, cache_len: torch.Tensor,
               cache: KVCache, merged: torch.Tensor | None = None, visible: torch.Tensor | None = None,
               merged_len: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The base pass of verify and compress mode (`checked_rows.feed_checked`): (B, W, d) inputs per row
    (token 0 or a trust row's smashed step, then the drafts) at positions first_pos.., written at the row's own
    slots cache_len... Each position sees its row's entries up to its own slot (and only the `visible` ones
    (B, S): a left-padded prompt's padding is hidden); with `merged_len` (B, S), the merger's bias on entries
    that merge several tokens. `merged` (B, W): positions that are smashed steps (the slot adapters act there).
    Returns the states at every position, each (B, W, d)."""
    width = embeds.shape[1]
    offsets = torch.arange(width, device=embeds.device)
    slots = cache_len[:, None] + offsets
    end = int(slots.max()) + 1
    mask = torch.arange(end, device=embeds.device)[None, None] <= slots[:, :, None]  # (B, W, end)
    if visible is not None:
        mask = mask & visible[:, None, :end]
    mask = mask[:, None]
    if merged_len is not None:  # per layer: -inf where hidden, the merger's bias on merged entries
        mask = MergedMask(runner.model.merger, mask, merged_len[:, :end], runner.dtype)
    # Rows at one cache length (one row; or a batch that has not drafted yet, none finished) write their slots as
    # a plain slice: cheaper than a scatter (benchmarks/step_profile.py)
    same = embeds.shape[0] == 1 or bool((cache_len == cache_len[0]).all())
    where = int(cache_len[0]) if same else RowSlots(slots, end)
    return runner.base_pass(embeds, first_pos[:, None] + offsets, cache, where, mask, merged, last=False)


def settle(merger: KVMerger | None, states: list[torch.Tensor], kept: torch.Tensor, cache: KVCache,
           cache_len: torch.Tensor, live: torch.Tensor, compress: torch.Tensor,
           merged_len: torch.Tensor, window: Window | None = None) -> list[torch.Tensor]:
    """After a `check_pass`, with `kept` (B,) drafts kept per row: the states at each row's last kept position
    (the features of its next draft), each (B, d); a compress row's decided step [t0, kept drafts] merged into
    one entry at the step's first slot (`merge_step`); and the live rows' cache lengths advanced in place, by
    1 + kept (1 for a compress row). Rows are the cache's rows 0..B-1. With a `window`, a compress row's step
    stays as its own entries until it lies `window.size` positions behind (`Window.close`)."""
    rows = torch.arange(kept.shape[0], device=kept.device)
    states = [s[rows, kept] for s in states]
    if window is not None:
        cache_len += live.long() * (1 + kept)
        window.close(merger, cache, cache_len, merged_len, compress, kept)
        return states
    merge = compress.nonzero().squeeze(1)
    if len(merge):
        merge_step(merger, cache, cache_len[merge], 1 + kept[merge], merged_len, merge)
    cache_len += live.long() * torch.where(compress, 1, 1 + kept)
    return states


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
    mk, mv = merger.merge_all_layers(k, v, lengths)  # (L, B, kvh, hd)
    cache.k[:, rows, :, start] = mk.transpose(0, 1)
    cache.v[:, rows, :, start] = mv.transpose(0, 1)
    merged_len[rows, start] = lengths
