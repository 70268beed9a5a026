"""Weight-only quantized linear layers: float16 weights, int8 and int4 codes. All three multiply with the native
kernels where they run (`native.py`: x86-64 CPUs with AVX2 or AVX-512, aarch64 ones, and a C compiler; int8 and
int4 then in GGUF's Q8_0 and Q4_1 blocks with float16 scales), else with PyTorch's packed kernels (FBGEMM's float16
GEMM, the int8 and int4 pack kernels: int8 per output channel, int4 in groups with bfloat16 scale and zero on CPU).
`qbase.py` holds what they share, `qcodes.py` the arithmetic that makes their codes, `quantize.py` plans which
layers to swap.
"""

from __future__ import annotations

import torch
from torch import nn

from hamburger.kernels import native
from hamburger.kernels.qbase import (
    FP16_MM,
    INT4_MM_CPU,
    INT8_MM,
    WIDE_ROWS,
    NativeCodes,
    QuantizedLinear,
    carry_hooks,
    cat_bias,
    check_device,
    fp16_unavailable,
    int8_unfit,
    int_kernel_dtype,
    native_here,
    wide_unavailable,
)
from hamburger.kernels.qcodes import (
    inner_k_tiles,
    int4_weights,
    int8_weights,
    pack_nibbles,
    unpack_nibbles,
    untile_q4,
    untile_q8,
)

__all__ = ["MODULES", "WIDE_ROWS", "Fp16Linear", "Fp16Weights", "Int4Linear", "Int8Linear", "QuantizedLinear",
           "carry_hooks", "fp16_unavailable", "int8_unfit", "int_kernel_dtype", "wide_unavailable"]



