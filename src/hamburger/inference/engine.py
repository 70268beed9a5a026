"""The fast engine's fixed-batch interface: `Engine.generate` / `Engine.stream` over a list of prompts.

An `Engine` holds a `ModelRunner` (`engine.runner`: the base and micro-step passes over static caches); its
`stream` submits the prompts to a `Scheduler` sized for them, decoding with that runner, and steps it until every
prompt is done: the server's continuous batching and a fixed batch run one decode loop. `ReferenceEngine` puts the transformers reference path behind the same
interface (any architecture, trust mode only); `make_engine` picks one.

Host synchronisation on the hot path: one `any()` per micro-step (does any sequence's step go on?) and one
transfer of the step's tokens per macro-step (for streaming); nothing per token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from hamburger.errors import HamburgerError
from hamburger.inference.admission import PREFILL_TOKENS
from hamburger.inference.proposers import Drafter
from hamburger.inference.modes import TRUST, Mode, check_merger, resolve_mode
from hamburger.inference.reference import (
    Generation,
    GenerationOutput,
    StepEvent,
    check_request,
    drain,
    timed,
)
from hamburger.inference.reference import stream as reference_stream
from hamburger.inference.runner import SUPPORTED, ModelRunner, auto_draft_rows, check_supported
from hamburger.inference.sampling import SamplingParams
from hamburger.inference.scheduler import Scheduler
from hamburger.inference.stats import GenerationStats
from hamburger.model.base import eos_ids
from hamburger.model.hamburger_model import HamburgerModel

ENGINES = ("auto", "fast", "reference")
PREFILL_PASS = 4096  # padded prompt tokens a fixed batch prefills in one pass at most (attention's memory grows as T^2)
__all__ = ["ENGINES", "SUPPORTED", "Engine", "EngineGeneration", "ReferenceEngine", "auto_draft_rows",
           "check_merger", "check_supported", "make_engine", "resolve_mode"]

# What a fixed batch sums over its rows' own stats (the rest: sequences and prompt tokens at the start, the
# base passes counted by the scheduler, and the clock).
SUMMED = ("generated_tokens", "macro_steps", "micro_steps", "drafted_tokens", "lookup_drafts", "lookup_kept",
          "row_forwards", "window_entries")


@dataclass
class EngineGeneration:
    """An iterator over macro-steps (`StepEvent`s), then `output()`: the same contract as `reference.Generation`.

    Row b is request b of a scheduler of len(prompts) rows; a seeded sampling draws row b with seed + b (rows of
    one prompt differ; a batch of one draws as the server does with that seed)."""

    engine: Engine
    prompts: list[list[int]]
    max_new_tokens: int
    confidence: float
    sampling: SamplingParams
    eos_token_ids: set[int]
    forced_steps: list[list[int]] | None = None
    mode: Mode = TRUST
    tokens: list[list[int]] = field(init=False)
    steps: list[list[int]] = field(init=False)
    stats: GenerationStats = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.prompts)
        self.tokens, self.steps = [[] for _ in range(n)], [[] for _ in range(n)]
        self.stats = GenerationStats(sequences=n, prompt_tokens=sum(len(p) for p in self.prompts),
                                     unmerged=self.mode.per_token)

    def __iter__(self) -> Iterator[StepEvent]:
        return timed(self._run(), self.stats)

    def _scheduler(self) -> Scheduler:
        """A scheduler of one row per prompt, the prompts submitted; one prefill pass for them all (prompts of more
        than `PREFILL_PASS` padded tokens together: in passes of at most that many, a longer prompt alone)."""
        n, width = len(self.prompts), max(map(len, self.prompts))
        sched = Scheduler(self.engine.model, max_batch_size=n, max_len=width + self.max_new_tokens,
                          prefill_tokens=max(PREFILL_TOKENS, min(n * width, PREFILL_PASS)), interleave_prefill=False,
                          runner=self.engine.runner, drafter=self.engine.drafter, alone=self.engine.alone)
        context = sched.max_len
        if width + self.max_new_tokens > context:
            raise HamburgerError(f"prompt ({width}) + max_new_tokens ({self.max_new_tokens}) exceed the model's "
                                 f"context of {context} tokens")
        for b, prompt in enumerate(self.prompts):
            seed = self.sampling.seed
            sampling = self.sampling if seed is None or b == 0 else replace(self.sampling, seed=seed + b)
            sched.submit(prompt, self.max_new_tokens, self.confidence, sampling, self.eos_token_ids, self.mode,
                         forced_steps=None if self.forced_steps is None else self.forced_steps[b])
        return sched

    def _run(self) -> Iterator[StepEvent]:
        start = time.perf_counter()
        sched, done = self._scheduler(), [False] * len(self.prompts)
        requests = {}
        step = 0
        while sched.has_work():
            new: list[list[int]] = [[] for _ in self.prompts]
            for event in sched.step():
                new[event.id] = event.tokens
                requests[event.id] = event.stats
                done[event.id] = done[event.id] or event.finished
                if event.tokens:
                    self.tokens[event.id].extend(event.tokens)
                    self.steps[event.id].append(len(event.tokens))
            if step == 0:
                self.stats.prefill_s = time.perf_counter() - start
            for name in SUMMED:
                setattr(self.stats, name, sum(getattr(s, name) for s in requests.values()))
            self.stats.base_forwards = sched.passes
            yield StepEvent(step, new, list(done))
            step += 1

    def output(self) -> GenerationOutput:
        return GenerationOutput(self.tokens, self.steps, self.stats)


class Engine:
    """Static-cache decoding of a `HamburgerModel` (or of its plain base with `max_step_tokens` 1) over a fixed
    batch of prompts. `drafter`: drafts for verify and compress rows from elsewhere (`proposers.Drafter`) in
    place of the micro-step decoder and lookup; `alone`: see `Scheduler` (False: a lone request takes the batched
    step too); the other arguments: `ModelRunner`, made once and kept as `runner` (its passes, its measured step
    costs and the checkpoint's stored replies serve every `stream`)."""

    def __init__(self, model: HamburgerModel, shortlist: bool = True,
                 draft_rows: int | str | None = "auto", lookup: int | None = None,
                 draft_policy: bool | None = None, drafter: Drafter | None = None, native_layers: bool = True,
                 alone: bool | None = None, kv_dtype: str | None = None) -> None:
        self.runner = ModelRunner(model, shortlist=shortlist, draft_rows=draft_rows, lookup=lookup,
                                  draft_policy=draft_policy, native_layers=native_layers, kv_dtype=kv_dtype)
        self.model, self.k, self.drafter, self.alone = model, self.runner.k, drafter, alone

    def stream(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 256, confidence: float | None = None,
        sampling: SamplingParams | None = None, forced_steps: Sequence[Sequence[int]] | None = None,
        eos_token_ids: set[int] | None = None, mode: str | Mode | None = None,
    ) -> EngineGeneration:
        """`mode`: "trust" (HAMburger: drafts kept, steps smashed), "verify" (the base checks every draft and
        the output is exactly the base's) or "compress" (verify against a base whose past steps are each merged
        into one KV entry: needs a checkpoint with a KV merger); None takes the checkpoint's default.
        `confidence` None takes the checkpoint's default for that mode (verify's for compress: it drafts the same)."""
        prompts, forced_steps = check_request(prompts, max_new_tokens, forced_steps, self.k)
        mode, confidence = resolve_mode(self.model, mode, confidence)
        if mode.checked and forced_steps is not None:
            raise HamburgerError(f"forced steps replay trust-mode step lengths: they do not apply to {mode} mode")
        return EngineGeneration(self, prompts, int(max_new_tokens), confidence, sampling or SamplingParams(),
                                eos_ids(self.model) if eos_token_ids is None else set(eos_token_ids), forced_steps,
                                mode)

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> GenerationOutput:
        return drain(self.stream(prompts, **kwargs))


class ReferenceEngine:
    """The transformers reference path (`reference.stream`) behind the engine's interface: any architecture."""

    trust_only = True  # `resolve_mode` refuses verify and compress mode for it

    def __init__(self, model: HamburgerModel) -> None:
        self.model = model

    def stream(self, prompts: Sequence[Sequence[int]], mode: str | Mode | None = None, **kwargs) -> Generation:
        resolve_mode(self.model, mode, kwargs.get("confidence"), self)
        return reference_stream(self.model, prompts, **kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> GenerationOutput:
        return drain(self.stream(prompts, **kwargs))


def make_engine(model: HamburgerModel, kind: str = "auto", draft_rows: int | str | None = "auto", lookup: int | None = None,
                draft_policy: bool | None = None, kv_dtype: str | None = None) -> Engine | ReferenceEngine:
    """`fast` (static caches, Llama-style decoders), `reference` (any model), or `auto`: fast where supported.
    `draft_rows`, `lookup`, `draft_policy`, `kv_dtype`: see `ModelRunner`."""
    if kind not in ENGINES:
        raise HamburgerError(f"engine must be one of {ENGINES}, got {kind!r}")
    supported = getattr(model.base.config, "model_type", "") in SUPPORTED
    if kind == "reference" or (kind == "auto" and not supported):
        if kv_dtype not in (None, "auto"):
            raise HamburgerError(f"a KV cache dtype ({kv_dtype}) is the fast engine's: the reference engine keeps "
                                 "transformers' cache")
        return ReferenceEngine(model)
    return Engine(model, draft_rows=draft_rows, lookup=lookup, draft_policy=draft_policy, kv_dtype=kv_dtype)
