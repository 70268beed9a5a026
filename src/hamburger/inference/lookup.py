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


_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as an int64: odd, so key * _MIX + token mixes every bit


def _ngram_keys(windows: torch.Tensor) -> torch.Tensor:
    """(N, n) int64 tokens -> (N,) int64 keys, a multiplicative hash (wrapping): equal n-grams, equal keys."""
    key = torch.zeros(windows.shape[0], dtype=torch.int64)
    for i in range(windows.shape[1]):
        key = key * _MIX + windows[:, i]
    return key


def _ngram_key(tokens: Sequence[int]) -> int:
    """`_ngram_keys` of one n-gram, in Python integers."""
    key = 0
    for t in tokens:
        key = (key * _MIX + t + 2**63) % 2**64 - 2**63
    return key


class ReplyStore:
    """Lookup drafts from the base's own earlier replies (retrieval drafts, as REST does with a datastore): a row
    whose own history offers no match drafts what followed its last `min_ngram`..`max_ngram` tokens in a stored
    corpus of replies, here the base's greedy replies to the training prompts (`hamburger export --replies`). The
    base checks these like any draft, so the output is unchanged; a phrase the base tends to write ("Here is a
    Python function that", a step of arithmetic, a list's form) is drafted whole.

    `tokens` (N,) int: the replies one after another, each followed by -1. Per n-gram length, the sorted hash keys
    of every n-gram and where its latest continuation starts, 16 bytes an n-gram (built once per store: about
    0.04 s for 200 k tokens, where dicts of tuples took 0.2 s); a match is checked against the tokens themselves,
    so a hash collision drafts nothing rather than something else."""

    def __init__(self, tokens: torch.Tensor, min_ngram: int = 2, max_ngram: int = 4) -> None:
        self.min, self.max = min_ngram, max_ngram
        toks = tokens.detach().to("cpu", torch.int64).flatten()
        self.tokens = toks.numpy()
        self.keys, self.ends = {}, {}
        for n in range(min_ngram, max_ngram + 1):
            # an n-gram ending at j-1 (no separator inside it) points at j, if j is a token (later wins)
            win = toks.unfold(0, n, 1)[:-1] if len(toks) > n else toks.new_zeros(0, n)
            ok = (toks[n:] >= 0) & (win >= 0).all(1)
            key, order = torch.sort(_ngram_keys(win[ok]), stable=True)  # equal keys stay in position order
            end = (ok.nonzero().squeeze(1) + n)[order]
            last = torch.cat([key[1:] != key[:-1], torch.ones(min(1, len(key)), dtype=torch.bool)])
            self.keys[n], self.ends[n] = key[last].numpy(), end[last].numpy()

    def draft(self, history: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest suffix of `history` (max_ngram .. min_ngram tokens) in
        the store, cut at the end of that reply."""
        for n in range(self.max, self.min - 1, -1):
            if len(history) < n:
                continue
            tail = list(history[-n:])
            key, keys = _ngram_key(tail), self.keys[n]
            i = int(keys.searchsorted(key))
            if i < len(keys) and keys[i] == key:
                at = int(self.ends[n][i])
                if self.tokens[at - n:at].tolist() == tail:
                    out = self.tokens[at : at + limit].tolist()
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


def find(index: NgramIndex, store: ReplyStore | None, limit: int, tail: Sequence[int] = ()) -> list[int]:
    """A row's lookup draft of at most `limit` tokens: from its own history (`NgramIndex.draft`; `tail`: tokens
    after it not indexed yet), else from the stored replies."""
    found = index.draft(limit, tail=tail)
    if not found and store is not None:
        found = store.draft(index.tokens[-store.max :] + list(tail), limit)
    return found


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
            found = find(index, self.store, min(r, cap), () if self.indexed_token0 else (t0,))
            if found:
                drafts[b, : len(found)] = torch.tensor(found, dtype=torch.long)
                counts[b] = len(found)
        self.counts = counts.to(tok.device)
        return drafts.to(tok.device), self.counts
