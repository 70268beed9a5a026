"""Reference generation on transformers: batched macro-steps, streaming, sampling and forced steps.

Each macro-step: token 0 from the base's own head at the current slot, tokens 1..K-1 from the
micro-step decoder while the stop head lets the step go on; then the step's tokens are smashed into
one embedding and fed to the base as one slot (one KV entry) at the position of the step's last token.
Every sequence of a batch adds exactly one slot per macro-step, so the cache stays rectangular.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from hamburger.errors import HamburgerError
from hamburger.inference.sampling import SamplingParams, Warpers, continues, sample
from hamburger.inference.stats import GenerationStats
from hamburger.model.base import eos_ids
from hamburger.model.config import check_confidence
from hamburger.model.hamburger_model import HamburgerModel


@dataclass
class StepEvent:
    """One macro-step of a batch: the tokens each sequence emitted (empty once it has finished)."""

    index: int
    tokens: list[list[int]]
    finished: list[bool]


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # generated tokens of each sequence
    steps: list[list[int]]  # step lengths of each sequence
    stats: GenerationStats
    logits: list[torch.Tensor] | None = None  # (generated, V) per sequence when asked for


@dataclass
class Generation:
    """An iterator over macro-steps; after it is exhausted, `output()` has tokens, steps and statistics."""

    model: HamburgerModel
    prompts: list[list[int]]
    max_new_tokens: int
    confidence: float
    sampling: SamplingParams
    eos_token_ids: set[int]
    forced_steps: list[list[int]] | None = None
    return_logits: bool = False
    mode: str = field(init=False, default="trust")  # the reference path runs trust mode only
    tokens: list[list[int]] = field(init=False)
    steps: list[list[int]] = field(init=False)
    stats: GenerationStats = field(init=False)
    logits: list[list[torch.Tensor]] = field(init=False)
    _start: float = field(init=False, default=0.0)
    _context: tuple = field(init=False, default=())  # (base cache, entries in use (B, T), the state's position (B,))
    _warpers: Warpers = field(init=False, default_factory=Warpers)
    _generator: torch.Generator | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        n = len(self.prompts)
        self.tokens, self.steps, self.logits = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
        self.stats = GenerationStats(sequences=n, prompt_tokens=sum(len(p) for p in self.prompts))

    def __iter__(self) -> Iterator[StepEvent]:
        return timed(self._run(), self.stats)

    def output(self) -> GenerationOutput:
        logits = [torch.cat(rows) if rows else torch.empty(0) for rows in self.logits] if self.return_logits else None
        return GenerationOutput(self.tokens, self.steps, self.stats, logits)

    def _forced_len(self, b: int, step: int) -> int | None:
        if self.forced_steps is None or step >= len(self.forced_steps[b]):
            return None
        return self.forced_steps[b][step]

    def _run(self) -> Iterator[StepEvent]:
        model = self.model
        device = next(model.parameters()).device
        bsz = len(self.prompts)
        lengths = torch.tensor([len(p) for p in self.prompts], device=device)
        pad = getattr(model.tokenizer, "pad_token_id", None) or 0
        ids, mask = left_pad(self.prompts, pad, device)
        self._warpers, self._generator = self.sampling.warpers(), self.sampling.generator(device)
        done = [False] * bsz

        from transformers import DynamicCache  # the reference engine only: transformers' classes

        self._start = time.perf_counter()
        cache = DynamicCache(config=model.base.config)
        hidden = model.base_forward(model.embed(ids), mask, (mask.cumsum(-1) - 1).clamp(min=0), cache)
        self.stats.base_forwards += 1
        self.stats.row_forwards += bsz
        for step in itertools.count():
            # What a micro-step decoder with context reads: the base's entries so far (the padding hidden).
            generated = torch.tensor([len(t) for t in self.tokens], device=device)
            self._context = (cache, mask.bool(), lengths + generated - 1)
            new = self._macro_step(hidden, step, done)
            for b, toks in enumerate(new):
                if toks:
                    self.steps[b].append(len(toks))
                    done[b] = toks[-1] in self.eos_token_ids or len(self.tokens[b]) >= self.max_new_tokens
            self.stats.macro_steps = sum(map(len, self.steps))
            self.stats.generated_tokens = sum(map(len, self.tokens))
            self.stats.micro_steps = self.stats.generated_tokens - self.stats.macro_steps
            yield StepEvent(step, new, list(done))
            if all(done):
                return
            # Smash each step into one slot at the position of its last token (finished rows get a dummy slot).
            step_ids = torch.full((bsz, self.model.config.max_step_tokens), pad, dtype=torch.long, device=device)
            step_len = torch.ones(bsz, dtype=torch.long, device=device)
            for b, toks in enumerate(new):
                step_ids[b, : len(toks)] = torch.tensor(toks, dtype=torch.long, device=device)
                step_len[b] = max(1, len(toks))
            generated = torch.tensor([len(t) for t in self.tokens], device=device)
            mask = torch.cat([mask, mask.new_ones((bsz, 1))], dim=1)
            hidden = model.base_forward(model.smash(step_ids, step_len)[:, None], mask, (lengths + generated - 1)[:, None],
                                        cache, merged=(step_len > 1)[:, None])
            self.stats.base_forwards += 1
            self.stats.row_forwards += done.count(False)

    def _macro_step(self, hidden: tuple[torch.Tensor, ...], step: int, done: list[bool]) -> list[list[int]]:
        """Token 0 from the base's head, then micro-steps while any live sequence's step goes on."""
        model = self.model
        h0 = hidden[-1][:, -1]
        logits = model.lm_head(h0)
        tok = sample(logits, self.sampling, self._generator, self._warpers)
        new: list[list[int]] = [[] for _ in done]
        live = [not d for d in done]
        go_on = self._record(tok, logits, model.stop_head(h0), live, step, new)
        if step == 0:
            self.stats.prefill_s = time.perf_counter() - self._start  # time to first token
        from transformers import DynamicCache

        micro_cache = DynamicCache()
        x = torch.cat([model.micro.features(hidden, (slice(None), -1)), model.embed(tok)[:, None]], dim=1)
        inputs = x[:, :0]  # the step's inputs so far, for a decoder with context
        while any(go_on):
            if model.micro.context:
                inputs = torch.cat([inputs, x], dim=1)
                hm = self._micro_with_context(inputs)
            else:
                hm = model.micro(x, micro_cache)[:, -1]
            logits = model.lm_head(hm)
            tok = sample(logits, self.sampling, self._generator, self._warpers)
            go_on = self._record(tok, logits, model.stop_head(hm), go_on, step, new)
            x = model.embed(tok)[:, None]
        return new

    def _micro_with_context(self, x: torch.Tensor) -> torch.Tensor:
        """The micro-step decoder with context over all of the step's inputs so far (B, q, d) -> the last state
        (B, d), recomputed from the start each micro-step (no cache: the oracle, not the fast path). Each micro
        layer also reads the base's cached keys and values of its source layer, the latest `micro.context` real
        entries, and the inputs take the positions after the base state's (as `train-drafter` trains it)."""
        micro = self.model.micro
        cache, valid, base_pos = self._context
        q = x.shape[1]
        latest = valid.long().flip(-1).cumsum(-1).flip(-1) <= micro.context
        ctx = (valid & latest)[:, None, None, :].expand(-1, 1, q, -1)
        own = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()[None, None].expand(x.shape[0], 1, q, q)
        layers = [cache.layers[i] for i in micro.context_layers]
        positions = base_pos[:, None] + 1 + torch.arange(q, device=x.device)
        out = micro.forward_context(x, positions, [c.keys for c in layers], [c.values for c in layers],
                                    torch.cat([ctx, own], -1))
        return out[:, -1]

    def _record(
        self, tok: torch.Tensor, logits: torch.Tensor, stop_logits: torch.Tensor, active: list[bool], step: int,
        new: list[list[int]],
    ) -> list[bool]:
        """Append the token of each active sequence; return which of them take one more token in this step."""
        more = continues(stop_logits, self.confidence).tolist()
        go_on = [False] * len(active)
        for b, (token, is_active) in enumerate(zip(tok.tolist(), active)):
            if is_active:
                self.tokens[b].append(token)
                new[b].append(token)
                if self.return_logits:
                    self.logits[b].append(logits[b][None].float().clone())
                go_on[b] = self._goes_on(b, step, new[b], more[b])
        return go_on

    def _goes_on(self, b: int, step: int, step_tokens: list[int], stop_head_says: bool) -> bool:
        """Whether sequence b's current step takes another token (before knowing which)."""
        if step_tokens[-1] in self.eos_token_ids or len(self.tokens[b]) >= self.max_new_tokens:
            return False
        if len(step_tokens) >= self.model.config.max_step_tokens:
            return False
        forced = self._forced_len(b, step)
        return stop_head_says if forced is None else len(step_tokens) < forced


