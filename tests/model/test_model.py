"""HamburgerModel structure, training forward and loss, and checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import EOS, PAD, hamburger, tiny_base, tiny_tokenizer
from hamburger import (
    HamburgerConfig,
    HamburgerError,
    HamburgerModel,
    SegmentedExample,
    collate,
    generate,
)
from hamburger.model.micro_decoder import MicroStepDecoder
from hamburger.model.outputs import metrics_from_counts
from hamburger.training.examples import evaluate
from hamburger.training.loss import hamburger_loss

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
    out = hamburger_loss(model, batch)
    assert out.logits.shape == (11, 96)  # every response token once, in sequence order
    assert out.targets.tolist() == [9, 10, 11, 12, 13, 14, 22, 23, 24, 25, 26]
    # steps [2, 1, 3] then [4, 1]
    assert out.in_step_index.tolist() == [0, 1, 0, 0, 1, 2, 0, 1, 2, 3, 0]
    assert out.stop_targets.tolist() == [0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 1]
    assert out.stop_mask.tolist() == [True] * 9 + [False, True]  # in-step index K-1 = 3 does not count
    keep = out.stop_mask
    expected = torch.nn.functional.cross_entropy(out.logits, out.targets) + 0.5 * torch.nn.functional.binary_cross_entropy_with_logits(
        out.stop_logits[keep], out.stop_targets[keep])
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
        together = hamburger_loss(model, collate(EXAMPLES, 4, PAD))
        alone = [hamburger_loss(model, collate([ex], 4, PAD)) for ex in EXAMPLES]
    torch.testing.assert_close(together.logits, torch.cat([a.logits for a in alone]), atol=1e-4, rtol=1e-4)


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
        out = hamburger_loss(model, collate(EXAMPLES, 4, PAD))
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.micro.layers[0].mlp.down_proj.weight.grad is not None


def test_verified_stops_also_end_a_step_before_a_wrong_token():
    model = hamburger("llama", k=4)
    batch = collate(EXAMPLES, 4, PAD)
    with torch.no_grad():
        plain, verified = hamburger_loss(model, batch), hamburger_loss(model, batch, verified_stops=True)
    wrong = (plain.logits.argmax(-1) != plain.targets).tolist()
    expected = [max(s, float(w)) for s, w in zip(plain.stop_targets.tolist(), wrong[1:] + [1.0])]
    assert verified.stop_targets.tolist() == expected
    assert verified.stop_targets.sum() > plain.stop_targets.sum()  # a random model gets most tokens wrong


def reference_forward(model: HamburgerModel, batch) -> dict[str, torch.Tensor]:
    """The training forward as first written: the micro-step decoder over every step, padded to K."""
    import torch.nn.functional as F

    k = model.config.max_step_tokens
    b, s, _ = batch.slot_tokens.shape
    slots = model.smash(batch.slot_tokens.view(b * s, k), batch.slot_lengths.view(-1)).view(b, s, -1)
    hidden = model.base_forward(slots, batch.attention_mask, batch.position_ids, merged=batch.slot_lengths > 1)
    at = (batch.step_batch, batch.step_slot)
    micro_in = torch.cat([model.micro.features(hidden, at), model.embed(batch.step_tokens[:, : k - 1])], dim=1)
    states = torch.cat([hidden[-1][at][:, None], model.micro(micro_in)[:, model.micro.num_features:]], dim=1)
    idx = torch.arange(k)
    valid = idx[None] < batch.step_lengths[:, None]
    logits, stop_logits = model.lm_head(states[valid]).float(), model.stop_head(states[valid]).float()
    targets = batch.step_tokens[valid]
    stop_targets = (idx[None] == batch.step_lengths[:, None] - 1)[valid].float()
    keep = (idx.expand_as(valid)[valid] < k - 1) & (targets != EOS)
    loss = F.cross_entropy(logits, targets) + 0.5 * F.binary_cross_entropy_with_logits(stop_logits[keep],
                                                                                      stop_targets[keep])
    return {"loss": loss, "logits": logits, "stop_logits": stop_logits}


SHORT_STEPS = [  # the longest step is 2 tokens; the second batch has one-token steps only
    [SegmentedExample([5, 6, 7, 30, 31, 32, 33, EOS], 3, [1, 2, 1, 1]), SegmentedExample([8, 9, 40, 41], 2, [1, 1])],
    [SegmentedExample([5, 6, 7, 30, 31, EOS], 3, [1, 1, 1]), SegmentedExample([8, 40], 1, [1])],
]


@pytest.mark.parametrize("examples,micro_rows,micro_width", [(EXAMPLES, 3, 3), (SHORT_STEPS[0], 1, 1),
                                                              (SHORT_STEPS[1], 0, 0)])
def test_micro_decoder_runs_only_over_multi_token_steps_and_the_loss_is_unchanged(arch, examples, micro_rows,
                                                                                   micro_width):
    """Steps of one token need no micro-step pass, and the rest only as far as the batch's longest step:
    the loss, logits and gradients equal the reference computation over every step padded to K."""
    model = hamburger(arch, k=4)
    torch.nn.init.normal_(model.embedder.o_proj.weight, std=0.2)
    batch = collate(examples, 4, PAD)
    calls = []
    hook = model.micro.register_forward_hook(lambda mod, args, out: calls.append(tuple(args[0].shape[:2])))
    out = hamburger_loss(model, batch)
    hook.remove()
    m = model.micro.num_features
    assert calls == ([(micro_rows, m + micro_width)] if micro_rows else [])
    ref = reference_forward(model, batch)
    torch.testing.assert_close(out.logits, ref["logits"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.stop_logits, ref["stop_logits"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, ref["loss"], atol=1e-5, rtol=1e-5)
    grads = []
    for loss in (out.loss, ref["loss"]):
        model.zero_grad()
        loss.backward()
        grads.append([p.grad.clone() for p in model.embedder.parameters() if p.grad is not None])
    assert grads[0]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_stop_labels_at_the_last_index_and_on_eos_do_not_count():
    """A step ends at K tokens and at EOS whatever the stop head says: those labels (always 1) are masked."""
    model = hamburger("llama", k=4)
    examples = [SegmentedExample([5, 6, 20, 21, 22, 23, 24, EOS], 2, [4, 2]),  # EOS closes a 2-token step
                SegmentedExample([5, 30, 31, EOS], 1, [1, 2])]  # ... and a 2-token step, not at K-1
    with torch.no_grad():
        out = hamburger_loss(model, collate(examples, 4, PAD))
    assert out.targets.tolist() == [20, 21, 22, 23, 24, EOS, 30, 31, EOS]
    assert out.stop_targets.tolist() == [0, 0, 0, 1, 0, 1, 1, 0, 1]
    assert out.stop_mask.tolist() == [True, True, True, False, True, False, True, True, False]
    stop = torch.nn.functional.binary_cross_entropy_with_logits(out.stop_logits[out.stop_mask],
                                                                out.stop_targets[out.stop_mask])
    torch.testing.assert_close(out.stop_loss, stop)
    out.stop_logits = torch.full_like(out.stop_logits, -30.0)  # "go on" everywhere: wrong at every label 1
    assert out.metrics(4)["stop_acc"] == pytest.approx(5 / 6)  # 6 labels count, one of them a 1

def test_held_out_metrics_are_means_over_the_whole_set_not_over_batches():
    """acc@k = right at k / targets at k over all examples, whatever the batching (the same as one batch)."""
    model = hamburger("llama", k=4)
    examples = []
    for n, steps in enumerate(([1, 1, 1, 1, 1, 1, 1, 1], [4, 4], [2], [3, 1, 4], [1, 2, 1], [4], [2, 3])):
        prompt = [5 + n, 6]
        if n % 2:  # the model's own greedy tokens: right at every position
            reply = generate(model, [prompt], max_new_tokens=sum(steps), forced_steps=[steps], eos_token_ids=set())
            examples.append(SegmentedExample(prompt + reply.tokens[0], 2, steps))
        else:  # mostly wrong
            examples.append(SegmentedExample(prompt + list(range(20, 20 + sum(steps))), 2, steps))
    with torch.no_grad():
        one_batch = hamburger_loss(model, collate(examples, 4, PAD))
    correct = one_batch.logits.argmax(-1) == one_batch.targets
    assert 0 < correct.float().mean() < 1
    for batch_size in (1, 2, 7):
        got = evaluate(model, examples, 4, PAD, batch_size, "cpu")
        for k in range(4):
            at_k = one_batch.in_step_index == k
            assert got[f"token_acc@{k}"] == pytest.approx(correct[at_k].float().mean().item()), (batch_size, k)
        counted = one_batch.stop_mask
        stop_right = ((one_batch.stop_logits > 0).float() == one_batch.stop_targets)[counted].float().mean()
        assert got["stop_acc"] == pytest.approx(stop_right.item())
        assert got["ce_loss"] == pytest.approx(one_batch.ce_loss.item(), rel=1e-5)
        assert got["stop_loss"] == pytest.approx(one_batch.stop_loss.item(), rel=1e-5)
        assert got["loss"] == pytest.approx(one_batch.loss.item(), rel=1e-5)
    assert metrics_from_counts({"ce_loss": (6.0, 3), "token_acc@3": (0.0, 0)}) == {"loss": 2.0, "ce_loss": 2.0}


def test_dense_losses_distil_the_unmerged_base_at_the_right_positions(arch):
    """kd_loss is KL(base reading the tokens one per position || model) at every target, the base's logits taken
    where it predicts that very token; state_loss compares each merged slot with the base at its step's last token."""
    model = hamburger(arch, k=4)
    batch = collate(EXAMPLES, 4, PAD)
    out = hamburger_loss(model, batch, kd_weight=0.7, state_weight=0.3)
    with torch.no_grad():
        want = []
        for ex in EXAMPLES:
            logits = model.base(torch.tensor([ex.input_ids])).logits[0]
            want.append(logits[ex.prompt_len - 1 : len(ex.input_ids) - 1])  # predicts each response token
        want = torch.log_softmax(torch.cat(want).float(), -1)
    kd = torch.nn.functional.kl_div(torch.log_softmax(out.logits, -1), want, log_target=True, reduction="batchmean")
    torch.testing.assert_close(out.kd_loss, kd)
    plain = hamburger_loss(model, batch)
    torch.testing.assert_close(out.loss, plain.loss + 0.7 * out.kd_loss + 0.3 * out.state_loss)
    assert plain.kd_loss is None and plain.state_loss is None
    assert out.merged_slots == 2  # steps [2, 1, 3] then [4, 1]: slots for [2, 1] and [4], two of them merged
    assert out.state_loss > 0
    out.loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.embedder.parameters())
    metrics = out.metrics(4)
    assert metrics["kd_loss"] == pytest.approx(out.kd_loss.item(), rel=1e-5)
    assert metrics["state_loss"] == pytest.approx(out.state_loss.item(), rel=1e-5)


