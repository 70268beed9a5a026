"""What every weight-only quantized linear layer shares (`QuantizedLinear`), and the rules of which kernel can take
which layer; the layers themselves are in `qlinear.py`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hamburger.kernels import native

# `set_wide`: passes of at least this many rows (prefill, a batch of 8 or more rows) multiply by a bfloat16 copy of
# the weights. On a CPU with AMX, oneDNN's bfloat16 GEMM costs about the same from 1 to 64 rows, while FBGEMM's fp16
# and the int8/int4 kernels grow with the rows; the two cross near 8 rows (docs/quantize.md, "Wide passes").
WIDE_ROWS = 8


def wide_unavailable(device: torch.device | str) -> str | None:
    """Why wide passes in bfloat16 would not pay on `device`, or None: a CPU whose oneDNN multiplies bfloat16
    natively (AVX512-BF16 / AMX)."""
    if torch.device(device).type != "cpu":
        return f"+bf16 (wide passes in bfloat16) is for CPUs, not {torch.device(device).type}"
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return "+bf16 (wide passes in bfloat16) needs a CPU with native bfloat16 (AVX512-BF16 or AMX)"
    return None


# --- the modules ---------------------------------------------------------------------------------------------


def fp16_unavailable(device: torch.device | str) -> str | None:
    """Why FBGEMM's packed float16 GEMM cannot run on `device` (None if it can): the one rule for `fp16`."""
    if torch.device(device).type != "cpu":
        return ("float16 packed weights run on x86 CPUs only (FBGEMM); on CUDA load the model with --dtype float16 "
                "or bfloat16 instead")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this PyTorch build has no FBGEMM (x86 CPUs only)"
    return None


def int_kernel_dtype(device: torch.device | str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the activations (and of the scales) the int8/int4 kernels multiply with by default.

    bfloat16 on CPU, whatever the model's dtype: PyTorch's CPU int8/int4 kernels are vectorized for bfloat16
    inputs only; float32 and float16 inputs take a scalar loop, an order of magnitude or more slower
    (benchmarks/native_variants.py; docs/quantize.md). The layer
    converts its input to bfloat16 and its output back, so the rest of the model keeps its dtype. On CUDA the
    model's dtype (the int4 kernel takes bfloat16 only, checked where the layer is made).
    """
    return torch.bfloat16 if torch.device(device).type == "cpu" else model_dtype


def int8_unfit(in_features: int, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why the int8 kernel cannot take a layer (None if it can). Its CPU bfloat16 path reads garbage or crashes
    when in_features is not a multiple of 16 (measured on torch 2.13, AVX-512)."""
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16 and in_features % 16:
        return f"in_features {in_features} is not a multiple of 16 (the CPU int8 kernel in bfloat16)"
    return None


def cat_bias(parts: list[QuantizedLinear]) -> torch.Tensor | None:
    """The parts' biases end to end (zeros for a part without one); None if none has one."""
    ref = next((p.bias for p in parts if p.bias is not None), None)
    if ref is None:
        return None
    return torch.cat([p.bias.detach() if p.bias is not None else ref.new_zeros(p.out_features) for p in parts])


def check_device(device: torch.device) -> None:
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"weight-only quantization has packed kernels for cpu and cuda only, not {device.type!r}")


# The kernels' overloads, called directly: an operator packet's call checks on every call which overload and
# whether to dispatch in Python (about 1.3 us of a 20 us call at batch 1).
def _overload(namespace: str, name: str):
    """torch.ops.<namespace>.<name>.default, or None in a build without it (the layer that needs it says so)."""
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):
        return None


FP16_MM = _overload("quantized", "linear_dynamic_fp16")
INT4_MM_CPU = _overload("aten", "_weight_int4pack_mm_for_cpu")
INT8_MM = _overload("aten", "_weight_int8pack_mm")


