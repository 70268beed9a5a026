"""Continuous batching on the fast engine: requests join the running batch at macro-step boundaries and
leave it (finished or cancelled) right after one, each row of a preallocated cache holding one request.

Every row keeps its own cache length (write slot), positions, step lengths, confidence, limits, EOS set
and sampling, so a request's greedy output does not depend on which others share the batch. Each live
row adds exactly one KV entry per macro-step. One `step()` call:

1. feeds the previous macro-step's tokens of the rows still running to the base (one slot each, at the
   RoPE position of the step's last token; a verify or compress row's token 0 and drafts as positions of their
   own, after which a compress row's decided step becomes one merged entry),
2. prefills newly admitted requests into free rows (right-padded, prompt positions 0..P-1): with
   `interleave_prefill` (the default) one pass of at most `prefill_tokens` padded tokens, of the shortest waiting
   prompts (the rest wait for the next step); otherwise all of them, shortest first, in such passes,
3. runs one macro-step over every live row and reports its tokens.

When a request leaves, the highest running ones move down into the freed rows (`_compact`), so every pass
computes exactly the running rows.

`submit` and `cancel` may be called from any thread; `step` only from the one thread that owns the model.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque

import torch

from hamburger.errors import HamburgerError
from hamburger.inference.admission import (
    CHECKED,
    PREFILL_TOKENS,
    Request,
    RequestEvent,
    prefill_groups,
    take_shortest,
)
from hamburger.inference.checked_rows import CheckedRows
from hamburger.inference.core import Limits, macro_step, micro_context
from hamburger.inference.engine import Engine, resolve_mode
from hamburger.inference.kv import CacheView, KVCache, SlotWrites
from hamburger.inference.lookup import NgramIndex
from hamburger.inference.reference import eos_ids
from hamburger.inference.sampling import SamplingParams, sample
from hamburger.inference.stats import GenerationStats
from hamburger.model.config import MODES
from hamburger.model.hamburger_model import HamburgerModel

DECODE_THREADS_ROWS = 16  # decode passes of at most this many rows run on `decode_threads`


class Scheduler(CheckedRows):
    """`max_batch_size` rows of `max_len` KV entries each; requests wait for a free row.

    Waiting requests are prefilled in one base pass per step of at most `prefill_tokens` padded prompt tokens (a
    longer prompt goes alone), shortest first, which bounds the pass's memory and the running requests' wait
    (`interleave_prefill`, the default; measured in docs/server.md)."""

    def __init__(self, model: HamburgerModel, max_batch_size: int = 8, max_len: int | None = None,
                 prefill_tokens: int = PREFILL_TOKENS, interleave_prefill: bool = True,
                 decode_threads: int | None = None, draft_rows: int | str | None = "auto",
                 draft_policy: bool | None = None, lookup: int | None = None) -> None:
        # checks the architecture; owns the shortlist head, `draft_rows` (verify rows draft only while at most
        # that many requests run; compress rows always draft) and the draft policy's step costs
        self.engine = engine = Engine(model, draft_rows=draft_rows, draft_policy=draft_policy, lookup=lookup)
        if decode_threads is not None and decode_threads < 1:
            raise HamburgerError(f"decode_threads must be >= 1 (or None: torch's setting), got {decode_threads}")
        # Small decode passes with `decode_threads` torch threads; prefill and large decode passes with the threads
        # torch had here.
        self.decode_threads, self.prefill_threads = decode_threads, torch.get_num_threads()
        self.model, self.k = model, engine.k
        cfg = model.base.config
        context = getattr(cfg, "max_position_embeddings", None) or 2048
        self.max_len = min(max_len or context, context)
        if max_batch_size < 1 or self.max_len < 2:
            raise HamburgerError(f"need max_batch_size >= 1 and max_len >= 2, got {max_batch_size}, {self.max_len}")
        if prefill_tokens < 1:
            raise HamburgerError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        self.prefill_tokens, self.interleave_prefill = prefill_tokens, interleave_prefill
        rows, dev, dtype = max_batch_size, engine.device, engine.dtype
        # k spare slots: a verify pass writes a row's drafts past its entries in use, up to K-1 of them
        # Verify rows draft up to `drafts` tokens (lookup drafts may run past K-1; compress rows keep K-1)
        self.drafts = max(self.k - 1, engine.lookup_drafts if engine.lookup else 0) if self.k > 1 else 0
        self.cache = KVCache.for_layers(engine.base.layers, cfg, rows, self.max_len + 1 + self.drafts, dtype, dev)
        self.micro_cache = (KVCache.for_layers(model.micro.layers, cfg, rows, model.micro.num_features + self.k,
                                               dtype, dev) if self.k > 1 else None)
        n_states = 1 + (model.micro.num_features if self.k > 1 else 0)
        self.states = torch.zeros(rows, n_states, cfg.hidden_size, dtype=dtype, device=dev)
        zeros = lambda dt=torch.long: torch.zeros(rows, dtype=dt, device=dev)  # noqa: E731
        self.cache_len, self.gen_len, self.prompt_len, self.max_new = zeros(), zeros(), zeros(), zeros()
        self.confidence = zeros(torch.float32)
        self.live, self.verify, self.compress = zeros(torch.bool), zeros(torch.bool), zeros(torch.bool)
        # compress rows: tokens merged into each cache entry (0: an ordinary entry), for the merger's attention bias
        self.merged_len = torch.zeros(rows, self.max_len + 1 + self.drafts, dtype=torch.long, device=dev)
        self.n_drafts = zeros()  # verify rows: drafts step_tok[1 : 1 + n] wait for the next base pass to check them
        self.pending: list[list[int]] = [[] for _ in range(rows)]  # drafts a verify pass kept, reported this step
        self.ended_early = [False] * rows  # a kept draft ended the request (EOS) before this step's macro-step
        self.next_t0 = torch.full((rows,), -1, dtype=torch.long, device=dev)  # sampled verify: the accepted token 0
        self.q: torch.Tensor | None = None  # sampled verify: (rows, drafts, V) the distributions drafts were drawn from
        self._depth = 0  # micro-steps into the current macro-step (which draft a pick makes)
        self._micro_calls = 0  # micro-step calls of the last macro-step (the draft policy's step costs)
        self.step_tok = torch.zeros(rows, 1 + max(self.k - 1, self.drafts), dtype=torch.long, device=dev)
        self.step_len = zeros()
        self.eos = torch.full((rows, 1), -1, dtype=torch.long, device=dev)
        self.default_eos = eos_ids(model)
        self.rows: list[Request | None] = [None] * rows
        self._waiting: deque[Request] = deque()
        self._cancels: set[int] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()

    # --- the thread-safe side ----------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], max_new_tokens: int, confidence: float | None = None,
               sampling: SamplingParams | None = None, eos_token_ids: set[int] | None = None,
               mode: str = "trust") -> int:
        """Queue a request; returns its id. Raises HamburgerError when it cannot fit in a row.

        `mode` "verify": the micro-step decoder's tokens are drafts that the next base pass checks: greedy, only
        those the base would choose itself are kept; sampled, speculative-sampling acceptance. Either way the
        output follows the base's own (warped) distribution exactly. "compress": drafts checked the same way,
        then each decided step's KV entries are merged into one by the model's KV merger (the base reads its
        past compressed)."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise HamburgerError("the prompt must have at least one token")
        if max_new_tokens < 1:
            raise HamburgerError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt) + max_new_tokens > self.max_len:
            raise HamburgerError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceed the "
                                 f"context of {self.max_len} tokens")
        if mode not in MODES:  # a mode must be named here (the service resolves the server's default)
            raise HamburgerError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        mode, conf = resolve_mode(self.model, mode, confidence)
        sampling = sampling or SamplingParams()
        eos = self.default_eos if eos_token_ids is None else set(eos_token_ids)
        req = Request(next(self._ids), prompt, int(max_new_tokens), conf, sampling, eos, mode)
        with self._lock:
            self._waiting.append(req)
        return req.id

    def cancel(self, request_id: int) -> None:
        """Drop a request (waiting or running) at the next step; its row is free for the step after."""
        with self._lock:
            self._cancels.add(request_id)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.rows)

    def has_work(self) -> bool:
        return bool(self._waiting or self._cancels or self.running)

    def kv_entries(self) -> int:
        """KV entries per layer held by the running requests (`GenerationStats.kv_entries`: one per step in trust
        and compress mode, one per token in verify mode, plus the prompt's)."""
        return sum(r.stats.kv_entries for r in self.rows if r is not None)

    # --- the model thread ----------------------------------------------------------------------------------

    def step(self) -> list[RequestEvent]:
        """Cancel, feed the last steps to the base, admit, then one macro-step: the events of this step."""
        with torch.inference_mode():
            events = self._apply_cancels()
            self._compact()
            self._threads(self._decode_threads())
            start = time.perf_counter()
            width = 1 + int(self.n_drafts[: self._span()].max()) if self.running else 1
            self._feed_steps()
            fed_s = time.perf_counter() - start
            self._threads(self.prefill_threads)
            self._admit()
            self._threads(self._decode_threads())
            if self.running:
                start = time.perf_counter()
                events += self._macro_step()
                # The decode work of a step (its base pass and its micro-steps, not the prefill): what the draft
                # policy weighs a drafting step against a plain one by.
                self.engine.step_costs(self._span()).observe(width - 1, self._micro_calls,
                                                             fed_s + time.perf_counter() - start)
        return events

    def _decode_threads(self) -> int | None:
        """Small decode passes (at most DECODE_THREADS_ROWS rows) read the weights more than they compute: they
        run on `decode_threads`; larger ones on all threads (measured on 2 cores: docs/server.md)."""
        return self.decode_threads if self.running <= DECODE_THREADS_ROWS else self.prefill_threads

    def _threads(self, n: int | None) -> None:
        """Run the next passes on n torch threads (a few microseconds to switch); None leaves them as they are."""
        if self.decode_threads is not None and n is not None and torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def _apply_cancels(self) -> list[RequestEvent]:
        with self._lock:
            cancels, self._cancels = self._cancels, set()
            dropped = [r for r in self._waiting if r.id in cancels]
            for req in dropped:
                self._waiting.remove(req)
        dropped += [r for r in self.rows if r is not None and r.id in cancels]
        for req in dropped:
            self._free(req)
        return [RequestEvent(r.id, [], True, "cancelled", r.stats) for r in dropped]

    def _free(self, req: Request) -> None:
        if req.row >= 0:
            self.rows[req.row] = None
            self.live[req.row] = False
            req.row = -1

    def _compact(self) -> None:
        """Move the highest running requests into the lowest free rows, so rows 0..n-1 are exactly the running
        ones and no pass computes a free row. A move copies the row's cache entries in use and its state once."""
        while True:
            free = next((i for i, r in enumerate(self.rows) if r is None), None)
            src = self._span() - 1
            if free is None or src < free:
                return
            req, used = self.rows[src], int(self.cache_len[src])
            for cache in (self.cache.k, self.cache.v):
                cache[:, free, :, :used] = cache[:, src, :, :used]
            for tensor in (self.states, self.step_tok, self.step_len, self.cache_len, self.gen_len, self.prompt_len,
                           self.max_new, self.confidence, self.live, self.verify, self.compress, self.n_drafts,
                           self.next_t0, self.eos, self.merged_len, *([self.q] if self.q is not None else [])):
                tensor[free] = tensor[src]
            self.rows[free], self.rows[src], req.row = req, None, free
            self.live[src] = False

    def _span(self) -> int:
        """Rows 0..n-1 cover every running request (rows are taken lowest first)."""
        return max((i + 1 for i, r in enumerate(self.rows) if r is not None), default=0)

    def _feed_steps(self) -> None:
        """The base pass over the running rows' last steps: one smashed slot per trust row; a verify row's
        token 0 and its drafts as separate positions, of which the base keeps the ones it agrees with."""
        n = self._span()
        if n == 0:
            return
        if any(r is not None and r.mode in CHECKED for r in self.rows[:n]):
            self._feed_verify(n)
        else:
            live = self.live[:n]
            step_len = self.step_len[:n].clamp(min=1)
            embeds = self.model.smash(self.step_tok[:n, : self.k], step_len)[:, None]
            positions = (self.prompt_len[:n] + self.gen_len[:n] - 1).clamp(min=0)[:, None]
            slots = torch.where(live, self.cache_len[:n], 0)
            mask = (torch.arange(int(slots.max()) + 1, device=slots.device)[None] <= slots[:, None])[:, None, None]
            states = self.engine.base_pass(embeds, positions, SlotWrites(self.cache, slots), 0, mask,
                                       (step_len > 1)[:, None])
            self.states[:n] = torch.stack(states, 1)
            self.cache_len[:n] += live.long()
        for req in self.rows[:n]:
            if req is not None:
                req.stats.base_forwards += 1
                req.stats.row_forwards += 1

    def _admit(self) -> None:
        """Fill free rows from the queue. Interleaved (the default): one pass of at most `prefill_tokens` padded
        tokens per step, of the shortest waiting prompts (a request passed over `MAX_PASSED` times goes first,
        oldest first), so each pass's requests get their first token in its step and running requests wait for
        one pass per step, not for a whole burst (a burst of 32 on 2 cores: TTFT p50 1.44 s against 2.07 s, p90
        2.33 s against 2.07 s). Otherwise every free row is filled now, FIFO, the prompts prefilled shortest first
        in such passes, and all get their first token in this step."""
        free = [i for i, r in enumerate(self.rows) if r is None]
        with self._lock:
            if self.interleave_prefill:
                groups = [take_shortest(self._waiting, len(free), self.prefill_tokens)]
            else:
                groups = prefill_groups([self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))],
                                        self.prefill_tokens)
        for group in groups:
            if group:
                self._prefill(group, free[: len(group)])
                free = free[len(group):]

    def _prefill(self, reqs: list[Request], rows: list[int]) -> None:
        """The prompts, unmerged and right-padded, in one pass at positions 0..P-1 into slots 0..P-1 of their
        rows. Causal attention keeps each prompt's real positions from seeing its padding, and the padding's
        entries lie past the row's cache length, where the next step overwrites them and no mask reaches."""
        dev, start = self.states.device, time.perf_counter()
        lens = [len(r.prompt) for r in reqs]
        m, width = len(reqs), max(lens)
        ids = torch.zeros(m, width, dtype=torch.long, device=dev)
        for i, req in enumerate(reqs):
            ids[i, : lens[i]] = torch.tensor(req.prompt, dtype=torch.long)
        positions = torch.arange(width, device=dev)[None].expand(m, -1)
        mask = torch.ones(width, width, dtype=torch.bool, device=dev).tril()[None, None]
        c = self.cache
        scratch = KVCache(c.k.shape[0], m, c.k.shape[2], width, c.k.shape[4], c.k.dtype, dev)
        states = self.engine.base_pass(self.model.embed(ids), positions, scratch, 0, mask, last=False)
        at, rows_t = torch.tensor(lens, device=dev) - 1, torch.tensor(rows, device=dev)
        c.k[:, rows_t, :, :width], c.v[:, rows_t, :, :width] = scratch.k, scratch.v
        self.states[rows_t] = torch.stack([s[torch.arange(m, device=dev), at] for s in states], 1)
        for req, row, p in zip(reqs, rows, lens):
            req.row, req.started = row, start
            self.rows[row] = req
            for tensor, value in ((self.cache_len, p), (self.prompt_len, p), (self.gen_len, 0),
                                  (self.max_new, req.max_new_tokens), (self.confidence, req.confidence),
                                  (self.live, True), (self.verify, req.mode in CHECKED),
                                  (self.compress, req.mode == "compress"), (self.n_drafts, 0), (self.next_t0, -1)):
                tensor[row] = value
            self.merged_len[row] = 0
            self._set_eos(row, req.eos)
            req.stats = GenerationStats(sequences=1, prompt_tokens=p, base_forwards=1, row_forwards=1,
                                        unmerged=req.mode == "verify")
            req.rng, req.warpers = req.sampling.generator(dev), req.sampling.warpers()
            if req.mode in CHECKED and self.engine.lookup:
                req.index = NgramIndex(req.prompt, self.engine.lookup)

    def _set_eos(self, row: int, ids: set[int]) -> None:
        if len(ids) > self.eos.shape[1]:
            pad = self.eos.new_full((self.eos.shape[0], len(ids) - self.eos.shape[1]), -1)
            self.eos = torch.cat([self.eos, pad], 1)
        self.eos[row] = -1
        self.eos[row, : len(ids)] = torch.tensor(sorted(ids), dtype=torch.long)

    # --- one macro-step over the live rows ----------------------------------------------------------------------

    def _pick(self, h: torch.Tensor, active: torch.Tensor, micro: bool) -> torch.Tensor:
        """Greedy rows by one argmax; sampled rows one by one with their own generator (only when active,
        so a request draws the same random numbers as when it runs alone). Sampled verify rows: token 0 is the
        one the last pass's acceptance drew, and each draft's distribution is kept for the next acceptance."""
        self._depth = self._depth + 1 if micro else 0
        shortlist = micro and self.engine.vocab is not None
        logits = self.engine.short_logits(h) if shortlist else self.model.lm_head(h)
        tok = logits.argmax(-1)
        sampled = [(i, r) for i, r in enumerate(self.rows[: len(h)]) if r is not None and not r.sampling.greedy]
        if sampled:
            on, given = active.tolist(), self.next_t0[: len(h)].tolist()
            for i, req in sampled:
                if not on[i]:
                    continue
                if req.mode in CHECKED and not micro and given[i] >= 0:
                    tok[i] = given[i]
                elif req.mode in CHECKED and micro:
                    probs = torch.softmax(req.warpers(None, logits[i : i + 1].float()), -1)
                    tok[i] = torch.multinomial(probs, 1, generator=req.rng)[0, 0]
                    self._keep_draft_distribution(i, probs[0])
                else:
                    tok[i] = sample(logits[i : i + 1], req.sampling, req.rng, req.warpers)[0]
        return self.engine.vocab[tok] if shortlist else tok

    def _macro_step(self) -> list[RequestEvent]:
        """`core.macro_step` over the running rows, each with its own limits and sampler. A verify row emits
        token 0 now; its micro tokens are drafts for the next pass (room is left for the base's token after
        them), so they do not count as generated and do not end the request."""
        n = self._span()
        live, verify = self.live[:n].clone(), self.verify[:n]
        confidence = self.confidence[:n]
        few = self.engine.draft_rows is None or n <= self.engine.draft_rows
        # Verify rows draft while few rows run and, greedy ones, while their drafts pay (the draft policy: a seeded
        # sampled request's draws must not depend on timings); compress rows always draft.
        costs, policy = self.engine.step_costs(n), self.engine.draft_policy
        most = self.k - 1
        wants = [(0, 0) if r is None or r.mode == "trust" or (r.mode == "verify" and not few)
                 else r.drafting.wants(costs, self.drafts, most) if r.mode == "verify" and policy and r.sampling.greedy
                 else (self.drafts, most) for r in self.rows[:n]]  # (lookup, micro-step) drafts at most per row
        # Trust rows' micro tokens are their step (K-1 at most); a checked row's micro drafts, the policy's
        micro_len = torch.tensor([most if r is not None and r.mode == "trust" else m
                                  for r, (_, m) in zip(self.rows[:n], wants)], device=verify.device)
        # Lookup drafts for the checked rows that look up now, from their own histories.
        indexes = [r.index if r is not None and look > 0 else None for r, (look, _) in zip(self.rows[:n], wants)]
        lookup = self._lookup(indexes, [look for look, _ in wants]) if any(i is not None for i in indexes) else None
        limits = Limits(self.eos[:n], self.max_new[:n] - verify.long(), confidence, path=verify, micro_len=micro_len)
        micro_cache = CacheView(self.micro_cache, slice(0, n)) if self.k > 1 else None
        ctx = micro_context(self.engine, CacheView(self.cache, slice(0, n)), self.cache_len[:n],
                            self.prompt_len[:n] + self.gen_len[:n] - 1)  # the state each row's step starts from
        step_tok, step_len, ended = macro_step(self.engine, list(self.states[:n].unbind(1)), live,
                                               self.gen_len[:n], limits, self._pick, micro_cache, context=ctx,
                                               lookup=lookup, lookup_width=self.drafts)
        looked = torch.tensor([r.looked if r is not None else 0 for r in self.rows[:n]], device=step_len.device)
        self._micro_calls = int(torch.where(looked > 0, 0, step_len - 1).clamp(min=0).max()) if n else 0
        drafts = torch.zeros_like(step_len)
        if any(r is not None and r.mode in CHECKED for r in self.rows[:n]):
            v = verify & live
            drafts = torch.where(v, step_len - 1, 0)
            self.gen_len[:n] -= drafts
            t0_ends = (step_tok[:, :1] == self.eos[:n]).any(-1) | (self.gen_len[:n] >= self.max_new[:n])
            ended = torch.where(v, t0_ends, ended)
            step_len = torch.where(v, 1, step_len)
            self.n_drafts[:n] = drafts
        self.step_tok[:n, : step_tok.shape[1]], self.step_len[:n] = step_tok, step_len
        return self._report(step_tok.tolist(), step_len.tolist(), ended.tolist(), drafts.tolist())  # one transfer

    def _report(self, rows: list[list[int]], lens: list[int], ended: list[bool], drafts: list[int]) -> list[RequestEvent]:
        now, events = time.perf_counter(), []
        for i, req in enumerate(self.rows[: len(rows)]):
            if req is None:
                continue
            new = self.pending[i] + rows[i][: lens[i]]  # a verify row: the drafts its pass kept, then token 0
            if req.index is not None:  # (the kept drafts went in when the pass kept them)
                req.index.extend(rows[i][: lens[i]])
            done = ended[i] or self.ended_early[i]
            self.pending[i], self.ended_early[i] = [], False
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
                self._free(req)
            events.append(RequestEvent(req.id, new, done, reason, s))
        return events
