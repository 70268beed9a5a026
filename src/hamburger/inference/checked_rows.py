"""The checked rows of the running batch: verify and compress requests, whose micro tokens are drafts.

`feed_checked` is the base pass that checks a step's drafts and keeps the longest prefix the base agrees with (the
one acceptance path of every mode that drafts); `lookup_drafts` and `given_drafts` give a macro-step drafts from
elsewhere than the micro-step decoder. All work on the rows they are given (`rows.RowBatch`), nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hamburger.inference.kv import CacheView
from hamburger.inference.lookup import Lookup, NgramIndex
from hamburger.inference.rows import RowBatch
from hamburger.inference.verify import Window, accept_greedy, accept_sampled, check_pass, settle

if TYPE_CHECKING:
    from hamburger.inference.runner import ModelRunner

# drafter(ids, histories, room) -> drafts: a custom source of drafts for checked rows (`Engine(drafter=...)`):
# for each row drafting now, its request id, its tokens so far (token 0 of this step included) and the most
# drafts it may take; returns a list of draft tokens per row (the base still checks every one).
Drafter = Callable[[list[int], list[list[int]], list[int]], list[list[int]]]


def feed_checked(runner: ModelRunner, rows: RowBatch, n: int) -> None:
    """A pass of 1 + most drafts positions per row, each row at its own slots. Trust rows use position 0 (their
    smashed step); a checked row feeds [t0, d1..dn] and keeps the longest prefix of drafts that the base agrees
    with (`accept_greedy`; sampled rows `accept_sampled`): those are reported with this step (`rows.pending`),
    the next token is the base's own (this step's macro-step picks it from the state after them), and the
    entries of rejected drafts lie past the row's cache length, where the next pass overwrites them. A compress
    row is checked under the merger's bias on its merged entries; then its decided step [t0, kept drafts]
    becomes one entry at the step's first slot (`verify.merge_step`)."""
    model, dev = runner.model, rows.states.device
    live, checked = rows.live[:n], rows.checked[:n] & rows.live[:n]
    width = 1 + int(rows.n_drafts[:n].max())
    step_len = rows.step_len[:n]
    embeds = model.embed(rows.step_tok[:n, :width])
    smashed = model.smash(rows.step_tok[:n, : rows.k], step_len.clamp(min=1))
    embeds[:, 0] = torch.where(checked[:, None], embeds[:, 0], smashed)
    positions = (rows.prompt_len[:n] + rows.gen_len[:n] - 1).clamp(min=0)
    compress = rows.compress[:n] & live
    merged = torch.zeros(n, width, dtype=torch.bool, device=dev)
    merged[:, 0] = ~checked & (step_len > 1)
    states = check_pass(runner, embeds, positions, torch.where(live, rows.cache_len[:n], 0),
                        CacheView(rows.cache, slice(0, n)), merged,
                        merged_len=rows.merged_len[:n] if bool(compress.any()) else None)
    kept = accept(runner, rows, n, checked, states[0], width)
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
    record_kept(runner, rows, n, kept, checked.nonzero().squeeze(1).tolist())


def accept(runner: ModelRunner, rows: RowBatch, n: int, checked: torch.Tensor, final: torch.Tensor,
           width: int) -> torch.Tensor:
    """The drafts each checked row keeps (n,) from the base's final states (n, width, d) after t0, d1..; each
    checked row's next token 0 goes to `rows.next_t0`: a greedy row's is the base's choice after its kept drafts,
    from these logits (so the macro-step needs no head of its own), a sampled row's is drawn by its acceptance."""
    at = torch.zeros(n, dtype=torch.long, device=final.device)
    which = checked.nonzero().squeeze(1)
    logits = runner.model.lm_head(final[which])  # (rows, width, V): the base's choice after t0, d1, ..
    at[which], rows.next_t0[which] = accept_greedy(rows.step_tok[which, 1:width], rows.n_drafts[which], logits)
    for j, i in enumerate(which.tolist()):  # sampled rows: speculative-sampling acceptance, each its own draws
        req = rows.requests[i]
        if req.sampling.greedy:
            continue
        # Only the row's own drafts: the random numbers it draws must not depend on its neighbours' drafts.
        nd = int(rows.n_drafts[i])
        probs = torch.softmax(req.warpers(logits[j, : nd + 1].float()), -1)[None]  # (1, nd + 1, V)
        q = rows.q[i : i + 1, :nd] if rows.q is not None else probs.new_zeros(1, nd, probs.shape[-1])
        kept_i, t0 = accept_sampled(rows.step_tok[i : i + 1, 1 : 1 + nd], rows.n_drafts[i : i + 1], q, probs,
                                    req.rng)
        at[i], rows.next_t0[i] = kept_i[0], t0[0]
    return at