def left_pad(prompts: Sequence[Sequence[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, width) ids and 0/1 mask, prompts aligned to the right: every row's next slot is the same column."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p, device=device)
        mask[b, width - len(p):] = 1
    return ids, mask


def timed(steps: Iterator[StepEvent], stats: GenerationStats) -> Iterator[StepEvent]:
    """Run a decoder's macro-steps under inference mode, and set `stats.decode_s` when they end.

    The clock covers the decoder's own work only, not what the consumer does between steps; the decoder
    sets `stats.prefill_s` (time to first token) itself. A consumer that stops early (a stop string) and closes
    the iterator still gets `decode_s` for the steps it took.
    """
    busy = 0.0
    try:
        while True:
            start = time.perf_counter()
            with torch.inference_mode():
                event = next(steps, None)
            busy += time.perf_counter() - start
            if event is None:
                break
            yield event
    finally:
        stats.decode_s = busy - stats.prefill_s


def check_request(prompts: Sequence[Sequence[int]], max_new_tokens: int, forced_steps: Sequence[Sequence[int]] | None,
                  max_step_tokens: int) -> tuple[list[list[int]], list[list[int]] | None]:
    """Validate a generation request (the same rules for every decoder); returns plain-int copies."""
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise HamburgerError("every prompt must have at least one token")
    if max_new_tokens <= 0:
        raise HamburgerError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    k = max_step_tokens
    if forced_steps is not None:
        forced_steps = [list(map(int, f)) for f in forced_steps]
        if len(forced_steps) != len(prompts) or any(not 1 <= s <= k for f in forced_steps for s in f):
            raise HamburgerError(f"forced_steps needs one list per prompt of step lengths in 1..{k}")
    return prompts, forced_steps


def drain(gen) -> GenerationOutput:
    """Run a generation (any decoder's) to its end and return its output."""
    for _ in gen:
        pass
    return gen.output()


def stream(
    model: HamburgerModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 256,
    confidence: float | None = None,
    sampling: SamplingParams | None = None,
    forced_steps: Sequence[Sequence[int]] | None = None,
    return_logits: bool = False,
    eos_token_ids: set[int] | None = None,
) -> Generation:
    """Validate inputs and return a `Generation` to iterate over, one `StepEvent` per macro-step."""
    prompts, forced_steps = check_request(prompts, max_new_tokens, forced_steps, model.config.max_step_tokens)
    confidence = check_confidence(model.config.default_confidence if confidence is None else confidence)
    return Generation(
        model=model,
        prompts=prompts,
        max_new_tokens=int(max_new_tokens),
        confidence=confidence,
        sampling=sampling or SamplingParams(),
        eos_token_ids=eos_ids(model) if eos_token_ids is None else set(eos_token_ids),
        forced_steps=forced_steps,
        return_logits=return_logits,
    )


def generate(model: HamburgerModel, prompts: Sequence[Sequence[int]], **kwargs) -> GenerationOutput:
    """Run `stream` to the end. Takes the same keyword arguments."""
    return drain(stream(model, prompts, **kwargs))
