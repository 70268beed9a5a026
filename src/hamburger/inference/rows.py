"""The per-row state of the running batch, in one place: a struct of arrays (one row per running request) with
add, free and compact, as vLLM's `InputBatch`.

Row i of every tensor belongs to the request `requests[i]`; rows 0..span-1 cover every running request (`compact`
moves the highest running rows down into freed ones, so no pass computes a free row).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from hamburger.errors import HamburgerError
from hamburger.inference.admission import Request, RequestEvent
from hamburger.inference.kv import CacheView, KVCache
from hamburger.inference.stats import kv_bytes_per_entry

if TYPE_CHECKING:
    from hamburger.inference.runner import ModelRunner

def draft_slots(runner: ModelRunner) -> int:
    """The most drafts a row feeds in one pass: K-1, or more lookup drafts in verify mode."""
    return max(runner.k - 1, runner.lookup_drafts if runner.lookup else 0) if runner.k > 1 else 0


def rows_in(kv_memory: int, runner: ModelRunner, max_len: int) -> int:
    """How many rows of `max_len` KV entries (and their spare draft slots) `kv_memory` bytes of base cache hold."""
    row = (max_len + 1 + draft_slots(runner)) * kv_bytes_per_entry(runner.model.base.config, runner.kv_dtype)
    if kv_memory < row:
        raise HamburgerError(f"kv_memory of {kv_memory} bytes holds no row of {max_len} KV entries ({row} bytes): "
                             "give more memory or a smaller max_len")
    return kv_memory // row


# The per-row tensors (dimension 0 is the row), all moved together by `compact`.
ROW_TENSORS = ("states", "step_tok", "step_len", "cache_len", "gen_len", "prompt_len", "max_new", "confidence",
               "live", "checked", "compress", "n_drafts", "next_t0", "eos", "merged_len")
HOST_VIEWS = ("step_tok", "step_len", "cache_len", "gen_len", "prompt_len", "max_new", "confidence", "live", "n_drafts",
              "next_t0")


class RowBatch:
    """`size` rows of `slots` KV entries each for the base (and K + features for the micro-step decoder).

    - states (rows, 1 + features, d): the base's last normed state and features each row's next step starts from;
    - step_tok (rows, 1 + drafts), step_len: the last macro-step's tokens (a checked row's token 0 and drafts);
    - cache_len: entries in use (the next write slot); prompt_len, gen_len: tokens of the prompt and generated;
    - max_new, confidence, eos (rows, E; -1 pads): the request's limits; live: still generating;
    - checked, compress: rows whose micro tokens are drafts (verify and compress mode), rows whose steps are
      merged (compress mode);
    - n_drafts: drafts in step_tok[1 : 1 + n] waiting for the next base pass; next_t0: a checked row's token 0
      from its last check pass (greedy: the base's choice after the kept drafts; sampled: drawn by the
      acceptance; -1: none, as after a prefill);
    - merged_len (rows, slots): tokens merged into each entry (0: an ordinary one), for the merger's bias;
    - q (rows, drafts, V): a sampled checked row's draft distributions, made on first use;
    - pending: the drafts a check pass kept, reported with this step; ended_early: one of them was EOS;
    - host (on a CPU): numpy views of the per-row scalars (`HOST_VIEWS`, the same memory); first_cache,
      first_micro_cache: row 0's caches as views: what a request alone reads and writes (`solo.py`).
    """

    def __init__(self, size: int, slots: int, drafts: int, k: int, cache: KVCache, micro_cache: KVCache | None,
                 n_states: int, hidden: int, vocab: int, dtype, device) -> None:
        self.size, self.drafts, self.vocab, self.k = size, drafts, vocab, k
        self.cache, self.micro_cache = cache, micro_cache
        self.states = torch.zeros(size, n_states, hidden, dtype=dtype, device=device)
        self.step_tok = torch.zeros(size, 1 + max(k - 1, drafts), dtype=torch.long, device=device)
        zeros = lambda dt=torch.long: torch.zeros(size, dtype=dt, device=device)
        self.step_len, self.cache_len, self.gen_len, self.prompt_len = zeros(), zeros(), zeros(), zeros()
        self.max_new, self.n_drafts, self.confidence = zeros(), zeros(), zeros(torch.float32)
        self.live, self.checked, self.compress = zeros(torch.bool), zeros(torch.bool), zeros(torch.bool)
        self.next_t0 = torch.full((size,), -1, dtype=torch.long, device=device)
        self.eos = torch.full((size, 1), -1, dtype=torch.long, device=device)
        self.merged_len = torch.zeros(size, slots, dtype=torch.long, device=device)
        self.q: torch.Tensor | None = None
        self.requests: list[Request | None] = [None] * size
        self.pending: list[list[int]] = [[] for _ in range(size)]
        self.ended_early = [False] * size
        # a lone request's step (`solo.py`) reads and writes its row through these without a PyTorch operator each
        self.host = None
        if self.cache_len.device.type == "cpu":
            self.host = SimpleNamespace(**{name: getattr(self, name).numpy() for name in HOST_VIEWS})
        self.first_cache = CacheView(cache, slice(0, 1))
        self.first_micro_cache = CacheView(micro_cache, slice(0, 1)) if micro_cache is not None else None

    @classmethod
    def for_model(cls, runner: ModelRunner, size: int, max_len: int) -> RowBatch:
        """`size` rows of `max_len` entries for the runner's model, and the caches: a verify row drafts up to
        `draft_slots` tokens (lookup drafts may run past K-1; compress rows keep K-1), written past its entries
        in use, so each row has that many spare slots (and one for token 0)."""
        model, cfg, k = runner.model, runner.model.base.config, runner.k
        drafts, dev, dtype = draft_slots(runner), runner.device, runner.dtype
        slots = max_len + 1 + drafts
        cache = KVCache.for_layers(runner.base.layers, cfg, size, slots, runner.kv_dtype, dev)
        micro_cache = (KVCache.for_layers(model.micro.layers, cfg, size, model.micro.num_features + k, runner.kv_dtype,
                                          dev) if k > 1 else None)
        n_states = 1 + (model.micro.num_features if k > 1 else 0)
        return cls(size, slots, drafts, k, cache, micro_cache, n_states, cfg.hidden_size, cfg.vocab_size, dtype,
                   dev)

    # --- membership ---------------------------------------------------------------------------------------------

    def span(self) -> int:
        """Rows 0..n-1 cover every running request."""
        return max((i + 1 for i, r in enumerate(self.requests) if r is not None), default=0)

    def running(self) -> int:
        return sum(r is not None for r in self.requests)

    def free_rows(self) -> list[int]:
        return [i for i, r in enumerate(self.requests) if r is None]

    def add(self, req: Request, row: int, prompt_len: int) -> None:
        """Row `row` starts `req` after its prompt's prefill (its entries and states written by the caller)."""
        req.row, self.requests[row] = row, req
        for name, value in (("cache_len", prompt_len), ("prompt_len", prompt_len), ("gen_len", 0),
                            ("max_new", req.max_new_tokens), ("confidence", req.confidence), ("live", True),
                            ("checked", req.mode.checked), ("compress", req.mode.merged),
                            ("n_drafts", 0), ("next_t0", -1), ("merged_len", 0)):
            getattr(self, name)[row] = value
        self.pending[row], self.ended_early[row] = [], False
        self.set_eos(row, req.eos)

    def free(self, req: Request) -> None:
        if req.row >= 0:
            self.requests[req.row] = None
            self.live[req.row] = False
            req.row = -1

    def compact(self) -> None:
        """Move the highest running requests into the lowest free rows, so rows 0..n-1 are exactly the running
        ones. A move copies the row's cache entries in use and its per-row state once."""
        while True:
            free = next((i for i, r in enumerate(self.requests) if r is None), None)
            src = self.span() - 1
            if free is None or src < free:
                return
            req, used = self.requests[src], int(self.cache_len[src])
            for cache in (self.cache.k, self.cache.v):
                cache[:, free, :, :used] = cache[:, src, :, :used]
            for name in ROW_TENSORS:
                tensor = getattr(self, name)
                tensor[free] = tensor[src]
            if self.q is not None:
                self.q[free] = self.q[src]
            self.pending[free], self.ended_early[free] = self.pending[src], self.ended_early[src]
            self.requests[free], self.requests[src], req.row = req, None, free
            self.live[src] = False

    def forced(self, n: int) -> torch.Tensor | None:
        """Forced step lengths of this macro-step per row (0: the stop head decides), None when no row has any."""
        reqs = self.requests[:n]
        if all(r is None or r.forced is None for r in reqs):
            return None
        return torch.tensor([r.forced[len(r.steps)] if r is not None and r.forced and len(r.steps) < len(r.forced)
                             else 0 for r in reqs], device=self.live.device)

    def set_eos(self, row: int, ids: set[int]) -> None:
        if len(ids) > self.eos.shape[1]:
            pad = self.eos.new_full((self.eos.shape[0], len(ids) - self.eos.shape[1]), -1)
            self.eos = torch.cat([self.eos, pad], 1)
        self.eos[row] = -1
        self.eos[row, : len(ids)] = torch.tensor(sorted(ids), dtype=torch.long)

    def report(self, rows: list[list[int]], lens: list[int], ended: list[bool], drafts: list[int]) -> list[RequestEvent]:
        """A macro-step's tokens `rows` (n, width), `lens` (n,) of them per row, the rows that `ended` and the drafts
        each checked row made: each request's new tokens (a checked row's kept drafts, then token 0) and stats;
        a finished request leaves its row."""
        now, events, b = time.perf_counter(), [], self
        for i, req in enumerate(self.requests[: len(rows)]):
            if req is None:
                continue
            new = b.pending[i] + rows[i][: lens[i]]  # a checked row: the drafts its pass kept, then token 0
            if req.index is not None:  # (the kept drafts went in when the pass kept them)
                req.index.extend(rows[i][: lens[i]])
            done = ended[i] or b.ended_early[i]
            b.pending[i], b.ended_early[i] = [], False
            req.tokens += new
            req.steps.append(len(new))
            s = req.stats
            s.generated_tokens, s.macro_steps = len(req.tokens), len(req.steps)
            s.micro_steps = s.generated_tokens - s.macro_steps
            s.drafted_tokens += drafts[i]
            if s.macro_steps == 1:
                s.prefill_s = now - req.started
            s.decode_s = now - req.started - s.prefill_s
            reason = None
            if done:
                reason = "stop" if new[-1] in req.eos else "length"
                self.free(req)
            events.append(RequestEvent(req.id, new, done, reason, s, req.mode))
        return events

    # --- a sampled checked row's draft distributions ------------------------------------------------------------

    def keep_distribution(self, row: int, depth: int, full: torch.Tensor) -> None:
        """The distribution (over the whole vocabulary) the row's draft `depth` (1..) was drawn from."""
        if self.q is None:
            self.q = torch.zeros(self.size, max(self.drafts, 1), self.vocab, device=full.device)
        self.q[row, depth - 1] = full
