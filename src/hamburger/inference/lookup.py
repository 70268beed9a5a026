"""Lookup drafts: the continuation of the latest earlier occurrence of a row's last n tokens (prompt lookup).

Verify and compress mode check every draft against the base, so a draft may come from anywhere. Text often
repeats what came before (code that reuses a name, a summary that quotes its source, a list that goes on in
the same form): where a row's last `n` tokens (n from `max_ngram` down to `min_ngram`) occurred earlier in its
prompt or output, the tokens that followed them there are a draft that costs no micro-step at all. A row with
such a match drafts those tokens; a row without drafts with the micro-step decoder as before. The output is the
base's either way (greedy: its argmax decides; sampling: a lookup draft is a draw from a point mass, which
speculative-sampling acceptance takes like any other draft distribution).

`NgramIndex` keeps, per row, a dict per n-gram length from each n-gram to where its latest continuation starts,
updated as tokens arrive, so a lookup costs a few dict reads whatever the prompt's length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hamburger.errors import HamburgerError
from hamburger.model.config import LOOKUP_MAX_NGRAM as MAX_NGRAM


class NgramIndex:
    """One row's token history and, per n-gram length, each n-gram's latest continuation start."""

    def __init__(self, tokens: Sequence[int], min_ngram: int = 2, max_ngram: int = MAX_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise HamburgerError(f"n-gram lengths must satisfy 1 <= min <= max, got {min_ngram}..{max_ngram}")
        self.min, self.max = min_ngram, max_ngram
        self.tokens: list[int] = []
        self.next: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens; every n-gram that now has a token after it points at that token."""
        toks = self.tokens
        for t in tokens:
            j = len(toks)  # the new token's index: the continuation of the n-grams ending at j - 1
            for n, table in self.next.items():
                if j >= n:
                    table[tuple(toks[j - n : j])] = j
            toks.append(int(t))

    def draft(self, limit: int, tail: Sequence[int] = ()) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the history's longest matching
        suffix (n-grams of `max_ngram` down to `min_ngram` tokens). `tail`: tokens that follow the history but
        are not part of it yet (the step's token 0); the result is what it would be with them appended."""
        if limit <= 0:
            return []
        toks, tail = self.tokens, list(tail)
        size = len(toks) + len(tail)
        # the history's end and the tail: enough to read every n-gram the tail would add
        near = toks[max(len(toks) - self.max, 0) :] + tail
        base = size - len(near)  # the index of near[0]
        for n in range(self.max, self.min - 1, -1):
            if size < n:
                continue
            key = tuple(near[-n:])
            at = self.next[n].get(key)
            for j in range(len(toks), size):  # the n-grams appending the tail would register (later wins)
                if j - n >= base and tuple(near[j - n - base : j - base]) == key:
                    at = j
            if at is not None:
                seq = toks if at + limit <= len(toks) else toks + tail
                return seq[at : at + limit]
        return []


class ReplyStore:
    """Lookup drafts from the base's own earlier replies (retrieval drafts, as REST does with a datastore): a row
    whose own history offers no match drafts what followed its last `min_ngram`..`max_ngram` tokens in a stored
    corpus of replies, here the base's greedy replies to the training prompts (`hamburger lookup-store`). The
    base checks these like any draft, so the output is unchanged; a phrase the base tends to write ("Here is a
    Python function that", a step of arithmetic, a list's form) is drafted whole.

    `tokens` (N,) int: the replies one after another, each followed by -1. Each n-gram points at the start of its
    latest continuation (one dict per length, built once per store: about 0.2 s for 200 k tokens)."""

    def __init__(self, tokens: torch.Tensor, min_ngram: int = 2, max_ngram: int = 4) -> None:
        self.min, self.max = min_ngram, max_ngram
        toks = tokens.tolist()
        self.tokens = toks
        self.next: dict[int, dict[tuple[int, ...], int]] = {}
        for n in range(min_ngram, max_ngram + 1):
            # an n-gram ending at j-1 (no separator inside it) points at j, if j is a token (later wins)
            keys = zip(*(toks[i:len(toks) - n + i] for i in range(n)))
            self.next[n] = {key: j for j, key, t in zip(range(n, len(toks)), keys, toks[n:])
                            if t >= 0 and -1 not in key}

    def draft(self, history: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest suffix of `history` (max_ngram .. min_ngram tokens) in
        the store, cut at the end of that reply."""
        for n in range(self.max, self.min - 1, -1):
            if len(history) < n:
                continue
            at = self.next[n].get(tuple(history[-n:]))
            if at is not None:
                out = self.tokens[at : at + limit]
                return out[: out.index(-1)] if -1 in out else out
        return []


_stores: dict[int, tuple[torch.Tensor, ReplyStore]] = {}


def reply_store(tokens: torch.Tensor | None) -> ReplyStore | None:
    """The `ReplyStore` of a model's stored replies, built once per tensor (engines of one model share it)."""
    if tokens is None:
        return None
    key = id(tokens)
    if key not in _stores or _stores[key][0] is not tokens:
        _stores[key] = (tokens, ReplyStore(tokens))
    return _stores[key][1]


class Lookup:
    """`core.macro_step`'s `lookup` over rows with these indexes (None: a row that never looks up): up to `width`
    drafts per row (one index per row of the batch). `indexed_token0`: the histories already end with the step's token 0 (the engine records it
    before drafting); else it is looked up as their tail (the scheduler reports it after the macro-step).
    `counts` (n,): the lookup drafts each row took at the last call (None before one). The one host transfer is
    of token 0, the rows and their room."""

    def __init__(self, indexes: Sequence[NgramIndex | None], width: int, indexed_token0: bool = True,
                 caps: Sequence[int] | None = None, store: ReplyStore | None = None) -> None:
        self.indexes, self.width, self.indexed_token0 = indexes, width, indexed_token0
        self.caps = caps  # per row, at most this many drafts (the draft policy's lengths); None: `width`
        self.store = store  # where a row's own history offers nothing: the base's stored replies
        self.counts: torch.Tensor | None = None

    def __call__(self, tok: torch.Tensor, rows: torch.Tensor, room: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, width = tok.shape[0], self.width
        drafts, counts = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, dtype=torch.long)
        for b, (t0, on, r) in enumerate(zip(tok.tolist(), rows.tolist(), room.tolist())):
            index = self.indexes[b]
            if index is None or not on or r <= 0:
                continue
            cap = width if self.caps is None else min(width, self.caps[b])
            tail = () if self.indexed_token0 else (t0,)
            found = index.draft(min(r, cap), tail=tail)
            if not found and self.store is not None:
                found = self.store.draft(index.tokens[-self.store.max :] + list(tail), min(r, cap))
            if found:
                drafts[b, : len(found)] = torch.tensor(found, dtype=torch.long)
                counts[b] = len(found)
        self.counts = counts.to(tok.device)
        return drafts.to(tok.device), self.counts
