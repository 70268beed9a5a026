"""Wide passes in bfloat16 (`--quantize SCHEME+bf16`): passes of at least `WIDE_ROWS` rows multiply by a bfloat16
copy of a quantized layer's weights; narrower passes are untouched."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_quantize import linear_from, needs_fbgemm, tiny_llama

from hamburger import HamburgerModel
from hamburger.errors import HamburgerError
from hamburger.inference.engine import Engine
from hamburger.kernels.fused import FusedPart
from hamburger.kernels.qlinear import MODULES, WIDE_ROWS, QuantizedLinear, wide_unavailable
from hamburger.kernels.quantize import quantize_model, wide_bytes
from hamburger.loading import check_quantize, parse_schemes, split_scheme, split_wide

needs_bf16 = pytest.mark.skipif(wide_unavailable("cpu") is not None, reason=str(wide_unavailable("cpu")))
SCHEMES = ["int8", "int4", pytest.param("fp16", marks=needs_fbgemm)]


@needs_bf16
@pytest.mark.parametrize("scheme", SCHEMES)
def test_layer_narrow_passes_unchanged_wide_ones_bfloat16(scheme):
    torch.manual_seed(0)
    lin = linear_from(torch.randn(96, 64) * 0.05, bias=True)
    layer = MODULES[scheme].from_linear(lin, 32)
    narrow, wide = torch.randn(2, WIDE_ROWS - 1, 64), torch.randn(WIDE_ROWS, 64)
    before_narrow, before_wide = layer(narrow), layer(wide)
    layer.set_wide()
    assert layer.wide_rows == WIDE_ROWS and layer.wide.dtype == torch.bfloat16
    assert torch.equal(layer(narrow[:1]), before_narrow[:1])  # 7 rows: the scheme's own kernel, bit for bit

    def bf16(x):
        return F.linear(x.bfloat16(), layer.dequantize().bfloat16()).float() + layer.bias

    assert torch.equal(layer(narrow), bf16(narrow))  # 2 x 7 = 14 rows (leading dims count): wide
    assert torch.equal(layer(wide), bf16(wide))
    assert torch.allclose(layer(wide), before_wide, rtol=0.05, atol=0.05 * before_wide.abs().max().item())
    layer.set_wide(0)
    assert layer.wide is None and torch.equal(layer(wide), before_wide)
    with pytest.raises(ValueError, match=">= 0"):
        layer.set_wide(-1)


@needs_bf16
@pytest.mark.parametrize("scheme", SCHEMES)
def test_model_wide_copies_once_per_fused_group(scheme):
    model = tiny_llama()
    summary = quantize_model(model, scheme, wide=True)
    layers, groups = [], {}
    for m in model.modules():
        if isinstance(m, FusedPart):
            groups[id(m.group)] = m.group.linear
            assert m.wide is None  # the group's layer holds the copy, not each part
        elif isinstance(m, QuantizedLinear):
            layers.append(m)
    every = layers + list(groups.values())
    assert groups and all(layer.wide is not None and layer.wide_rows == WIDE_ROWS for layer in every)
    params = sum(layer.in_features * layer.out_features for layer in every)
    assert summary["wide_bytes"] == wide_bytes(model) == 2 * params
    plain = tiny_llama()
    assert quantize_model(plain, scheme)["wide_bytes"] == 0


@needs_bf16
@pytest.mark.parametrize("scheme", SCHEMES)
def test_engine_short_prompts_at_batch_1_decode_exactly_as_without(scheme):
    """Every pass of a short prompt at batch 1 is narrow, so the tokens are those of the scheme alone; a long
    prompt's prefill is wide and its first logits stay close."""
    base = tiny_llama()
    alone = HamburgerModel.plain(copy.deepcopy(base), None)
    quantize_model(alone, scheme)
    wide = HamburgerModel.plain(base, None)
    quantize_model(wide, scheme, wide=True)
    short = [[5, 6, 7, 8]]
    assert Engine(wide).generate(short, max_new_tokens=12).tokens == \
        Engine(alone).generate(short, max_new_tokens=12).tokens
    ids = torch.randint(2, 256, (1, 3 * WIDE_ROWS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = alone.base(ids).logits, wide.base(ids).logits
    assert ((a - b).norm() / a.norm()).item() < 0.05


def test_scheme_specs_with_the_suffix():
    assert parse_schemes("fp16,fp16+bf16,int4/int8+bf16", many=True) == ["fp16", "fp16+bf16", "int4/int8+bf16"]
    assert split_wide("int4/int8+bf16") == ("int4/int8", True) and split_wide("int4") == ("int4", False)
    assert split_scheme("int4/int8+bf16") == ("int4", "int8")
    with pytest.raises(HamburgerError, match="--dtype bfloat16"):
        parse_schemes("none+bf16")
    for bad in ("fp16+bf17", "+bf16", "fp16+bf16+bf16"):
        with pytest.raises(HamburgerError, match="--quantize must be"):
            parse_schemes(bad)
    with pytest.raises(HamburgerError, match="for CPUs"):
        check_quantize("int8+bf16", 32, torch.device("meta"), torch.float32)


def test_quantize_model_refuses_wide_where_it_cannot_run(monkeypatch):
    from hamburger.kernels import quantize as qz

    monkeypatch.setattr(qz, "wide_unavailable", lambda device: "no native bfloat16 here")
    with pytest.raises(ValueError, match="no native bfloat16"):
        quantize_model(tiny_llama(), "int8", wide=True)
