"""The fast engine: static KV caches, batched macro-steps, one host transfer per macro-step.

In the spirit of gpt-fast, for Llama-style decoders (Llama, Mistral, Qwen2, Qwen3): the base's own
modules (projections, norms, MLPs, rotary embedding) do the math, and this file owns the cache and the
loop. Every sequence of a batch adds one KV entry per macro-step at the same slot, so the cache stays
rectangular while each sequence keeps its own positions, step lengths and stop state. The same engine
runs the plain base (one token per step, no micro-step decoder), so base and HAMburger compare like for like.

Host synchronisation on the hot path: one `any()` per micro-step (does any sequence's step go on?) and
one transfer of the step's tokens per macro-step (for streaming); nothing per token.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hamburger.errors import HamburgerError
from hamburger.inference import draft_policy as draft_policy_mod
from hamburger.inference.core import Limits, MicroContext, macro_step, micro_context
from hamburger.inference.draft_policy import StepCosts
from hamburger.inference.kv import KVCache, RowSlots, layer_forward
from hamburger.inference.lookup import reply_store
from hamburger.kernels.qlinear import Fp16Linear, QuantizedLinear, fp16_unavailable
from hamburger.inference.reference import (
    Generation,
    GenerationOutput,
    StepEvent,
    check_request,
    drain,
    eos_ids,
    left_pad,
    timed,
)
from hamburger.inference.reference import stream as reference_stream
from hamburger.inference.sampling import SamplingParams, sample
from hamburger.inference.stats import GenerationStats
from hamburger.model.config import (
    DRAFT_ROWS,
    LOOKUP_DRAFTS,
    check_confidence,
    check_draft_rows,
    check_lookup,
    check_mode,
)
from hamburger.model.hamburger_model import HamburgerModel
from hamburger.model.slot_adapters import AdapterPass

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
ENGINES = ("auto", "fast", "reference")


def auto_draft_rows(model: HamburgerModel) -> int:
    """`draft_rows` "auto": DRAFT_ROWS on a GPU and on a CPU with packed weights (a pass of 4 positions costs 1.08x
    one of 1 with fp16, 1.22x with int8/int4 in bfloat16, where verify mode runs at 1.9-2.0x its base at batch 1;
    docs/quantize.md), 0 on a CPU with float32/bfloat16 weights (2 positions 1.55x, 3 positions 1.92x: torch's small
    CPU matmuls run row by row)."""
    device = next(model.parameters()).device
    if device.type != "cpu" or any(isinstance(m, QuantizedLinear) for m in model.base.modules()):
        return DRAFT_ROWS
    return 0


def check_merger(model: HamburgerModel) -> None:
    """Compress mode needs a KV merger fitted to the base, for steps as long as the model makes."""
    merger = model.merger
    if merger is None:
        raise HamburgerError("compress mode needs a KV merger in the checkpoint (merger.safetensors): fit one with "
                             "`hamburger train-merger` and copy its merger.safetensors into the checkpoint folder")
    if merger.max_step_tokens < model.config.max_step_tokens:
        raise HamburgerError(f"the KV merger takes steps of up to {merger.max_step_tokens} tokens, the model makes "
                             f"steps of up to {model.config.max_step_tokens}")


def resolve_mode(model: HamburgerModel, mode: str | None = None, confidence: float | None = None,
                 engine: Engine | ReferenceEngine | None = None) -> tuple[str, float]:
    """A request's mode and confidence, checked: the mode (None: the checkpoint's `default_mode`; compress needs
    the checkpoint's KV merger; the reference `engine` runs trust mode only) and its confidence (None:
    `default_confidence` for trust mode, `verify_confidence` for verify and compress mode, which draft alike). The
    engines, the scheduler, generate and the demo all decide here."""
    cfg = model.config
    resolved = check_mode(cfg.default_mode if mode is None else mode)
    if isinstance(engine, ReferenceEngine) and resolved != "trust":
        why = f"{resolved} mode" if mode is not None else f"this checkpoint's default mode, {resolved},"
        raise HamburgerError(f"{why} runs on the fast engine only (Llama, Mistral, Qwen2, Qwen3 bases); the "
                             "reference engine runs trust mode only: add --mode trust")
    if resolved == "compress":
        check_merger(model)
    default = cfg.default_confidence if resolved == "trust" else cfg.verify_confidence
    return resolved, check_confidence(default if confidence is None else confidence)


def check_supported(model: HamburgerModel) -> None:
    kind = getattr(model.base.config, "model_type", "")
    if kind not in SUPPORTED:
        raise HamburgerError(f"the fast engine supports {', '.join(SUPPORTED)} models, not {kind!r}: "
                             "use the reference engine (--engine reference)")



@dataclass
class EngineGeneration:
    """An iterator over macro-steps (`StepEvent`s), then `output()`: the same contract as `reference.Generation`."""

    engine: Engine
    prompts: list[list[int]]
    max_new_tokens: int
    confidence: float
    sampling: SamplingParams
    eos_token_ids: set[int]
    forced_steps: list[list[int]] | None = None
    mode: str = "trust"
    tokens: list[list[int]] = field(init=False)
    steps: list[list[int]] = field(init=False)
    stats: GenerationStats = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.prompts)
        self.tokens, self.steps = [[] for _ in range(n)], [[] for _ in range(n)]
        self.stats = GenerationStats(sequences=n, prompt_tokens=sum(len(p) for p in self.prompts))

    def __iter__(self) -> Iterator[StepEvent]:
        if self.mode in ("verify", "compress"):
            from hamburger.inference.verify import run_verify  # noqa: PLC0415 - verify builds on this module

            merger = self.engine.model.merger if self.mode == "compress" else None
            return timed(run_verify(self.engine, self, merger), self.stats)
        return timed(self.engine.run(self), self.stats)

    def output(self) -> GenerationOutput:
        return GenerationOutput(self.tokens, self.steps, self.stats)


class Engine:
    """Static-cache decoding of a `HamburgerModel` (or of its plain base with `max_step_tokens` 1)."""

    def __init__(self, model: HamburgerModel, compile: bool = False, shortlist: bool = True,
                 draft_rows: int | str | None = "auto", lookup: int | None = None,
                 draft_policy: bool | None = None) -> None:
        """`draft_rows`: verify mode drafts only in batches of at most this many rows (None: always; 0: never;
        "auto": `config.DRAFT_ROWS` where a pass of a few positions costs about one of one position, else 0; see
        `auto_draft_rows`). Compress mode always drafts: its steps are what it merges. `lookup`: verify and
        compress mode also draft by lookup (`lookup.py`) where a row's last `lookup` or more tokens occurred
        before (0: never; None: the checkpoint's `lookup`). `draft_policy`: a verify row drafts only while its
        drafts pay for their cost, measured on this engine's own steps (`draft_policy.py`); False: every step;
        None: `draft_policy.ON_BY_DEFAULT`."""
        check_supported(model)
        self.model = model
        self.lookup = check_lookup(model.config.lookup if lookup is None else lookup)
        self.draft_rows = auto_draft_rows(model) if check_draft_rows(draft_rows) == "auto" else draft_rows
        self.draft_policy = draft_policy_mod.ON_BY_DEFAULT if draft_policy is None else draft_policy
        self.lookup_drafts = LOOKUP_DRAFTS
        # the checkpoint's stored replies, where a row's own history offers no lookup draft
        self.store = reply_store(model.reply_tokens) if self.lookup else None
        self._step_costs: dict[int, StepCosts] = {}
        # Micro-steps choose among the checkpoint's shortlist (if it has one): a head of |shortlist| rows
        # instead of the whole vocabulary. Token 0 of every step always uses the full head.
        self.vocab = model.micro_vocab if shortlist else None
        self._short: Fp16Linear | None = None
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        if self.vocab is not None:
            self.vocab = self.vocab.to(self.device)
            head = model.base.get_output_embeddings()
            self.short_head = head.weight[self.vocab].to(self.dtype).contiguous()
            if isinstance(head, QuantizedLinear) and fp16_unavailable(self.device) is None:
                # A quantized head's rows packed as fp16: its own float16 values for fp16; int8/int4 rows are
                # bfloat16 values, which float16 holds exactly within its normal range (a test)
                self._short, self.short_head = Fp16Linear(self.short_head), None
        self.base = model.base.base_model
        self.k = model.config.max_step_tokens
        self.compiled = False
        # What --compile compiles: every base pass (the slot adapters inline in smashed ones) and every micro-step.
        self._layers_fn = self._compile(self._layers) if compile else self._layers
        self._micro_fn = self._compile(self._micro_layers) if compile else self._micro_layers

    def _compile(self, fn):
        """`fn` compiled (dynamic shapes: the cache grows each step), falling back to eager if compiling fails.

        torch.compile is lazy, so failures (no C++ compiler, an unsupported op) show at the first call. Each kind
        of pass compiles once (about a minute each on 2 CPU cores): the prefill, a step, a step with a smashed
        slot (the slot adapters inline), verify mode's multi-position passes.
        """
        try:
            # One graph per kind of pass (prefill, step, smashed step at every or some rows, verify passes...).
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
            compiled = torch.compile(fn, dynamic=True)
        except Exception as exc:  # noqa: BLE001 - any compiler failure falls back to eager
            warnings.warn(f"torch.compile is unavailable ({exc}); running eagerly", stacklevel=2)
            return fn
        self.compiled = True

        def run(*args):
            if self.compiled:
                try:
                    return compiled(*args)
                except Exception as exc:  # noqa: BLE001
                    warnings.warn(f"torch.compile failed ({type(exc).__name__}: {exc}); running eagerly", stacklevel=2)
                    self.compiled = False
            return fn(*args)

        return run

    def step_costs(self, rows: int) -> StepCosts:
        """The measured cost of a decode step over `rows` rows (`draft_policy.StepCosts`), kept across calls."""
        return self._step_costs.setdefault(rows, StepCosts())

    def short_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of (..., d) states over the micro-step shortlist (requires one)."""
        return self._short(h) if self._short is not None else F.linear(h, self.short_head)

    # --- the two networks ------------------------------------------------------------------------------

    def base_pass(self, embeds, positions, cache: KVCache, start: int | RowSlots, mask, merged=None,
              last: bool = True) -> list[torch.Tensor]:
        """Base pass over (B, T, d) at cache slots start.. -> [final normed state, feature_1 .. feature_m] at the
        last position, each (B, d); with `last=False` at every position, each (B, T, d). `mask`: one for every
        layer, or a function of the layer index (compress mode's merged entries carry a per-layer bias).
        `merged` (B, T): the slot adapters act there (inline, in the engine's own layer code)."""
        adapters = self.model.slot_adapters.inline(merged)
        return self._layers_fn(embeds, positions, cache, start, mask, last, adapters)

    def _layers(self, embeds, positions, cache: KVCache, start: int | RowSlots, mask, last: bool,
                adapters: list[AdapterPass] | None) -> list[torch.Tensor]:
        """The base's layers and final norm (what --compile compiles); `adapters`: the slot adapters of each layer."""
        model, base = self.model, self.base
        wanted = model.micro.feature_layers if self.k > 1 else []
        depth = len(base.layers)
        rope = base.rotary_emb(embeds, positions)
        feats: dict[int, torch.Tensor] = {}
        x = embeds
        for i, layer in enumerate(base.layers):
            x = layer_forward(layer, x, rope, cache, i, start, mask(i) if callable(mask) else mask,
                              None if adapters is None else adapters[i])
            if i + 1 in wanted and i + 1 < depth:
                feats[i + 1] = x[:, -1] if last else x
        final = base.norm(x[:, -1] if last else x)
        return [final] + [feats[i] if i < depth else final for i in wanted]

    def micro_pass(self, x: torch.Tensor, cache: KVCache, start: int, context: MicroContext | None = None) -> torch.Tensor:
        """Micro-step decoder over (B, T, d) new inputs following `start` cached ones -> normed (B, d) at the last.

        With a `context`, each micro layer also attends to the base's entries of the layer it was copied from
        (`MicroContext.visible` of them), and the inputs take the positions after the features' state."""
        return self._micro_fn(x, cache, start, context)

    def _micro_layers(self, x: torch.Tensor, cache: KVCache, start: int, context: MicroContext | None) -> torch.Tensor:
        micro = self.model.micro
        b, t, _ = x.shape
        offsets = torch.arange(start, start + t, device=x.device)[None]
        own = torch.ones(t, start + t, dtype=torch.bool, device=x.device).tril(start)[None, None]
        if context is None:
            rope = micro.rotary_emb(x, offsets.expand(b, -1))
            for i, layer in enumerate(micro.layers):
                x = layer_forward(layer, x, rope, cache, i, start, own)
            return micro.norm(x[:, -1])
        rope = micro.rotary_emb(x, context.base_pos[:, None] + 1 + offsets)
        end = context.visible.shape[1]
        seen = context.visible[:, None, None]  # (B, 1, 1, end)
        base_k, base_v = context.cache.k, context.cache.v
        for i in range(len(micro.layers)):
            src = micro.context_layers[i]
            x = micro.context_layer(i, x, rope, (None, None, own), (base_k[src, :, :, :end], base_v[src, :, :, :end], seen),
                                    write=lambda k, v, i=i: cache.update(i, start, k, v))
        return micro.norm(x[:, -1])

    # --- the loop ------------------------------------------------------------------------------------------

    def start(self, gen: EngineGeneration, extra: int = 0):
        """Allocate the caches and prefill the prompts (left-padded, one pass). Returns the prefill's states,
        the base's cache (prompt width + budget + `extra` slots), the micro-step decoder's cache (None at K 1),
        the slots in use (B, max_len) (False on padding) and the prompt lengths (B,)."""
        model, k, dev = self.model, self.k, self.device
        cfg = model.base.config
        bsz = len(gen.prompts)
        lengths = torch.tensor([len(p) for p in gen.prompts], device=dev)
        width = int(lengths.max())
        if width + gen.max_new_tokens > getattr(cfg, "max_position_embeddings", width + gen.max_new_tokens):
            raise HamburgerError(f"prompt ({width}) + max_new_tokens ({gen.max_new_tokens}) exceed the model's "
                                 f"context of {cfg.max_position_embeddings} tokens")
        max_len = width + gen.max_new_tokens + extra
        cache = KVCache.for_layers(self.base.layers, cfg, bsz, max_len, self.dtype, dev)
        micro_cache = (KVCache.for_layers(model.micro.layers, cfg, bsz, model.micro.num_features + k, self.dtype, dev)
                       if k > 1 else None)
        ids, prompt_mask = left_pad(gen.prompts, getattr(model.tokenizer, "pad_token_id", None) or 0, dev)
        valid = torch.ones(bsz, max_len, dtype=torch.bool, device=dev)  # slots after the prompt: all in use
        valid[:, :width] = prompt_mask.bool()
        positions = (valid[:, :width].long().cumsum(-1) - 1).clamp(min=0)
        mask = valid[:, None, None, :width] & torch.ones(width, width, dtype=torch.bool, device=dev).tril()[None, None]
        states = self.base_pass(model.embed(ids), positions, cache, 0, mask)
        gen.stats.base_forwards += 1
        gen.stats.row_forwards += bsz
        return states, cache, micro_cache, valid, lengths

    def run(self, gen: EngineGeneration) -> Iterator[StepEvent]:
        """Trust mode: one base pass per macro-step over every row, each step smashed into one slot."""
        model, dev = self.model, self.device
        bsz = len(gen.prompts)
        start_t = time.perf_counter()
        states, cache, micro_cache, valid, lengths = self.start(gen)
        slot = int(lengths.max())
        eos = torch.tensor(sorted(gen.eos_token_ids) or [-1], device=dev)[None]
        limits = Limits(eos, gen.max_new_tokens, gen.confidence)
        forced = None
        if gen.forced_steps is not None:
            most = max(map(len, gen.forced_steps))
            forced = torch.zeros(bsz, most + 1, dtype=torch.long, device=dev)
            for b, f in enumerate(gen.forced_steps):
                forced[b, : len(f)] = torch.tensor(f, dtype=torch.long)
        warpers, rng = gen.sampling.warpers(), gen.sampling.generator(dev)

        def pick(h: torch.Tensor, active: torch.Tensor, micro: bool) -> torch.Tensor:
            if micro and self.vocab is not None:  # the micro-step shortlist head
                return self.vocab[sample(self.short_logits(h), gen.sampling, rng, warpers)]
            return sample(model.lm_head(h), gen.sampling, rng, warpers)

        gen_len = torch.zeros(bsz, dtype=torch.long, device=dev)
        done = torch.zeros(bsz, dtype=torch.bool, device=dev)
        for step in range(gen.max_new_tokens):
            forced_len = None if forced is None else forced[:, min(step, forced.shape[1] - 1)]
            # The base's state that the step starts from: the last prompt token, then each step's last token.
            ctx = micro_context(self, cache, slot, lengths + gen_len - 1, valid)
            step_tok, step_len, ended = macro_step(self, states, ~done, gen_len, limits, pick, micro_cache, forced_len,
                                                   ctx)
            if step == 0:
                gen.stats.prefill_s = time.perf_counter() - start_t
            done |= ended
            rows, lens, dn = step_tok.tolist(), step_len.tolist(), done.tolist()  # the one transfer per macro-step
            new = [row[:n] for row, n in zip(rows, lens)]
            for b, toks in enumerate(new):
                if toks:
                    gen.tokens[b].extend(toks)
                    gen.steps[b].append(len(toks))
            gen.stats.macro_steps = sum(map(len, gen.steps))
            gen.stats.generated_tokens = sum(map(len, gen.tokens))
            gen.stats.micro_steps = gen.stats.generated_tokens - gen.stats.macro_steps
            yield StepEvent(step, new, dn)
            if all(dn):
                return
            # Smash each step into one slot at the position of its last token (finished rows: a dummy slot).
            embeds = model.smash(step_tok, step_len.clamp(min=1))[:, None]
            pos = (lengths + gen_len - 1)[:, None]
            step_mask = valid[:, None, None, : slot + 1]
            states = self.base_pass(embeds, pos, cache, slot, step_mask, (step_len > 1)[:, None])
            gen.stats.base_forwards += 1
            gen.stats.row_forwards += dn.count(False)
            slot += 1

    def stream(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 256, confidence: float | None = None,
        sampling: SamplingParams | None = None, forced_steps: Sequence[Sequence[int]] | None = None,
        eos_token_ids: set[int] | None = None, mode: str | None = None,
    ) -> EngineGeneration:
        """`mode`: "trust" (HAMburger: drafts kept, steps smashed), "verify" (the base checks every draft and
        the output is exactly the base's) or "compress" (verify against a base whose past steps are each merged
        into one KV entry: needs a checkpoint with a KV merger); None takes the checkpoint's default.
        `confidence` None takes the checkpoint's default for that mode (verify's for compress: it drafts the same)."""
        prompts, forced_steps = check_request(prompts, max_new_tokens, forced_steps, self.k)
        mode, confidence = resolve_mode(self.model, mode, confidence)
        if mode != "trust" and forced_steps is not None:
            raise HamburgerError(f"forced steps replay trust-mode step lengths: they do not apply to {mode} mode")
        return EngineGeneration(self, prompts, int(max_new_tokens), confidence, sampling or SamplingParams(),
                                eos_ids(self.model) if eos_token_ids is None else set(eos_token_ids), forced_steps,
                                mode)

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> GenerationOutput:
        return drain(self.stream(prompts, **kwargs))


class ReferenceEngine:
    """The transformers reference path (`reference.stream`) behind the engine's interface: any architecture."""

    compiled = False

    def __init__(self, model: HamburgerModel) -> None:
        self.model = model

    def stream(self, prompts: Sequence[Sequence[int]], mode: str | None = None, **kwargs) -> Generation:
        resolve_mode(self.model, mode, kwargs.get("confidence"), engine=self)  # trust mode only
        return reference_stream(self.model, prompts, **kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> GenerationOutput:
        return drain(self.stream(prompts, **kwargs))


def make_engine(model: HamburgerModel, kind: str = "auto", compile: bool = False,
                draft_rows: int | str | None = "auto", lookup: int | None = None,
                draft_policy: bool | None = None) -> Engine | ReferenceEngine:
    """`fast` (static caches, Llama-style decoders), `reference` (any model), or `auto`: fast where supported.
    `draft_rows`, `lookup`, `draft_policy`: see `Engine`."""
    if kind not in ENGINES:
        raise HamburgerError(f"engine must be one of {ENGINES}, got {kind!r}")
    supported = getattr(model.base.config, "model_type", "") in SUPPORTED
    if kind == "reference" or (kind == "auto" and not supported):
        return ReferenceEngine(model)
    return Engine(model, compile=compile, draft_rows=draft_rows, lookup=lookup, draft_policy=draft_policy)
