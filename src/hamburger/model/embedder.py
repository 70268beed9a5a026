"""The compositional embedder: smashes the tokens of one step into a single input embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CompositionalEmbedder(nn.Module):
    """One-query cross-attention over a step's token embeddings, each tagged with its position in the step.

    query = Wq·mean(E); keys/values from [E_i ; p_i]; output = mean(E) + Wo·attn. Wo starts at zero,
    so an untrained embedder is mean pooling, and a one-token step is returned untouched (the exact
    base input), which is what makes one-token-per-step decoding identical to the base model.
    """

    def __init__(self, hidden_size: int, num_heads: int, max_step_tokens: int, position_dim: int) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.positions = nn.Embedding(max_step_tokens, position_dim)
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size + position_dim, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size + position_dim, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        nn.init.normal_(self.positions.weight, std=0.02)
        nn.init.zeros_(self.o_proj.weight)

    def forward(self, embeds: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """embeds: (N, K, d) token embeddings padded to K; lengths: (N,) tokens in each step -> (N, d)."""
        n, k, d = embeds.shape
        valid = torch.arange(k, device=embeds.device) < lengths[:, None]  # (N, K)
        mean = (embeds * valid[..., None]).sum(1) / lengths.clamp(min=1)[:, None].to(embeds.dtype)
        pos = self.positions.weight[:k].to(embeds.dtype).expand(n, k, -1)
        kv_in = torch.cat([embeds, pos], dim=-1)
        h, hd = self.num_heads, d // self.num_heads
        q = self.q_proj(mean).view(n, h, 1, hd)
        key = self.k_proj(kv_in).view(n, k, h, hd).transpose(1, 2)
        value = self.v_proj(kv_in).view(n, k, h, hd).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, key, value, attn_mask=valid[:, None, None, :])
        merged = mean + self.o_proj(attn.reshape(n, d))
        return torch.where((lengths == 1)[:, None], embeds[:, 0], merged)
