"""Sibling projections that read one input (a decoder layer's q/k/v, or its MLP's gate/up) served by one kernel
call of a quantized layer, whatever the scheme: fewer, larger calls, the same outputs (`quantize_model(fuse=True)`).
"""

from __future__ import annotations

import torch
from torch import nn

from hamburger.kernels.qlinear import MODULES, WIDE_ROWS, QuantizedLinear, carry_hooks


class FusedGroup:
    """One kernel call for sibling projections that read the same input (a decoder layer's q/k/v, or its MLP's
    gate/up), in any scheme: fewer, larger calls (benchmarks/step_profile.py counts the calls of a step;
    docs/quantize.md). Each sibling becomes a `FusedPart`, so the callers (the engine's `layers.project`,
    transformers' own attention and MLP forwards, the slot adapters' hooks) stay unchanged.

    The first part called with an input computes every part's output in one call; its siblings called with the
    same tensor object take their slices without a call, each once. A part asked again, or asked with another
    tensor, computes afresh: an input is never changed in place between its projections in these layers.
    """

    def __init__(self, linear: QuantizedLinear, sizes: list[int]) -> None:
        """`linear`: the siblings' output rows end to end, `sizes` rows each."""
        self.linear = linear
        ends = torch.tensor(sizes).cumsum(0).tolist()
        self.bounds = list(zip([0, *ends[:-1]], ends))
        self._x: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._left: set[int] = set()

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if x is not self._x or index not in self._left:
            self._x, self._out, self._left = x, self.linear(x), set(range(len(self.bounds)))
        self._left.discard(index)
        start, end = self.bounds[index]
        out = self._out[..., start:end]
        if not self._left:  # every sibling served: hold no activations between passes
            self._x = self._out = None
        return out


class FusedPart(QuantizedLinear):
    """One projection of a `FusedGroup`: the forward, weights, bias, byte count and cache tensors of the layer it
    replaces (so the disk cache and the byte counts see the same layers as before fusion)."""

    def __init__(self, group: FusedGroup, index: int, bias: torch.Tensor | None) -> None:
        start, end = group.bounds[index]
        super().__init__(group.linear.in_features, end - start, bias, group.linear.group_size)
        self.__dict__["group"] = group  # shared by the siblings, not a submodule of each
        self.index = index
        self.scheme = group.linear.scheme

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.group.linear.compute_dtype

    @property
    def packed_nbytes(self) -> int:
        """This part's share of the group's weights (which are no buffer of the part's)."""
        return self.group.linear.weight_nbytes * self.out_features // self.group.linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(x, self.index)

    def set_wide(self, rows: int = WIDE_ROWS) -> None:
        """The group's one layer takes the bfloat16 copy (`QuantizedLinear.set_wide`), made once for the siblings."""
        if self.group.linear.wide_rows != rows:
            self.group.linear.set_wide(rows)

    def dequantize(self) -> torch.Tensor:
        start, end = self.group.bounds[self.index]
        return self.group.linear.dequantize()[start:end]

    def portable(self) -> dict[str, torch.Tensor]:
        """The group's tensors cut to this part's rows (int4's scales are (K/g, N, 2): cut along N)."""
        start, end = self.group.bounds[self.index]
        out = {key: t[:, start:end] if key in ("scales_and_zeros", "scales_and_mins") else t[start:end]
               for key, t in self.group.linear.portable().items() if key != "bias"}
        if self.bias is not None:
            out["bias"] = self.bias.detach().cpu()
        return out


# Sibling projections that read one input in the decoder layers of transformers' Llama-style models.
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# The modules whose layers call those siblings on one input: transformers' classes and the same tree without it.
DECODER_MODULES = ("transformers.", "hamburger.model.llama")


def is_decoder_module(module: nn.Module) -> bool:
    return type(module).__module__.startswith(DECODER_MODULES)


def fuse_projections(model: nn.Module) -> int:
    """Put a `FusedGroup` in place of each set of `FUSED_SIBLINGS` that are all quantized layers of one class and
    settings (fp16, int8, int4), in the modules of transformers' own classes (the base's and the micro-step
    decoder's layers: they call the siblings on one input). Outputs are unchanged: each output row is the same dot
    products. Returns the number of groups made."""
    made = 0
    for module in model.modules():
        if not is_decoder_module(module):
            continue
        for names in FUSED_SIBLINGS:
            parts = [getattr(module, n, None) for n in names]
            if not all(type(p) in MODULES.values() for p in parts):
                continue
            if len({(type(p), p.in_features, p.group_size, p.compute_dtype, getattr(p, "packed_for", None))
                    for p in parts}) != 1:  # one class and the same settings, or no single kernel serves them
                continue
            install(module, names, parts, type(parts[0]).concat(parts))
            made += 1
    return made


def install(module: nn.Module, names: tuple[str, ...], parts: list[nn.Module], linear: QuantizedLinear) -> None:
    """`module`'s siblings `names` (the layers `parts`) become the parts of one group around `linear`, whose output
    rows are the parts' end to end; each part keeps its layer's bias and hooks."""
    group = FusedGroup(linear, [p.out_features for p in parts])
    for i, (name, old) in enumerate(zip(names, parts)):
        setattr(module, name, carry_hooks(old, FusedPart(group, i, old.bias)))


def sibling_sets(model: nn.Module, todo: dict[str, str]) -> list[tuple[nn.Module, tuple[str, ...], list[str], str]]:
    """The `FUSED_SIBLINGS` that `quantize_model` is about to quantize alike (`todo`: layer name -> scheme), float
    `nn.Linear`s of one input size, device and dtype in a module of transformers' own classes: (module, sibling
    names, their names in `model`, scheme) for each, to quantize as one layer (`fused_layer`)."""
    out = []
    for prefix, module in model.named_modules():
        if not is_decoder_module(module):
            continue
        for names in FUSED_SIBLINGS:
            full = [f"{prefix}.{n}" if prefix else n for n in names]
            parts = [getattr(module, n, None) for n in names]
            wants = {todo.get(f) for f in full}
            if not all(type(p) is nn.Linear for p in parts) or None in wants or len(wants) != 1:
                continue
            if len({(p.in_features, p.weight.device, p.weight.dtype) for p in parts}) == 1:
                out.append((module, names, full, todo[full[0]]))
    return out


def fused_layer(module: nn.Module, names: tuple[str, ...], quantized: type[QuantizedLinear], group_size: int,
                dtype: torch.dtype | None) -> QuantizedLinear:
    """The one quantized layer of `module`'s float siblings `names`, their output rows end to end (`install` makes
    it their group): each output row is quantized on its own in every scheme, so this is bit for bit the group
    `fuse_projections` makes of the siblings quantized one by one, at one packing of the weights instead of three
    (fp16: packed, unpacked to concatenate, packed again)."""
    parts = [getattr(module, n) for n in names]
    whole = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=False, device="meta")
    whole.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
    if any(p.bias is not None for p in parts):
        whole.bias = nn.Parameter(torch.cat([p.bias.detach() if p.bias is not None else
                                             p.weight.new_zeros(p.out_features) for p in parts]), requires_grad=False)
    return quantized.from_linear(whole, group_size, dtype)
