"""The base's own decoder-layer math, split where a KV cache comes in: `project` (norm, q/k/v projections,
Qwen3's head norms, rotary embedding of the base's transformers module) and `attend` (attention under a
mask, output projection, MLP). The engine's cached layer and the KV merger's forward both run on these."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from hamburger.model.slot_adapters import AdapterPass


def project(layer, x: torch.Tensor, rope, adapters: AdapterPass | None = None) -> tuple[torch.Tensor, ...]:
    """Queries, rotated keys and values of (B, T, d) by the layer's own modules: each (B, heads, T, hd). `adapters`:
    the slot adapters' deltas at a pass's merged positions."""
    attn = layer.self_attn
    b, t, _ = x.shape
    hd = attn.head_dim
    h = layer.input_layernorm(x)
    q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    if adapters is not None:
        q, k, v = adapters(("q_proj", "k_proj", "v_proj"), h, (q, k, v))
    q, k = q.view(b, t, -1, hd), k.view(b, t, -1, hd)
    v = v.view(b, t, -1, hd).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3 normalises each head's queries and keys
        q, k = attn.q_norm(q), attn.k_norm(k)
    apply_rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    q, k = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), *rope)
    return q, k, v


class Causal:
    """The mask of a pass whose queries are its keys (a prompt's prefill from slot 0): query i sees keys 0..i.
    `attention` hands it to SDPA as `is_causal`, which skips the masked half (a 2,000-token prefill's attention
    in half the time); `tensor` is the same mask written out, for the native call."""

    def tensor(self, n: int, device) -> torch.Tensor:
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]

    def __repr__(self) -> str:
        return "CAUSAL"


CAUSAL = Causal()


def attention(layer, q, keys, values, mask: torch.Tensor | Causal) -> torch.Tensor:
    """The layer's attention (its scale, grouped query heads) under a mask (or `CAUSAL`) -> (B, heads, T, hd)."""
    attn = layer.self_attn  # grouped query heads from the module
    if keys.dtype != q.dtype:  # a cache of another dtype (a float16 cache of a float32 model): read in q's
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    gqa = getattr(attn, "num_key_value_groups", 1) != 1
    if mask is CAUSAL:
        if keys.shape[-2] != q.shape[-2]:
            raise ValueError(f"a causal pass of {q.shape[-2]} queries over {keys.shape[-2]} keys")
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=attn.scaling, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=gqa)


def finish(layer, x: torch.Tensor, o: torch.Tensor, adapters: AdapterPass | None = None) -> torch.Tensor:
    """Output projection of the heads' outputs o (B, heads, T, hd), then the MLP (both residual). `adapters`: the
    slot adapters' deltas at a pass's merged positions (the MLP is then spelled out: Llama's, Mistral's, Qwen's)."""
    o = o.transpose(1, 2).reshape(*x.shape[:2], -1)
    if adapters is None:
        x = x + layer.self_attn.o_proj(o)
        return x + layer.mlp(layer.post_attention_layernorm(x))
    x = x + adapters(("o_proj",), o, (layer.self_attn.o_proj(o),))[0]
    h, mlp = layer.post_attention_layernorm(x), layer.mlp
    gate, up = adapters(("gate_proj", "up_proj"), h, (mlp.gate_proj(h), mlp.up_proj(h)))
    a = mlp.act_fn(gate) * up
    return x + adapters(("down_proj",), a, (mlp.down_proj(a),))[0]


def attend(layer, x: torch.Tensor, q, keys, values, mask: torch.Tensor, adapters: AdapterPass | None = None) -> torch.Tensor:
    """The rest of the layer: attention under a float mask, output projection, MLP (both residual)."""
    return finish(layer, x, attention(layer, q, keys, values, mask), adapters)
