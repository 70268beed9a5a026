"""LoRA on the base (`hamburger train --base-training lora`): peft's adapters on the base's projections, and the
switch that turns them off.

The LoRA teaches the base to read smashed slots; it serves trust mode, which decodes with the base's own
(unchecked) view of the smashed steps. Verify and compress mode check drafts against the base and must run the
untouched base to stay exact, so they decode with the LoRA off (`LORA_MODES`). The switch costs a Python flag per
adapted projection (no weight is copied or merged); `BaseLora.enabled(rows)` also turns the LoRA on for some rows
of a batch only (a batch mixing trust rows with verify or compress rows), through forward hooks.

The adapters' parameters are named `...<projection>.lora_A.default.weight` / `lora_B` inside the base (peft's
names), which `hamburger_model.is_trained_key` keeps in a checkpoint without the base.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from hamburger.errors import HamburgerError

LORA_MODES = ("trust",)  # the decoding modes that run the base with its LoRA on (verify, compress: off)
ADAPTER = "default"  # peft's adapter name: one LoRA per base


def inject_lora(base: nn.Module, rank: int, alpha: float, targets: list[str]) -> None:
    """Add LoRA adapters of `rank` to the base's `targets` projections; B starts at zero, so the outputs are
    unchanged."""
    from peft import LoraConfig, inject_adapter_in_model  # noqa: PLC0415 - only for models with a LoRA

    if rank < 1:
        raise HamburgerError(f"a LoRA needs a rank >= 1, got {rank}")
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    inject_adapter_in_model(config, base)


def lora_layers(base: nn.Module) -> list[nn.Module]:
    """The base's projections that carry a LoRA (peft's `LoraLayer` wrappers). Without peft imported there are none:
    importing it to look would cost every model load about half a second."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.lora import LoraLayer  # noqa: PLC0415

    return [m for m in base.modules() if isinstance(m, LoraLayer)]


def merge_lora(base: nn.Module) -> None:
    """Fold the adapters into the base's weights and put the plain projections back (no LoRA left)."""
    from peft.tuners.lora import LoraLayer  # noqa: PLC0415

    for name, module in list(base.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(base.get_submodule(parent), child, module.get_base_layer())


class BaseLora:
    """The switch over one base's LoRA layers (found once; `refresh` after the layers change)."""

    def __init__(self, base: nn.Module) -> None:
        self.base = base
        self.layers: list[nn.Module] = []
        self.refresh()

    def refresh(self) -> None:
        self.layers = lora_layers(self.base)

    @property
    def on(self) -> bool:
        """Whether the LoRA acts on every row (the state peft's forward reads)."""
        return bool(self.layers) and not self.layers[0].disable_adapters

    def set(self, enabled: bool) -> bool:
        """Turn the LoRA on or off for every row; returns the previous state. Leaves `requires_grad` alone (peft's
        own `enable_adapters` would change it)."""
        before = self.on
        for layer in self.layers:
            layer._disable_adapters = not enabled
        return before

    @contextmanager
    def enabled(self, rows: bool | torch.Tensor = True) -> Iterator[None]:
        """The LoRA on (True), off (False), or on where the bool tensor `rows` is true during the block: (B,) rows
        of the batch, or (B, T) positions, of every adapted projection's input (B, T, in). The state before
        comes back after."""
        before = self.on
        handles = []
        if isinstance(rows, torch.Tensor):
            self.set(False)
            handles = [layer.register_forward_hook(masked_delta(layer, rows)) for layer in self.layers]
        else:
            self.set(bool(rows))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.set(before)


def masked_delta(layer: nn.Module, rows: torch.Tensor):
    """A forward hook adding the LoRA's delta of `layer` (with its adapters off) where `rows` is true."""

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        mask = rows.reshape(*rows.shape, *([1] * (x.dim() - rows.dim()))).to(output.dtype)
        a, b = layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]
        delta = b(a(x.to(a.weight.dtype))) * layer.scaling[ADAPTER]
        return output + (delta.to(output.dtype) * mask)

    return hook
