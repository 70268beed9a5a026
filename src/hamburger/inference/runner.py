"""The model runner: a `HamburgerModel`'s base and micro-step decoder run over static KV caches.

In the spirit of gpt-fast, for Llama-style decoders (Llama, Mistral, Qwen2, Qwen3): the base's own modules
(projections, norms, MLPs, rotary embedding) do the math, one layer after another (`kv.layer_forward`), or one
native call runs them all where the native kernels take the layers (`native_layers.py`, the fast path). This file
owns the passes, the micro-step shortlist head and the drafting settings; `scheduler.py` owns the rows and the loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hamburger.errors import HamburgerError
from hamburger.inference import draft_policy as draft_policy_mod
from hamburger.inference.draft_policy import StepCosts
from hamburger.inference.kv import KVCache, MicroContext, RowSlots, layer_forward
from hamburger.inference.lookup import reply_store
from hamburger.inference.native_layers import ARGMAX, NORMED, RopeTable, final_norm, micro_native_layers, native_parts
from hamburger.inference.native_layers import native_layers as make_native
from hamburger.inference.sampling import greedy_tokens
from hamburger.kernels.qbase import native_argmax, native_head
from hamburger.kernels.qlinear import Fp16Linear, Int8Linear, QuantizedLinear, fp16_unavailable
from hamburger.model.config import DRAFT_ROWS, LOOKUP_DRAFTS, check_draft_rows, check_lookup
from hamburger.model.hamburger_model import HamburgerModel
from hamburger.model.layers import CAUSAL
from hamburger.model.slot_adapters import AdapterPass

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


def auto_draft_rows(model: HamburgerModel) -> int:
    """`draft_rows` "auto": DRAFT_ROWS on a GPU and on a CPU with packed weights (there a pass of a few positions
    costs little more than one of 1, so drafts pay), 0 on a CPU with float32/bfloat16 weights (a pass of 2 or 3
    positions costs nearly 2 or 3 passes: torch's small CPU matmuls run row by row). benchmarks/verify_costs.py
    measures the cost of a pass by positions; docs/quantize.md."""
    device = next(model.parameters()).device
    if device.type != "cpu" or any(isinstance(m, QuantizedLinear) for m in model.base.modules()):
        return DRAFT_ROWS
    return 0


def check_supported(model: HamburgerModel) -> None:
    kind = getattr(model.base.config, "model_type", "")
    if kind not in SUPPORTED:
        raise HamburgerError(f"the fast engine supports {', '.join(SUPPORTED)} models, not {kind!r}: "
                             "use the reference engine (--engine reference)")


KV_CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def kv_cache_dtype(choice: str | None, dtype: torch.dtype, native: bool) -> torch.dtype:
    """The dtype the KV caches hold: `choice` (a `KV_CACHE_DTYPES` name), or for None / "auto" float16 where the
    native layers run the passes (they write it rounded and read it back exactly: half the bytes a step reads and
    the memory a row takes; llama.cpp's default too) and the compute dtype is float32, else the compute dtype.
    The modules read a cache of another dtype in theirs."""
    if choice is None or choice == "auto":
        return torch.float16 if native and dtype == torch.float32 else dtype
    if choice not in KV_CACHE_DTYPES:
        raise HamburgerError(f"KV cache dtype {choice!r}: choose auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[choice]


def engine_kv_dtype(model: HamburgerModel, choice: str | None = None) -> torch.dtype:
    """The dtype an engine made now for `model` keeps its KV caches in (`ModelRunner.kv_dtype`)."""
    return kv_cache_dtype(choice, next(model.parameters()).dtype, native_parts(model.base.base_model) is not None)


def head_rows(model: HamburgerModel, rows: torch.Tensor) -> torch.Tensor:
    """The LM head's weights at `rows`, as the head multiplies with them. An fp16 head tied to a float input
    embedding: the embedding's rows rounded to float16, the values it was packed from (a test), without unpacking
    the whole head (which showed in the default's start-up: benchmarks/startup.py)."""
    head, emb = model.base.get_output_embeddings(), model.base.get_input_embeddings()
    if (isinstance(head, Fp16Linear) and getattr(model.base.config, "tie_word_embeddings", False)
            and isinstance(emb, torch.nn.Embedding) and emb.weight.shape == (head.out_features, head.in_features)):
        return emb.weight[rows].detach().half().float()
    return head.weight[rows]


class ModelRunner:
    """The two networks of a `HamburgerModel` over static caches: base passes and micro-step passes, the micro-step
    shortlist head, and the settings and measured step costs of drafting. The decode
    loop (`scheduler.Scheduler`) calls these; an `Engine` holds one (`engine.runner`) for its fixed batches."""

    def __init__(self, model: HamburgerModel, shortlist: bool = True,
                 draft_rows: int | str | None = "auto", lookup: int | None = None,
                 draft_policy: bool | None = None, native_layers: bool = True, kv_dtype: str | None = None) -> None:
        """`draft_rows`: verify mode drafts only in batches of at most this many rows (None: always; 0: never;
        "auto": `config.DRAFT_ROWS` where a pass of a few positions costs about one of one position, else 0; see
        `auto_draft_rows`). Compress mode always drafts: its steps are what it merges. `lookup`: verify and
        compress mode also draft by lookup (`lookup.py`) where a row's last `lookup` or more tokens occurred
        before (0: never; None: the checkpoint's `lookup`). `draft_policy`: a verify row drafts only while its
        drafts pay for their cost, measured on this engine's own steps (`draft_policy.py`); False: every step;
        None: `draft_policy.ON_BY_DEFAULT`. `native_layers`: passes of up to `NATIVE_ROWS` rows without slot
        adapters run every decoder layer in one native call where the native kernels take the layers
        (`native_layers.py`); False: the model's modules one by one, always. `kv_dtype`: what the KV caches hold
        (`kv_cache_dtype`; None: float16 where the native layers run, else the model's dtype)."""
        check_supported(model)
        self.model = model
        self.lookup = check_lookup(model.config.lookup if lookup is None else lookup)
        self.draft_rows = auto_draft_rows(model) if check_draft_rows(draft_rows) == "auto" else draft_rows
        self.draft_policy = draft_policy_mod.ON_BY_DEFAULT if draft_policy is None else draft_policy
        self.lookup_drafts = LOOKUP_DRAFTS
        self._reply_tokens = model.reply_tokens if self.lookup else None
        reply_store(self._reply_tokens)  # built now (once per model), not inside the first drafting step
        self._step_costs: dict[int, StepCosts] = {}
        # Micro-steps choose among the checkpoint's shortlist (if it has one): a head of |shortlist| rows
        # instead of the whole vocabulary. Token 0 of every step always uses the full head.
        self.vocab = model.micro_vocab if shortlist else None
        self._short: QuantizedLinear | None = None
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        if self.vocab is not None:
            self.vocab = self.vocab.to(self.device)
            head = model.base.get_output_embeddings()
            if isinstance(head, Int8Linear) and head.native and (short := head.rows(self.vocab)).native:
                self._short, self.short_head = short, None  # the head's own codes at those rows: exact
            else:
                self.short_head = head_rows(model, self.vocab).to(self.dtype).contiguous()
            if self._short is None and isinstance(head, QuantizedLinear) and fp16_unavailable(self.device) is None:
                # A quantized head's rows packed as fp16: its own float16 values for fp16; int8/int4 rows are
                # bfloat16 values, which float16 holds exactly within its normal range (a test)
                self._short, self.short_head = Fp16Linear(self.short_head), None
        self.base = model.base.base_model
        self.native = make_native(self.base) if native_layers else None
        # the micro-step decoder's layers in one native call too (their attention to the base's entries included)
        self.micro_native = micro_native_layers(model.micro, self.base.config, self.native)
        # the final norms, run inside those calls where they can be (`native_layers.FinalNorm`)
        self._norm = final_norm(self.base) if self.native is not None else None
        self._micro_norm = final_norm(model.micro) if self.micro_native is not None else None
        self.kv_dtype = kv_cache_dtype(kv_dtype, self.dtype, self.native is not None)
        self.k = model.config.max_step_tokens
        # the native calls' rotary tables, read by position (the module path computes its own each pass)
        self.rope, self.micro_rope = RopeTable(self.base.rotary_emb), RopeTable(model.micro.rotary_emb)
        wanted = model.micro.feature_layers if self.k > 1 else []
        self._stops = sorted({i for i in wanted if 0 < i < len(self.base.layers)} | {len(self.base.layers)})

    @property
    def store(self):
        """The checkpoint's stored replies, where a row's own history offers no lookup draft (`lookup.ReplyStore`),
        indexed at the first lookup rather than before the first token (benchmarks/startup.py)."""
        return reply_store(self._reply_tokens)

    def step_costs(self, rows: int) -> StepCosts:
        """The measured cost of a decode step over `rows` rows (`draft_policy.StepCosts`), kept across calls."""
        return self._step_costs.setdefault(rows, StepCosts())

    def short_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of (..., d) states over the micro-step shortlist (requires one)."""
        return self._short(h) if self._short is not None else F.linear(h, self.short_head)

    def head_argmax(self, h: torch.Tensor, shortlist: bool = False) -> torch.Tensor:
        """Each (..., d) state's greedy token, `greedy_tokens` of the LM head's logits (of the micro-step
        shortlist's with `shortlist`, as vocabulary ids): from the native kernels' fused argmax where they
        multiply the head, which hands back no logits."""
        head = self._short if shortlist else self.model.base.get_output_embeddings()
        tok = None if head is None else native_argmax(head, h.reshape(-1, h.shape[-1]))
        if tok is None:
            tok = greedy_tokens(self.short_logits(h) if shortlist else self.model.lm_head(h))
        else:
            tok = tok.view(h.shape[:-1])
        return self.vocab[tok] if shortlist else tok

    # --- the two networks ------------------------------------------------------------------------------

    def prefill(self, prompts: list[list[int]], cache: KVCache, rows: torch.Tensor) -> torch.Tensor:
        """The prompts, unmerged and right-padded, in one pass at positions 0..P-1, their entries written into
        slots 0..P-1 of the cache's `rows` (m,). Causal attention keeps each prompt's real positions from seeing
        its padding, and the padding's entries lie past the row's cache length, where the next step overwrites
        them and no mask reaches. Returns each prompt's states at its last token, (m, 1 + features, d)."""
        for layers in (self.native, self.micro_native):  # a module or tensor replaced since: seen from now on
            if layers is not None:
                layers.recheck()
        dev, lens = self.device, [len(p) for p in prompts]
        m, width = len(prompts), max(lens)
        ids = torch.zeros(m, width, dtype=torch.long, device=dev)
        for i, prompt in enumerate(prompts):
            ids[i, : lens[i]] = torch.tensor(prompt, dtype=torch.long)
        positions = torch.arange(width, device=dev)[None].expand(m, -1)
        c = cache
        scratch = KVCache(c.k.shape[0], m, c.k.shape[2], width, c.k.shape[4], c.k.dtype, dev)
        states = self.base_pass(self.model.embed(ids), positions, scratch, 0, CAUSAL, last=False)
        c.k[:, rows, :, :width], c.v[:, rows, :, :width] = scratch.k, scratch.v
        at = torch.tensor(lens, device=dev) - 1
        return torch.stack([s[torch.arange(m, device=dev), at] for s in states], 1)

    def trust_pass(self, step_tok: torch.Tensor, step_len: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                   slots: torch.Tensor) -> torch.Tensor:
        """Each row's last step (`step_tok` (n, K), `step_len` (n,) of them) smashed into one entry at its own slot
        `slots` (n,) and RoPE position `positions` (n,) (a slice where every row is at one slot, as at batch 1):
        the states after it, (n, 1 + features, d)."""
        n, step_len = step_tok.shape[0], step_len.clamp(min=1)
        embeds = self.model.smash(step_tok, step_len)[:, None]
        end = int(slots.max()) + 1
        mask = (torch.arange(end, device=slots.device)[None] <= slots[:, None])[:, None, None]
        same = n == 1 or bool((slots == slots[0]).all())
        where = int(slots[0]) if same else RowSlots(slots[:, None], end)
        return torch.stack(self.base_pass(embeds, positions[:, None], cache, where, mask, (step_len > 1)[:, None]), 1)

    def base_pass(self, embeds, positions, cache: KVCache, start: int | RowSlots, mask, merged=None,
                  last: bool = True, argmax: bool = False) -> list[torch.Tensor]:
        """Base pass over (B, T, d) at cache slots start.. -> [final normed state, feature_1 .. feature_m] at the
        last position, each (B, d); with `last=False` at every position, each (B, T, d). `positions` (B, T), or a
        `range` where one row's positions follow one another (read as a slice of the rotary table). `mask`: one for
        every layer, a function of the layer index (compress mode's merged entries carry a per-layer bias), or
        `layers.CAUSAL` (a pass from slot 0 over its own positions: a prefill).
        `merged` (B, T): the slot adapters act there (inline, in the engine's own layer code). `argmax`: the list
        ends with the head's greedy token at each final state too (`head_argmax`'s), from the native call where it
        runs the layers, the final norm and the head."""
        adapters = self.model.slot_adapters.inline(merged)
        return self._layers(embeds, positions, cache, start, mask, last, adapters, argmax)

    def _layers(self, embeds, positions, cache: KVCache, start: int | RowSlots, mask, last: bool,
                adapters: list[AdapterPass] | None, argmax: bool = False) -> list[torch.Tensor]:
        """The base's layers and final norm (and the head's argmax: `base_pass`); `adapters`: the slot adapters of
        each layer."""
        model, base = self.model, self.base
        wanted = model.micro.feature_layers if self.k > 1 else []
        depth = len(base.layers)
        feats: dict[int, torch.Tensor] = {}
        # compress mode's mask is a function of the layer (`merge.MergedMask`): the native call takes its parts
        native_mask, bias = mask.native_parts() if hasattr(mask, "native_parts") else (mask, None)
        if mask is CAUSAL:  # a prefill: SDPA's is_causal on the module path, written out for the native call
            native_mask = CAUSAL.tensor(embeds.shape[1], embeds.device)
        if adapters is None and self.native is not None and self.native.takes(embeds, cache, start, native_mask):
            norm = self._norm if self._norm is not None and self._norm.here() else None
            head = native_head(model.base.get_output_embeddings(), embeds) if argmax and norm is not None else None
            xs = self.native.run(embeds.clone(memory_format=torch.contiguous_format), self.rope(positions), cache,
                                 start, native_mask, self._stops, bias=bias, norm=norm, last=last, head=head)
            final = xs[NORMED] if norm is not None else base.norm(xs[depth][:, -1] if last else xs[depth])
            out = [final] + [(xs[i][:, -1] if last else xs[i]) if i < depth else final for i in wanted]
            if argmax:
                out.append(xs[ARGMAX] if head is not None else self.head_argmax(final))
            return out
        if isinstance(positions, range):
            positions = torch.arange(positions.start, positions.stop, device=embeds.device)[None]
        x, rope = embeds, base.rotary_emb(embeds, positions)
        for i, layer in enumerate(base.layers):
            m = mask(i) if callable(mask) else mask
            x = layer_forward(layer, x, rope, cache, i, start, m, None if adapters is None else adapters[i])
            if i + 1 in wanted and i + 1 < depth:
                feats[i + 1] = x[:, -1] if last else x
        final = base.norm(x[:, -1] if last else x)
        return [final] + [feats[i] if i < depth else final for i in wanted] + [self.head_argmax(final)] * argmax

    def micro_pass(self, x: torch.Tensor, cache: KVCache, start: int, context: MicroContext | None = None) -> torch.Tensor:
        """Micro-step decoder over (B, T, d) new inputs following `start` cached ones -> normed (B, d) at the last.

        With a `context`, each micro layer also attends to the base's entries of the layer it was copied from
        (`MicroContext.visible` of them), and the inputs take the positions after the features' state."""
        return self._micro_layers(x, cache, start, context)

    def _micro_native_pass(self, x: torch.Tensor, cache: KVCache, start: int,
                           context: MicroContext | None) -> torch.Tensor | None:
        """The micro pass in one native call (`micro_native`), or None where that call does not take it."""
        micro, b, t = self.model.micro, x.shape[0], x.shape[1]
        offsets = torch.arange(start, start + t, device=x.device)[None]
        own = torch.ones(t, start + t, dtype=torch.bool, device=x.device).tril(start)[None, None]
        if not self.micro_native.takes(x, cache, start, own):
            return None
        ctx, positions = None, offsets.expand(b, -1)
        if context is not None:
            base_k = context.cache.k
            if base_k.dtype != cache.k.dtype or base_k.stride(-1) != 1 or context.cache.v.stride() != base_k.stride():
                return None
            ctx, positions = (context.cache, context.visible), context.base_pos[:, None] + 1 + offsets
        rope = self.micro_rope(positions)
        depth = len(micro.layers)
        norm = self._micro_norm if self._micro_norm is not None and self._micro_norm.here() else None
        xs = self.micro_native.run(x.clone(memory_format=torch.contiguous_format), rope, cache, start, own, [depth],
                                   context=ctx, norm=norm, last=True)
        return xs[NORMED] if norm is not None else micro.norm(xs[depth][:, -1])

    def _micro_layers(self, x: torch.Tensor, cache: KVCache, start: int, context: MicroContext | None,
                      native: bool = True) -> torch.Tensor:
        if native and self.micro_native is not None:
            out = self._micro_native_pass(x, cache, start, context)
            if out is not None:
                return out
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
