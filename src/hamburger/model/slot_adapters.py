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
fingerprint and weights stay as they were. The hooks exist only during a base pass with merged positions
(`gated` installs and removes them): a pass without one runs the base's modules with no hook at all (a hooked
module takes PyTorch's slower call path, 4 % of a decode step of the default).

Without gradients (decoding), sibling adapters that read one input (a layer's q/k/v, its MLP's gate/up) share
one down-projection GEMM, and each up-projection adds into the base's output in one `addmm` with the scale
folded in: 11 small ops a layer instead of 35 (`_Fused`). Training keeps one module per adapter.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from hamburger.errors import HamburgerError

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Sibling projections that read one input in a Llama-style decoder layer: their adapters share a down GEMM.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Fused:
    """Inference copies of a group of sibling adapters: their down weights stacked into one (n·rank, in) matrix
    and each up weight transposed to (rank, out) with the scale folded in (`SlotAdapters` rebuilds them when a
    weight changed).

    The first sibling called with an input computes the shared down-projection; the others called with the same
    tensor object take their slice, each once (as `fused.FusedGroup` serves the base's fused GEMM)."""

    def __init__(self, downs: list[nn.Parameter], ups: list[nn.Parameter], scale: float) -> None:
        self.sources, self.scale = downs + ups, scale
        self.n, self.rank = len(downs), downs[0].shape[0]
        self.down_w = torch.empty(0)
        self.ups_t: list[torch.Tensor] = []
        self.clear()

    def clear(self) -> None:
        self._x: torch.Tensor | None = None
        self._h: torch.Tensor | None = None
        self._left = 0

    def rebuild(self) -> None:
        downs, ups = self.sources[: self.n], self.sources[self.n:]
        self.down_w = torch.cat([w.detach() for w in downs])  # (n·rank, in): F.linear's layout, the fast one
        self.ups_t = [(w.detach() * self.scale).t().contiguous() for w in ups]

    def down(self, x: torch.Tensor, rows: torch.Tensor | None, index: int) -> torch.Tensor:
        """The (N, rank) down-projection of adapter `index` for `x`'s rows (all, or the merged `rows`): the
        group's GEMM runs once per input tensor object, for all its siblings."""
        if x is not self._x or not self._left & (1 << index):
            flat = x.reshape(-1, x.shape[-1])
            self._x, self._left = x, (1 << self.n) - 1
            self._h = F.linear(flat if rows is None else flat[rows], self.down_w)
        self._left &= ~(1 << index)
        h = self._h[:, index * self.rank:(index + 1) * self.rank]
        if not self._left:  # every sibling served: hold no activations between passes
            self.clear()
        return h


def _regroup(module: SlotAdapters, incompatible_keys) -> None:
    module._group_siblings()


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
        self._fused: dict[str, tuple[_Fused, int]] = {}  # key -> (its sibling group, its index there)
        self._hook_fns: dict[str, object] = {}  # key -> its forward hook (reads the pass's state below)
        self._signature: tuple = ()  # the weights' versions and storages when the inference copies were made
        self._groups: list[_Fused] = []
        # A state dict loaded with assign=True puts new parameter objects in place: group them again.
        self.register_load_state_dict_post_hook(_regroup)
        self._every = self._fast = False
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
                    parent, _, leaf = name.rpartition(".")
                    self._sites[key] = (layer.get_submodule(parent), leaf)
        if not self.down:
            raise HamburgerError(f"slot adapters found none of the layers {list(targets)} in the base's decoder layers")
        self._group_siblings()

    def _group_siblings(self) -> None:
        """Each adapter's inference group (its siblings: one parent module, one `SIBLINGS` set; or itself alone)
        and its hook."""
        self._fused, self._signature = {}, ()
        for key in self.down:
            if key in self._fused:
                continue
            group = [key]
            for names in SIBLINGS:
                name = next((n for n in names if key.endswith("_" + n)), None)
                if name is not None:
                    stem = key[: -len(name)]
                    group = [stem + n for n in names if stem + n in self.down]
            fused = _Fused([self.down[k].weight for k in group], [self.up[k].weight for k in group], self.scale)
            for i, k in enumerate(group):
                self._fused[k] = (fused, i)
        self._groups = list({id(f): f for f, _ in self._fused.values()}.values())
        self._hook_fns = {key: self._hook(key) for key in self.down}

    def _refresh(self) -> None:
        """Rebuild the inference copies if a weight changed since: a loaded state dict or an optimizer step bumps
        its version, a move to another device or dtype gives it new storage."""
        signature = tuple((w._version, w.data_ptr()) for f in self._groups for w in f.sources)
        if signature != self._signature:
            for fused in self._groups:
                fused.rebuild()
            self._signature = signature

    def _hook(self, key: str):
        """The forward hook of one adapter. Per pass (`gated`): `rows`, the merged positions; `_every`, whether
        that is every position (e.g. batch-1 decoding); `_fast`, no gradients, so the sibling group's inference
        copies serve (`_Fused`) where the input is in the adapters' dtype."""
        fused, index = self._fused[key]
        down, up = self.down[key], self.up[key]
        dtype = down.weight.dtype

        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            x, rows, every = args[0], self.rows, self._every
            if self._fast and x.dtype is dtype and output.dtype is dtype:
                h = fused.down(x, None if every else rows, index)
                if every:
                    return torch.addmm(output.reshape(-1, output.shape[-1]), h, fused.ups_t[index]).view_as(output)
                flat = output.reshape(-1, output.shape[-1])
                return flat.index_add(0, rows, h @ fused.ups_t[index]).view_as(output)
            if every:
                return output + (up(down(x)) * self.scale).to(output.dtype)
            # Only the merged positions go through the adapter (a third or less of a training batch).
            delta = up(down(x.reshape(-1, x.shape[-1])[rows])) * self.scale
            flat = output.reshape(-1, output.shape[-1])
            return flat.index_add(0, rows, delta.to(output.dtype)).view_as(output)
        return hook

    @contextmanager
    def gated(self, merged: torch.Tensor | None) -> Iterator[bool]:
        """Adapters act where `merged` (B, S) is true during the block; nothing changes if none is (no hook is
        installed then). Yields whether the hooks are on."""
        if not self.rank or not self._sites or merged is None or not bool(merged.any()):
            yield False
            return
        self.rows = merged.reshape(-1).nonzero().squeeze(1)  # flat (batch x sequence) indices of merged slots
        self._every = self.rows.numel() == merged.numel()
        self._fast = not torch.is_grad_enabled()
        if self._fast:
            self._refresh()
        hooks = self._hook_fns
        handles = [getattr(parent, leaf).register_forward_hook(hooks[key]) for key, (parent, leaf) in self._sites.items()]
        try:
            yield True
        finally:
            for handle in handles:
                handle.remove()
            for fused in self._groups:
                fused.clear()
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
        self._group_siblings()  # the groups hold the replaced modules' weights
        return worst

    def remove(self) -> None:
        """Detach from the base: later passes install no hook (e.g. before fresh adapters take this one's place)."""
        self._sites = {}
