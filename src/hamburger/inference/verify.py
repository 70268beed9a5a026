"""The verify step: the base checks a step's drafts, keeps the longest prefix it agrees with, and rolls the cache
back past the rest, so verify mode's output is exactly the base's (and compress mode checks its steps the same way).

A checked row (verify or compress mode: `Mode.checked`) ends each macro-step with its token 0 emitted and up to n
drafts proposed (`core.macro_step`: the micro-step decoder's tokens, or a proposer's: `proposers.py`); the drafts
are not tokens of the reply yet. The next call's `check` runs one base pass over [t0, d1..dn] as positions of
their own (`check_pass`), one KV entry each at the row's own slots, and then per row:

1. **accept**: greedy rows keep a draft while it is the base's argmax (`accept_greedy`); sampled rows by
   speculative sampling (keep d with probability min(1, p(d)/q(d)), else draw from max(p - q, 0):
   `accept_sampled`), so the output follows the base's own distribution exactly. The base's own token after the
   kept drafts is the row's next token 0 (`RowBatch.next_t0`): the next macro-step needs no head of its own.
2. **roll back** (`settle`): the row's cache length advances by 1 + kept, so a rejected draft's entries lie past
   it and the next pass overwrites them; the row's next step starts from the state at its last kept position. A
   compress row's decided step [t0, kept drafts] becomes one entry by the KV merger (`merge.merge_step`,
   `merge.Window`).
3. **report** (`record_kept`): the kept drafts become the row's pending tokens (cut after EOS, which ends the
   request), reported with this step before its token 0; the draft policy and lookup counts learn from them.

Trust rows in the same pass feed their last step smashed into position 0 and keep nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hamburger.inference.kv import CacheView, KVCache, RowSlots
from hamburger.inference.merge import MergedMask, Window, merge_step
from hamburger.inference.rows import RowBatch
from hamburger.inference.sampling import greedy_tokens

if TYPE_CHECKING:
    from hamburger.inference.runner import ModelRunner
    from hamburger.model.merger import KVMerger


def check(runner: ModelRunner, rows: RowBatch, n: int) -> None:
    """A pass of 1 + most drafts positions per row, each row at its own slots. Trust rows use position 0 (their
    smashed step); a checked row feeds [t0, d1..dn] and keeps the longest prefix of drafts that the base agrees
    with (`accept_greedy`; sampled rows `accept_sampled`): those are reported with this step (`rows.pending`),
    the next token is the base's own (this step's macro-step picks it from the state after them), and the
    entries of rejected drafts lie past the row's cache length, where the next pass overwrites them. A compress
    row is checked under the merger's bias on its merged entries; then its decided step [t0, kept drafts]
    becomes one entry at the step's first slot (`merge.merge_step`)."""
    model, dev = runner.model, rows.states.device
    live, checked = rows.live[:n], rows.checked[:n] & rows.live[:n]
    width = 1 + int(rows.n_drafts[:n].max())
    step_len = rows.step_len[:n]
    embeds = model.embed(rows.step_tok[:n, :width])
    if not all(r is None or r.mode.checked for r in rows.requests[:n]):  # trust rows feed their steps smashed
        smashed = model.smash(rows.step_tok[:n, : rows.k], step_len.clamp(min=1))
        embeds[:, 0] = torch.where(checked[:, None], embeds[:, 0], smashed)
    positions = (rows.prompt_len[:n] + rows.gen_len[:n] - 1).clamp(min=0)
    compress = rows.compress[:n] & live
    merged = torch.zeros(n, width, dtype=torch.bool, device=dev)
    merged[:, 0] = ~checked & (step_len > 1)
    states = check_pass(runner, embeds, positions, torch.where(live, rows.cache_len[:n], 0),
                        CacheView(rows.cache, slice(0, n)), merged,
                        merged_len=rows.merged_len[:n] if bool(compress.any()) else None)
    which = [i for i, on in enumerate(checked.tolist()) if on]  # on the host: acceptance compares lists
    kept_l = accept(runner, rows, n, which, states[0], width)
    kept = torch.tensor(kept_l, device=dev)
    window = None
    if model.config.merge_window > 1 and bool(compress.any()):
        window = Window(model.config.merge_window, n)
        window.steps = [r.window_steps if r is not None else [] for r in rows.requests[:n]]  # the requests' lists
        window.first_pos = positions
    rows.states[:n] = torch.stack(settle(model.merger, states, kept, rows.cache, rows.cache_len[:n], live,
                                         compress, rows.merged_len, window), 1)
    if window is not None:
        for req in rows.requests[:n]:
            if req is not None and req.mode.merged:
                req.stats.window_entries = sum(m - 1 for _, m, _ in req.window_steps)
    record_kept(runner, rows, n, kept_l, which)