def record_kept(runner: ModelRunner, rows: RowBatch, n: int, kept: torch.Tensor, checked: list[int]) -> None:
    """Each checked row's kept drafts become `pending` (cut after EOS, which ends the request early), its lookup
    counts and draft policy learn from the pass, and its generated length grows by them."""
    kept_l, tokens = kept.tolist(), rows.step_tok[:n].tolist()
    added = [0] * n
    costs, drafted = runner.step_costs(n), rows.n_drafts[:n].tolist()
    for i in checked:
        req = rows.requests[i]
        if req.mode.paced and drafted[i]:  # the draft policy learns what this row's drafts keep
            req.drafting.observe(drafted[i], kept_l[i], req.looked > 0, costs, rows.drafts)
        if req.looked:
            req.stats.lookup_drafts += req.looked
            req.stats.lookup_kept += kept_l[i]
            req.looked = 0
        new = tokens[i][1 : 1 + kept_l[i]]
        new = new[: next((j + 1 for j, t in enumerate(new) if t in req.eos), len(new))]  # cut after EOS
        rows.pending[i], added[i] = new, len(new)
        if req.index is not None:  # before this step's lookup, which follows them
            req.index.extend(new)
        if new and new[-1] in req.eos:
            rows.ended_early[i] = True
    dev = rows.gen_len.device
    rows.gen_len[:n] += torch.tensor(added, device=dev)
    rows.live[:n] &= ~torch.tensor(rows.ended_early[:n], device=dev)
    rows.n_drafts[:n] = 0


def keep_point_masses(rows: RowBatch, drafts: torch.Tensor, counts: torch.Tensor) -> None:
    """A sampled row's drafts from elsewhere than the micro-step decoder are draws from point masses: kept as its
    draft distributions for the next acceptance. Every row with drafts records them (`Request.looked`)."""
    for i, (c, d) in enumerate(zip(counts.tolist(), drafts.tolist())):
        req = rows.requests[i]
        if c:
            req.looked = c
        if c and not req.sampling.greedy:
            for j in range(c):
                rows.keep_distribution(i, j + 1, torch.nn.functional.one_hot(drafts[i, j], rows.vocab).float())


def drafts_wanted(runner: ModelRunner, rows: RowBatch, n: int) -> list[tuple[int, int]]:
    """(lookup, micro-step) drafts at most per row this step. Verify rows draft while few rows run
    (`draft_rows`) and, greedy ones, while their drafts pay (the draft policy: a seeded sampled request's draws
    must not depend on timings); compress rows always draft; trust rows' micro tokens are their step."""
    most = runner.k - 1
    few = runner.draft_rows is None or n <= runner.draft_rows
    costs = runner.step_costs(n)
    return [(0, 0) if r is None or not r.mode.checked or (r.mode.paced and not few)
            else r.drafting.wants(costs, rows.drafts, most) if (r.mode.paced and runner.draft_policy
                                                                and r.sampling.greedy)
            else (rows.drafts, most) for r in rows.requests[:n]]


def step_drafts(runner: ModelRunner, rows: RowBatch, wants: list[tuple[int, int]], drafter: Drafter | None):
    """The macro-step's drafts from elsewhere than the micro-step decoder (`core.macro_step`'s lookup): the custom
    drafter's, or lookup drafts from the checked rows' own histories (None: none this step)."""
    caps = [look for look, _ in wants]
    if drafter is not None:
        return given_drafts(drafter, rows, caps) if any(caps) else None
    indexes = [r.index if r is not None and look > 0 else None for r, look in zip(rows.requests, caps)]
    return lookup_drafts(runner, rows, indexes, caps) if any(i is not None for i in indexes) else None


def lookup_drafts(runner: ModelRunner, rows: RowBatch, indexes: list[NgramIndex | None], caps: list[int]):
    """`core.macro_step`'s lookup over the running rows, at most `caps` drafts each, from their own histories
    (and the checkpoint's stored replies); compress rows at most K-1 (the merger's steps have at most K tokens)."""
    find = Lookup(indexes, rows.drafts, indexed_token0=False, caps=caps, store=runner.store)
    compress = rows.compress[: len(indexes)]

    def fn(tok: torch.Tensor, live: torch.Tensor, room: torch.Tensor):
        drafts, counts = find(tok, live, torch.where(compress, room.clamp(max=rows.k - 1), room))
        keep_point_masses(rows, drafts, counts)
        return drafts, counts

    return fn


def given_drafts(drafter: Drafter, rows: RowBatch, caps: list[int]):
    """`core.macro_step`'s lookup from a custom `drafter` (in place of the micro-step decoder and the lookup) for
    the rows with a cap > 0; compress rows take at most K-1."""
    n = len(caps)

    def fn(tok: torch.Tensor, live: torch.Tensor, room: torch.Tensor):
        room = torch.where(rows.compress[:n], room.clamp(max=rows.k - 1), room)
        want = [i for i, (on, r, c) in enumerate(zip(live.tolist(), room.tolist(), caps)) if on and r > 0 and c > 0]
        drafts = torch.zeros(n, rows.drafts, dtype=torch.long, device=tok.device)
        counts = torch.zeros(n, dtype=torch.long, device=tok.device)
        if want:
            t0, most = tok.tolist(), room.tolist()
            reqs = [rows.requests[i] for i in want]
            got = drafter([r.id for r in reqs], [r.tokens + rows.pending[i] + [t0[i]] for r, i in zip(reqs, want)],
                          [min(most[i], caps[i]) for i in want])
            for i, toks in zip(want, got):
                toks = [int(t) for t in toks][: min(most[i], caps[i], rows.drafts)]
                drafts[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
                counts[i] = len(toks)
        keep_point_masses(rows, drafts, counts)
        return drafts, counts

    return fn