class Int8Linear(NativeCodes, QuantizedLinear):
    """Symmetric int8 weights. Natively (CPU, where the native kernels run): GGUF's Q8_0, a float16 scale per block
    of 32 inputs, the activations quantized to int16 in blocks of 32 (`native.INT8_Q16`); else a scale per output
    channel and `aten._weight_int8pack_mm` (CPU and CUDA)."""

    scheme = "int8"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """q: (N, K) codes -127..127; scales: (N,) per output channel or (N, K/32) per block, w = q · scale."""
        n, k = q.shape
        here = native_here(q.device, n, k, native.INT8_Q16)
        super().__init__(k, n, bias, 32 if here else 0)
        self.native = here
        if here:
            self.set_native(native.tile_q8(q, scales[:, None].expand(n, k // 32) if scales.dim() == 1 else scales))
            return
        if scales.dim() == 2:  # Q8_0 blocks where the native kernels do not run: per channel again
            w = q.float() * scales.float().repeat_interleave(32, 1)
            q, scales = int8_weights(w, int_kernel_dtype(q.device, torch.float32))
        if (why := int8_unfit(k, q.device, scales.dtype)) is not None:
            raise ValueError(why)
        # Own, freshly allocated copies: the bfloat16 kernel crashes (segmentation fault) on weights that are not
        # aligned, as tensors read from a safetensors file can be.
        self.register_buffer("weight_int8", q.to(torch.int8).clone(memory_format=torch.contiguous_format))
        self.register_buffer("scales", scales.clone(memory_format=torch.contiguous_format))

    def set_native(self, tiles: torch.Tensor) -> None:
        """The native layout: codes and float16 scales in tiles of 16 outputs by 32 inputs (`native.tile_q8`)."""
        self.register_buffer("tiles", tiles)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 0, dtype: torch.dtype | None = None) -> Int8Linear:
        """dtype: of the per-channel scales and so of the activations (default `int_kernel_dtype`); natively
        float16 block scales (`qcodes.q8_0_weights`, computed in one native pass) and float32 activations."""
        w = linear.weight
        check_device(w.device)
        if native_here(w.device, *w.shape, native.INT8_Q16) and dtype in (None, torch.float32):
            return cls.native_layer(linear, 32, (native.tile_q8(*native.quantize_q8_0(w)),))
        q, scales = int8_weights(w, dtype or int_kernel_dtype(w.device, w.dtype))
        return cls(q, scales, linear.bias)

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32 if self.native else self.scales.dtype

    def native_tensors(self) -> tuple[int, torch.Tensor]:
        return native.INT8_Q16, self.tiles

    def linear2d(self, x: torch.Tensor) -> torch.Tensor:
        return self.native_linear2d(x) if self.native else super().linear2d(x)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return self.native_mm(x) if self.native else INT8_MM(x, self.weight_int8, self.scales)

    def codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes (N, K) int8, scales: (N, K/32) float16 natively, else (N,))."""
        if self.native:
            return untile_q8(self.tiles, self.out_features)
        return self.weight_int8, self.scales

    def rows(self, index: torch.Tensor) -> Int8Linear:
        """A layer of these output rows (e.g. the LM head's shortlist), their codes and scales as they are here."""
        q, scales = self.codes()
        return Int8Linear(q[index], scales[index])

    def dequantize(self) -> torch.Tensor:
        if self.native:
            q, scales = self.codes()
            return q.float() * scales.float().repeat_interleave(32, 1)
        return self.weight_int8.to(self.scales.dtype) * self.scales[:, None]

    def portable(self) -> dict[str, torch.Tensor]:
        q, scales = self.codes()
        out = {"q": q.cpu(), "block_scales" if self.native else "scales": scales.cpu()}
        if self.bias is not None:
            out["bias"] = self.bias.detach().cpu()
        return out

    @classmethod
    def from_portable(cls, t: dict[str, torch.Tensor], device: torch.device, group_size: int = 0) -> Int8Linear:
        scales = t["block_scales"] if "block_scales" in t else t["scales"]
        return cls(t["q"].to(device), scales.to(device), t["bias"].to(device) if "bias" in t else None)

    @classmethod
    def concat(cls, parts: list[Int8Linear]) -> Int8Linear:
        codes = [p.codes() for p in parts]
        return cls(torch.cat([c[0] for c in codes]), torch.cat([c[1] for c in codes]), cat_bias(parts))


class Int4Linear(NativeCodes, QuantizedLinear):
    """Asymmetric group-wise 4-bit weights (GGUF's Q4_1 layout, w = q · scale + min). Natively (CPU, where the
    native kernels run) with float16 scales and mins, the inputs quantized to int16 in blocks of 32
    (`native.INT4_Q16`: each product about 3e-5 off its float value); else PyTorch's packed int4 kernels of CPU or
    CUDA (scale and zero in bfloat16 on CPU)."""

    scheme = "int4"
    # natively, the activations in 8 bits instead of 16 (`native.INT4_Q8`; `--quantize ...+a8`, `quantize.inputs_in_8_bits`)
    activations8 = False

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None) -> None:
        """q: (N, K) codes 0..15 (any int dtype), scales and mins: (N, K/g) with w = q · scale + min."""
        n, k = q.shape
        super().__init__(k, n, bias, group_size)
        device = q.device
        check_device(device)
        self.native = native_here(device, n, k, native.INT4_Q16, group_size)
        if self.native:
            self.set_native(native.tile_q4(q, scales, mins, group_size))
            return
        self.packed_for = device.type
        if device.type == "cpu" and scales.dtype == torch.float16:  # native blocks read here: the CPU kernel's dtype
            scales, mins = scales.to(torch.bfloat16), mins.to(torch.bfloat16)
        zeros = mins + 8 * scales  # in the stored dtype, as quantized against
        self.register_buffer("scales_and_zeros", torch.stack([scales.t(), zeros.t()], -1).contiguous())
        if device.type == "cuda":
            if scales.dtype != torch.bfloat16:
                raise ValueError(f"the CUDA int4 kernel runs in bfloat16 only, not {scales.dtype}: load the model "
                                 "in bfloat16 or use int8")
            q8 = q.to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack((q8[:, ::2] << 4 | q8[:, 1::2]).contiguous(),
                                                               inner_k_tiles(k))
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
        self.register_buffer("weight_int4pack", packed)

    def set_native(self, tiles: torch.Tensor) -> None:
        """The native layout: codes, float16 scales and mins in tiles of 16 outputs by 32 inputs
        (`native.tile_q4`)."""
        self.register_buffer("tiles", tiles)

    def native_tensors(self) -> tuple[int, torch.Tensor]:
        return native.INT4_Q8 if self.activations8 else native.INT4_Q16, self.tiles

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int, dtype: torch.dtype | None = None) -> Int4Linear:
        """dtype: of the scales and zeros and so of the activations (default `int_kernel_dtype`); codes are
        computed against the scales rounded to it. Natively GGUF's Q4_1 (`qcodes.q4_1_weights`: float16 scales and
        mins, computed in one native pass) and float32 activations."""
        w = linear.weight
        if native_here(w.device, *w.shape, native.INT4_Q16, group_size) and dtype in (None, torch.float32):
            codes = native.quantize_q4_1(w, group_size)
            return cls.native_layer(linear, group_size, (native.tile_q4(*codes, group_size),))
        q, scales, mins = int4_weights(w, group_size, dtype or int_kernel_dtype(w.device, w.dtype))
        return cls(q, scales, mins, group_size, linear.bias)

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32 if self.native else self.scales_and_zeros.dtype

    def linear2d(self, x: torch.Tensor) -> torch.Tensor:
        return self.native_linear2d(x) if self.native else super().linear2d(x)

    def _kernel(self, x: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
        if x.device.type != self.packed_for:
            raise ValueError(f"int4 weights packed for {self.packed_for} cannot run on {x.device.type}: quantize "
                             "the model on the device it runs on")
        if self.packed_for == "cuda":
            return torch.ops.aten._weight_int4pack_mm(x, self.weight_int4pack, self.group_size, scales_and_zeros)
        return INT4_MM_CPU(x, self.weight_int4pack, self.group_size, scales_and_zeros)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return self.native_mm(x) if self.native else self._kernel(x, self.scales_and_zeros)

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes (N, K) uint8, scales (N, K/g), mins (N, K/g)), read back from the packed weights.

        PyTorch's packing: layout-agnostic, the kernel itself multiplies an identity with scale 1 and zero 8, so it
        returns (q - 8) + 8 = q for every weight, exactly.
        """
        if self.native:
            return untile_q4(self.tiles, self.out_features, self.group_size)
        sz = self.scales_and_zeros
        scales, zeros = sz[..., 0].t(), sz[..., 1].t()
        dtype = torch.bfloat16  # codes 0..15 times an identity: exact, and the kernels' fast path on CPU and CUDA
        probe = torch.stack([torch.ones_like(sz[..., 0]), torch.full_like(sz[..., 0], 8)], -1).to(dtype)
        eye = torch.eye(self.in_features, dtype=dtype, device=sz.device)
        q = self._kernel(eye, probe).t().round().to(torch.uint8)
        return q, scales.contiguous(), (zeros - 8 * scales).contiguous()

    def dequantize(self) -> torch.Tensor:
        """The kernel's own weights: an identity through the kernel (exactly what any input is multiplied with)."""
        if self.native:  # q · scale + min in float32
            q, scales, mins = self.unpack()
            return q.float() * scales.float().repeat_interleave(self.group_size, 1) + mins.float().repeat_interleave(
                self.group_size, 1)
        eye = torch.eye(self.in_features, dtype=self.compute_dtype, device=self.scales_and_zeros.device)
        return self._mm(eye).t().contiguous()

    def portable(self) -> dict[str, torch.Tensor]:
        q, scales, mins = self.unpack()
        out = {"q4": pack_nibbles(q).cpu()}
        if self.native:  # (K/g, N, 2): the disk cache's layout
            out["scales_and_mins"] = torch.stack([scales.t(), mins.t()], -1).contiguous()
        else:
            out["scales_and_zeros"] = self.scales_and_zeros.cpu()
        if self.bias is not None:
            out["bias"] = self.bias.detach().cpu()
        return out

    @classmethod
    def from_portable(cls, t: dict[str, torch.Tensor], device: torch.device, group_size: int = 32) -> Int4Linear:
        q = unpack_nibbles(t["q4"]).to(device)
        bias = t["bias"].to(device) if "bias" in t else None
        if "scales_and_mins" in t:
            sm = t["scales_and_mins"].to(device)
            return cls(q, sm[..., 0].t(), sm[..., 1].t(), group_size, bias)
        sz = t["scales_and_zeros"].to(device)
        scales, zeros = sz[..., 0].t(), sz[..., 1].t()
        module = cls(q, scales, zeros - 8 * scales, group_size, bias)
        if not module.native:
            module.scales_and_zeros.copy_(sz)  # exactly the stored (scale, zero), not re-derived through the min
        return module

    @classmethod
    def concat(cls, parts: list[Int4Linear]) -> Int4Linear:
        unpacked = [p.unpack() for p in parts]
        module = cls(*(torch.cat([u[i] for u in unpacked]) for i in range(3)), parts[0].group_size, cat_bias(parts))
        if not module.native:  # exactly the parts' (scale, zero)
            module.scales_and_zeros.copy_(torch.cat([p.scales_and_zeros for p in parts], 1))
        return module


