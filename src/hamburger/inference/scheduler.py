"""The decode loop: continuous batching of every mode on the fast engine. The server steps it as requests come
and go; `Engine.generate` submits its prompts and steps it until they are done: one loop for both.

Requests join the running batch at macro-step boundaries and leave it (finished or cancelled) right after one,
each row of a preallocated cache holding one request (`rows.RowBatch`). Every row keeps its own cache length
(write slot), positions, step lengths, confidence, limits, EOS set and sampling, so a request's greedy output
does not depend on which others share the batch. One `step()` call:

1. feeds the previous macro-step's tokens of the rows still running to the base (one slot each, at the RoPE
   position of the step's last token; a verify or compress row's token 0 and drafts as positions of their own,
   after which a compress row's decided step becomes one merged entry: the verify step, `verify.check`),
2. prefills newly admitted requests into free rows (right-padded, prompt positions 0..P-1; `admission`),
3. runs one macro-step (`core.macro_step`) over every live row and reports its tokens.

When a request leaves, the highest running ones move down into the freed rows (`RowBatch.compact`).

`submit` and `cancel` may be called from any thread; `step` only from the one thread that owns the model.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from contextlib import AbstractContextManager, nullcontext

import torch

from hamburger.errors import HamburgerError
from hamburger.inference import solo, verify
from hamburger.inference.admission import (
    PREFILL_TOKENS,
    EntriesEstimate,
    Request,
    RequestEvent,
    prefill_groups,
    take_shortest,
)
from hamburger.inference.core import Limits, RowPicker, macro_step, micro_context
from hamburger.inference.kv import CacheView
from hamburger.inference.lookup import NgramIndex
from hamburger.inference.modes import TRUST, Mode, parse_mode, resolve_mode
from hamburger.inference.proposers import Drafter, drafts_wanted, proposer_for
from hamburger.inference.rows import RowBatch, rows_in
from hamburger.inference.runner import ModelRunner
from hamburger.inference.sampling import SamplingParams
from hamburger.inference.stats import GenerationStats
from hamburger.model.base import eos_ids
from hamburger.model.hamburger_model import HamburgerModel

DECODE_THREADS_ROWS = 16  # decode passes of at most this many rows run on `decode_threads`


class Scheduler:
    """`max_batch_size` rows of `max_len` KV entries each (`kv_memory`: as many rows as that many bytes of base
    cache hold); requests wait for a free row.

    A request is admitted when its expected KV entries fit a row: its prompt, and per generated token one entry in
    verify mode and fewer in trust and compress mode, which keep one entry per step (`admission.EntriesEstimate`:
    a prior, then the rate measured on the replies served; `entries_per_token` fixes a mode's rate), so a compress
    row holds a longer reply than a verify row of the same entries; a row whose entries run out all the same ends
    there (finish reason "length").

    Waiting requests are prefilled in passes of at most `prefill_tokens` padded prompt tokens, shortest first
    (`admission`; `interleave_prefill`: one pass a step, the default). `runner`: the model runner to decode with
    (its compiled passes, drafting settings and measured step costs); None: a new one with `draft_rows`,
    `draft_policy`, `lookup` and `kv_dtype` (see `ModelRunner`). `drafter`: drafts for checked rows from elsewhere
    (`proposers.Drafter`), in place of the micro-step decoder and lookup. `alone`: a request running alone, greedy,
    in verify mode (or on the plain base) is stepped on host integers (`solo.py`, the same tokens and decisions);
    False: always the batched step; None: `solo.ON_BY_DEFAULT`."""

    def __init__(self, model: HamburgerModel, max_batch_size: int = 8, max_len: int | None = None,
                 prefill_tokens: int = PREFILL_TOKENS, interleave_prefill: bool = True,
                 decode_threads: int | None = None, draft_rows: int | str | None = "auto",
                 draft_policy: bool | None = None, lookup: int | None = None, runner: ModelRunner | None = None,
                 drafter: Drafter | None = None, kv_memory: int | None = None,
                 entries_per_token: dict[str, float] | None = None, alone: bool | None = None,
                 kv_dtype: str | None = None) -> None:
        self.runner = runner or ModelRunner(model, draft_rows=draft_rows, draft_policy=draft_policy, lookup=lookup,
                                            kv_dtype=kv_dtype)
        if decode_threads is not None and decode_threads < 1:
            raise HamburgerError(f"decode_threads must be >= 1 (or None: torch's setting), got {decode_threads}")
        # Small decode passes with `decode_threads` torch threads; prefill and large decode passes with the threads
        # torch had here.
        self.decode_threads, self.prefill_threads = decode_threads, torch.get_num_threads()
        self.model, self.k, self.drafter = model, self.runner.k, drafter
        self.alone = solo.ON_BY_DEFAULT if alone is None else alone
        cfg = model.base.config
        self.context = getattr(cfg, "max_position_embeddings", None) or 2048
        self.max_len = min(max_len or self.context, self.context)
        if max_batch_size < 1 or self.max_len < 2:
            raise HamburgerError(f"need max_batch_size >= 1 and max_len >= 2, got {max_batch_size}, {self.max_len}")
        if prefill_tokens < 1:
            raise HamburgerError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        self.prefill_tokens, self.interleave_prefill = prefill_tokens, interleave_prefill
        self.entries = EntriesEstimate(getattr(model.config, "merge_window", 0) or 0, entries_per_token)
        if kv_memory is not None:
            max_batch_size = rows_in(kv_memory, self.runner, self.max_len)
        self.batch = RowBatch.for_model(self.runner, max_batch_size, self.max_len)
        self.default_eos = eos_ids(model)
        self.passes = 0  # base passes run (prefills and decode passes): a fixed batch's `base_forwards`
        self.picker = RowPicker(self.runner, self.batch)  # how each row chooses its tokens
        self._micro_calls = 0  # micro-step calls of the last macro-step (the draft policy's step costs)
        self._waiting: deque[Request] = deque()
        self._cancels: set[int] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def token_room(self, prompt_len: int, mode: str) -> int:
        """The most max_new_tokens a request of `mode` with a prompt of `prompt_len` tokens is admitted with: its
        expected KV entries within a row (`self.entries`), its positions within the model's context."""
        return max(0, min(self.context - prompt_len, self.entries.room(max(0, self.max_len - prompt_len), mode)))

    def kv_bytes(self) -> int:
        """The bytes the base's KV cache takes (every row, allocated once)."""
        return self.batch.cache.k.nbytes + self.batch.cache.v.nbytes

    @property
    def rows(self) -> list[Request | None]:
        """The request each row holds (None: free)."""
        return self.batch.requests

    # --- the thread-safe side ----------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], max_new_tokens: int | None, confidence: float | None = None,
               sampling: SamplingParams | None = None, eos_token_ids: set[int] | None = None,
               mode: str | Mode = TRUST, forced_steps: list[int] | None = None) -> int:
        """Queue a request; returns its id. Raises HamburgerError when it cannot fit in a row. `max_new_tokens` None:
        until EOS or the row's entries (or the model's context) run out.

        `mode` "verify": the micro-step decoder's tokens are drafts that the next base pass checks (greedy: kept when
        the base would choose them; sampled: speculative-sampling acceptance), so the output follows the base's own
        distribution exactly. "compress": drafts checked the same way, then each decided step's KV entries merged
        into one by the model's KV merger. `forced_steps` (trust mode): the lengths of its first steps, whatever
        the stop head says (bench's forced-steps system)."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise HamburgerError("the prompt must have at least one token")
        fill = max_new_tokens is None
        max_new_tokens = self.context - len(prompt) if fill else max_new_tokens
        if max_new_tokens < 1:
            raise HamburgerError(f"max_new_tokens must be >= 1, got {max_new_tokens} (a prompt of {len(prompt)} tokens)")
        if len(prompt) + max_new_tokens > self.context:
            raise HamburgerError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceed the "
                                 f"model's context of {self.context} tokens")
        mode, conf = resolve_mode(self.model, parse_mode(mode), confidence)  # named here: no default
        need = len(prompt) + 1 if fill else self.entries.need(len(prompt), max_new_tokens, mode)
        if need > self.max_len:
            raise HamburgerError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) need about {need} "
                                 f"KV entries in {mode} mode; a row holds {self.max_len}")
        if forced_steps is not None and mode.checked:
            raise HamburgerError(f"forced steps replay trust-mode step lengths: they do not apply to {mode} mode")
        sampling = sampling or SamplingParams()
        eos = self.default_eos if eos_token_ids is None else set(eos_token_ids)
        req = Request(next(self._ids), prompt, int(max_new_tokens), conf, sampling, eos, mode, forced=forced_steps)
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
        return self.batch.running()

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
            self.batch.compact()
            self._threads(self._decode_threads())
            start = time.perf_counter()
            n = self.batch.span()
            alone = self._alone(n)
            width = self._feed_steps(alone)
            fed_s = time.perf_counter() - start
            if not alone:  # (a request submitted meanwhile is admitted at the next step)
                self._threads(self.prefill_threads)
                self._admit()
                self._threads(self._decode_threads())
            if self.running:
                start = time.perf_counter()
                if alone:
                    step_events, self._micro_calls = solo.macro_step(self.runner, self.batch, self.max_len)
                    events += step_events
                else:
                    events += self._macro_step()
                self._measure_entries(events)
                # The decode work of a step (its base pass and its micro-steps, not the prefill): what the draft
                # policy weighs a drafting step against a plain one by.
                self.runner.step_costs(self.batch.span()).observe(width - 1, self._micro_calls,
                                                                  fed_s + time.perf_counter() - start)
        return events

    def _measure_entries(self, events: list[RequestEvent]) -> None:
        """Each finished reply teaches the admission estimate its mode's entries per token."""
        for event in (e for e in events if e.finished):
            s = event.stats
            self.entries.observe(event.mode, s.generated_tokens, s.kv_entries - s.prompt_tokens)

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
            self.batch.free(req)
        return [RequestEvent(r.id, [], True, "cancelled", r.stats, r.mode) for r in dropped]

    def _alone(self, n: int) -> bool:
        """Whether this step runs one request alone on host integers (`solo.py`): a lone greedy verify row (or the
        plain base's), with no request waiting to be admitted."""
        return (self.alone and n == 1 and not self._waiting
                and solo.takes(self.runner, self.batch, self.drafter is not None))

    def _feed_steps(self, alone: bool = False) -> int:
        """The base pass over the running rows' last steps: one smashed slot per trust row; a checked row's
        token 0 and its drafts as separate positions, of which the base keeps the ones it agrees with (`alone`: row
        0's, on host integers). Returns the pass's width (1 + the most drafts a row checked)."""
        n = self.batch.span()
        if n == 0:
            return 1
        with self._base_lora(self.rows[:n]):
            if alone:
                width = solo.check(self.runner, self.batch)
            else:
                width = 1 + int(self.batch.n_drafts[:n].max())
                if any(r is not None and r.mode.checked for r in self.rows[:n]):
                    verify.check(self.runner, self.batch, n)
                else:
                    self._feed_trust(n)
        self.passes += 1
        for req in self.rows[:n]:
            if req is not None:
                req.stats.base_forwards += 1
                req.stats.row_forwards += 1
        return width

    def _feed_trust(self, n: int) -> None:
        """Trust rows only: each row's last step smashed into one entry at its own slot (`ModelRunner.trust_pass`)."""
        b = self.batch
        positions = (b.prompt_len[:n] + b.gen_len[:n] - 1).clamp(min=0)
        b.states[:n] = self.runner.trust_pass(b.step_tok[:n, : self.k], b.step_len[:n], positions,
                                              CacheView(b.cache, slice(0, n)), torch.where(b.live[:n], b.cache_len[:n], 0))
        b.cache_len[:n] += b.live[:n].long()

    def _base_lora(self, reqs: list[Request | None]) -> AbstractContextManager[None]:
        """The base's LoRA (a checkpoint trained with `--base-training lora`) on for the trust rows `reqs` of a pass
        and off for verify and compress rows, which check drafts against the untouched base."""
        if not self.model.lora.layers:  # no LoRA (every shipped checkpoint): nothing to switch, nothing built
            return nullcontext()
        if not self.model.config.lora_rank:  # a plain model over a LoRA checkpoint's base: the untouched base
            return self.model.base_lora(False)
        trust = [r is not None and r.mode.base_lora for r in reqs]
        if all(trust) or not any(trust):
            return self.model.base_lora(bool(trust and trust[0]))
        return self.model.base_lora(torch.tensor(trust, device=self.batch.live.device))

    def _admit(self) -> None:
        """Fill free rows from the queue. Interleaved (the default): one pass of at most `prefill_tokens` padded
        tokens per step, of the shortest waiting prompts (a request passed over `MAX_PASSED` times goes first,
        oldest first), so each pass's requests get their first token in its step and running requests wait for
        one pass per step, not for a whole burst (a lower median time to the first token, a higher
        slowest tenth: benchmarks/scheduler_prefill.py). Otherwise every free row is filled now, FIFO, the prompts prefilled shortest first
        in such passes, and all get their first token in this step."""
        free = self.batch.free_rows()
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
        rows (`ModelRunner.prefill`), then the rows start their requests."""
        b = self.batch
        dev, start = b.states.device, time.perf_counter()
        rows_t = torch.tensor(rows, device=dev)
        with self._base_lora(reqs):
            b.states[rows_t] = self.runner.prefill([r.prompt for r in reqs], b.cache, rows_t)
        self.passes += 1
        for req, row, p in zip(reqs, rows, [len(r.prompt) for r in reqs]):
            b.add(req, row, p)
            req.started = start
            req.stats = GenerationStats(sequences=1, prompt_tokens=p, base_forwards=1, row_forwards=1,
                                        unmerged=req.mode.per_token)
            req.rng, req.warpers = req.sampling.generator(dev), req.sampling.warpers()
            if req.mode.lookup and self.runner.lookup:
                req.index = NgramIndex(req.prompt, self.runner.lookup)

    # --- one macro-step over the live rows ----------------------------------------------------------------------

    def _macro_step(self) -> list[RequestEvent]:
        """`core.macro_step` over the running rows, each with its own limits and sampler. A checked row emits
        token 0 now; its micro tokens (or a proposer's) are drafts for the next pass to check."""
        b, n = self.batch, self.batch.span()
        live, checked = b.live[:n].clone(), b.checked[:n]
        wants = drafts_wanted(self.runner, b, n)
        micro_len = torch.tensor([self.k - 1 if r is not None and not r.mode.checked else m
                                  for r, (_, m) in zip(self.rows[:n], wants)], device=checked.device)
        limits = Limits(b.eos[:n], b.max_new[:n], b.confidence[:n], drafting=checked, micro_len=micro_len)
        micro_cache = CacheView(b.micro_cache, slice(0, n)) if self.k > 1 else None
        base_pos = b.prompt_len[:n] + b.gen_len[:n] - 1  # the state each row's step starts from

        def ctx():  # what a micro-step decoder with context reads: made only if a micro-step runs
            return micro_context(self.runner, CacheView(b.cache, slice(0, n)), b.cache_len[:n], base_pos)

        step = macro_step(self.runner, list(b.states[:n].unbind(1)), live, b.gen_len[:n], limits, self.picker,
                          micro_cache, b.forced(n), context=ctx, width=b.drafts,
                          proposer=proposer_for(self.runner, b, wants, self.drafter))
        self._micro_calls = step.micro_calls
        # A row whose entries have run out ends here (admitted on an estimate of its entries per token: trust and
        # compress mode); its cache never holds more than `max_len` entries in use.
        ended = step.ended | live & (b.cache_len[:n] >= self.max_len)
        b.step_tok[:n, : step.tokens.shape[1]], b.step_len[:n], b.n_drafts[:n] = step.tokens, step.emitted, step.drafts
        return b.report(step.tokens.tolist(), step.emitted.tolist(), ended.tolist(), step.drafts.tolist())
