"""`MicroDrafts`: verify mode's drafts in vLLM with the micro-step decoder, reading the base's hidden states.

vLLM's `custom_class` proposer gets token ids only, but its CPU runner hands the target model over once
(`load_model(model)`). `BaseTap` hooks that model (vLLM's own Llama, unchanged): on every forward it keeps the
residual stream after the micro-step decoder's feature layers (8, 15, 22 of SmolLM2's 30) and the final normed
output, the rotated keys and values of the layers the decoder reads as context (26-29), the tokens' positions, and
where each request's tokens start in the forward (`query_start_loc` of the attention metadata).

Each step, per row: lookup drafts first, as verify mode does (`LookupDrafts`); where lookup finds nothing, the
micro-step decoder drafts from the base's states at the row's last kept token (position n - 2: the token before
the one vLLM just sampled) and its latest `micro_context` kept keys and values, which `ContextRows` keeps per row
from the forwards that computed them (rejected drafts' positions never enter). The decoder runs as in training
(`MicroStepDecoder.forward_context`): inputs [f_1..f_m, emb(t_0), emb(t_1), ...] at the positions after the state.

This needs eager mode (`enforce_eager`: hooks on modules) and vLLM's CPU runner (it calls `load_model`); the base
must be the checkpoint's own (the embedded default).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hamburger.errors import HamburgerError
from hamburger.inference.runner import head_rows
from hamburger.model.config import DRAFT_ROWS
from hamburger.model.hamburger_model import load_model
from hamburger.vllm.proposer import LookupDrafts, checkpoint_for, in_vocab, settings


class BaseTap:
    """Forward hooks on vLLM's Llama: the latest forward's features (tokens, m, d), context keys and values
    (n_ctx, tokens, kv), positions (tokens,) and query offsets (rows + 1,)."""

    def __init__(self, model: torch.nn.Module, feature_layers: list[int], context_layers: list[int]) -> None:
        inner = model.model
        last = len(inner.layers)
        self.feature_layers, self.context_layers = feature_layers, context_layers
        self.states: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.positions: torch.Tensor | None = None
        self.starts: torch.Tensor | None = None
        for j in feature_layers:
            if j < last:  # the residual stream entering layer j: the output of layer j - 1, hidden + residual
                inner.layers[j - 1].register_forward_hook(self.keep_state(j))
        for j in context_layers:
            inner.layers[j].self_attn.attn.register_forward_pre_hook(self.keep_kv(j))
        # (the model itself is compiled-wrapped, its hooks do not run: its first layer and its final norm are modules)
        inner.layers[0].register_forward_pre_hook(self.start, with_kwargs=True)
        inner.norm.register_forward_hook(self.finish(last))

    def keep_state(self, j: int):
        def hook(module, args, out):
            self.states[j] = (out[0] + out[1]).detach().float()
        return hook

    def keep_kv(self, j: int):
        def hook(module, args):
            self.keys[j], self.values[j] = args[1].detach().float().clone(), args[2].detach().float().clone()
        return hook

    def start(self, module, args, kwargs):
        positions = args[0] if args else kwargs.get("positions")
        self.positions = positions.detach().cpu().clone() if positions is not None else None

    def finish(self, last: int):
        def hook(module, args, out):
            self.states[last] = (out[0] if isinstance(out, tuple) else out).detach().float()
            from vllm.forward_context import get_forward_context

            meta = get_forward_context().attn_metadata
            if isinstance(meta, list):
                meta = meta[0] if meta else None
            first = next(iter(meta.values()), None) if isinstance(meta, dict) else meta
            starts = getattr(first, "query_start_loc", None)
            self.starts = starts.detach().cpu().clone() if starts is not None else None
        return hook


class ContextRows:
    """Per row of vLLM's batch: the base's kept keys and values (by position) of the context layers, at most
    `window` latest, and the tokens the row held when last seen. vLLM moves requests between rows (a finished
    row is filled from the end): each step, a row's entries go to the request whose tokens start with that row's
    tokens, wherever it is now; entries nobody claims are dropped."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.rows: dict[int, tuple[np.ndarray, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.old: dict[int, tuple[np.ndarray, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}

    def begin(self) -> None:
        """A new step: every row's entries wait to be claimed by the request that still holds their tokens."""
        self.old, self.rows = self.rows, {}

    def entries(self, row: int, history: np.ndarray) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The entries of the request in `row` now, whose tokens so far are `history` (its own row's first, else
        those of the row it moved from; none for a new request)."""
        old = self.old
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for r in [row] + [r for r in old if r != row]:
            seen = old[r][0] if r in old else None
            if seen is not None and len(seen) <= len(history) and np.array_equal(history[: len(seen)], seen):
                kept = old.pop(r)[1]
                break
        self.rows[row] = (history.copy(), kept)
        return kept

    def admit(self, entries: dict, positions: list[int], keys: torch.Tensor, values: torch.Tensor, upto: int) -> None:
        """Keep the forward's entries of this row at positions <= `upto` (kept tokens), the latest `window`."""
        for i, p in enumerate(positions):
            if p <= upto:
                entries[p] = (keys[:, i], values[:, i])
        for p in sorted(entries)[: max(len(entries) - self.window, 0)]:
            del entries[p]
        for p in [p for p in entries if p > upto]:
            del entries[p]


