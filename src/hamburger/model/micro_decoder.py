"""The micro-step decoder and the stop head: tokens 1..K-1 of a macro-step from the base's features."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import nn

from hamburger.model.base import cache_kwargs
from hamburger.model.layers import attention, finish, project
from hamburger.model.llama import rms_norm

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def causal_mask(q_len: int, kv_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive (1, 1, q, kv) mask where query i (the last q of kv positions) sees keys <= its own index.

    An explicit mask works with every attention implementation (eager ignores `is_causal`).
    """
    q_idx = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    allowed = torch.arange(kv_len, device=device)[None, :] <= q_idx
    mask = torch.zeros(q_len, kv_len, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


class MicroStepDecoder(nn.Module):
    """A few decoder layers of the base's own type over `[f_1..f_m, emb(t_0), emb(t_1), ...]`.

    The output at the position of emb(t_i) predicts t_{i+1} through the base's LM head. Features taken
    before the final norm are raw residual streams of very different scales, so each gets an RMSNorm.

    With `context` > 0, micro layer i also attends to the base's (rotated) keys and values of base layer
    `context_layers[i]` (the top layer it was copied from) over the latest `context` positions, and its own
    inputs take the absolute positions that follow them (`context_layer`). That attention has a softmax of its
    own, added to the layer's through a per-head gate tanh(g) with g = 0 at the start: a decoder trained
    without context starts out unchanged and learns how much to read.
    """

    def __init__(self, base: PreTrainedModel, num_layers: int, feature_layers: list[int], init_from_top: bool,
                 context: int = 0) -> None:
        super().__init__()
        decoder = base.base_model
        base_layers = decoder.layers
        config = base.config
        layer_cls = type(base_layers[0])
        self.layers = nn.ModuleList(layer_cls(config, i) for i in range(num_layers))
        if init_from_top:
            for layer, src in zip(self.layers, base_layers[len(base_layers) - num_layers :]):
                layer.load_state_dict(src.state_dict())
        num_base_layers = len(base_layers)
        self.context = 0
        self.context_gate: nn.Parameter | None = None
        self.context_layers = list(range(num_base_layers - num_layers, num_base_layers))
        self.feature_layers = list(feature_layers)
        # The final output (index L) is already normed by the base; the others are raw residual streams.
        self.feature_norms = nn.ModuleList(
            RMSNorm(config.hidden_size) if i < num_base_layers else nn.Identity() for i in feature_layers
        )
        self.norm = copy.deepcopy(decoder.norm)
        self.rotary_emb = copy.deepcopy(decoder.rotary_emb)
        self.to(dtype=next(base.parameters()).dtype)
        self.set_context(context)

    @property
    def num_features(self) -> int:
        return len(self.feature_layers)

    def features(self, hidden_states: tuple[torch.Tensor, ...], index: tuple[torch.Tensor, ...] | slice) -> torch.Tensor:
        """Stack the normed feature vectors at `index` of each selected base hidden state -> (..., m, d)."""
        return torch.stack([norm(hidden_states[i][index]) for i, norm in zip(self.feature_layers, self.feature_norms)], dim=-2)

    def forward(self, x: torch.Tensor, cache: DynamicCache | None = None) -> torch.Tensor:
        """x: (N, q, d) new inputs; with a cache, they follow the ones already in it. Returns normed (N, q, d)."""
        past = cache.get_seq_length() if cache is not None else 0
        q_len = x.shape[1]
        position_ids = torch.arange(past, past + q_len, device=x.device)[None].expand(x.shape[0], -1)
        position_embeddings = self.rotary_emb(x, position_ids)
        mask = causal_mask(q_len, past + q_len, x.dtype, x.device)
        for layer in self.layers:
            out = layer(
                x,
                attention_mask=mask,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                **cache_kwargs(layer, cache),
            )
            x = out[0] if isinstance(out, tuple) else out
        return self.norm(x)

    def set_context(self, window: int) -> None:
        """Read the latest `window` base positions (0: none); a new gate starts closed (the outputs unchanged)."""
        self.context = window
        if not window:
            self.context_gate = None
        elif self.context_gate is None:
            heads = self.layers[0].self_attn.config.num_attention_heads
            p = next(self.parameters())
            self.context_gate = nn.Parameter(torch.zeros(len(self.layers), heads, dtype=p.dtype, device=p.device))

    def keep_top(self, n: int) -> None:
        """Keep only the last `n` layers (each with its context source and gates): a micro-step that reads fewer
        weights. The first kept layer then reads the features directly."""
        if not 1 <= n <= len(self.layers):
            raise ValueError(f"a micro-step decoder of {len(self.layers)} layers can keep 1..{len(self.layers)}, not {n}")
        drop = len(self.layers) - n
        self.layers = nn.ModuleList(list(self.layers)[drop:])
        for i, layer in enumerate(self.layers):  # caches are indexed by the layer's own number
            layer.self_attn.layer_idx = i
        self.context_layers = self.context_layers[drop:]
        if self.context_gate is not None:
            self.context_gate = nn.Parameter(self.context_gate.detach()[drop:].clone())

    def context_layer(self, i: int, x: torch.Tensor, rope, own: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                      context: tuple[torch.Tensor, torch.Tensor, torch.Tensor], write=None) -> torch.Tensor:
        """Micro layer i over (B, q, d) with context. `own` = (keys, values, mask) of the decoder's earlier inputs
        (the new ones are appended; `write(k, v)` instead returns the keys and values to attend to, e.g. a cache
        update); `context` = (keys, values, mask) of the base's entries (B, kv_heads, T, hd) and (B|1, 1, q, T)
        bool. Rows that see no context entry get none (not a uniform average)."""
        layer = self.layers[i]
        q, k, v = project(layer, x, rope)
        own_k, own_v, own_mask = own
        k, v = write(k, v) if write is not None else (torch.cat([own_k, k], 2), torch.cat([own_v, v], 2))
        o = attention(layer, q, k, v, own_mask)
        ctx_k, ctx_v, ctx_mask = context
        seen = ctx_mask.any(-1, keepdim=True)  # (B|1, 1, q, 1)
        bias = torch.zeros(ctx_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~ctx_mask, -1e4)
        o_ctx = torch.where(seen, attention(layer, q, ctx_k, ctx_v, bias), 0.0)
        return finish(layer, x, o + torch.tanh(self.context_gate[i])[None, :, None, None] * o_ctx)

    def forward_context(self, x: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor],
                        values: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """x (B, q, d) at absolute `positions` (B, q), after context keys/values (one (B, kv_heads, T, hd) per
        micro layer, rotated at their own positions); `mask` (B or 1, 1, q, T + q) bool, True = attend: its
        first T columns over the context, the rest over x. Returns normed (B, q, d)."""
        rope = self.rotary_emb(x, positions)
        t = keys[0].shape[2]
        empty = x.new_zeros(x.shape[0], keys[0].shape[1], 0, keys[0].shape[3])
        for i, (ck, cv) in enumerate(zip(keys, values)):
            x = self.context_layer(i, x, rope, (empty, empty, mask[..., t:]), (ck, cv, mask[..., :t]))
        return self.norm(x)


class StopHead(nn.Module):
    """Logit of "the step ends after this token", from the hidden state that produced the token."""

    def __init__(self, hidden_size: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hidden_size, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.net(h).squeeze(-1)
