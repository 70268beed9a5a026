"""Proposers: where a checked row's drafts come from besides the micro-step decoder.

A checked row (verify or compress mode) drafts after its token 0, as many tokens as the draft policy wants
(`drafts_wanted`). The macro-step (`core.macro_step`) first asks the step's proposer, if any; a row that gets
drafts from it takes them and runs no micro-step, the others draft with the micro-step decoder (which also makes
trust rows' steps, so it lives in the macro-step itself). Every proposer has one interface,
`propose(t0, drafting, room) -> (drafts (n, D), counts (n,))`: after token 0 `t0` (n,), drafts for the rows that
may draft now (`drafting` (n,)), at most `room` (n,) each (0: none). The base checks every draft (`verify.py`).

- `LookupProposer`: the tokens that followed the row's last few tokens where they occurred before, in its prompt,
  its reply, or the checkpoint's stored replies (`lookup.py`);
- `DrafterProposer`: a custom drafter's (`Engine(drafter=...)`), in place of the micro-step decoder and lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from hamburger.inference.lookup import Lookup, NgramIndex
from hamburger.inference.rows import RowBatch

if TYPE_CHECKING:
    from hamburger.inference.runner import ModelRunner

# drafter(ids, histories, room) -> drafts: a custom source of drafts for checked rows (`Engine(drafter=...)`):
# for each row drafting now, its request id, its tokens so far (token 0 of this step included) and the most
# drafts it may take; returns a list of draft tokens per row (the base still checks every one).
Drafter = Callable[[list[int], list[list[int]], list[int]], list[list[int]]]


class Proposer(Protocol):
    def propose(self, t0: torch.Tensor, drafting: torch.Tensor,
                room: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


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


def proposer_for(runner: ModelRunner, rows: RowBatch, wants: list[tuple[int, int]],
                 drafter: Drafter | None) -> Proposer | None:
    """This step's proposer: the custom drafter's, or lookup in the checked rows' own histories (None: none)."""
    caps = [look for look, _ in wants]
    if drafter is not None:
        return DrafterProposer(drafter, rows, caps) if any(caps) else None
    indexes = [r.index if r is not None and look > 0 else None for r, look in zip(rows.requests, caps)]
    return LookupProposer(runner, rows, indexes, caps) if any(i is not None for i in indexes) else None


def keep_point_masses(rows: RowBatch, drafts: torch.Tensor, counts: torch.Tensor) -> None:
    """A sampled row's drafts from a proposer are draws from point masses: kept as its draft distributions for the
    next acceptance. Every row with drafts records how many it took from the proposer (`Request.looked`)."""
    for i, (c, d) in enumerate(zip(counts.tolist(), drafts.tolist())):
        req = rows.requests[i]
        if c:
            req.looked = c
        if c and not req.sampling.greedy:
            for j in range(c):
                rows.keep_distribution(i, j + 1, torch.nn.functional.one_hot(drafts[i, j], rows.vocab).float())


class LookupProposer:
    """Lookup drafts from the rows' own histories (and the checkpoint's stored replies), at most `caps` each;
    compress rows at most K-1 (the merger's steps have at most K tokens)."""

    def __init__(self, runner: ModelRunner, rows: RowBatch, indexes: list[NgramIndex | None], caps: list[int]):
        self.rows, self.compress = rows, rows.compress[: len(indexes)]
        self.find = Lookup(indexes, rows.drafts, indexed_token0=False, caps=caps, store=runner.store)

    def propose(self, t0: torch.Tensor, drafting: torch.Tensor, room: torch.Tensor):
        drafts, counts = self.find(t0, drafting, torch.where(self.compress, room.clamp(max=self.rows.k - 1), room))
        keep_point_masses(self.rows, drafts, counts)
        return drafts, counts


class DrafterProposer:
    """A custom `drafter`'s drafts for the rows with a cap > 0; compress rows take at most K-1."""

    def __init__(self, drafter: Drafter, rows: RowBatch, caps: list[int]) -> None:
        self.drafter, self.rows, self.caps = drafter, rows, caps

    def propose(self, t0: torch.Tensor, drafting: torch.Tensor, room: torch.Tensor):
        rows, caps, n = self.rows, self.caps, len(self.caps)
        room = torch.where(rows.compress[:n], room.clamp(max=rows.k - 1), room)
        want = [i for i, (on, r, c) in enumerate(zip(drafting.tolist(), room.tolist(), caps)) if on and r > 0 and c > 0]
        drafts = torch.zeros(n, rows.drafts, dtype=torch.long, device=t0.device)
        counts = torch.zeros(n, dtype=torch.long, device=t0.device)
        if want:
            tok, most = t0.tolist(), room.tolist()
            reqs = [rows.requests[i] for i in want]
            got = self.drafter([r.id for r in reqs], [r.tokens + rows.pending[i] + [tok[i]] for r, i in zip(reqs, want)],
                               [min(most[i], caps[i]) for i in want])
            for i, toks in zip(want, got):
                toks = [int(t) for t in toks][: min(most[i], caps[i], rows.drafts)]
                drafts[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
                counts[i] = len(toks)
        keep_point_masses(rows, drafts, counts)
        return drafts, counts
