"""The native kernels' matrix products (`kernels/native.c` through `Fp16Linear` / `Int4Linear` / `Int8Linear`): the
layers' own weights, the bias, each row alike whatever the other rows, and the 4-bit and 8-bit layouts read back
exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from native_variant import every_variant, pytest_generate_tests, variant  # noqa: F401 - pytest finds them here
from hamburger.kernels import native, qbase
from hamburger.kernels.qlinear import Fp16Linear, Int4Linear, Int8Linear

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
    """A native 4-bit layer from random codes, and its weights computed here: q * scale + min (float16 scales and
    mins, GGUF's Q4_1)."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).half()
    mins = (torch.randn(n, k // group, generator=gen) * 0.05).half()
    layer = Int4Linear(q, scales, mins, group, torch.randn(n, generator=gen) if bias else None)
    s, m = (t.float().repeat_interleave(group, 1) for t in (scales, mins))
    return layer, q.float() * s + m


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


def q16_products(layer: Int4Linear, x: torch.Tensor, limit: int = 32767) -> torch.Tensor:
    """What `native.INT4_Q16` computes, in float64: each block of 32 inputs as int16 codes times max|x| / 32767
    (rounded to nearest even, as the kernel converts), the codes' dot product scaled by scale * dx, plus
    min times the block's float sum; and the bias. `limit` 127: `native.INT4_Q8`'s 8-bit codes."""
    n, k, g = layer.out_features, layer.in_features, layer.group_size
    xb, x16, dx = int16_blocks(x, limit)
    codes, scales, mins = layer.unpack()
    scale, low = (t.double().repeat_interleave(g // 32, 1) for t in (scales, mins))  # (n, k/32)
    dots = torch.einsum("rbi,nbi->rnb", x16, codes.double().reshape(n, k // 32, 32))
    out = (dots * scale[None] * dx[:, None]).sum(-1) + (low[None] * xb.double().sum(-1)[:, None]).sum(-1)
    return (out + (layer.bias.double() if layer.bias is not None else 0)).float()


def int16_blocks(x: torch.Tensor, limit: int = 32767) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x in blocks of 32, their int16 codes as the kernels round them, float64, and each block's max|x| / limit)."""
    xb = x.reshape(x.shape[0], -1, 32)
    top = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, torch.tensor(float(limit)) / top, torch.zeros(()))
    return xb, torch.round(xb * inv).clamp(-limit - 1, limit).double(), (top / limit).double().squeeze(-1)


def check_int16_products(layer, weights: torch.Tensor, emulated, scales: torch.Tensor, rows: int) -> None:
    """The layer's products are `emulated`'s arithmetic (a block of zeros included), the float product to about
    3e-5 (an int8 rounding would be 1e-2 off), and a mutation that takes each block's scales from its neighbour
    (`scales`: the tiles' bytes of them, (tiles, blocks, bytes); what a wrong layout does) is far from it."""
    x = torch.randn(rows, layer.in_features)
    x[0, 32:64] = 0
    got, want = layer(x), emulated(layer, x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    exact = F.linear(x, weights, layer.bias)
    assert (got - exact).norm() <= 3e-4 * exact.norm()
    scales.copy_(scales.clone().roll(1, 1))
    assert (layer(x) - want).abs().max() > 1e-3 * want.abs().max()


@every_variant
@pytest.mark.parametrize(("n", "k", "group"), [(48, 256, 32), (48, 256, 64), (64, 256, 128), (16, 96, 32), (40, 96, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_int4_products_with_int16_activations_are_that_arithmetic(rows, n, k, group):
    layer, weights = q4_layer(n, k, group)  # 48 outputs: tiles of 32 and 16; 40: 32 and 8; 96 inputs: 3 blocks
    assert layer.native and not hasattr(layer, "weight_int4pack") and torch.equal(layer.dequantize(), weights)
    # an identity through the kernel gives each weight back to the activations' rounding
    assert (layer._mm(torch.eye(k)).t() - weights).abs().max() <= 1e-4 * weights.abs().max()
    check_int16_products(layer, weights, q16_products, layer.tiles[..., 256:288], rows)


@every_variant
@pytest.mark.parametrize(("n", "k", "group"), [(48, 256, 32), (64, 256, 128), (40, 96, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_int4_products_with_8bit_activations_are_that_arithmetic(rows, n, k, group):
    """`native.INT4_Q8` (`--quantize ...+a8`): the same tiles, the inputs in 8-bit codes per block of 32 (where the
    CPU multiplies bytes, stored as bytes in the tiles' nibble order): the int16 reference's arithmetic with codes
    within 127, so about 1e-2 of the float product off where int16's are 3e-5."""
    layer, weights = q4_layer(n, k, group)
    layer.activations8 = True
    assert layer.native_desc().kind == native.INT4_Q8
    x = torch.randn(rows, k)
    x[0, 32:64] = 0
    got, want = layer(x), q16_products(layer, x, 127)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    exact = F.linear(x, weights, layer.bias)
    assert 1e-3 * exact.norm() < (got - exact).norm() <= 3e-2 * exact.norm()
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(rows)]), got)  # each row alone: the same
    layer.activations8 = False
    assert layer.native_desc().kind == native.INT4_Q16 and (layer(x) - exact).norm() <= 3e-4 * exact.norm()


@every_variant
@pytest.mark.parametrize("kind", ["fp16", "int4", "int4 96", "int8"])
def test_each_row_is_the_same_whatever_the_other_rows(kind):
    k = 96 if kind in ("fp16", "int4 96") else 128
    if kind == "fp16":
        layer = Fp16Linear.from_linear(linear(64, k))
    else:  # 40 outputs: two tiles of 16 and half of one
        layer = q8_layer(40, k)[0] if kind == "int8" else q4_layer(40, k, 32)[0]
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
    assert torch.equal(again.tiles, layer.tiles)
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
    assert native.fits(48, 80, native.INT8_Q16, 32) is not None  # codes: blocks of 32 inputs
    assert native.fits(40, 64, native.INT4_Q16, 32) is None  # any number of outputs (the last tile in part)
    assert not Int8Linear.from_linear(linear(48, 80)).native


def test_the_start_line_names_the_kernels():
    from hamburger.loading import kernels_note
    cpu, named = torch.device("cpu"), f"native kernels ({native.variant()})"
    assert native.variant() in native.VARIANTS
    assert kernels_note("fp16", cpu) == named and kernels_note("int4/int8", cpu) == named
    assert kernels_note("int8", cpu) == named and kernels_note("none", cpu) is None
    assert kernels_note("int4", torch.device("meta")) is None  # not a CPU


def test_a_wrong_input_is_refused_not_read_out_of_bounds():
    layer = Fp16Linear.from_linear(linear(64, 96))
    with pytest.raises(RuntimeError):  # the module reshapes to its in_features first
        layer(torch.randn(3, 80))
    for bad in (torch.randn(3, 80), torch.randn(96, 3).t(), torch.randn(3, 96).double()):
        with pytest.raises(ValueError, match="native product takes"):
            native.linear(bad, layer.native_desc())


def q8_layer(n: int = 48, k: int = 192, bias: bool = True) -> tuple[Int8Linear, torch.Tensor]:
    """A native 8-bit layer from random codes and float16 block scales (GGUF's Q8_0), and its weights q * scale."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-4).half()
    layer = Int8Linear(q, scales, torch.randn(n, generator=gen) if bias else None)
    return layer, q.float() * scales.float().repeat_interleave(32, 1)


def q8_products(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """What `native.INT8_Q16` computes, in float64: each block of 32 inputs as int16 codes times max|x| / 32767,
    the codes' dot product with the weights' codes scaled by scale * dx; and the bias."""
    n, k = layer.out_features, layer.in_features
    _, x16, dx = int16_blocks(x)
    codes, scales = layer.codes()
    dots = torch.einsum("rbi,nbi->rnb", x16, codes.double().reshape(n, k // 32, 32))
    out = (dots * scales.double()[None] * dx[:, None]).sum(-1)
    return (out + (layer.bias.double() if layer.bias is not None else 0)).float()


@every_variant
@pytest.mark.parametrize("n", [48, 7])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9])
def test_int8_products_with_int16_activations_are_that_arithmetic(rows, n):
    layer, weights = q8_layer(n)  # 7 outputs: less than a tile
    assert layer.native and layer.group_size == 32 and not hasattr(layer, "weight_int8")
    assert torch.equal(layer.dequantize(), weights)
    check_int16_products(layer, weights, q8_products, layer.tiles[..., 512:], rows)


def test_int8_codes_read_back_and_survive_the_disk_format_and_concatenation():
    layer, weights = q8_layer()
    gen = torch.Generator().manual_seed(2)
    assert torch.equal(layer.codes()[0], torch.randint(-127, 128, (48, 192), generator=gen, dtype=torch.int8))
    again = Int8Linear.from_portable(layer.portable(), torch.device("cpu"))
    assert torch.equal(again.tiles, layer.tiles)
    both = Int8Linear.concat([layer, again])
    x = torch.randn(3, 192)
    assert torch.equal(both(x), torch.cat([layer(x), again(x)], -1))
    with native.turned_off():  # read where the native kernels do not run: per channel again, close to the blocks
        torch_layer = Int8Linear.from_portable(layer.portable(), torch.device("cpu"))
    assert not torch_layer.native and torch_layer.scales.shape == (48,)
    err = (torch_layer.dequantize().float() - weights).abs()  # half a step, and the bfloat16 product's rounding
    assert (err <= 0.51 * torch_layer.scales.float()[:, None] + 2**-8 * weights.abs()).all()


def test_gguf_q4_1_and_q8_0_blocks_come_back_exactly():
    """Weights dequantised from GGUF blocks in float32 (the embedded default's projections are Q4_1, its embedding
    and tied LM head Q8_0): the native layers made from them hold the GGUF's own codes and float16 scales (and
    mins), so they multiply with exactly those weights."""
    gen = torch.Generator().manual_seed(3)
    n, k = 32, 128
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15  # Q4_1's rule: each block's min gets 0, its max 15
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.02 + 1e-3).half()
    m = (-8 * d.float() + torch.randn(n, k // 32, 1, generator=gen) * 0.01).half()
    w4 = (q * d.float() + m.float()).reshape(n, k)
    layer = Int4Linear.from_linear(_with_weight(w4), 32)
    codes, scales, mins = layer.unpack()
    assert torch.equal(codes.long(), q.reshape(n, k)) and torch.equal(scales, d.squeeze(-1))
    assert torch.equal(mins, m.squeeze(-1)) and torch.equal(layer.dequantize(), w4)
    q8 = torch.randint(-127, 128, (n, k // 32, 32), generator=gen)
    q8[..., 5] = torch.where(torch.rand(n, k // 32, generator=gen) < 0.5, -127, 127)  # Q8_0: the max |w| gets 127
    d8 = (torch.rand(n, k // 32, 1, generator=gen) * 0.01 + 1e-4).half()
    w8 = (q8 * d8.float()).reshape(n, k)
    head = Int8Linear.from_linear(_with_weight(w8))
    codes8, scales8 = head.codes()
    assert torch.equal(codes8.long(), q8.reshape(n, k)) and torch.equal(scales8, d8.squeeze(-1))
    assert torch.equal(head.dequantize(), w8)


def _with_weight(w: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(w)
    return layer


@pytest.mark.parametrize("group", [32, 64])
def test_the_native_quantizer_is_the_reference_arithmetic_bit_for_bit(group):
    """`native.quantize_q4_1` / `quantize_q8_0` (what the layers are made with) against `qcodes.q4_1_weights` /
    `q8_0_weights`, on weights with constant blocks, zeros, exact ties and a wide range of scales."""
    from hamburger.kernels.qcodes import q4_1_weights, q8_0_weights
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(40, 256, generator=gen) * torch.logspace(-4, 1, 40)[:, None]
    w[0, :64] = 0.25  # constant blocks
    w[1] = 0
    w[2, :32] = torch.arange(32) / 31 * 15  # codes that land on .5 ties
    assert all(torch.equal(a, b) for a, b in zip(native.quantize_q4_1(w, group), q4_1_weights(w, group), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(native.quantize_q8_0(w), q8_0_weights(w), strict=True))
    with pytest.raises(ValueError, match="float16's range"):
        native.quantize_q8_0(torch.full((4, 64), 1e6))


@pytest.mark.parametrize("group", [32, 64])
def test_the_tiles_hold_each_code_and_scale_where_the_layout_says(group):
    """`native.tile_q4` / `tile_q8` against the layout written out here index by index, and read back."""
    from hamburger.kernels.qcodes import untile_q4, untile_q8
    gen = torch.Generator().manual_seed(5)
    n, k = 40, 128  # two whole tiles of 16 outputs and a part of one
    q4 = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    q8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales, mins = torch.randn(n, k // group, generator=gen).half(), torch.randn(n, k // group, generator=gen).half()
    t4, t8 = native.tile_q4(q4, scales, mins, group), native.tile_q8(q8, scales.repeat_interleave(group // 32, 1))
    for r, i in ((0, 0), (5, 37), (17, 100), (31, 127), (39, 64)):
        tile, lane, block, j, h, e = r // 16, r % 16, i // 32, (i % 32) // 8, (i % 8) // 2, i % 2
        word = int(t4[tile, block, 64 * j + 2 * (2 * lane + e)]) | int(t4[tile, block, 64 * j + 2 * (2 * lane + e) + 1]) << 8
        assert (word >> 4 * h) & 15 == q4[r, i]
        assert t8[tile, block, 32 * ((i % 32) // 2) + 2 * lane + e].view(torch.int8) == q8[r, i]
        assert t4[tile, block, 256 + 2 * lane:258 + 2 * lane].view(torch.float16) == scales[r, i // group]
        assert t4[tile, block, 288 + 2 * lane:290 + 2 * lane].view(torch.float16) == mins[r, i // group]
        assert t8[tile, block, 512 + 2 * lane:514 + 2 * lane].view(torch.float16) == scales[r, i // group]
    assert all(torch.equal(a, b) for a, b in zip(untile_q4(t4, n, group), (q4, scales, mins), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(untile_q8(t8, n), (q8, scales.repeat_interleave(group // 32, 1)),
                                                  strict=True))


@every_variant
@pytest.mark.parametrize("kind", ["fp16", "int4", "int8", "int8 short"])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_the_fused_argmax_is_the_products_argmax_ties_and_nans_included(kind, rows):
    """Greedy decoding's head (`native.linear_argmax`, `qbase.native_argmax`) gives `max(-1).indices` of the
    layer's own outputs: the first of equal ones (duplicated weight rows tie exactly), a NaN before any number, an
    output in either thread's share of the outputs."""
    n, k = (1000, 96) if kind == "int8 short" else (2048, 128)
    lin = linear(n, k, bias=False, seed=3)
    with torch.no_grad():
        lin.weight[7] = lin.weight[1500 % n] = lin.weight[n - 3] = 3 * lin.weight[0].abs()  # three equal rows
    layer = {"fp16": Fp16Linear.from_linear, "int4": lambda m: Int4Linear.from_linear(m, 32)}.get(
        kind, Int8Linear.from_linear)(lin)
    assert layer.native
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen)
    x[0] = lin.weight[0].abs().sign()  # row 0: the three equal rows' outputs are the largest
    if rows > 1:
        x[1, 5] = float("nan")  # every output NaN
    if rows > 2:
        x[2] = -x[0]  # the largest elsewhere
    want = layer(x).max(-1).indices
    got = qbase.native_argmax(layer, x)
    assert got.tolist() == want.tolist()
    assert got[0] == 7
    out = layer(x[1:2])[0] if rows > 1 else None
    if out is not None and out.isnan().any():  # a NaN input (Q8_0's int16 activations round it to a number)
        assert got[1] == out.isnan().nonzero()[0, 0]