def test_dense_losses_vanish_when_nothing_is_smashed():
    """One token per step is the base exactly: nothing to distil, no merged slot to compare."""
    model = hamburger("llama", k=4)
    ones = [SegmentedExample(ex.input_ids, ex.prompt_len, [1] * (len(ex.input_ids) - ex.prompt_len)) for ex in EXAMPLES]
    with torch.no_grad():
        out = hamburger_loss(model, collate(ones, 4, PAD), dense_metrics=True)
    assert out.kd_loss.item() == pytest.approx(0.0, abs=1e-5)
    assert out.merged_slots == 0 and out.state_loss.item() == 0.0
    # dense_metrics alone adds nothing
    torch.testing.assert_close(out.loss, hamburger_loss(model, collate(ones, 4, PAD)).loss)


def test_smash_of_one_token_steps_is_their_embedding():
    """Decoding skips the embedder when every step has one token: the same embeddings it would give."""
    model = hamburger("llama", k=4)
    torch.nn.init.normal_(model.embedder.o_proj.weight, std=0.2)
    steps = torch.tensor([[5, 0, 0, 0], [9, 3, 0, 0]])
    with torch.no_grad():
        ones = model.smash(steps, torch.tensor([1, 1]))
        mixed = model.smash(steps, torch.tensor([1, 2]))
    torch.testing.assert_close(ones, model.embedder(model.embed(steps), torch.tensor([1, 1])))
    torch.testing.assert_close(ones[0], mixed[0])
    assert not torch.allclose(ones[1], mixed[1])  # a two-token step is smashed
