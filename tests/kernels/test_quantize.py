"""Weight-only int8 / int4 quantization (hamburger.kernels.quantize): kernels, Q4_1 exactness, whole models, disk cache."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import hamburger, tiny_base
from hamburger import HamburgerModel, generate
from hamburger.inference.engine import Engine
from hamburger.kernels import native, qlinear
from hamburger.kernels import quantize as qz
from hamburger.kernels.fused import FusedPart
from hamburger.kernels.qlinear import Fp16Linear, Int4Linear, Int8Linear, QuantizedLinear, fp16_unavailable
from hamburger.kernels.quantize import quantize_cached, quantize_model


def tiny_llama(seed: int = 0, hidden: int = 64, vocab: int = 256, dtype=torch.float32) -> LlamaForCausalLM:
    """A random Llama with the default init (std 0.02) and a tied LM head, as SmolLM2 has."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1,
                      pad_token_id=0, bos_token_id=None, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def q4_1_blocks(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights made as GGUF Q4_1 makes them: q in 0..15 per block of 32, each block using both 0 and 15 (its min
    and max), fp16 scale d and min m; dequantised in float32 as q·d + m. Returns (w, q, d, m)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15
    q = q[..., torch.randperm(32, generator=gen)]
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.02 + 1e-3).half().float()
    m = (-8 * d + torch.randn(n, k // 32, 1, generator=gen) * 0.01).half().float()
    return (q * d + m).reshape(n, k), q.reshape(n, k), d.squeeze(-1), m.squeeze(-1)


def linear_from(w: torch.Tensor, bias: bool = False) -> nn.Linear:
    layer = nn.Linear(w.shape[1], w.shape[0], bias=bias)
    with torch.no_grad():
        layer.weight.copy_(w)
        if bias:
            layer.bias.normal_()
    return layer


# --- single layers ---------------------------------------------------------------------------------------------


def test_int4_represents_q4_1_blocks_exactly():
    """PyTorch's kernels with float32 scales (and activations: the kernel's slow path on CPU,
    `act_dtype=torch.float32`); the native kernels' float16 blocks are exact (tests/kernels/test_native.py)."""
    w, q, d, m = q4_1_blocks(64, 256)
    with native.turned_off():
        layer = Int4Linear.from_linear(linear_from(w), 32, torch.float32)
    codes, scales, mins = layer.unpack()
    assert torch.equal(codes.long(), q)  # every 4-bit code comes back as GGUF stored it
    # The scale is (max - min) / 15 in float32: d up to its rounding; the min is the block's min.
    assert torch.allclose(scales, d, rtol=4e-7, atol=0) and torch.allclose(mins, m, rtol=0, atol=4e-7 * d.max())
    # Dequantised (through the kernel): the float weights up to a few float32 ulps of the block's range.
    tol = 8 * torch.finfo(torch.float32).eps * (m.abs() + 16 * d).repeat_interleave(32, 1)
    assert ((layer.dequantize() - w).abs() <= tol).all()
    assert tol.max() < 0.01 * d.min()  # far below one quantisation step: a wrong code or zero would fail
    x = torch.randn(5, 256)
    ref = F.linear(x, w)
    out = layer(x)
    assert (out - ref).abs().max() < 1e-4 * ref.abs().max()


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_int4_q4_1_blocks_in_bfloat16_up_to_rounding(model_dtype):
    """The default on CPU: scale and zero (= min + 8·scale) kept in bfloat16, the kernel's fast path, for a float32
    model too. A bfloat16 model's cast also rounds the weights (so each block's min and max). The codes still
    come back exactly; scale and weights up to those roundings (unit roundoff u = 2^-8 each: the scale inherits
    the min's and max's, over 15). The layer takes and returns the model's dtype."""
    w, q, d, m = q4_1_blocks(32, 128, seed=1)
    with native.turned_off():
        layer = Int4Linear.from_linear(linear_from(w).to(model_dtype), 32)
    assert layer(torch.randn(2, 128, dtype=model_dtype)).dtype == model_dtype
    codes, scales, _ = layer.unpack()
    assert scales.dtype == torch.bfloat16 and torch.equal(codes.long(), q)
    u, top, zero = 2**-8, (m + 15 * d).abs(), (m + 8 * d).abs()
    scale_tol = u * (d + (m.abs() + top) / 15)
    assert ((scales.float() - d).abs() <= scale_tol).all()
    tol = 16 * scale_tol + u * (zero + m.abs())
    err = (layer.dequantize().float() - w).abs()
    assert (err <= tol.repeat_interleave(32, 1)).all()


def bf16_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What a layer with bfloat16 activations computes: x rounded to bfloat16, float32 sums, output rounded."""
    y = F.linear(x.bfloat16().float(), w.float()).bfloat16().float()
    return y if bias is None else y + bias


@pytest.mark.parametrize("dtype", [torch.float32, None])
def test_int4_general_weights_within_half_a_step(dtype):
    """PyTorch's kernels, both activation dtypes (None: the default, bfloat16 on CPU): the weights within half a
    quantisation step (plus the scale's own rounding), the forward = those weights times the input in that dtype."""
    w = torch.randn(48, 128)
    with native.turned_off():
        layer = Int4Linear.from_linear(linear_from(w, bias=True), 64, dtype)
    codes, scales, mins = layer.unpack()
    assert scales.dtype == (dtype or torch.bfloat16)
    deq = codes.float() * scales.float().repeat_interleave(64, 1) + mins.float().repeat_interleave(64, 1)
    u = torch.finfo(scales.dtype).eps
    assert ((deq - w).abs() <= scales.float().repeat_interleave(64, 1) * (0.5 + 16 * u) + 8 * u).all()
    x = torch.randn(2, 3, 128)  # leading dims and a bias, as nn.Linear takes them
    lin = linear_from(w, bias=True)
    layer.bias.data.copy_(lin.bias)
    ref = F.linear(x, deq, lin.bias) if dtype else bf16_linear(x, deq, lin.bias)
    assert torch.allclose(layer(x), ref, atol=1e-4) if dtype else \
        torch.allclose(layer(x), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())  # bfloat16 output


@native.turned_off()
def test_int8_per_channel():
    """PyTorch's int8 kernel (natively: GGUF's Q8_0 blocks, tests/kernels/test_native.py)."""
    w = torch.randn(40, 72) * torch.linspace(0.1, 3, 40)[:, None]
    lin = linear_from(w, bias=True)
    exact = Int8Linear.from_linear(lin, dtype=torch.float32)
    assert exact.weight_int8.dtype == torch.int8 and exact.scales.shape == (40,)
    assert torch.allclose(exact.scales, w.abs().amax(1) / 127)
    assert ((exact.weight - w).abs() <= exact.scales[:, None] * 0.5 + 1e-6).all()
    x = torch.randn(3, 72)
    assert torch.allclose(exact(x), F.linear(x, exact.weight, lin.bias), atol=1e-4)
    assert torch.allclose(exact(x), lin(x), rtol=0, atol=0.02 * lin(x).abs().max().item())
    with pytest.raises(ValueError, match="not a multiple of 16"):  # the bfloat16 kernel would read garbage
        Int8Linear.from_linear(lin)
    lin = linear_from(torch.randn(40, 80), bias=True)
    fast = Int8Linear.from_linear(lin)  # the default on CPU: bfloat16 scales and activations
    x = torch.randn(3, 80)
    assert fast.scales.dtype == torch.bfloat16 and fast(x).dtype == torch.float32
    deq = fast.weight_int8.float() * fast.scales.float()[:, None]
    assert ((deq - lin.weight).abs() <= fast.scales.float()[:, None] * 0.51).all()
    ref = bf16_linear(x, deq, lin.bias)
    assert torch.allclose(fast(x), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


needs_fbgemm = pytest.mark.skipif(fp16_unavailable("cpu") is not None, reason=str(fp16_unavailable("cpu")))


def rounded_to_fp16(model: nn.Module) -> nn.Module:
    """A copy whose linear weights are rounded to float16 (and computed in float32): what fp16 multiplies with."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(m.weight.half().float())
    return model


@needs_fbgemm
def test_fp16_linear_rounds_weights_and_rows_are_independent():
    torch.manual_seed(0)
    lin = linear_from(torch.randn(96, 80) * 0.05, bias=True)
    layer = Fp16Linear.from_linear(lin)
    assert torch.equal(layer.dequantize(), lin.weight.half().float())  # the weights, rounded once
    assert layer.weight_nbytes == 96 * 80 * 2 and torch.equal(layer.weight, layer.dequantize())
    x = torch.randn(2, 7, 80)
    ref = F.linear(x, lin.weight.half().float(), lin.bias)
    out = layer(x)
    assert out.shape == (2, 7, 96) and (out - ref).abs().max() < 1e-5 * ref.abs().max()
    # Each row's output does not depend on how many rows go through (batched decoding equals unbatched): bit for
    # bit with FBGEMM's AVX-512 kernels; its AVX2 kernels tile rows by count, which moves the last bits.
    rows = torch.cat([layer(x.reshape(14, 80)[i : i + 1]) for i in range(14)])
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        assert torch.equal(rows, out.reshape(14, 96))
    else:
        assert (rows - out.reshape(14, 96)).abs().max() <= 4e-6 * out.abs().max()
    # A mutation that forgets the bias fails the comparison above.
    assert (F.linear(x, lin.weight.half().float()) - ref).abs().max() > 1e-3


@needs_fbgemm
def test_fp16_model_equals_its_rounded_float_copy():
    """Whole models: fp16-packed logits equal those of the float model with float16-rounded weights up to float32
    summation order, and the bytes of the packed layers are half of float32's (the packs are not buffers)."""
    base = tiny_llama(hidden=128)
    rounded = rounded_to_fp16(base)
    summary = quantize_model(base, "fp16")
    assert summary["quantized"] == 2 * 7 + 1 and isinstance(base.lm_head, Fp16Linear)
    assert summary["linear_bytes_after"] * 2 == summary["linear_bytes_before"]
    ids = torch.randint(2, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    ref, out = logits(rounded, ids), logits(base, ids)
    assert (out - ref).abs().max() < 1e-4 * ref.abs().max()
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


@needs_fbgemm
def test_fp16_engine_greedy_and_shortlist():
    """The engine on fp16 layers: greedy equals the rounded float model's, batched equals one row at a time, and
    the micro-step shortlist head is packed too (its logits are those of the rounded head's rows)."""
    def build() -> HamburgerModel:  # built twice: a deep copy would share the slot adapters' hooks
        model = hamburger("llama", k=4, slot_adapter_rank=4)
        torch.nn.init.normal_(model.embedder.o_proj.weight, std=0.2, generator=torch.Generator().manual_seed(1))
        model.micro_vocab = torch.arange(2, 50)
        return model

    model, rounded = build(), build()
    with torch.no_grad():
        for name, m in rounded.named_modules():
            if isinstance(m, nn.Linear) and not name.startswith(qz.DEFAULT_SKIP):  # what fp16 swaps
                m.weight.copy_(m.weight.half().float())
    quantize_model(model, "fp16")
    engine = Engine(model)
    assert isinstance(engine.runner._short, Fp16Linear)
    h = torch.randn(3, model.base.config.hidden_size)
    assert torch.allclose(engine.runner.short_logits(h), F.linear(h, rounded.base.lm_head.weight[2:50]), atol=1e-5)
    prompts = [[5, 17, 33, 8, 60, 12, 9], [40, 41]]
    for confidence in (0.3, 1.0):
        both = engine.generate(prompts, max_new_tokens=16, confidence=confidence)
        ref = Engine(rounded).generate(prompts, max_new_tokens=16, confidence=confidence)
        assert both.tokens == ref.tokens and both.steps == ref.steps
        assert (max(max(s) for s in both.steps) > 1) == (confidence < 1)  # merged steps (slot adapters) ran
        alone = [engine.generate([p], max_new_tokens=16, confidence=confidence).tokens[0] for p in prompts]
        assert both.tokens == alone


@needs_fbgemm
def test_fp16_fuses_sibling_projections_into_one_gemm(monkeypatch):
    """q/k/v and gate/up of each decoder layer become parts of one packed GEMM: the logits are those of the unfused
    fp16 layers, each layer runs two GEMMs for its five projections, and a part asked with another input (or
    twice) computes afresh. The embedder's q/k/v (one query, other keys) are never fused."""
    ids = torch.randint(2, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    unfused = tiny_llama()
    quantize_model(unfused, "fp16", fuse=False)
    fused = tiny_llama()
    summary = quantize_model(fused, "fp16")
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert all(isinstance(m, FusedPart) for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.up_proj))
    assert attn.q_proj.group is attn.v_proj.group is not mlp.gate_proj.group
    assert isinstance(attn.o_proj, Fp16Linear) and isinstance(mlp.down_proj, Fp16Linear)
    assert summary["quantized"] == 15 and summary["linear_bytes_after"] * 2 == summary["linear_bytes_before"]
    assert torch.equal(attn.k_proj.weight, unfused.model.layers[0].self_attn.k_proj.weight)
    assert (logits(fused, ids) - logits(unfused, ids)).abs().max() <= 4e-6 * logits(unfused, ids).abs().max()

    calls = []
    group_linear = type(attn.q_proj.group.linear)
    monkeypatch.setattr(group_linear, "_mm", lambda self, x: calls.append(self.out_features) or
                        self.eager_mm(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1))
    logits(fused, ids)
    # Per layer: q/k/v (64 + 2 KV heads x 16 x 2 = 128 rows) in one, o_proj, gate/up (2 x 128) in one, down_proj;
    # then the LM head. Unfused it would be seven calls a layer.
    assert calls == [128, 64, 256, 64] * 2 + [256]
    calls.clear()
    x1, x2 = torch.randn(3, 64), torch.randn(3, 64)
    ref = unfused.model.layers[0].self_attn
    assert torch.allclose(attn.q_proj(x1), ref.q_proj(x1), atol=1e-6)
    assert torch.allclose(attn.k_proj(x2), ref.k_proj(x2), atol=1e-6)  # another input: not q's GEMM
    assert torch.allclose(attn.k_proj(x2), ref.k_proj(x2), atol=1e-6)  # asked twice: computed again
    assert calls == [128, 64, 128, 32, 128, 32]  # the fused GEMM (128 rows) three times, between the unfused ones

    model = hamburger("llama", k=4)
    quantize_model(model, "fp16", skip=())
    assert type(model.embedder.q_proj) is Fp16Linear and type(model.embedder.k_proj) is Fp16Linear
    assert isinstance(model.base.model.layers[0].self_attn.q_proj, FusedPart)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_int_schemes_fuse_sibling_projections_too(tmp_path, scheme):
    """int8/int4: q/k/v and gate/up become parts of one kernel call each, with the same logits, bytes and disk
    cache tensors as the unfused layers (each output row is quantized on its own, so concatenating rows is exact)."""
    ids = torch.randint(2, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    unfused, fused = tiny_llama(), tiny_llama()
    before = quantize_model(unfused, scheme, fuse=False)
    after = quantize_model(fused, scheme)
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert isinstance(attn.q_proj, FusedPart) and attn.q_proj.scheme == scheme
    assert attn.q_proj.group is attn.v_proj.group is not mlp.gate_proj.group
    assert type(attn.o_proj) is qlinear.MODULES[scheme] and type(mlp.down_proj) is qlinear.MODULES[scheme]
    assert abs(after["linear_bytes_after"] - before["linear_bytes_after"]) <= 16  # the parts' shares, rounded down
    assert torch.equal(logits(fused, ids), logits(unfused, ids))
    assert torch.equal(attn.k_proj.dequantize(), unfused.model.layers[0].self_attn.k_proj.dequantize())
    path = tmp_path / "q.safetensors"
    qz.save_quantized(fused, path)
    again = tiny_llama()
    qz.load_quantized(again, path, scheme)
    assert isinstance(again.model.layers[0].self_attn.q_proj, FusedPart)
    assert torch.equal(logits(again, ids), logits(unfused, ids))


@needs_fbgemm
@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_fp16_fused_projections_keep_biases_and_outputs(arch):
    """Qwen2's q/k/v carry biases: the fused GEMM adds each part's own (and none where a part has none)."""
    ids = torch.randint(2, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    unfused, fused = tiny_base(arch).eval(), tiny_base(arch).eval()
    with torch.no_grad():  # transformers initialises biases to zero: make them matter
        for model in (unfused, fused):
            gen = torch.Generator().manual_seed(1)
            for m in model.modules():
                if isinstance(m, nn.Linear) and m.bias is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=gen))
    quantize_model(unfused, "fp16", fuse=False)
    quantize_model(fused, "fp16")
    attn = fused.model.layers[0].self_attn
    assert isinstance(attn.q_proj, FusedPart) and (attn.q_proj.bias is not None) == (arch == "qwen2")
    ref = logits(unfused, ids)
    assert (logits(fused, ids) - ref).abs().max() <= 4e-6 * ref.abs().max()


def test_fp16_refused_off_cpu():
    assert qz._why_not(nn.Linear(8, 8, device="meta"), "fp16", 32) == "no packed kernel on meta"
    assert "x86 CPUs only" in fp16_unavailable("cuda") and "--dtype float16" in fp16_unavailable("cuda")
    with pytest.raises(ValueError, match="x86 CPUs only"):
        Fp16Linear(torch.zeros(8, 8, device="meta"))


def test_int4_zero_and_constant_groups():
    w = torch.zeros(16, 64)
    w[1] = 0.5  # a constant row
    layer = Int4Linear.from_linear(linear_from(w), 32)
    assert torch.equal(layer.dequantize(), w)
    int8 = Int8Linear.from_linear(linear_from(w))
    # natively GGUF's Q8_0: 0.5 = 127 codes times 0.5 / 127 rounded to float16
    assert torch.equal(int8.weight, w) if not int8.native else torch.allclose(int8.weight, w, rtol=2**-11, atol=0)


# --- whole models ------------------------------------------------------------------------------------------------


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("hidden", [64, 128])
def test_quantized_logits_close_to_float(hidden):
    """Random Gaussian weights are the hard case for 4 bits (a trained base from Q4_1 is exact, see above):
    measured relative logit errors are ~0.01 (int8) and ~0.11-0.15 (int4), asserted with ~2x margin. Greedy
    tokens may only differ where the float top-2 are within the logits' error of each other."""
    base = tiny_llama(hidden=hidden)
    ids = torch.randint(2, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = logits(base, ids)
    top2 = ref.topk(2, -1).values
    margin = top2[..., 0] - top2[..., 1]
    for scheme, bound in (("int8", 0.03), ("int4", 0.3)):
        model = copy.deepcopy(base)
        summary = quantize_model(model, scheme)
        assert summary["quantized"] == 2 * 7 + 1 and summary["skipped"] == 0
        out = logits(model, ids)
        assert ((out - ref).norm() / ref.norm()).item() < bound, scheme
        worst = (out - ref).abs().max()
        differ = out.argmax(-1) != ref.argmax(-1)
        assert (margin[differ] < 2 * worst).all()
        if scheme == "int8":
            assert not differ.any()


def test_tied_head_and_float_embedding():
    model = tiny_llama()
    emb = model.get_input_embeddings().weight
    before = emb.detach().clone()
    summary = quantize_model(model, "int4")
    head = model.get_output_embeddings()
    assert isinstance(head, Int4Linear) and model.get_input_embeddings().weight is emb
    assert emb.dtype == torch.float32 and torch.equal(emb, before)  # the lookup stays float, untouched
    assert summary["head"] == "int4" and summary["bytes_after"] < summary["bytes_before"]
    assert summary["linear_bytes_after"] * 5 < summary["linear_bytes_before"]
    # A different head scheme (e.g. int8 for a head that came from Q8_0).
    model = tiny_llama()
    quantize_model(model, "int4", head="int8")
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.model.layers[0].mlp.down_proj, Int4Linear)
    model = tiny_llama()
    quantize_model(model, "int4", head="none")
    assert type(model.lm_head) is nn.Linear


def test_none_changes_nothing():
    model = tiny_llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    summary = quantize_model(model, "none")
    assert summary["quantized"] == 0 and summary["bytes_after"] == summary["bytes_before"]
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)


def test_quantizing_twice_is_idempotent_or_refused():
    model = tiny_llama()
    quantize_model(model, "int4")
    ids = torch.tensor([[3, 4, 5, 6]])
    first = logits(model, ids)
    again = quantize_model(model, "int4")
    assert again["quantized"] == 0 and again["already_quantized"] == 15
    assert torch.equal(logits(model, ids), first)
    assert quantize_model(model, "none")["quantized"] == 0
    with pytest.raises(ValueError, match="already quantized as int4"):
        quantize_model(model, "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, "int4", group_size=64)


def test_bad_arguments_are_value_errors():
    model = tiny_llama()
    for group in (16, 48, 0, 33, "32", True):
        with pytest.raises(ValueError, match="group_size must be one of"):
            quantize_model(model, "int4", group_size=group)
    with pytest.raises(ValueError, match="scheme must be one of"):
        quantize_model(model, "int3")
    with pytest.raises(ValueError, match="head scheme must be one of"):
        quantize_model(model, "int4", head="fp8")
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())


def test_layers_the_kernels_cannot_take_stay_float_and_are_counted():
    model = nn.Sequential(nn.Linear(48, 32), nn.Linear(32, 20), nn.Linear(32, 32), nn.Linear(64, 32))
    summary = quantize_model(model, "int4")
    assert summary["quantized"] == 2 and summary["skipped"] == 2
    assert "multiple of the group size 32" in summary["skipped_layers"]["0"]  # in_features 48
    assert "multiple of 16" in summary["skipped_layers"]["1"]  # out_features 20 (CPU int4 packing)
    assert [type(m) for m in model] == [nn.Linear, nn.Linear, Int4Linear, Int4Linear]
    summary = quantize_model(nn.Sequential(nn.Linear(32, 32), nn.Linear(64, 32)), "int4", group_size=64)
    assert summary["quantized"] == 1 and list(summary["skipped_layers"]) == ["0"]
    summary = quantize_model(nn.Sequential(nn.Linear(48, 32), nn.Linear(32, 20)), "int8")
    assert summary["quantized"] == 2 and summary["skipped"] == 0  # int8 takes any shape


def test_bfloat16_model():
    base = tiny_llama(dtype=torch.bfloat16)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    ref = logits(base, ids).float()
    for scheme in ("int8", "int4"):
        model = copy.deepcopy(base)
        quantize_model(model, scheme)
        out = logits(model, ids)
        assert out.dtype == torch.bfloat16
        assert ((out.float() - ref).norm() / ref.norm()).item() < (0.05 if scheme == "int8" else 0.3)


@pytest.mark.parametrize("scheme", ["int4", "int8"] + (["fp16"] if fp16_unavailable("cpu") is None else []))
def test_hamburger_model_engine_equals_reference_path_when_quantized(scheme):
    """Base, micro-step decoder and head quantized; both decoding paths run the same quantized modules, and
    the slot adapters hook the swapped layers (during gated passes only)."""
    model = hamburger("llama", k=4, slot_adapter_rank=4)
    torch.nn.init.normal_(model.embedder.o_proj.weight, std=0.2)
    summary = quantize_model(model, scheme)
    n_base, n_micro = 4 * 7, len(model.micro.layers) * 7
    assert summary["quantized"] == n_base + n_micro + 1
    assert all(type(m) is nn.Linear for m in model.stop_head.modules() if isinstance(m, nn.Linear))
    q_proj = model.base.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, FusedPart) and q_proj.scheme == scheme and len(q_proj._forward_hooks) == 0
    with model.slot_adapters.gated(torch.ones(1, 1, dtype=torch.bool)):
        assert len(q_proj._forward_hooks) == 1
    assert len(q_proj._forward_hooks) == 0
    prompts = [[5, 17, 33, 8, 60, 12, 9], [40, 41]]
    for confidence in (0.3, 1.0):
        ref = generate(model, prompts, max_new_tokens=16, confidence=confidence)
        fast = Engine(model).generate(prompts, max_new_tokens=16, confidence=confidence)
        assert fast.tokens == ref.tokens and fast.steps == ref.steps
    model.slot_adapters.remove()
    with model.slot_adapters.gated(torch.ones(1, 1, dtype=torch.bool)):
        assert len(q_proj._forward_hooks) == 0  # detached: no pass hooks the base any more


def test_engine_shortlist_reads_the_quantized_head():
    model = hamburger("llama", k=4)
    quantize_model(model, "int8")
    model.micro_vocab = torch.arange(2, 50)
    engine = Engine(model)
    rows = model.base.lm_head.dequantize()[2:50].float()
    short = engine.runner.short_head if engine.runner._short is None else engine.runner._short.dequantize()  # fp16-packed: exact
    assert torch.equal(short, rows)
    out = engine.generate([[5, 6, 7]], max_new_tokens=8)
    assert len(out.tokens[0]) == 8


def test_plain_engine_greedy_int8_equals_float():
    base = tiny_llama()
    float_model = HamburgerModel.plain(copy.deepcopy(base), None)
    quant = HamburgerModel.plain(base, None)
    quantize_model(quant, "int8")
    prompts = [[5, 6, 7, 8], [9, 10]]
    assert Engine(quant).generate(prompts, max_new_tokens=20).tokens == \
        Engine(float_model).generate(prompts, max_new_tokens=20).tokens


# --- disk cache ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["int8", "int4", pytest.param("fp16", marks=needs_fbgemm)])
def test_disk_cache_second_start_reads_it(tmp_path, monkeypatch, scheme):
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    first = tiny_llama()
    s1 = quantize_cached(first, scheme, root=tmp_path)
    assert s1["cache"] == "miss" and s1["quantized"] == 15
    files = list(tmp_path.iterdir())
    assert [p.name for p in files] == [s1["cache_path"].rsplit("/", 1)[-1]] and scheme in files[0].name

    def no_quantizing(*a, **k):
        raise AssertionError("quantized again instead of reading the cache")

    monkeypatch.setattr(qlinear, "int8_weights", no_quantizing)
    monkeypatch.setattr(qlinear, "int4_weights", no_quantizing)
    monkeypatch.setattr(qlinear.Fp16Linear, "from_linear", no_quantizing)
    second = tiny_llama()
    s2 = quantize_cached(second, scheme, root=tmp_path)
    assert s2["cache"] == "hit" and s2["cache_path"] == s1["cache_path"] and s2["quantized"] == 15
    assert torch.equal(logits(second, ids), logits(first, ids))
    b1, b2 = dict(first.named_buffers()), dict(second.named_buffers())
    assert b1.keys() == b2.keys() and all(torch.equal(b1[k], b2[k]) for k in b1)


def test_disk_cache_keys_and_stale_files(tmp_path):
    a, b = tiny_llama(seed=0), tiny_llama(seed=1)
    pa, pb = qz.cache_path(a, "int4", root=tmp_path), qz.cache_path(b, "int4", root=tmp_path)
    assert pa != pb  # another model's weights
    assert pa != qz.cache_path(a, "int4", 64, root=tmp_path) != qz.cache_path(a, "int8", root=tmp_path)
    assert pa != qz.cache_path(a, "int4", head="int8", root=tmp_path)
    assert pa != qz.cache_path(a.to(torch.bfloat16), "int4", root=tmp_path)  # same fingerprint, other dtype
    a = tiny_llama(seed=0)
    path = qz.cache_path(a, "int4", root=tmp_path)
    path.write_bytes(b"not a safetensors file")
    with pytest.warns(UserWarning, match="ignoring the quantized cache"):
        summary = quantize_cached(a, "int4", root=tmp_path)
    assert summary["cache"] == "miss" and summary["quantized"] == 15
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert quantize_cached(tiny_llama(seed=0), "int4", root=tmp_path)["cache"] == "hit"


def test_load_quantized_refuses_another_plan(tmp_path):
    model = tiny_llama()
    quantize_model(model, "int4")
    path = tmp_path / "q.safetensors"
    assert qz.save_quantized(model, path) == 15
    fresh = tiny_llama()
    with pytest.raises(ValueError, match="other layers or schemes"):
        qz.load_quantized(fresh, path, "int4", head="int8")
    assert not any(isinstance(m, QuantizedLinear) for m in fresh.modules())  # untouched
    qz.load_quantized(fresh, path, "int4")
    assert isinstance(fresh.lm_head, Int4Linear)


def test_cache_off(monkeypatch):
    monkeypatch.setenv("HAMBURGER_CACHE", "off")
    summary = quantize_cached(tiny_llama(), "int8")
    assert summary["cache"] == "off" and summary["quantized"] == 15


# --- the real default (slow) ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
def test_default_int4_int8_is_its_gguf_weights_bit_for_bit():
    """SmolLM2's GGUF stores its projections as Q4_1 and its embedding (the tied LM head) as Q8_0: natively
    `int4/int8` (what "auto" picks for it) holds exactly the float default's weights, every one of them."""
    from hamburger.model.hamburger_model import load_model

    model, _ = load_model("SmolLM2-135M-Instruct")
    floats = {n: m.weight.detach().clone() for n, m in model.base.named_modules() if isinstance(m, nn.Linear)}
    embedding = model.base.get_input_embeddings().weight.detach()
    quantize_model(model.base, "int4", head="int8", fuse=False)
    assert len(floats) == 211
    for name, w in floats.items():
        layer = model.base.get_submodule(name)
        assert layer.native and torch.equal(layer.dequantize(), embedding if name == "lm_head" else w), name


@pytest.mark.slow
def test_default_q4_1_base_is_exact_in_int4_with_pytorchs_kernels():
    """PyTorch's kernels: int4 at group 32 gives the GGUF's Q4_1 projections back up to float32 rounding with
    float32 scales, and the same codes nearly everywhere with the CPU kernel's bfloat16 scale and zero."""
    from hamburger.model.hamburger_model import load_model

    model, _ = load_model("SmolLM2-135M-Instruct")
    # Every projection of the first, a middle and the last layer (21 of the 210: quantizing all took a minute)
    depth = len(model.base.model.layers)
    picked = nn.ModuleDict({f"l{i}": model.base.model.layers[i] for i in (0, depth // 2, depth - 1)})
    floats = {n: m.weight.detach().clone() for n, m in picked.named_modules() if isinstance(m, nn.Linear)}
    assert len(floats) == 21
    exact, fast = copy.deepcopy(picked), picked
    with native.turned_off():
        quantize_model(exact, "int4", act_dtype=torch.float32, fuse=False)  # layer by layer, as the GGUF stores them
        quantize_model(fast, "int4", fuse=False)  # the default of PyTorch's CPU kernel: bfloat16 scales and zeros
    for name, w in floats.items():
        layer = exact.get_submodule(name)
        codes, scales, _ = layer.unpack()
        err = (layer.dequantize() - w).abs().max()
        assert err < 1e-3 * scales.min() + 1e-6, name
        # bfloat16: the same codes nearly everywhere, the weights up to the scale's and zero's rounding
        fcodes, fscales, fmins = fast.get_submodule(name).unpack()
        assert (fcodes == codes).float().mean() > 0.999, name
        deq = fcodes.float() * fscales.float().repeat_interleave(32, 1) + fmins.float().repeat_interleave(32, 1)
        assert ((deq - w).abs() <= 2**-7 * (w.abs() + 16 * scales.repeat_interleave(32, 1))).all(), name


@pytest.mark.parametrize("scheme", [pytest.param("fp16", marks=needs_fbgemm), "int8", "int4"])
def test_siblings_quantized_as_one_layer_equal_the_parts_fused(scheme):
    """`quantize_model` quantizes q/k/v and gate/up as one layer each (one packing of their weights): bit for bit the
    group `fuse_projections` makes of the siblings quantized one by one, biases (Qwen2's q/k/v) included."""
    from hamburger.kernels.fused import fuse_projections

    ids = torch.randint(2, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    models = []
    for _ in range(2):
        model = tiny_base("qwen2").eval()
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1)
            for m in model.modules():
                if isinstance(m, nn.Linear) and m.bias is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=gen))
        models.append(model)
    one_by_one, at_once = models
    quantize_model(one_by_one, scheme, fuse=False)
    assert fuse_projections(one_by_one) == 2 * len(one_by_one.model.layers)  # q/k/v and gate/up of each layer
    quantize_model(at_once, scheme)
    for a, b in zip(one_by_one.modules(), at_once.modules()):
        assert type(a) is type(b)
        if isinstance(a, FusedPart):
            assert a.group.bounds == b.group.bounds
            assert torch.equal(a.dequantize(), b.dequantize())
            assert all(torch.equal(x, y) for x, y in zip(a.group.linear.portable().values(),
                                                          b.group.linear.portable().values()))
            assert (a.bias is None) == (b.bias is None) and (a.bias is None or torch.equal(a.bias, b.bias))
    assert torch.equal(logits(at_once, ids), logits(one_by_one, ids))


@pytest.mark.parametrize("scheme", ["fp16", "int8", "int4"])
def test_layers_made_on_threads_equal_layers_made_one_by_one(scheme, monkeypatch):
    """`quantize.in_threads` makes the layers on torch's threads: the model's logits are the same, bit for bit, as
    when they are made one after another on one thread."""
    if scheme == "fp16" and fp16_unavailable("cpu"):
        pytest.skip(fp16_unavailable("cpu"))
    made = []
    real = qz.in_threads
    monkeypatch.setattr(qz, "in_threads", lambda jobs: made.append(len(jobs)) or real(jobs))
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = []
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            model = tiny_base()
            quantize_model(model, scheme)
        finally:
            torch.set_num_threads(before)
        logits.append(model(ids).logits)
    assert made and made[0] > 2  # the fused groups and the single layers, in one call
    assert torch.equal(logits[0], logits[1])


def test_the_shortlist_of_a_tied_fp16_head_equals_its_unpacked_rows():
    """`runner.head_rows` reads a tied fp16 head's rows from the float embedding rounded to float16 (no unpacking
    of the whole head): the same values, bit for bit, as the packed head unpacked."""
    from hamburger.inference.runner import head_rows

    if fp16_unavailable("cpu"):
        pytest.skip(fp16_unavailable("cpu"))
    model = hamburger("llama", k=4)
    quantize_model(model, "fp16")
    rows = torch.arange(2, 50)
    assert isinstance(model.base.lm_head, Fp16Linear) and model.base.config.tie_word_embeddings
    unpacked = model.base.lm_head.dequantize()[rows].float()
    head = model.base.lm_head
    head.dequantize = lambda: pytest.fail("head_rows unpacked the whole head")  # the embedding's path, not this
    assert torch.equal(head_rows(model, rows), unpacked)
    del head.dequantize
    big = hamburger("llama", k=4)
    with torch.no_grad():  # larger weights (tied: the head's too), where float16's steps are coarser
        big.base.get_input_embeddings().weight.mul_(1000)
    quantize_model(big, "fp16")
    assert torch.equal(head_rows(big, rows), big.base.lm_head.dequantize()[rows].float())
    assert not torch.equal(head_rows(big, rows), big.base.get_input_embeddings().weight[rows])  # rounded, not raw
