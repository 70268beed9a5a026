"""`HamburgerModel`: a base causal LM + compositional embedder + micro-step decoder + stop head.

Also the training forward and loss on segmented batches, and checkpoints (config.json + model.safetensors).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file, save_model
from torch import nn
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from hamburger.errors import HamburgerError
from hamburger.model.base import DEFAULT_MODEL, cache_kwargs, eos_ids, fingerprint, load_base
from hamburger.model.config import HamburgerConfig
from hamburger.model.embedder import CompositionalEmbedder
from hamburger.model.micro_decoder import MicroStepDecoder, StopHead
from hamburger.model.outputs import STOP_LOSS_WEIGHT, HamburgerOutput, sparse_kl
from hamburger.model.slot_adapters import SlotAdapters

if TYPE_CHECKING:
    from hamburger.training.data import SegmentedBatch

WEIGHTS_NAME = "model.safetensors"
MERGER_NAME = "merger.safetensors"  # compress mode's KV merger, when the checkpoint has one
REPLIES_NAME = "replies.safetensors"  # the base's own replies, verify mode's lookup drafts (`lookup.ReplyStore`)
MICRO_VOCAB_KEY = "micro_vocab"
NEW_MODULES = ("embedder", "micro", "stop_head", "slot_adapters")  # what `hamburger train` trains
DRAFT_STOP_HEAD = "draft_stop_head"  # verify/compress mode's own stop head, when the checkpoint has one


def is_trained_key(key: str) -> bool:
    """State-dict keys a checkpoint stores when the base itself is not shipped: new modules and LoRA adapters."""
    return key.split(".")[0] in (*NEW_MODULES, DRAFT_STOP_HEAD) or ".lora_" in key


class HamburgerModel(nn.Module):
    def __init__(
        self, base: PreTrainedModel, config: HamburgerConfig, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> None:
        super().__init__()
        bcfg = base.config
        self.config = config.resolve(bcfg.num_hidden_layers, bcfg.hidden_size)
        self.base = base
        self.tokenizer = tokenizer
        cfg = self.config
        self.embedder = CompositionalEmbedder(
            bcfg.hidden_size, bcfg.num_attention_heads, cfg.max_step_tokens, cfg.position_dim
        )
        self.micro = MicroStepDecoder(base, cfg.micro_layers, cfg.feature_layers, cfg.init_micro_from_top,
                                       cfg.micro_context)
        self.stop_head = StopHead(bcfg.hidden_size, cfg.stop_hidden)
        self.draft_stop_head: StopHead | None = None
        self.slot_adapters = SlotAdapters(base, cfg.slot_adapter_rank, cfg.slot_adapter_alpha, cfg.slot_adapter_targets)
        if cfg.lora_rank:
            from peft import LoraConfig, inject_adapter_in_model  # noqa: PLC0415 - only for LoRA checkpoints

            lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=cfg.lora_targets,
                              lora_dropout=0.0)
            inject_adapter_in_model(lora, base)  # B starts at zero: the base's outputs are unchanged
        # Optional shortlist of token ids the fast engine's micro-steps choose from (a cheaper LM head):
        # set by `hamburger export --micro-vocab`, stored in the checkpoint as MICRO_VOCAB_KEY.
        self.micro_vocab: torch.Tensor | None = None
        # Optional: the base's own replies (N,) int32, -1 after each, that verify mode drafts from by lookup
        self.reply_tokens: torch.Tensor | None = None
        # Optional KV merger for compress mode (merger.py): stored beside the weights as MERGER_NAME. Kept out
        # of the module tree, so the weights file and the trained-module counts stay as they were.
        self.__dict__["merger"] = None
        dtype = next(base.parameters()).dtype
        device = next(base.parameters()).device
        for name in NEW_MODULES:
            getattr(self, name).to(device=device, dtype=dtype)
        if cfg.draft_stop_head:
            self.add_draft_stop_head()

    def add_draft_stop_head(self) -> StopHead:
        """Give verify and compress mode a stop head of their own, starting as a copy of the trust one."""
        if self.draft_stop_head is None:
            self.draft_stop_head = copy.deepcopy(self.stop_head)
            self.config.draft_stop_head = True
        return self.draft_stop_head

    def stop_logits(self, h: torch.Tensor, drafting: torch.Tensor | bool = False) -> torch.Tensor:
        """The stop head's logits for states (n, d): trust mode's head, or for `drafting` rows ((n,) or one bool:
        verify and compress mode's drafts) the draft stop head where the checkpoint has one."""
        draft = self.draft_stop_head
        if draft is None or drafting is False:
            return self.stop_head(h)
        if drafting is True:
            return draft(h)
        return torch.where(drafting, draft(h), self.stop_head(h))

    # --- construction and checkpoints -------------------------------------------------------------

    @classmethod
    def from_base(
        cls, ref: str | None = None, config: HamburgerConfig | None = None,
        dtype: torch.dtype = torch.float32, device: str = "cpu",
    ) -> HamburgerModel:
        """A fresh (untrained) HAMburger around a base loaded from `ref` (hub id, path, or the default)."""
        base, tokenizer = load_base(ref, dtype=dtype, device=device)
        return cls.wrap(base, tokenizer, config)

    @classmethod
    def wrap(
        cls, base: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, config: HamburgerConfig | None = None
    ) -> HamburgerModel:
        config = config or HamburgerConfig()
        config.base_model = config.base_model or getattr(base.config, "hamburger_ref", "") or base.config.name_or_path
        config.base_fingerprint = fingerprint(base)
        return cls(base, config, tokenizer)

    @classmethod
    def plain(cls, base: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> HamburgerModel:
        """The base alone, one token per step (exactly its greedy output), with the smallest unused micro-decoder."""
        config = HamburgerConfig(max_step_tokens=1, micro_layers=1, num_features=1, init_micro_from_top=False)
        return cls.wrap(base, tokenizer, config).eval()

    def save_pretrained(self, directory: str | Path, dtype: torch.dtype | None = None) -> None:
        """config.json + model.safetensors; the base weights are included only if they were trained.

        `dtype` (e.g. bfloat16) stores floating-point weights smaller; loading casts them back.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.config.save(directory)
        if self.config.base_in_checkpoint and dtype is None and self.micro_vocab is None:
            save_model(self, str(directory / WEIGHTS_NAME))
            self._save_extras(directory)
            return
        keep = self.state_dict().items() if self.config.base_in_checkpoint else (
            (k, v) for k, v in self.state_dict().items() if is_trained_key(k))
        state, seen = {}, set()
        for k, v in keep:
            if v.data_ptr() in seen:  # a tied weight (e.g. lm_head = embeddings) is stored once
                continue
            seen.add(v.data_ptr())
            state[k] = (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
        if self.micro_vocab is not None:
            state[MICRO_VOCAB_KEY] = self.micro_vocab.to("cpu", torch.int64).contiguous()
        save_file(state, str(directory / WEIGHTS_NAME))
        self._save_extras(directory)

    def _save_extras(self, directory: str | Path) -> None:
        """The optional files beside the weights: the KV merger and the stored replies."""
        if self.merger is not None:
            self.merger.save(Path(directory) / MERGER_NAME, base_fingerprint=self.config.base_fingerprint)
        if self.reply_tokens is not None:
            save_file({"tokens": self.reply_tokens.to("cpu", torch.int32).contiguous()},
                      str(Path(directory) / REPLIES_NAME))

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, base: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu",
    ) -> HamburgerModel:
        """Load a checkpoint; its base comes from `base` or is loaded from the reference it records."""
        config = HamburgerConfig.load(directory)
        if base is None:
            base, tokenizer = load_base(config.base_model, dtype=dtype, device=device)
        if not config.base_in_checkpoint:
            found = fingerprint(base)
            if found != config.base_fingerprint:
                raise HamburgerError(
                    f"checkpoint {directory} was trained on base {config.base_model!r} "
                    f"(fingerprint {config.base_fingerprint}) but the base given has fingerprint {found}: "
                    "load it with the base it was trained on"
                )
        model = cls(base, config, tokenizer)
        state = load_file(str(Path(directory) / WEIGHTS_NAME), device=str(device))
        model.micro_vocab = state.pop(MICRO_VOCAB_KEY, None)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing_new = [k for k in missing if is_trained_key(k)]
        if missing_new or unexpected:
            raise HamburgerError(
                f"checkpoint {directory} does not match its config: missing {missing_new[:5]}, unexpected {unexpected[:5]}"
            )
        if (Path(directory) / MERGER_NAME).is_file():
            model.attach_merger(Path(directory) / MERGER_NAME)
        if (Path(directory) / REPLIES_NAME).is_file():
            model.reply_tokens = load_file(str(Path(directory) / REPLIES_NAME))["tokens"]
        return model.eval()

    def attach_merger(self, merger) -> None:
        """Use a KV merger (compress mode): a `KVMerger`, or the path of a saved one, which must have been
        fitted to this model's base; None removes it."""
        from hamburger.model.merger import KVMerger  # noqa: PLC0415 - only for checkpoints with a merger

        if merger is None:
            self.__dict__["merger"] = None
            return
        path = "the KV merger given"
        if not isinstance(merger, KVMerger):
            path = merger
            try:
                merger = KVMerger.load(path)
            except Exception as exc:  # noqa: BLE001 - a damaged or foreign file: one clear error
                raise HamburgerError(f"{path} is not a KV merger ({type(exc).__name__}: {exc})") from exc
            want = merger.meta.get("base_fingerprint", "")
            if want and want != self.config.base_fingerprint:
                raise HamburgerError(f"KV merger {path} was fitted to another base (fingerprint {want}, this "
                                     f"model's base: {self.config.base_fingerprint})")
        bcfg = self.base.config
        shape = (bcfg.num_hidden_layers, bcfg.num_key_value_heads, bcfg.num_attention_heads)
        got = (merger.config["layers"], merger.config["kv_heads"], merger.config["heads"])
        if got != shape:
            raise HamburgerError(f"KV merger {path} has layers/kv heads/heads {got}, the base {shape}")
        self.__dict__["merger"] = merger.to(next(self.base.parameters()).device).eval()

    # --- building blocks shared by training and generation ------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.base.get_input_embeddings()(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.base.get_output_embeddings()(hidden)

    def smash(self, step_tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(N, K) token ids of N steps (padded) -> (N, d) one input embedding per step. Decoding skips the
        embedder when every step has one token: it returns a one-token step's embedding untouched (0.6 ms a decode
        step of the default on 2 CPU cores, most of trust mode's steps). Training always runs it (every parameter
        in the graph, as DDP expects)."""
        if not torch.is_grad_enabled() and bool((lengths == 1).all()):
            return self.embed(step_tokens[:, 0])
        return self.embedder(self.embed(step_tokens), lengths)

    def base_forward(
        self, embeds: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
        cache: DynamicCache | None = None, merged: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """One base pass over (B, S, d) slot embeddings -> all hidden states (index L is the final normed one).

        `merged` (B, S) marks slots holding two or more tokens, where slot adapters (if any) act.
        The 2D mask is always given: it covers padding and stops transformers from reading our
        non-contiguous position ids as packed sequences.
        """
        with self.slot_adapters.gated(merged):
            out = self.base.base_model(
                inputs_embeds=embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                output_hidden_states=True,
                **cache_kwargs(self.base.base_model, cache),
            )
        return out.hidden_states

    def truncate_slot_adapters(self, rank: int) -> float:
        """Cut the slot adapters to rank `rank` (SVD); alpha follows so the scale alpha/rank is unchanged."""
        old = self.config.slot_adapter_rank
        error = self.slot_adapters.truncate(rank)
        self.config.slot_adapter_alpha *= rank / old
        self.config.slot_adapter_rank = rank
        return error

    def attach_slot_adapters(self, rank: int, alpha: float | None = None) -> None:
        """Give a model (e.g. a checkpoint trained without them) fresh slot adapters; the outputs do not change."""
        self.slot_adapters.remove()
        cfg = self.config
        cfg.slot_adapter_rank, cfg.slot_adapter_alpha = rank, alpha or cfg.slot_adapter_alpha
        p = next(self.base.parameters())
        self.slot_adapters = SlotAdapters(self.base, rank, cfg.slot_adapter_alpha, cfg.slot_adapter_targets).to(
            device=p.device, dtype=p.dtype)

    # --- training forward ----------------------------------------------------------------------------

    @torch.no_grad()
    def teacher_states(self, batch: SegmentedBatch) -> tuple[torch.Tensor, ...]:
        """The unmerged base's hidden states over the batch's examples, one token per position (no slot adapters,
        which act only at merged slots): the teacher of the dense losses. Frozen base only (`--mode frozen`)."""
        out = self.base.base_model(input_ids=batch.full_ids, attention_mask=batch.full_mask,
                                   output_hidden_states=True)
        return out.hidden_states

    def forward(self, batch: SegmentedBatch, verified_stops: bool = False, kd_weight: float = 0.0,
                state_weight: float = 0.0, dense_metrics: bool = False) -> HamburgerOutput:
        """Teacher-forced loss on a segmented batch.

        `verified_stops`: the stop head also learns to end a step before a token the micro-step decoder gets
        wrong (its argmax differs from the data's token), not only where the segmentation ends it; with
        self-distilled data this makes the confidence knob track agreement with the base.

        Dense losses against the unmerged base (`teacher_states`), added with their weights:
        `kd_weight`: KL(base || model) of the next-token distribution at every target (token 0 after a smashed
        slot and the micro tokens), where the base reads the step's tokens one per position;
        `state_weight`: at every merged slot, ||h - h_base||^2 / ||h_base||^2 at each layer's output, averaged
        over the layers, where h_base is the base's state at the step's last token (the slot's position).
        `dense_metrics` computes both (for held-out figures) whatever their weights.
        """
        if self.micro.context:
            raise HamburgerError("`hamburger train` trains the features-only micro-step decoder; one with context "
                                 "(micro_context) trains with `hamburger train-drafter --micro-context`")

        k = self.config.max_step_tokens
        b, s, _ = batch.slot_tokens.shape
        slots = self.smash(batch.slot_tokens.view(b * s, k), batch.slot_lengths.view(-1)).view(b, s, -1)
        hidden = self.base_forward(slots, batch.attention_mask, batch.position_ids, merged=batch.slot_lengths > 1)
        h0 = hidden[-1][batch.step_batch, batch.step_slot]  # (N, d): the state that predicts token 0 of each step
        n, d = h0.shape
        lengths = batch.step_lengths
        span = int(lengths.max())  # tokens in the longest step of the batch
        idx = torch.arange(span, device=h0.device)
        valid = idx[None] < lengths[:, None]  # (N, span)
        if span > 1:
            # The micro-step decoder only runs over steps of >= 2 tokens (a one-token step's only target comes
            # from the base) and only as far as the longest of them; it is causal, so cutting the padding
            # changes no output. States: [h0 of every step; micro outputs of the multi-token steps, flattened].
            rows = (lengths > 1).nonzero().squeeze(1)  # (M,)
            feats = self.micro.features(hidden, (batch.step_batch[rows], batch.step_slot[rows]))  # (M, m, d)
            micro_in = torch.cat([feats, self.embed(batch.step_tokens[rows, : span - 1])], dim=1)
            micro_out = self.micro(micro_in)[:, self.micro.num_features :]  # (M, span-1, d): tokens 1..span-1
            row_of = torch.zeros(n, dtype=torch.long, device=h0.device)
            row_of[rows] = torch.arange(len(rows), device=h0.device)
            where = torch.cat([torch.arange(n, device=h0.device)[:, None],  # token 0: h0 of its own step
                               n + row_of[:, None] * (span - 1) + idx[None, : span - 1]], dim=1)  # (N, span)
            chosen = torch.cat([h0, micro_out.reshape(-1, d)])[where[valid]]  # (T, d) in sequence order
        else:
            chosen = h0
        logits = self.lm_head(chosen).float()
        stop_logits = self.stop_head(chosen).float()
        targets = batch.step_tokens[:, :span][valid]
        in_step = idx.expand_as(valid)[valid]
        stop_targets = (idx[None] == lengths[:, None] - 1)[valid].float()
        if verified_stops:
            wrong = (logits.detach().argmax(-1) != targets).float()
            wrong_next = torch.zeros_like(wrong)
            wrong_next[:-1] = wrong[1:]  # the next token in sequence order; it is in this step unless this one ends it
            stop_targets = torch.maximum(stop_targets, wrong_next)
        eos = torch.tensor(sorted(eos_ids(self)), dtype=targets.dtype, device=targets.device)
        stop_mask = (in_step < k - 1) & ~torch.isin(targets, eos)
        if batch.step_cut is not None:  # a cut step's last token: the segment goes on there, so no stop label
            stop_mask &= ~((idx[None] == lengths[:, None] - 1) & batch.step_cut[:, None])[valid]
        ce = F.cross_entropy(logits, targets)
        bce = F.binary_cross_entropy_with_logits(stop_logits, stop_targets, reduction="none")
        stop = (bce * stop_mask).sum() / stop_mask.sum().clamp(min=1)
        loss, kd, state, n_merged = ce + STOP_LOSS_WEIGHT * stop, None, None, 0
        if kd_weight or state_weight or dense_metrics:
            # The batch's cached teacher (`segment --teacher-top-k`) spares the base's second forward when only KD
            # trains; held-out figures (`dense_metrics`) always take the full KL, one definition to compare by.
            from_cache = batch.teacher_ids is not None and not dense_metrics
            teacher = None if from_cache and not state_weight else self.teacher_states(batch)
            if from_cache:
                kd = sparse_kl(logits, batch.teacher_ids, batch.teacher_logprobs).mean()
            else:
                step_pos = batch.position_ids[batch.step_batch, batch.step_slot]  # (N,) where the base predicts token 0
                tb = batch.step_batch[:, None].expand_as(valid)[valid]
                tp = (step_pos[:, None] + idx[None])[valid]  # token i of a step: predicted at step_pos + i
                with torch.no_grad():
                    want = F.log_softmax(self.lm_head(teacher[-1][tb, tp]).float(), -1)
                kd = F.kl_div(F.log_softmax(logits, -1), want, log_target=True, reduction="none").sum(-1).mean()
            merged = (batch.slot_lengths > 1) & batch.attention_mask.bool()
            n_merged = int(merged.sum())
            if teacher is None:
                state = None
            elif n_merged:
                mb, ms = merged.nonzero(as_tuple=True)
                mp = batch.position_ids[mb, ms]
                parts = []
                for got, ref in zip(hidden[1:], teacher[1:]):
                    g, r = got[mb, ms].float(), ref[mb, mp].float()
                    parts.append(((g - r).square().sum(-1) / r.square().sum(-1).clamp(min=1e-6)).mean())
                state = torch.stack(parts).mean()
            else:
                state = hidden[-1].sum() * 0.0
            loss = loss + kd_weight * kd + (state_weight * state if state is not None else 0.0)
        return HamburgerOutput(
            loss=loss,
            kd_loss=kd,
            state_loss=state,
            merged_slots=n_merged,
            ce_loss=ce,
            stop_loss=stop,
            logits=logits,
            targets=targets,
            in_step_index=in_step,
            stop_logits=stop_logits,
            stop_targets=stop_targets,
            stop_mask=stop_mask,
        )

    def merge_lora(self) -> None:
        """Fold LoRA adapters into the base weights (no adapter cost at inference); the base then ships along."""
        from peft.tuners.lora import LoraLayer  # noqa: PLC0415

        for name, module in list(self.base.named_modules()):
            if isinstance(module, LoraLayer):
                module.merge()
                parent, _, child = name.rpartition(".")
                setattr(self.base.get_submodule(parent), child, module.get_base_layer())
        self.config.lora_rank = 0
        self.config.base_in_checkpoint = True

    # --- reporting -----------------------------------------------------------------------------------

    def parameter_counts(self) -> dict[str, int]:
        counts = {"base": sum(p.numel() for p in self.base.parameters())}
        for name in (*NEW_MODULES, DRAFT_STOP_HEAD):
            module = getattr(self, name)
            if module is not None and (n := sum(p.numel() for p in module.parameters())):  # optional modules
                counts[name] = n
        return counts


def packaged_checkpoint() -> Path | None:
    """The trained HAMburger for the embedded default that ships inside the package, if any."""
    path = Path(__file__).parent.parent / "checkpoints" / DEFAULT_MODEL
    return path if HamburgerConfig.is_checkpoint(path) else None


def load_model(
    ref: str | None = None, base_ref: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[HamburgerModel, bool]:
    """Load a HAMburger checkpoint, or wrap a plain base model for one-token-per-step (exact base) decoding.

    `default` (or None) is the checkpoint shipped in the package when there is one; the base's own name
    (SmolLM2-135M-Instruct) is always the plain base.

    Returns the model and whether it is a trained HAMburger checkpoint. `base_ref` overrides the base
    a checkpoint records (e.g. a local copy of it); it must be the same weights.
    """
    if ref in (None, "default") and (shipped := packaged_checkpoint()) is not None:
        ref = str(shipped)
    if ref is not None and HamburgerConfig.is_checkpoint(ref):
        base, tokenizer = load_base(base_ref, dtype=dtype, device=device) if base_ref else (None, None)
        return HamburgerModel.from_pretrained(ref, base=base, tokenizer=tokenizer, dtype=dtype, device=device), True
    if base_ref is not None:
        raise HamburgerError(f"--base only applies to a HAMburger checkpoint, and {ref!r} is not one")
    base, tokenizer = load_base(ref, dtype=dtype, device=device)
    return HamburgerModel.plain(base, tokenizer), False