def accept(runner: ModelRunner, rows: RowBatch, n: int, which: list[int], final: torch.Tensor,
           width: int) -> list[int]:
    """The drafts each of the n rows keeps from the base's final states (n, width, d) after t0, d1..; `which`:
    the checked rows. Each checked row's next token 0 goes to `rows.next_t0`: a greedy row's is the base's choice
    after its kept drafts (so the macro-step needs no head of its own), a sampled row's is drawn by its acceptance.
    Greedy rows read only the head's argmax (`ModelRunner.head_argmax`) and compare on the host."""
    sel = slice(0, n) if len(which) == n else torch.tensor(which, dtype=torch.long, device=final.device)
    sampled = [(j, i) for j, i in enumerate(which) if not rows.requests[i].sampling.greedy]
    if sampled:
        logits = runner.model.lm_head(final[sel])  # (rows, width, V): the base's choice after t0, d1, ..
        choice = greedy_tokens(logits)
    else:  # greedy rows only: the head's argmax alone (no logits where the native kernels run it)
        choice = runner.head_argmax(final[sel])
    kept, nxt = accept_greedy(rows.step_tok[sel, 1:width].tolist(), rows.n_drafts[sel].tolist(), choice.tolist())
    for j, i in sampled:  # sampled rows: speculative-sampling acceptance, each its own draws
        req = rows.requests[i]
        # Only the row's own drafts: the random numbers it draws must not depend on its neighbours' drafts.
        nd = int(rows.n_drafts[i])
        probs = torch.softmax(req.warpers(logits[j, : nd + 1].float()), -1)[None]  # (1, nd + 1, V)
        q = rows.q[i : i + 1, :nd] if rows.q is not None else probs.new_zeros(1, nd, probs.shape[-1])
        kept_i, t0 = accept_sampled(rows.step_tok[i : i + 1, 1 : 1 + nd], rows.n_drafts[i : i + 1], q, probs,
                                    req.rng)
        kept[j], nxt[j] = int(kept_i[0]), int(t0[0])
    rows.next_t0[sel] = torch.tensor(nxt, device=final.device)
    at = [0] * n
    for j, i in enumerate(which):
        at[i] = kept[j]
    return at


def record_kept(runner: ModelRunner, rows: RowBatch, n: int, kept_l: list[int], checked: list[int]) -> None:
    """Each checked row's kept drafts become `pending` (`record_row`), and its generated length grows by them."""
    tokens = rows.step_tok[:n].tolist()
    added = [0] * n
    drafted = rows.n_drafts[:n].tolist()
    for i in checked:
        added[i] = len(record_row(runner, rows, n, i, tokens[i][1 : 1 + drafted[i]], kept_l[i]))
    dev = rows.gen_len.device
    rows.gen_len[:n] += torch.tensor(added, device=dev)
    if any(rows.ended_early[:n]):
        rows.live[:n] &= ~torch.tensor(rows.ended_early[:n], device=dev)
    rows.n_drafts[:n] = 0


