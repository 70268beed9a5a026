"""Slot adapters: low-rank adapters on the base's linear layers that act only at merged (smashed) slots.

A frozen base has never seen a smashed embedding, and an embedder alone can only do so much to make one
readable. Full or LoRA fine-tuning teaches the base to read them, but changes what it computes for every
ordinary token too, so one-token-per-step decoding no longer equals the base model.

Slot adapters sit between the two: a LoRA delta (B·A·x, B starting at zero) is added to a base linear
layer's output only at positions whose slot holds a merged step of two or more tokens. Prompt tokens and
one-token steps go through the untouched base weights, so at confidence 1.0 (every step one token)
the output is exactly the base model's, while the merged slots learn to write keys and values (and the
features that predict the next step) that the rest of the sequence can read.

The adapters live outside the base (forward hooks, no renamed base parameters), so the base's state dict,
fingerprint and weights stay as they were; the merged positions are set around each base pass (`gated`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from hamburger.errors import HamburgerError

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class SlotAdapters(nn.Module):
    def __init__(self, base: nn.Module, rank: int, alpha: float, targets: list[str] | tuple[str, ...]) -> None:
        super().__init__()
        self.rank, self.scale = rank, (alpha / rank if rank else 0.0)
        self.down = nn.ModuleDict()
        self.up = nn.ModuleDict()
        self.rows: torch.Tensor | None = None
        self._hooks = []
        if not rank:
            return
        layers = base.base_model.layers
        for li, layer in enumerate(layers):
            for name, module in layer.named_modules():
                if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
                    key = f"{li}_{name.replace('.', '_')}"
                    self.down[key] = nn.Linear(module.in_features, rank, bias=False)
                    self.up[key] = nn.Linear(rank, module.out_features, bias=False)
                    nn.init.kaiming_uniform_(self.down[key].weight, a=math.sqrt(5))
                    nn.init.zeros_(self.up[key].weight)  # starts as the untouched base
                    self._hooks.append(module.register_forward_hook(self._hook(key)))
        if not self.down:
            raise HamburgerError(f"slot adapters found none of the layers {list(targets)} in the base's decoder layers")

    def _hook(self, key: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            rows = self.rows
            if rows is None:
                return None
            x = args[0]
            if rows.numel() == x.numel() // x.shape[-1]:  # every position is merged (e.g. batch-1 decoding)
                return output + (self.up[key](self.down[key](x)) * self.scale).to(output.dtype)
            # Only the merged positions go through the adapter (a third or less of a training batch).
            x = x.reshape(-1, x.shape[-1])[rows]
            delta = self.up[key](self.down[key](x)) * self.scale
            flat = output.reshape(-1, output.shape[-1])
            return flat.index_add(0, rows, delta.to(output.dtype)).view_as(output)
        return hook

    @contextmanager
    def gated(self, merged: torch.Tensor | None) -> Iterator[None]:
        """Adapters act where `merged` (B, S) is true during the block; nothing changes if none is."""
        if not self.rank or merged is None or not bool(merged.any()):
            yield
            return
        self.rows = merged.reshape(-1).nonzero().squeeze(1)  # flat (batch x sequence) indices of merged slots
        try:
            yield
        finally:
            self.rows = None

    @torch.no_grad()
    def truncate(self, rank: int) -> float:
        """Cut every adapter to its best rank-`rank` approximation (SVD of up @ down), e.g. to ship a smaller
        checkpoint. Returns the largest relative Frobenius error over the adapters."""
        if not 0 < rank <= self.rank:
            raise HamburgerError(f"slot adapters of rank {self.rank} cannot be cut to rank {rank}")
        worst = 0.0
        for key in self.down:
            down, up = self.down[key].weight, self.up[key].weight
            full = up.float() @ down.float()
            u, s, vh = torch.linalg.svd(full, full_matrices=False)
            root = s[:rank].sqrt()
            new_down, new_up = root[:, None] * vh[:rank], u[:, :rank] * root[None]
            norm = full.norm()
            if norm > 0:
                worst = max(worst, ((new_up @ new_down - full).norm() / norm).item())
            self.down[key] = nn.Linear(down.shape[1], rank, bias=False).to(down)
            self.up[key] = nn.Linear(rank, up.shape[0], bias=False).to(up)
            self.down[key].weight.copy_(new_down)
            self.up[key].weight.copy_(new_up)
        self.rank = rank  # self.scale stays: the product up @ down was kept, not rescaled
        return worst

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
