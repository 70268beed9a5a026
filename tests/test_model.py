"""HamburgerModel structure, training forward and loss, and checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import PAD, hamburger, tiny_base, tiny_tokenizer
from hamburger import HamburgerConfig, HamburgerError, HamburgerModel, SegmentedExample, collate, generate
from hamburger.micro_decoder import MicroStepDecoder

EXAMPLES = [
    SegmentedExample([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], 4, [2, 1, 3]),
    SegmentedExample([20, 21, 22, 23, 24, 25, 26], 2, [4, 1]),
]


@pytest.mark.parametrize("layers,expected", [(30, [8, 15, 22, 30]), (16, [4, 8, 12, 16]), (4, [1, 2, 3, 4]), (2, [1, 2])])
def test_feature_layers_are_spread_over_depth_ending_at_final_output(layers, expected):
    assert HamburgerConfig().resolve(layers, 64).feature_layers == expected


def test_micro_decoder_uses_base_layer_type_and_top_layer_weights(arch):
    model = hamburger(arch, k=4, micro_layers=2, randomize=False)
    base_layers = model.base.base_model.layers
    assert all(type(layer) is type(base_layers[0]) for layer in model.micro.layers)
    for mine, src in zip(model.micro.layers, base_layers[-2:]):
        for (name, a), (_, b) in zip(mine.state_dict().items(), src.state_dict().items()):
            torch.testing.assert_close(a, b, msg=name)
        assert mine.state_dict().keys() == src.state_dict().keys()
    fresh = MicroStepDecoder(model.base, 2, [2, 4], init_from_top=False)
    assert not torch.equal(fresh.layers[0].mlp.down_proj.weight, base_layers[-2].mlp.down_proj.weight)


def test_training_forward_loss_and_metrics(arch):
    model = hamburger(arch, k=4)
    batch = collate(EXAMPLES, 4, PAD)
    out = model(batch)
    assert out.logits.shape == (11, 96)  # every response token once, in sequence order
    assert out.targets.tolist() == [9, 10, 11, 12, 13, 14, 22, 23, 24, 25, 26]
    # steps [2, 1, 3] then [4, 1]
    assert out.in_step_index.tolist() == [0, 1, 0, 0, 1, 2, 0, 1, 2, 3, 0]
    assert out.stop_targets.tolist() == [0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 1]
    expected = torch.nn.functional.cross_entropy(out.logits, out.targets) + 0.5 * torch.nn.functional.binary_cross_entropy_with_logits(
        out.stop_logits, out.stop_targets)
    torch.testing.assert_close(out.loss, expected)
    out.loss.backward()
    for name in ("embedder", "micro", "stop_head"):
        grads = [p.grad for p in getattr(model, name).parameters() if p.requires_grad]
        assert any(g is not None and g.abs().sum() > 0 for g in grads), name
    metrics = out.metrics(4)
    assert {"loss", "ce_loss", "stop_loss", "token_acc", "token_acc@0", "token_acc@3", "stop_acc"} <= metrics.keys()


def test_padding_in_a_batch_does_not_change_logits():
    model = hamburger("llama", k=4)
    with torch.no_grad():
        together = model(collate(EXAMPLES, 4, PAD))
        alone = [model(collate([ex], 4, PAD)) for ex in EXAMPLES]
    torch.testing.assert_close(together.logits, torch.cat([a.logits for a in alone]), atol=1e-5, rtol=1e-5)


def test_save_load_roundtrip_gives_identical_outputs(tmp_path, arch):
    model = hamburger(arch, k=4)
    base = model.base
    model.save_pretrained(tmp_path / "ckpt")
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["config.json", "model.safetensors"]
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())["hamburger"]
    assert raw["base_fingerprint"] == model.config.base_fingerprint and raw["max_step_tokens"] == 4
    loaded = HamburgerModel.from_pretrained(tmp_path / "ckpt", base=base, tokenizer=tiny_tokenizer())
    a = generate(model, [[5, 6, 7]], max_new_tokens=12, confidence=0.3, return_logits=True)
    b = generate(loaded, [[5, 6, 7]], max_new_tokens=12, confidence=0.3, return_logits=True)
    assert a.tokens == b.tokens and a.steps == b.steps
    assert torch.equal(a.logits[0], b.logits[0])


def test_checkpoint_refuses_another_base(tmp_path):
    model = hamburger("llama", k=4)
    model.save_pretrained(tmp_path / "ckpt")
    other = tiny_base("llama", seed=99)
    with pytest.raises(HamburgerError, match="fingerprint"):
        HamburgerModel.from_pretrained(tmp_path / "ckpt", base=other)


def test_checkpoint_base_reference_is_loaded(tmp_path, tiny_model_dir):
    from hamburger import load_base

    base, tok = load_base(str(tiny_model_dir))
    model = HamburgerModel.wrap(base, tok, HamburgerConfig(max_step_tokens=3))
    assert model.config.base_model == str(tiny_model_dir)
    model.save_pretrained(tmp_path / "ckpt")
    again = HamburgerModel.from_pretrained(tmp_path / "ckpt")
    assert again.config.max_step_tokens == 3 and again.tokenizer is not None


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(HamburgerError, match="not a HAMburger checkpoint"):
        HamburgerModel.from_pretrained(tmp_path)


def test_bfloat16_checkpoint_is_half_the_size_and_loads_close(tmp_path):
    model = hamburger("llama", k=4)
    model.save_pretrained(tmp_path / "fp32")
    model.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    size = lambda d: (tmp_path / d / "model.safetensors").stat().st_size  # noqa: E731
    assert size("bf16") < 0.55 * size("fp32")
    loaded = HamburgerModel.from_pretrained(tmp_path / "bf16", base=model.base, tokenizer=tiny_tokenizer())
    assert next(loaded.micro.parameters()).dtype == torch.float32
    for (name, a), b in zip(model.stop_head.state_dict().items(), loaded.stop_head.state_dict().values()):
        torch.testing.assert_close(a.to(torch.bfloat16).float(), b, msg=name)


def test_training_forward_under_bf16_autocast():
    model = hamburger("llama", k=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(collate(EXAMPLES, 4, PAD))
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.micro.layers[0].mlp.down_proj.weight.grad is not None


def test_verified_stops_also_end_a_step_before_a_wrong_token():
    model = hamburger("llama", k=4)
    batch = collate(EXAMPLES, 4, PAD)
    with torch.no_grad():
        plain, verified = model(batch), model(batch, verified_stops=True)
    wrong = (plain.logits.argmax(-1) != plain.targets).tolist()
    expected = [max(s, float(w)) for s, w in zip(plain.stop_targets.tolist(), wrong[1:] + [1.0])]
    assert verified.stop_targets.tolist() == expected
    assert verified.stop_targets.sum() > plain.stop_targets.sum()  # a random model gets most tokens wrong