def record_row(runner: ModelRunner, rows: RowBatch, n: int, i: int, drafts: list[int], kept: int) -> list[int]:
    """Row i's pass (of a batch of n rows) drafted `drafts` and kept the first `kept`: its lookup counts and draft
    policy learn from it; the kept drafts, cut after EOS (which ends the request early: `rows.ended_early`),
    become its pending tokens and go into its lookup history. Returns them."""
    req = rows.requests[i]
    if req.mode.paced and drafts:  # the draft policy learns what this row's drafts keep
        req.drafting.observe(len(drafts), kept, req.looked > 0, runner.step_costs(n), rows.drafts)
    if req.looked:
        req.stats.lookup_drafts += req.looked
        req.stats.lookup_kept += kept
        req.looked = 0
    new = drafts[:kept]
    new = new[: next((j + 1 for j, t in enumerate(new) if t in req.eos), len(new))]  # cut after EOS
    rows.pending[i] = new
    if req.index is not None:  # before this step's lookup, which follows them
        req.index.extend(new)
    if new and new[-1] in req.eos:
        rows.ended_early[i] = True
    return new


def accept_greedy(drafts: list[list[int]], n_drafts: list[int], choice: list[list[int]]) -> tuple[list[int], list[int]]:
    """Per row: its drafts d1..dD, how many of them it drafted, and the base's greedy tokens after t0, d1..dD
    (`greedy_tokens` of its logits there). Returns how many drafts each row keeps (the longest prefix the base
    agrees with) and the base's own token after them."""
    kept, after = [], []
    for d, nd, c in zip(drafts, n_drafts, choice):
        j = 0
        while j < nd and d[j] == c[j]:
            j += 1
        kept.append(j)
        after.append(c[j])
    return kept, after


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


def check_pass(runner: ModelRunner, embeds: torch.Tensor, first_pos: torch.Tensor | int,
               cache_len: torch.Tensor | int, cache: KVCache, merged: torch.Tensor | None = None,
               visible: torch.Tensor | None = None, merged_len: torch.Tensor | None = None,
               argmax: bool = False) -> list[torch.Tensor]:
    """The base pass of verify and compress mode (`check`): (B, W, d) inputs per row
    (token 0 or a trust row's smashed step, then the drafts) at positions first_pos.., written at the row's own
    slots cache_len... Each position sees its row's entries up to its own slot (and only the `visible` ones
    (B, S): a left-padded prompt's padding is hidden); with `merged_len` (B, S), the merger's bias on entries
    that merge several tokens. `merged` (B, W): positions that are smashed steps (the slot adapters act there).
    Returns the states at every position, each (B, W, d), and with `argmax` the head's greedy token at each
    (B, W) after them (`ModelRunner.base_pass`). One row may give its position and cache length as ints
    (`solo.py`): its mask is then a band of two operators."""
    width = embeds.shape[1]
    if isinstance(cache_len, int):  # one row, nothing hidden or merged
        if visible is not None or merged_len is not None:
            raise ValueError("a row given as ints has no hidden or merged entries")
        mask = torch.ones(1, 1, width, cache_len + width, dtype=torch.bool, device=embeds.device).tril_(cache_len)
        return runner.base_pass(embeds, range(first_pos, first_pos + width), cache, cache_len, mask, merged,
                                last=False, argmax=argmax)
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
    return runner.base_pass(embeds, first_pos[:, None] + offsets, cache, where, mask, merged, last=False,
                            argmax=argmax)


def settle(merger: KVMerger | None, states: list[torch.Tensor], kept: torch.Tensor, cache: KVCache,
           cache_len: torch.Tensor, live: torch.Tensor, compress: torch.Tensor,
           merged_len: torch.Tensor, window: Window | None = None) -> list[torch.Tensor]:
    """After a `check_pass`, with `kept` (B,) drafts kept per row: the states at each row's last kept position
    (the features of its next draft), each (B, d); a compress row's decided step [t0, kept drafts] merged into
    one entry at the step's first slot (`merge_step`); and the live rows' cache lengths advanced in place, by
    1 + kept (1 for a compress row). Rows are the cache's rows 0..B-1. With a `window`, a compress row's step
    stays as its own entries until it lies `window.size` positions behind (`Window.close`)."""
    if kept.shape[0] == 1:  # one row: its position as a view, no gather
        states = [s[:, int(kept[0])] for s in states]
    else:
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
