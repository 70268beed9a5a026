"""The transformers-free base (`hamburger.model.llama`): the same weights, logits and engine output as transformers'
classes on the same folder, None where it would differ, and decoding without importing transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tests.conftest import random_merger, randomize_new_modules, tiny_base, tiny_tokenizer
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hamburger import HamburgerConfig, HamburgerModel
from hamburger.inference.engine import Engine
from hamburger.kernels import native
from hamburger.loading import quantize_loaded
from hamburger.model.base import fingerprint, load_base
from hamburger.model.llama import CausalLM, load_light


def tiny(arch: str, tied: bool = True, seed: int = 0) -> torch.nn.Module:
    if arch != "qwen3":
        model = tiny_base(arch, seed=seed)
    else:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=1, pad_token_id=0,
            tie_word_embeddings=True, initializer_range=0.2)).eval()
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 1.5)
    return model


def saved(model: torch.nn.Module, path) -> str:
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", True), ("mistral", True),
                                       ("qwen3", True)])
def test_same_weights_and_logits_as_transformers(tmp_path, arch, tied):
    hf = tiny(arch, tied)
    light = load_light(saved(hf, tmp_path))
    assert isinstance(light, CausalLM)
    assert sorted(light.state_dict()) == sorted(hf.state_dict())
    assert fingerprint(light) == fingerprint(hf)  # a checkpoint trained on one loads on the other
    assert (light.lm_head.weight is light.model.embed_tokens.weight) == tied
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # padding at the end of a row
    with torch.no_grad():
        ours, theirs = light(ids, mask).logits, hf(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours[1, :6], theirs[1, :6], rtol=1e-5, atol=1e-5)
        hidden = light.base_model(input_ids=ids, output_hidden_states=True).hidden_states
        expected = hf.base_model(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(hidden) == len(expected)
    for a, b in zip(hidden, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch,mode,scheme", [
    *[(arch, mode, "fp16") for arch in ("llama", "qwen2", "mistral") for mode in ("trust", "verify", "compress")],
    ("llama", "verify", "none"), ("llama", "verify", "int4/int8"), ("qwen2", "trust", "int4"),
])
def test_engine_output_is_the_same_on_either_base(tmp_path, arch, mode, scheme):
    """A HAMburger around the light base decodes exactly what it decodes around transformers' (the engine runs
    the same modules: its fast layers over quantized ones, and the micro-step decoder built from the base's layer)."""
    folder = saved(tiny(arch, seed=3), tmp_path)
    outputs = []
    for base in (AutoModelForCausalLM.from_pretrained(folder).eval(), load_light(folder)):
        torch.manual_seed(5)
        config = HamburgerConfig(max_step_tokens=3, micro_layers=2, num_features=2, micro_context=4)
        model = randomize_new_modules(HamburgerModel.wrap(base, tiny_tokenizer(), config).eval())
        if mode == "compress":
            model.attach_merger(random_merger(base, channels=arch == "qwen2"))
        quantize_loaded(model, scheme)
        engine = Engine(model)
        assert (engine.runner.native is not None) == (scheme != "none" and native.available())  # the light base's too
        out = engine.generate([[2, 7, 9, 11, 4], [2, 30]], max_new_tokens=12, mode=mode, confidence=0.2)
        outputs.append((out.tokens, out.steps))
    assert outputs[0] == outputs[1]


def edited(tmp_path, change) -> str:
    folder = saved(tiny("llama"), tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("change", [
    lambda d: d.update(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
    lambda d: d.update(hidden_act="gelu"),
    lambda d: d.update(model_type="gpt2"),
    lambda d: d.pop("num_key_value_heads"),
    lambda d: d.update(model_type="mistral", sliding_window=16),
    lambda d: d.update(quantization_config={"quant_method": "bitsandbytes"}),
], ids=["rope-scaling", "activation", "architecture", "missing-size", "sliding-window", "quantized"])
def test_none_where_it_would_not_be_transformers(tmp_path, change):
    assert load_light(edited(tmp_path, change)) is None


def test_none_for_foreign_weight_names_and_missing_files(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = saved(tiny("llama"), tmp_path / "a")
    state = load_file(f"{folder}/model.safetensors")
    state["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(state, f"{folder}/model.safetensors")
    assert load_light(folder) is None
    assert load_light(tmp_path / "empty") is None


def test_load_base_light_falls_back_to_transformers(tmp_path):
    light_folder = saved(tiny("llama"), tmp_path / "a")
    base, tok = load_base(light_folder, decode_only=True)
    assert isinstance(base, CausalLM) and type(tok).__module__ == "hamburger.model.tokenizer"
    assert base.config.hamburger_ref == light_folder
    other = edited(tmp_path / "b", lambda d: d.update(rope_parameters={"rope_type": "linear", "rope_theta": 1e4,
                                                                      "factor": 2.0}))
    base, tok = load_base(other, decode_only=True)
    assert type(base).__module__.startswith("transformers.")
    base, _ = load_base(light_folder)  # only when asked for
    assert type(base).__module__.startswith("transformers.")


def test_decoding_a_local_base_does_not_import_transformers(tmp_path):
    """What `hamburger generate` does with a local Llama-style base: load it, quantize, decode, detokenize, and
    transformers is never imported (its import is most of a cold start)."""
    folder = saved(tiny("llama"), tmp_path)
    code = f"""
import sys
from hamburger.loading import load
from hamburger.inference.engine import make_engine
from hamburger.model.base import encode_chat
model, trained = load({folder!r}, quantize="fp16", decode_only=True)
ids = encode_chat(model.tokenizer, [{{"role": "user", "content": "w3 w4"}}])
out = make_engine(model).generate([ids], max_new_tokens=5, mode="verify")
print(type(model.base).__name__, type(model.tokenizer).__name__, isinstance(model.tokenizer.decode(out.tokens[0]), str))
print(sorted(m for m in sys.modules if m.split(".")[0] == "transformers"))
"""
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-2:] == ["CausalLM Tokenizer True", "[]"]


def test_rms_norm_gives_the_formulas_bits():
    """`rms_norm`'s fused operator (float32) against transformers' formula written out: the same bits, over shapes
    and magnitudes; other dtypes take the formula itself."""
    from hamburger.model.llama import rms_norm

    gen = torch.Generator().manual_seed(0)
    for shape, scale, eps in (((1, 576), 3.0, 1e-5), ((2, 5, 64), 1e-3, 1e-6), ((16, 576), 40.0, 1e-5),
                              ((3, 7, 128), 1.0, 1e-6)):
        x = torch.randn(*shape, generator=gen) * scale
        w = torch.randn(shape[-1], generator=gen)
        formula = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        assert torch.equal(rms_norm(x, w, eps), formula), shape
        xb = x.to(torch.bfloat16)
        x32 = xb.float()
        expected = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)
        assert torch.equal(rms_norm(xb, w, eps), expected)
