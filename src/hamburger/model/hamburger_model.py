"""`HamburgerModel`: a base causal LM + compositional embedder + micro-step decoder + stop head.

Also checkpoints (config.json + model.safetensors) and the switch of the base's LoRA. The training loss lives in
`hamburger.training.loss` (`hamburger_loss(model, batch)`).
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file, save_model
from torch import nn

from hamburger.errors import HamburgerError
from hamburger.model.base import DEFAULT_MODEL, cache_kwargs, fingerprint, load_base
from hamburger.model.config import HamburgerConfig
from hamburger.model.embedder import CompositionalEmbedder
from hamburger.model.files import load_state, read_safetensors
from hamburger.model.lora import LORA_MODES, BaseLora, inject_lora, merge_lora
from hamburger.model.micro_decoder import MicroStepDecoder, StopHead
from hamburger.model.slot_adapters import SlotAdapters

if TYPE_CHECKING:  # not imported to decode: a base may be `llama.CausalLM` (see `base.load_base`)
    from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

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
            inject_lora(base, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)  # B starts at zero: outputs unchanged
        self.__dict__["lora"] = BaseLora(base)  # the LoRA's switch (no module: nothing in the state dict)
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
        decode_only: bool = False,
    ) -> HamburgerModel:
        """Load a checkpoint; its base comes from `base` or is loaded from the reference it records (`decode_only`: as
        `load_base` says)."""
        config = HamburgerConfig.load(directory)
        if base is None:
            base, tokenizer = load_base(config.base_model, dtype=dtype, device=device, decode_only=decode_only)
        if not config.base_in_checkpoint:
            found = fingerprint(base)
            if found != config.base_fingerprint:
                raise HamburgerError(
                    f"checkpoint {directory} was trained on base {config.base_model!r} "
                    f"(fingerprint {config.base_fingerprint}) but the base given has fingerprint {found}: "
                    "load it with the base it was trained on"
                )
        model = cls(base, config, tokenizer)
        weights = Path(directory) / WEIGHTS_NAME
        state = read_safetensors(weights, device)
        model.micro_vocab = state.pop(MICRO_VOCAB_KEY, None)
        missing, unexpected = load_state(model, state, weights, strict=False)
        missing_new = [k for k in missing if is_trained_key(k)]
        if missing_new or unexpected:
            raise HamburgerError(
                f"checkpoint {directory} does not match its config: missing {missing_new[:5]}, unexpected {unexpected[:5]}"
            )
        if (Path(directory) / MERGER_NAME).is_file():
            model.attach_merger(Path(directory) / MERGER_NAME)
        if (Path(directory) / REPLIES_NAME).is_file():
            replies = read_safetensors(Path(directory) / REPLIES_NAME)
            if "tokens" not in replies:
                raise HamburgerError(f"{Path(directory) / REPLIES_NAME}: no 'tokens' tensor (not a reply store)")
            model.reply_tokens = replies["tokens"]
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
            except HamburgerError:
                raise
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

    def _apply(self, fn, *args, **kwargs):
        """`.to()`, `.cuda()`, ...: the merger (outside the module tree) follows the base to its device, keeping
        its own dtype."""
        super()._apply(fn, *args, **kwargs)
        if self.merger is not None:
            self.__dict__["merger"] = self.merger.to(next(self.base.parameters()).device)
        return self

    # --- building blocks shared by training and generation ------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.base.get_input_embeddings()(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.base.get_output_embeddings()(hidden)

    def smash(self, step_tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(N, K) token ids of N steps (padded) -> (N, d) one input embedding per step. Decoding skips the
        embedder when every step has one token: it returns a one-token step's embedding untouched (most of trust mode's
        steps; what the embedder costs a step: `hamburger bench --systems hamburger_engine`). Training always runs it (every parameter
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

    # --- the base's LoRA -----------------------------------------------------------------------------

    def attach_lora(self, rank: int, alpha: float | None = None) -> None:
        """Give a model without one (e.g. the shipped checkpoint) a LoRA on the base of `rank`; the outputs do not
        change (B starts at zero). It is saved with the checkpoint and, like every LoRA, serves trust mode only."""
        if self.config.lora_rank:
            raise HamburgerError(f"the model already has a LoRA of rank {self.config.lora_rank}")
        cfg = self.config
        cfg.lora_rank, cfg.lora_alpha = rank, alpha or cfg.lora_alpha
        inject_lora(self.base, rank, cfg.lora_alpha, cfg.lora_targets)
        self.lora.refresh()
        self.lora.set(True)

    def base_lora(self, enabled: bool | torch.Tensor = True) -> AbstractContextManager[None]:
        """`with model.base_lora(False):` the untouched base during the block (verify and compress mode), `True`: the
        base with its LoRA (trust mode; the state after loading), a bool tensor (B,) or (B, T): the LoRA on those
        rows or positions only. A model without a LoRA is the base either way."""
        return self.lora.enabled(enabled)

    def base_lora_for(self, mode: str) -> AbstractContextManager[None]:
        """`base_lora` as decoding mode `mode` runs: on in trust mode (`LORA_MODES`), off in verify and compress."""
        return self.lora.enabled(mode in LORA_MODES)

    def merge_lora(self) -> None:
        """Fold LoRA adapters into the base weights (no adapter cost at inference); the base then ships along. The
        LoRA can no longer be turned off after: verify and compress mode then check against the adapted base."""
        merge_lora(self.base)
        self.lora.refresh()
        self.config.lora_rank = 0
        self.config.base_in_checkpoint = True

    def forward(self, *args, **kwargs):
        raise TypeError("HamburgerModel has no forward of its own: the training loss is "
                        "hamburger.training.loss.hamburger_loss(model, batch); decoding goes through an engine")

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
    ref: str | None = None, base_ref: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu",
    decode_only: bool = False,
) -> tuple[HamburgerModel, bool]:
    """Load a HAMburger checkpoint, or wrap a plain base model for one-token-per-step (exact base) decoding.

    `default` (or None) is the checkpoint shipped in the package when there is one; the base's own name
    (SmolLM2-135M-Instruct) is always the plain base.

    Returns the model and whether it is a trained HAMburger checkpoint. `base_ref` overrides the base
    a checkpoint records (e.g. a local copy of it); it must be the same weights. `decode_only`: a base for decoding with
    the fast engine, without transformers where it can be (`load_base`).
    """
    if ref in (None, "default") and (shipped := packaged_checkpoint()) is not None:
        ref = str(shipped)
    if ref is not None and HamburgerConfig.is_checkpoint(ref):
        base, tokenizer = (load_base(base_ref, dtype=dtype, device=device, decode_only=decode_only) if base_ref
                           else (None, None))
        return HamburgerModel.from_pretrained(ref, base=base, tokenizer=tokenizer, dtype=dtype, device=device,
                                              decode_only=decode_only), True
    if base_ref is not None:
        raise HamburgerError(f"--base only applies to a HAMburger checkpoint, and {ref!r} is not one")
    base, tokenizer = load_base(ref, dtype=dtype, device=device, decode_only=decode_only)
    return HamburgerModel.plain(base, tokenizer), False
