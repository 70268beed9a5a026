"""The native kernels' matrix products (`kernels/native.c` through `Fp16Linear` / `Int4Linear`): the layers' own
weights, the bias, each row alike whatever the other rows, and the 4-bit layout read back exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hamburger.kernels import native
from hamburger.kernels.qlinear import Fp16Linear, Int4Linear

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")


def linear(out_features: int, in_features: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        if bias:
            layer.bias.normal_(0, 0.5)
    return layer


def q4_layer(n: int = 48, k: int = 128, group: int = 64, bias: bool = True) -> tuple[Int4Linear, torch.Tensor]:
    """A native 4-bit layer from random codes, and its weights computed here: q * scale + (zero - 8 * scale)."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).bfloat16()
    mins = (torch.randn(n, k // group, generator=gen) * 0.05).bfloat16()
    layer = Int4Linear(q, scales, mins, group, torch.randn(n, generator=gen) if bias else None)
    sz = layer.scales_and_zeros.float()
    s, z = (sz[..., i].t().repeat_interleave(group, 1) for i in (0, 1))
    return layer, q.float() * s + (z - 8 * s)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_fp16_products_are_the_rounded_weights_with_the_bias(rows):
    lin = linear(96, 80)
    layer = Fp16Linear.from_linear(lin)
    assert layer.native and layer.packed is None
    x = torch.randn(rows, 80)
    want = F.linear(x, lin.weight.half().float(), lin.bias)
    got = layer(x)
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()
    # A mutation that forgets the bias is far outside that
    assert (F.linear(x, lin.weight.half().float()) - want).abs().max() > 1e-2


def q16_products(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """What `native.INT4_Q16` computes, in float64: each block of 32 inputs as int16 codes times max|x| / 32767
    (rounded to nearest even, as the kernel converts), the codes' dot product scaled by scale * dx, plus
    (zero - 8 * scale) times the block's float sum; and the bias."""
    n, k, g = layer.out_features, layer.in_features, layer.group_size
    xb = x.reshape(-1, k // 32, 32)
    top = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, torch.tensor(32767.0) / top, torch.zeros(()))
    x8 = torch.round(xb * inv).clamp(-32768, 32767).double()
    dx = (top / 32767).double()
    codes = layer.unpack()[0].double().reshape(n, k // 32, 32)
    sz = layer.scales_and_zeros.double()  # (k/g, n, 2)
    scale, zero = (sz[..., i].t().repeat_interleave(g // 32, 1) for i in (0, 1))  # (n, k/32)
    dots = torch.einsum("rbi,nbi->rnb", x8, codes)
    out = (dots * scale[None] * dx.squeeze(-1)[:, None]).sum(-1)
    out += ((zero - 8 * scale)[None] * xb.double().sum(-1)[:, None]).sum(-1)
    return (out + (layer.bias.double() if layer.bias is not None else 0)).float()


@pytest.mark.parametrize("rows", [1, 3, 4, 7])
def test_int4_products_with_float_activations_are_the_layers_weights(rows):
    layer, weights = q4_layer(k=96, group=32)  # inputs not a multiple of 64: float32 activations
    assert layer.native and layer.kind == native.INT4 and not hasattr(layer, "weight_int4pack")
    x = torch.randn(rows, 96)
    want = F.linear(x, weights, layer.bias)
    assert (layer(x) - want).abs().max() <= 2e-6 * want.abs().max()
    # dequantize() is exactly what the kernel multiplies with: an identity through it gives it back, bit for bit
    assert torch.equal(layer.dequantize(), weights)
    assert torch.equal(layer._mm(torch.eye(96)).t(), weights)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_int4_products_with_int16_activations_are_that_arithmetic(rows, group):
    layer, weights = q4_layer(k=256, group=group)
    assert layer.native and layer.kind == native.INT4_Q16 and torch.equal(layer.dequantize(), weights)
    x = torch.randn(rows, 256)
    x[0, 32:64] = 0  # a block of zeros
    got, want = layer(x), q16_products(layer, x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    # ... which is the float product to about 3e-5 (an int8 rounding would be 1e-2 off), and a mutation that takes a
    # block's scale from its neighbour (what a wrong lane layout does) is far from it
    exact = F.linear(x, weights, layer.bias)
    assert (got - exact).norm() <= 3e-4 * exact.norm()
    swapped = layer.scales_and_zeros.clone()
    layer.scales_and_zeros.copy_(swapped.roll(1, 0))
    assert (layer(x) - want).abs().max() > 1e-3 * want.abs().max()


@pytest.mark.parametrize("kind", ["fp16", "int4", "int4 int16"])
def test_each_row_is_the_same_whatever_the_other_rows(kind):
    k = 128 if kind == "int4 int16" else 96
    layer = Fp16Linear.from_linear(linear(64, k)) if kind == "fp16" else q4_layer(64, k, 32)[0]
    x = torch.randn(11, k)
    together = layer(x)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(11)])
    assert torch.equal(together, alone)
    for cut in (2, 4, 7):  # the tiles of 4 rows fall elsewhere
        assert torch.equal(torch.cat([layer(x[:cut]), layer(x[cut:])]), together)


def test_int4_codes_and_scales_read_back_exactly_and_survive_the_disk_format():
    layer, _ = q4_layer(bias=True)
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (48, 128), generator=gen)
    codes = layer.unpack()[0]
    assert torch.equal(codes, q.to(torch.uint8))
    again = Int4Linear.from_portable(layer.portable(), torch.device("cpu"), 64)
    assert torch.equal(again.q4, layer.q4) and torch.equal(again.scales_and_zeros, layer.scales_and_zeros)
    both = Int4Linear.concat([layer, again])
    x = torch.randn(3, 128)
    assert torch.equal(both(x), torch.cat([layer(x), again(x)], -1))


def test_turned_off_makes_pytorchs_kernels_and_shapes_that_do_not_fit_stay_there():
    from conftest import tiny_base
    from hamburger.kernels.quantize import quantize_model
    with native.turned_off():
        assert not native.available()
        assert not Fp16Linear.from_linear(linear(96, 80)).native
        assert not Int4Linear.from_linear(linear(48, 128), 32).native
        model = tiny_base()
        quantize_model(model, "int4")  # its layers are made on a pool of threads: off there too
        assert not any(getattr(m, "native", False) for m in model.modules())
    assert native.available()
    assert native.fits(50, 64, native.FP16) is not None  # out_features not a multiple of 4
    assert native.fits(48, 40, native.FP16) is not None  # in_features not a multiple of 16
    assert not Fp16Linear.from_linear(linear(50, 64)).native  # PyTorch's kernel takes it instead


def test_the_start_line_names_the_kernels():
    from hamburger.loading import kernels_note
    cpu = torch.device("cpu")
    assert kernels_note("fp16", cpu) == "native kernels" and kernels_note("int4/int8", cpu) == "native kernels"
    assert kernels_note("none", cpu) is None and kernels_note("int8", cpu) is None


def test_a_wrong_input_is_refused_not_read_out_of_bounds():
    layer = Fp16Linear.from_linear(linear(64, 96))
    with pytest.raises(RuntimeError):  # the module reshapes to its in_features first
        layer(torch.randn(3, 80))
    for bad in (torch.randn(3, 80), torch.randn(96, 3).t(), torch.randn(3, 96).double()):
        with pytest.raises(ValueError, match="native product takes"):
            native.linear(bad, layer.native_desc())
