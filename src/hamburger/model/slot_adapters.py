"""Slot adapters: low-rank adapters on the base's linear layers that act only at merged (smashed) slots.

A frozen base has never seen a smashed embedding, and an embedder alone can only do so much to make one
readable. Full or LoRA fine-tuning teaches the base to read them, but changes what it computes for every
ordinary token too, so one-token-per-step decoding no longer equals the base model.

Slot adapters sit between the two: a LoRA delta (B·A·x, B starting at zero) is added to a base linear
layer's output only at positions whose slot holds a merged step of two or more tokens. Prompt tokens and
one-token steps go through the untouched base weights, so at confidence 1.0 (every step one token)
the output is exactly the base model's, while the merged slots learn to write keys and values (and the
features that predict the next step) that the rest of the sequence can read.

The adapters live outside the base (no renamed base parameters), so the base's state dict, fingerprint and
weights stay as they were. Two ways apply them, both only to a pass with merged positions:
- the fast engine's own layer code applies them inline (`inline`, `layers.project` / `finish`): per layer, sibling
  adapters that read one input (q/k/v, gate/up) share one down GEMM, and each up-projection adds into the base's
  output in one `addmm` with the scale folded in (11 small ops a layer; no hooks, whose registration and slower
  call path cost milliseconds a smashed step of the default);
- the transformers path (training, the reference decoder) gets forward hooks on the base's linear layers for the
  pass (`gated` installs and removes them: a hooked module takes PyTorch's slower call path), one module each.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hamburger.errors import HamburgerError

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Sibling projections that read one input in a Llama-style decoder layer (their adapters share a down GEMM when
# the engine applies them inline), and the two that read an input alone.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


# One decoder layer's adapters as the engine applies them inline (`SlotAdapters.inline`): per group of `GROUPS`, the
# down weights stacked into one (n·rank, in) matrix, and per name of the group the rows (start, end) of that GEMM's
# output that are its own and its up weight transposed to (rank, out) with the scale folded in (None: no adapter).
LayerAdapters = dict[tuple[str, ...], tuple[torch.Tensor, tuple[tuple[int, int, torch.Tensor] | None, ...]]]


@dataclass
class AdapterPass:
    """A layer's adapters during one pass of the engine: `rows`, the flat (batch x sequence) indices of the merged
    positions, or None when every position is merged (batch-1 decoding). A group costs one down GEMM and an `addmm`
    (or an `index_add`) per projection into the base's output: 11 small ops a Llama layer."""

    groups: LayerAdapters
    rows: torch.Tensor | None

    def __call__(self, names: tuple[str, ...], x: torch.Tensor, outs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The base's outputs `outs` of the sibling projections `names`, all reading `x` (..., in), with each one's
        adapter delta added at the merged positions (unchanged where a projection has no adapter)."""
        group = self.groups.get(names)
        if group is None:
            return outs
        down, ups = group
        flat, rows = x.reshape(-1, x.shape[-1]), self.rows
        h = F.linear(flat if rows is None else flat[rows], down)
        new = []
        for out, up in zip(outs, ups):
            if up is not None:
                start, end, weight = up
                hi, o = h[:, start:end], out.reshape(-1, out.shape[-1])
                out = (torch.addmm(o, hi, weight) if rows is None else o.index_add(0, rows, hi @ weight)).view_as(out)
            new.append(out)
        return tuple(new)


class SlotAdapters(nn.Module):
    def __init__(self, base: nn.Module, rank: int, alpha: float, targets: list[str] | tuple[str, ...]) -> None:
        super().__init__()
        self.rank, self.scale = rank, (alpha / rank if rank else 0.0)
        self.down = nn.ModuleDict()
        self.up = nn.ModuleDict()
        self.rows: torch.Tensor | None = None
        # Where each adapter's hook goes during a gated pass: (parent module, attribute name), looked up then, so
        # a layer swapped in later (weight-only quantization) is the one hooked.
        self._sites: dict[str, tuple[nn.Module, str]] = {}
        self._keys: list[dict[str, str]] = []  # per decoder layer: projection name -> adapter key
        self._hook_fns = {}  # key -> its forward hook (reads `rows`, the pass's merged positions)
        self._signature: tuple = ()  # the weights' versions and storages when the inline copies were made
        self._inline: list[LayerAdapters] = []
        self._every = False
        if not rank:
            return
        layers = base.base_model.layers
        for li, layer in enumerate(layers):
            self._keys.append({})
            for name, module in layer.named_modules():
                if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
                    key = f"{li}_{name.replace('.', '_')}"
                    self.down[key] = nn.Linear(module.in_features, rank, bias=False)
                    self.up[key] = nn.Linear(rank, module.out_features, bias=False)
                    nn.init.kaiming_uniform_(self.down[key].weight, a=math.sqrt(5))
                    nn.init.zeros_(self.up[key].weight)  # starts as the untouched base
                    parent, _, leaf = name.rpartition(".")
                    self._sites[key] = (layer.get_submodule(parent), leaf)
                    self._keys[li][leaf] = key
        if not self.down:
            raise HamburgerError(f"slot adapters found none of the layers {list(targets)} in the base's decoder layers")
        self._hook_fns = {key: self._hook(key) for key in self.down}

    def _weights(self) -> list[nn.Parameter]:
        return [m.weight for m in (*self.down.values(), *self.up.values())]

    def inline(self, merged: torch.Tensor | None) -> list[AdapterPass] | None:
        """The adapters of each decoder layer for one pass of the engine, which applies them inline (its own layer
        code, `layers.project` / `finish`; no hooks): None if they would change nothing (no adapters, nothing
        merged). The copies are detached (decoding, not training) and rebuilt when a weight changed since: a loaded
        state dict or an optimizer step bumps its version, a move to another device or dtype gives it new
        storage, `truncate` replaces it."""
        if (merged_rows := self._merged_rows(merged)) is None:
            return None
        signature = tuple((w._version, w.data_ptr()) for w in self._weights())
        if signature != self._signature:
            self._inline = [self._layer_copies(keys) for keys in self._keys]
            self._signature = signature
        rows, every = merged_rows
        return [AdapterPass(groups, None if every else rows) for groups in self._inline]

    def _merged_rows(self, merged: torch.Tensor | None) -> tuple[torch.Tensor, bool] | None:
        """The flat (batch x sequence) indices of `merged`'s true positions and whether that is every position; None
        when the adapters would change nothing (no adapters, nothing merged)."""
        if not self.rank or not self._sites or merged is None or not bool(merged.any()):
            return None
        rows = merged.reshape(-1).nonzero().squeeze(1)
        return rows, rows.numel() == merged.numel()

    @torch.no_grad()
    def _layer_copies(self, keys: dict[str, str]) -> LayerAdapters:
        """One layer's inline copies, its adapters grouped by `GROUPS` (the projections the engine's layer code
        calls: an adapter elsewhere would be silently left out, so it is refused)."""
        copies: LayerAdapters = {}
        if stray := set(keys) - {n for names in GROUPS for n in names}:
            raise HamburgerError(f"the fast engine applies slot adapters to {sorted(DEFAULT_TARGETS)} only, not to "
                                 f"{sorted(stray)}: use the reference engine (--engine reference)")
        for names in GROUPS:
            present = [n for n in names if n in keys]
            if not present:
                continue
            down = torch.cat([self.down[keys[n]].weight for n in present])  # (n·rank, in): F.linear's layout
            ups, at = [], 0
            for n in names:
                if n in keys:
                    ups.append((at, at + self.rank, (self.up[keys[n]].weight * self.scale).t().contiguous()))
                    at += self.rank
                else:
                    ups.append(None)
            copies[names] = (down, tuple(ups))
        return copies

    def _hook(self, key: str):
        """The forward hook of one adapter (the transformers path: training, the reference decoder)."""
        down, up = self.down[key], self.up[key]

        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            x, rows = args[0], self.rows
            if self._every:
                return output + (up(down(x)) * self.scale).to(output.dtype)
            # Only the merged positions go through the adapter (a third or less of a training batch).
            delta = up(down(x.reshape(-1, x.shape[-1])[rows])) * self.scale
            flat = output.reshape(-1, output.shape[-1])
            return flat.index_add(0, rows, delta.to(output.dtype)).view_as(output)
        return hook

    @contextmanager
    def gated(self, merged: torch.Tensor | None) -> Iterator[bool]:
        """Adapters act where `merged` (B, S) is true during the block, through forward hooks on the base's linear
        layers (the transformers path); nothing changes if none is (no hook is installed then). Yields whether
        the hooks are on."""
        if (merged_rows := self._merged_rows(merged)) is None:
            yield False
            return
        self.rows, self._every = merged_rows
        hooks = self._hook_fns
        handles = [getattr(parent, leaf).register_forward_hook(hooks[key]) for key, (parent, leaf) in self._sites.items()]
        try:
            yield True
        finally:
            for handle in handles:
                handle.remove()
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
        self._hook_fns = {key: self._hook(key) for key in self.down}  # the hooks hold the replaced modules
        self._signature = ()
        return worst

    def remove(self) -> None:
        """Detach from the base: later passes install no hook (e.g. before fresh adapters take this one's place)."""
        self._sites = {}
