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

Compress mode is the same loop with a KV merger: each decided step is then merged into one KV entry, and the
drafts are checked against a base whose past steps are merged (`merge_step`, `merged_mask`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from hamburger.inference.core import Limits, MicroContext, macro_step, micro_context
from hamburger.inference.draft_policy import RowDrafts
from hamburger.inference.kv import KVCache, RowSlots
from hamburger.inference.lookup import Lookup, NgramIndex
from hamburger.inference.reference import StepEvent
from hamburger.inference.sampling import SamplingParams

if TYPE_CHECKING:
    from hamburger.inference.engine import Engine, EngineGeneration
    from hamburger.model.merger import KVMerger


def accept_greedy(drafts: torch.Tensor, n_drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts (B, D), n_drafts (B,), the base's logits (B, D+1, V) after t0, d1..dD.

    Returns how many drafts each row keeps (B,) and the base's own token after them (B,).
    """
    choice = logits.argmax(-1)
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


def draft(engine: Engine, states: list[torch.Tensor], t0: torch.Tensor, limit: torch.Tensor, confidence: float,
          sampling: SamplingParams, rng, warpers, cache: KVCache, context: MicroContext | None = None,
          lookup: Lookup | None = None, micro_len: torch.Tensor | None = None):
    """Up to min(K-1, limit) drafts per row from the micro-step decoder: `core.macro_step` with token 0 given
    (the base's own) and the micro tokens read as drafts (no EOS ends a draft; the base decides). With `lookup`,
    a row whose history offers lookup drafts takes those instead (no micro-step for it).

    Returns drafts (B, D), their number (B,) and, when sampling, the distributions they were drawn from
    (B, D, V) (None when greedy; a lookup draft's is a point mass). D is the most any row drafted (0 when none did).
    """
    qs = []
    if lookup is not None:
        lookup.counts = None

    def pick(h: torch.Tensor, active: torch.Tensor, micro: bool) -> torch.Tensor:
        if not micro:
            return t0
        tok, q = draw(engine, h, sampling, rng, warpers)
        if q is not None:
            qs.append(q)
        return tok

    bsz = t0.shape[0]
    live = torch.ones(bsz, dtype=torch.bool, device=t0.device)
    gen_len = torch.zeros(bsz, dtype=torch.long, device=t0.device)
    # t0 + at most `limit` drafts, each only while P(every draft so far is kept) > confidence
    limits = Limits(torch.full((1, 1), -1, device=t0.device), limit + 1, confidence, path=True, micro_len=micro_len)
    step_tok, step_len, _ = macro_step(engine, states, live, gen_len, limits, pick, cache, context=context,
                                       lookup=lookup, lookup_width=lookup.width if lookup is not None else 0)
    n = step_len - 1
    d = int(n.max()) if bsz else 0
    drafts = step_tok[:, 1 : 1 + d]
    if sampling.greedy or d == 0:
        return drafts, n, None
    vocab = engine.model.base.config.vocab_size
    q = torch.zeros(bsz, d, vocab, device=t0.device)
    if qs:
        q[:, : len(qs)] = torch.stack(qs, 1)[:, :d]
    if lookup is not None and lookup.counts is not None:  # a lookup draft is a draw from a point mass on it
        from_lookup = (lookup.counts > 0)[:, None] & (torch.arange(d, device=t0.device)[None] < n[:, None])
        point = torch.zeros_like(q).scatter_(2, drafts[..., None], 1.0)
        q = torch.where(from_lookup[..., None], point, q)
    return drafts, n, q


def draw(engine: Engine, h: torch.Tensor, sampling: SamplingParams, rng, warpers):
    """One draft token per row, and (sampling only) the full-vocabulary distribution it was drawn from."""
    vocab = engine.vocab
    logits = engine.short_logits(h) if vocab is not None else engine.model.lm_head(h)
    if sampling.greedy:
        tok = logits.argmax(-1)
        return (vocab[tok] if vocab is not None else tok), None
    probs = torch.softmax(warpers(None, logits.float()), -1)
    tok = torch.multinomial(probs, 1, generator=rng).squeeze(1)
    if vocab is None:
        return tok, probs
    full = torch.zeros(h.shape[0], engine.model.base.config.vocab_size, device=h.device)
    return vocab[tok], full.index_copy_(1, vocab, probs)


def run_verify(engine: Engine, gen: EngineGeneration, merger: KVMerger | None = None) -> Iterator[StepEvent]:
    """Verify-mode decoding: one base forward per step over t0 and the drafts, each row at its own length.

    With a `merger`, compress mode: once a pass has decided a step (t0 and its kept drafts), the step's KV
    entries are replaced by the merger's one entry per layer (`merge_step`), and later passes add the merger's
    bias to those entries' attention logits; with the checkpoint's `merge_window` > 1, only once the step lies
    that many positions behind (`Window`). The drafts are then checked against a base that reads its past
    compressed; the prompt's entries stay as they are.
    """

    model, k, dev = engine.model, engine.k, engine.device
    bsz = len(gen.prompts)
    eos = sorted(gen.eos_token_ids)
    warpers, rng = gen.sampling.warpers(), gen.sampling.generator(dev)
    gen.stats.unmerged = merger is None
    start_t = time.perf_counter()
    # Drafts of the last step may be written past the budget: k slots more.
    # Lookup drafts: up to the engine's `lookup_drafts` in verify mode; K-1 in compress mode (the merger's steps).
    most = k - 1 if merger is not None else max(k - 1, engine.lookup_drafts)
    states, cache, micro_cache, valid, lengths = engine.start(gen, extra=1 + most)
    width, max_len = int(lengths.max()), valid.shape[1]
    merged_len = torch.zeros(bsz, max_len, dtype=torch.long, device=dev)  # tokens merged into each entry (0: none)
    size = model.config.merge_window
    window = Window(size, bsz) if merger is not None and size > 1 else None
    t0 = pick(model.lm_head(states[0])[:, None], gen.sampling, rng, warpers)[:, 0]
    gen.stats.prefill_s = time.perf_counter() - start_t
    done = [False] * bsz
    new = [[t] for t in t0.tolist()]
    # Lookup drafts (the checkpoint's `lookup`, or the engine's): each row's prompt and output so far, indexed.
    indexes = [NgramIndex(p, engine.lookup) for p in gen.prompts] if engine.lookup else None
    lookup = Lookup(indexes, most, store=engine.store) if indexes is not None else None
    cache_len = torch.full((bsz,), width, device=dev)  # entries in use per row: t0 of the coming pass goes here
    # Greedy verify mode: each row drafts while its drafts pay, against this engine's measured step costs at this
    # batch. Sampled rows always draft: which random numbers a seeded request draws must not depend on timings.
    policy = ([RowDrafts() for _ in range(bsz)] if merger is None and engine.draft_policy and k > 1
              and gen.sampling.greedy else None)
    costs = engine.step_costs(bsz)
    next_pos = lengths.clone()  # position id of t0
    for step in range(gen.max_new_tokens):
        for b, toks in enumerate(new):
            done[b] = done[b] or record(gen, b, toks, eos)
            if indexes is not None:
                indexes[b].extend(toks)
        gen.stats.macro_steps = sum(map(len, gen.steps))
        gen.stats.generated_tokens = sum(map(len, gen.tokens))
        gen.stats.micro_steps = gen.stats.generated_tokens - gen.stats.macro_steps
        yield StepEvent(step, new, list(done))
        if all(done):
            return
        # Drafts may not run past the token budget: the pass adds the kept drafts and one token of the base's.
        left = torch.tensor([0 if d else gen.max_new_tokens - len(t) - 1 for d, t in zip(done, gen.tokens)], device=dev)
        alive = torch.tensor([not d for d in done], device=dev)
        # Verify rows draft only in a batch of at most `draft_rows` rows (every row is computed, finished or not),
        # and (`draft_policy`) only while their drafts pay; compress rows always draft: their steps are what the
        # merger compresses.
        step_t = time.perf_counter()
        wants = [r.wants(costs, most, k - 1) for r in policy] if policy is not None else [(most, k - 1)] * bsz
        micro_len = None
        if policy is not None:  # each row's own lookup length and micro-step drafts
            left = left * torch.tensor([a > 0 or b > 0 for a, b in wants], device=dev)
            micro_len = torch.tensor([b for _, b in wants], device=dev)
            if lookup is not None:
                lookup.caps = [a for a, _ in wants]
        micro_calls = 0
        drafting = (k > 1 and (merger is not None or engine.draft_rows is None or bsz <= engine.draft_rows)
                    and any(a > 0 or b > 0 for a, b in wants))
        if drafting and policy is not None and lookup is not None and not any(b for _, b in wants):
            # Lookup drafts alone (no row drafts by micro-steps now): the index, without the micro-step decoder's
            # stop head or context (about 2 ms a step on the default), and none of it when nothing matches.
            found, looked = lookup(t0, left > 0, left)
            n_drafts = torch.minimum(looked, left)
            drafts, q = found[:, : int(n_drafts.max())], None
        elif drafting:
            ctx = micro_context(engine, cache, cache_len, next_pos - 1, valid)  # next_pos - 1: t0's state
            drafts, n_drafts, q = draft(engine, states, t0, left, gen.confidence, gen.sampling, rng, warpers,
                                        micro_cache, ctx, lookup=lookup, micro_len=micro_len)
            looked = lookup.counts if lookup is not None else None  # lookup drafts per row (set by this draft)
            from_micro = n_drafts if looked is None else torch.where(looked > 0, 0, n_drafts)
            micro_calls = int(from_micro.max()) if bsz else 0  # a micro-step call gives every row going on a token
        else:
            drafts, n_drafts, q = torch.zeros(bsz, 0, dtype=torch.long, device=dev), left * 0, None
            looked = None
        gen.stats.drafted_tokens += int(n_drafts.sum())
        tokens = torch.cat([t0[:, None], drafts], 1)
        compress = alive if merger is not None else torch.zeros_like(alive)
        states = check_pass(engine, model.embed(tokens), next_pos, cache_len, cache, visible=valid,
                            merged_len=merged_len if merger is not None else None)
        gen.stats.base_forwards += 1
        gen.stats.row_forwards += done.count(False)
        logits = model.lm_head(states[0])
        if gen.sampling.greedy:
            kept, t0 = accept_greedy(drafts, n_drafts, logits)
        else:
            p = torch.softmax(warpers(None, logits.flatten(0, 1).float()), -1).view(*logits.shape[:2], -1)
            kept, t0 = accept_sampled(drafts, n_drafts, q if q is not None else p[:, :0], p, rng)
        if looked is not None:
            gen.stats.lookup_drafts += int(looked.sum())
            gen.stats.lookup_kept += int(torch.where(looked > 0, kept, 0).sum())
        # A row that ended before a pass with drafts stays where it is: it is still computed (the batch is
        # rectangular) but writes over its own unused slots, so the cache never grows past its last live entry.
        if window is not None:
            window.first_pos = next_pos
        # A pass without drafts in verify mode (a large batch) advances every row by one, finished or not, as the
        # base's own loop does: the rows stay at one length, and the next pass writes a slice, not a scatter.
        advance = torch.ones_like(alive) if merger is None and drafts.shape[1] == 0 else alive
        states = settle(merger, states, kept, cache, cache_len, advance, compress, merged_len, window)
        if window is not None:
            gen.stats.window_entries = window.extra_entries()
        kept_l, t0_l, drafts_l = kept.tolist(), t0.tolist(), drafts.tolist()  # the one transfer per step
        if policy is not None:
            costs.observe(drafts.shape[1], micro_calls, time.perf_counter() - step_t)
            n_l, looked_l = n_drafts.tolist(), (looked.tolist() if looked is not None else [0] * bsz)
            for b, row in enumerate(policy):
                if n_l[b] and not done[b]:
                    row.observe(n_l[b], kept_l[b], looked_l[b] > 0, costs, most)
        new = [[] if done[b] else drafts_l[b][: kept_l[b]] + [t0_l[b]] for b in range(bsz)]
        next_pos += (1 + kept) * alive


def check_pass(engine: Engine, embeds: torch.Tensor, first_pos: torch.Tensor, cache_len: torch.Tensor,
               cache: KVCache, merged: torch.Tensor | None = None, visible: torch.Tensor | None = None,
               merged_len: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The base pass of verify and compress mode (the engine's and the scheduler's): (B, W, d) inputs per row
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
        mask = merged_mask(engine.model.merger, mask, merged_len[:, :end], engine.dtype)
    # Rows at one cache length (one row; or a batch that has not drafted yet, none finished) write their slots as
    # a plain slice: cheaper than a scatter (about 0.6 ms a step on the default at batch 1)
    same = embeds.shape[0] == 1 or bool((cache_len == cache_len[0]).all())
    where = int(cache_len[0]) if same else RowSlots(slots, end)
    return engine.base_pass(embeds, first_pos[:, None] + offsets, cache, where, mask, merged, last=False)


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


def merged_mask(merger: KVMerger, visible: torch.Tensor, merged_len: torch.Tensor, dtype):
    """The attention mask of layer i as a function of i: visible (B, 1, T, S) -> (B, H, T, S) floats, -inf where
    hidden and a*log k + c on entries that merge k tokens (`merged_len` (B, S), 0: an ordinary entry). Built one
    layer at a time: all layers at once would be layers x heads x T x S floats per row."""
    floor = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
    logk = torch.log(merged_len.clamp(min=1).to(merger.a.dtype))[:, None]  # (B, 1, S)
    on = (merged_len > 0)[:, None].to(merger.a.dtype)

    def layer(i: int) -> torch.Tensor:
        bias = (merger.a[i][None, :, None] * logk + merger.c[i][None, :, None]) * on  # (B, H, S)
        return floor + bias.to(dtype)[:, :, None]

    return layer


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


def pick(logits: torch.Tensor, sampling: SamplingParams, rng, warpers) -> torch.Tensor:
    """(B, T, V) -> (B, T) tokens: argmax, or one draw per position from the warped distribution."""
    if sampling.greedy:
        return logits.argmax(-1)
    b, t, v = logits.shape
    probs = torch.softmax(warpers(None, logits.reshape(b * t, v).float()), -1)
    return torch.multinomial(probs, 1, generator=rng).view(b, t)


def record(gen: EngineGeneration, b: int, toks: list[int], eos: list[int]) -> bool:
    """Append a row's new tokens (cut after EOS and at the token budget) as one step; True when the row ends."""
    if not toks:
        return False
    room = gen.max_new_tokens - len(gen.tokens[b])
    cut = next((i + 1 for i, t in enumerate(toks) if t in eos), len(toks))
    toks[:] = toks[: min(cut, room)]
    gen.tokens[b].extend(toks)
    gen.steps[b].append(len(toks))
    return toks[-1] in eos or len(gen.tokens[b]) >= gen.max_new_tokens