def micro_draft_rows(value: Any, device_type: str) -> int | None:
    """`additional_config` `hamburger.draft_rows`: the micro-step decoder drafts while at most this many rows decode
    (null: always; lookup drafts are not limited). "auto" (the default): `DRAFT_ROWS` where vLLM runs on a CPU, as
    our engine's verify mode (there a check pass costs every drafted position a row's products: at concurrency 8 the
    decoder's drafts ran 0.82x vLLM plain), always elsewhere (unmeasured: vLLM's own methods draft at any batch)."""
    if value == "auto":
        return DRAFT_ROWS if device_type == "cpu" else None
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise HamburgerError(f'additional_config hamburger.draft_rows: an integer >= 0, null or "auto", not {value!r}')


class MicroDrafts(LookupDrafts):
    """vLLM `custom_class` proposer: lookup drafts, else the micro-step decoder's (up to K - 1 of them)."""

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        checkpoint = checkpoint_for(vllm_config)  # the same rule as the stored replies': the packaged one for its base
        if checkpoint is None:
            raise HamburgerError("the micro-step decoder's drafts need the HAMburger checkpoint of the base vLLM serves: "
                                 "serve the embedded default, or name one in additional_config hamburger.checkpoint")
        ref = str(checkpoint)
        self.ham, trained = load_model(ref, decode_only=True)
        if not trained or self.ham.micro is None:
            raise HamburgerError(f"{ref}: not a HAMburger checkpoint with a micro-step decoder")
        self.ham.eval()
        micro = self.ham.micro
        self.micro_k = max(self.ham.config.max_step_tokens - 1, 0)
        self.context = ContextRows(micro.context)
        config = self.ham.base.config
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.tap: BaseTap | None = None
        # which drafts a row takes: "history" (lookup in its own prompt and reply, else the micro-step decoder),
        # "lookup" (lookup, the stored replies included, else the micro-step decoder), "micro" (the decoder only)
        self.order = str(settings(vllm_config).get("order", "history"))
        if self.order not in ("history", "lookup", "micro"):
            raise HamburgerError(f"additional_config hamburger.order: history, lookup or micro, not {self.order!r}")
        if self.order == "history":
            self.store = None
        # a micro-step draft ends before its first token the decoder gives less than this probability (0: never)
        self.min_prob = float(settings(vllm_config).get("min_prob", 0.0))
        self.shortlist(self.ham)
        self.rows_setting = settings(vllm_config).get("draft_rows", "auto")
        self.draft_rows = micro_draft_rows(self.rows_setting, "cpu")  # checked now; the device's at `load_model`

    def shortlist(self, ham: Any) -> None:
        """The micro-step head: the LM head's rows at the checkpoint's micro-step shortlist (`micro_vocab`), as the
        engine's micro-steps and `train-drafter` use it (a 7,244-token head for the default instead of 49,152), or
        the whole head for a checkpoint without one."""
        self.short_vocab = ham.micro_vocab
        self.short_head = None if ham.micro_vocab is None else head_rows(ham, ham.micro_vocab).float().contiguous()

    def load_model(self, model: Any = None, *args: Any, **kwargs: Any) -> None:
        super().load_model(model)
        micro = self.ham.micro
        self.tap = BaseTap(model, micro.feature_layers, micro.context_layers)
        weight = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
        self.draft_rows = micro_draft_rows(self.rows_setting, weight.device.type if weight is not None else "cpu")

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                *args: Any, **kwargs: Any) -> list[list[int]]:
        out = (super().propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu) if self.order != "micro"
               else [[] for _ in sampled_token_ids])
        tap, micro = self.tap, self.ham.micro
        if (tap is None or tap.starts is None or tap.positions is None or len(tap.starts) < len(sampled_token_ids) + 1
                or any(j not in tap.keys for j in micro.context_layers)
                or any(j not in tap.states for j in micro.feature_layers)):
            return out  # no forward seen yet (or hooks that did not run): lookup drafts only
        self.context.begin()  # every row's entries stay current, also in the steps where the decoder does not draft
        few = self.draft_rows is None or sum(1 for s in sampled_token_ids if s) <= self.draft_rows
        jobs: dict[int, tuple[torch.Tensor, int, dict, int, int]] = {}
        with torch.inference_mode():
            for row, sampled in enumerate(sampled_token_ids):
                n = int(num_tokens_no_spec[row])
                a, b = int(tap.starts[row]), int(tap.starts[row + 1])
                entries = self.context.entries(row, np.asarray(token_ids_cpu[row, :n]))
                upto = n - 2 if sampled else 1 << 60
                keys = torch.stack([tap.keys[j][a:b] for j in micro.context_layers])
                values = torch.stack([tap.values[j][a:b] for j in micro.context_layers])
                positions = tap.positions[a:b].tolist()
                self.context.admit(entries, positions, keys, values, upto)
                room = min(self.micro_k, self.k, self.max_len - n - 1)
                if few and sampled and not out[row] and room > 0 and upto in positions and entries:
                    at = a + positions.index(upto)
                    feats = torch.stack([tap.states[j][at] for j in micro.feature_layers])
                    jobs[row] = (feats, sampled[-1], entries, upto, room)
            for row, drafts in zip(jobs, self.micro_drafts(list(jobs.values()))):
                out[row] = drafts
        return out

    def micro_drafts(self, jobs: list[tuple[torch.Tensor, int, dict, int, int]]) -> list[list[int]]:
        """Greedy micro-step drafts for every row at once: each job is (the features (m, d) of the state at `pos`,
        token 0 `t0`, the row's context `entries` by position (at least one), `pos`, how many drafts at most).
        The rows run as one batch, their context entries padded to the longest and masked, and each micro-step
        recomputes the decoder over [f_1..f_m, emb(t_0), ...] as in training; a row's drafts end at its count
        or before its first token under `min_prob`. A row's drafts do not depend on the other rows (a test)."""
        if not jobs:
            return []
        micro, ham = self.ham.micro, self.ham
        b, longest, steps = len(jobs), max(len(e) for _, _, e, _, _ in jobs), max(c for *_, c in jobs)
        n_ctx, kv, hd = len(micro.context_layers), self.kv_heads, self.head_dim
        dtype = next(iter(jobs[0][2].values()))[0].dtype
        keys = torch.zeros(n_ctx, b, kv, longest, hd, dtype=dtype)
        values = torch.zeros_like(keys)
        seen = torch.zeros(b, longest, dtype=torch.bool)  # the real entries; the padding after them is masked
        for i, (_, _, entries, _, _) in enumerate(jobs):
            order = sorted(entries)
            t = len(order)
            split = lambda x: x.reshape(n_ctx, t, kv, hd).transpose(1, 2)  # noqa: E731  (n_ctx, kv, T, hd)
            keys[:, i, :, :t] = split(torch.stack([entries[p][0] for p in order], 1))
            values[:, i, :, :t] = split(torch.stack([entries[p][1] for p in order], 1))
            seen[i, :t] = True
        normed = torch.stack([torch.stack([norm(f) for f, norm in zip(feats, micro.feature_norms)])
                              for feats, *_ in jobs])  # (B, m, d)
        tokens = torch.tensor([[t0] for _, t0, *_ in jobs])
        pos = torch.tensor([p for *_, p, _ in jobs])
        count = [c for *_, c in jobs]
        out: list[list[int]] = [[] for _ in jobs]
        going = [True] * b
        for step in range(steps):
            x = torch.cat([normed, ham.embed(tokens)], 1)  # (B, m + 1 + step, d)
            q = x.shape[1]
            positions = pos[:, None] + 1 + torch.arange(q)[None]
            causal = torch.ones(q, q, dtype=torch.bool).tril()
            mask = torch.cat([seen[:, None].expand(b, q, longest), causal.expand(b, q, q)], -1)[:, None]
            h = micro.forward_context(x, positions, list(keys), list(values), mask)[:, -1]
            logits = ham.lm_head(h) if self.short_head is None else torch.nn.functional.linear(h, self.short_head)
            probs = torch.softmax(logits.float(), -1)
            best = probs.argmax(-1)
            sure = probs.gather(1, best[:, None])[:, 0].tolist()
            if self.short_vocab is not None:
                best = self.short_vocab[best]
            for i, (tok, p) in enumerate(zip(best.tolist(), sure)):
                going[i] = going[i] and step < count[i] and p >= self.min_prob
                if going[i]:
                    out[i].append(tok)
            if not any(going):
                break
            tokens = torch.cat([tokens, best[:, None]], 1)
        return [in_vocab(drafts, self.vocab) for drafts in out]