class Fp16Weights(QuantizedLinear):
    """What every fp16 layer shares: float32 compute, two bytes a weight, and the disk cache's float16 tensors."""

    scheme = "fp16"

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def packed_nbytes(self) -> int:
        """Bytes of the packed weights (an opaque object, not a buffer)."""
        return self.in_features * self.out_features * 2

    @property
    def weight_nbytes(self) -> int:
        return self.in_features * self.out_features * 2

    def portable(self) -> dict[str, torch.Tensor]:
        out = {"w16": self.dequantize().half()}
        if self.bias is not None:
            out["bias"] = self.bias.detach().cpu()
        return out


class Fp16Linear(Fp16Weights):
    """Weights rounded to float16, float32 activations, accumulation and output; half the bytes of float32 weights
    to read per step. Multiplied by the native kernels where they run (`native.py`: the float16 weights as a
    buffer), else packed once for FBGEMM's float16 GEMM (`quantized::linear_dynamic_fp16`, x86 CPUs). Either way
    each row's output is independent of how many rows go through: bit for bit with the native and FBGEMM's
    AVX-512 kernels, to the last bits with FBGEMM's AVX2 ones (a test)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias)
        if (why := fp16_unavailable(weight.device)) is not None:
            raise ValueError(why)
        b = None if bias is None else bias.detach().float().contiguous()  # added inside the kernel: exact
        self.native = native.available() and native.fits(*weight.shape, native.FP16) is None
        if self.native:
            # int16 bits, so that casting the model's floating tensors (`.float()`, `.to(dtype)`) leaves them be
            self.register_buffer("w16", weight.detach().half().contiguous().view(torch.int16))
            self.bias32, self._desc, self.packed = b, None, None
        else:
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(), b)

    @property
    def packed_nbytes(self) -> int:
        """Bytes of the packed weights held as an opaque object (FBGEMM's), not as a buffer."""
        return 0 if self.native else self.in_features * self.out_features * 2

    def native_desc(self) -> native.Weights:
        """The native kernels' description of these weights (made again if the buffers moved)."""
        ptrs = (self.w16.data_ptr(), None if self.bias32 is None else self.bias32.data_ptr())
        if self._desc is None or self._desc[0] != ptrs:
            self._desc = (ptrs, native.weights(native.FP16, self.w16, self.out_features, self.in_features,
                                               bias=self.bias32))
        return self._desc[1]

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 0, dtype: torch.dtype | None = None) -> Fp16Linear:
        if dtype not in (None, torch.float32):
            raise ValueError(f"fp16 packed weights compute in float32, not {dtype}")
        return cls(linear.weight, linear.bias)

    def eager_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x (rows, in) float32 contiguous -> (rows, out), the bias included."""
        if self.native:
            return native.linear(x, self.native_desc())
        return FP16_MM(x, self.packed)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return self.eager_mm(x.reshape(-1, self.in_features)).view(*x.shape[:-1], -1)
        return FP16_MM(x, self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # any leading dims, the bias inside: no extra ops
        if (y := self._wide(x)) is not None:
            return y
        if x.dtype == torch.float32:
            return self._mm(x.contiguous())
        return self._mm(x.float().contiguous()).to(x.dtype)

    linear2d = forward  # any leading dims already

    def dequantize(self) -> torch.Tensor:
        if self.native:
            return self.w16.view(torch.float16).float()
        return torch.ops.quantized.linear_unpack_fp16(self.packed)[0]

    @classmethod
    def from_portable(cls, t: dict[str, torch.Tensor], device: torch.device, group_size: int = 0) -> Fp16Linear:
        return cls(t["w16"].to(device).float(), t["bias"].to(device) if "bias" in t else None)

    @classmethod
    def concat(cls, parts: list[Fp16Linear]) -> Fp16Linear:
        bias = cat_bias(parts)  # the float16 values: packing again rounds nothing
        return cls(torch.cat([p.dequantize() for p in parts]), None if bias is None else bias.float())


MODULES = {"fp16": Fp16Linear, "int8": Int8Linear, "int4": Int4Linear}