class QuantizedLinear(nn.Module):
    """Common part: same forward as nn.Linear (any leading dims), float bias, `.weight` as a dequantised copy."""

    scheme = ""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, group_size: int = 0) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None

    @property
    def compute_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # `set_wide`: a bfloat16 copy of the weights for passes of at least `wide_rows` rows (None: off). A plain
    # attribute, not a buffer, so the disk cache holds the quantized weights only; `quantize.wide_bytes` counts it.
    wide: torch.Tensor | None = None
    wide_rows: int = 0

    def set_wide(self, rows: int = WIDE_ROWS) -> None:
        """Passes of at least `rows` rows multiply by a bfloat16 copy of the (dequantized) weights from now on, and
        add the bias in float; 0 turns it off. One more copy of the weights in memory (two bytes a weight)."""
        if rows < 0:
            raise ValueError(f"wide rows must be >= 0, got {rows}")
        self.wide = self.dequantize().to(torch.bfloat16).contiguous() if rows else None
        self.wide_rows = rows

    def wide_pass(self, x: torch.Tensor) -> bool:
        """Whether a pass over x multiplies by the bfloat16 copy (`set_wide`)."""
        return self.wide is not None and x.numel() >= self.wide_rows * self.in_features

    def _wide(self, x: torch.Tensor) -> torch.Tensor | None:
        """The output through the bfloat16 copy when the pass is wide enough, else None."""
        if not self.wide_pass(x):
            return None
        y = F.linear(x.to(torch.bfloat16), self.wide).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2d(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)

    def linear2d(self, x: torch.Tensor) -> torch.Tensor:
        """The forward of a (rows, in_features) input without the reshapes."""
        if (y := self._wide(x)) is not None:
            return y
        y = self._mm(x.to(self.compute_dtype).contiguous())
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The (out, in) float weights the kernel multiplies with, in the compute dtype."""
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:  # a fresh dequantised copy: read-only use (e.g. rows of the LM head)
        return self.dequantize()

    def portable(self) -> dict[str, torch.Tensor]:
        """Device-independent CPU tensors that `from_portable` turns back into this module bit for bit."""
        raise NotImplementedError

    @classmethod
    def concat(cls, parts: list[QuantizedLinear]) -> QuantizedLinear:
        """One layer of this class whose output rows are the parts' in order, each exactly as the part had them
        (every scheme here quantizes an output row independently of the others)."""
        raise NotImplementedError

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the weights the kernel reads (buffers, or the packed object), without the bias."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{group}"


class NativeCodes:
    """What the int4 and int8 layers share where the native kernels multiply them (`native` true): float32
    activations, the C description of their buffers (`native_tensors`), the bias added inside the kernel."""

    native = False
    _desc = None

    @classmethod
    def native_layer(cls, linear: nn.Linear, group_size: int, buffers: tuple[torch.Tensor, ...]):
        """A layer of this class in place of `linear` from buffers already in the native layout (`set_native`'s):
        what `from_linear` returns where the native quantizer made them, with no other layout made first."""
        layer = cls.__new__(cls)
        QuantizedLinear.__init__(layer, linear.in_features, linear.out_features, linear.bias, group_size)
        layer.native = True
        layer.set_native(*buffers)
        return layer

    def native_tensors(self) -> tuple[int, torch.Tensor]:
        """(native kind, the tiles of codes and scales) of the native layout."""
        raise NotImplementedError

    def native_desc(self) -> native.Weights:
        """The native kernels' description of these weights (made again if the buffers moved)."""
        kind, tiles = self.native_tensors()
        bias = None if self.bias is None else self.bias.data_ptr()
        ptrs = (tiles.data_ptr(), bias, kind)
        if self._desc is None or self._desc[0] != ptrs:
            if self.bias is not None and self.bias.dtype != torch.float32:
                raise ValueError(f"native {self.scheme} layers take a float32 bias")
            self._desc = (ptrs, native.weights(kind, tiles, self.out_features, self.in_features,
                                               group=self.group_size, bias=self.bias))
        return self._desc[1]

    def native_linear2d(self, x: torch.Tensor) -> torch.Tensor:
        if (y := self._wide(x)) is not None:
            return y
        return native.linear(x.float().contiguous(), self.native_desc()).to(x.dtype)  # the bias inside

    def native_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x (rows, in) float32 -> (rows, out) without the bias (`linear2d` adds it)."""
        desc = self.native_desc()
        return native.linear(x, native.Weights(desc.kind, 0, desc.n, desc.k, desc.group, desc.w, desc.sz, None))


def native_head(layer: nn.Module, x: torch.Tensor) -> native.Weights | None:
    """`layer`'s native weights where its forward at (rows, in) x would be that one native product, else None (not
    native, a wide pass, not float32 on the CPU, a forward hook): what a fused argmax may multiply by."""
    hooks = torch.nn.modules.module
    if (not getattr(layer, "native", False) or not hasattr(layer, "native_desc") or x.dtype != torch.float32
            or x.device.type != "cpu" or layer._forward_hooks or layer._forward_pre_hooks
            or hooks._global_forward_hooks or hooks._global_forward_pre_hooks
            or layer.wide_pass(x)):
        return None
    return layer.native_desc()


def native_argmax(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The index of each row's largest output of `layer` at (rows, in) x, from the native kernels' fused argmax
    (`native.linear_argmax`: the same products as its forward, no outputs handed back), or None where its forward
    would not be that one native product (`native_head`)."""
    desc = native_head(layer, x)
    return None if desc is None else native.linear_argmax(x.contiguous(), desc)


def native_here(device: torch.device, out_features: int, in_features: int, kind: int, group: int = 0) -> bool:
    """Whether a layer of this shape made now on `device` is multiplied by the native kernels."""
    return (device.type == "cpu" and native.available()
            and native.fits(out_features, in_features, kind, group) is None)


def carry_hooks(old: nn.Module, new: nn.Module) -> nn.Module:
    """`new`, given `old`'s forward hooks (e.g. the slot adapters') and training flag, to take its place.

    The hook dicts are shared, not copied, so the handles that registered them still remove them.
    """
    for attr in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"):
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))
    new.train(old.training)
    return new
