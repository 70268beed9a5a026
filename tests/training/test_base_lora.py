"""The base learning from any checkpoint (`train --base-training lora|full`): a LoRA attached to a model without
one, its on/off switch (verify and compress mode decode with the untouched base), its checkpoint and resume, and
trust-mode training of a micro-step decoder that reads context."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import PAD, hamburger
from hamburger import HamburgerModel, SegmentedExample, collate, generate
from hamburger.cli import main
from hamburger.training.loss import hamburger_loss
from hamburger.training.train import TrainArgs, Trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

PROMPT = [5, 17, 33, 8, 60, 12, 9]


def make_data(path, n: int = 40, seed: int = 0):
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            prompt = [rng.randrange(5, 96) for _ in range(rng.randrange(2, 6))]
            steps = [rng.randint(1, 4) for _ in range(rng.randrange(2, 6))]
            ids = prompt + [rng.randrange(5, 30) for _ in range(sum(steps))]
            f.write(json.dumps({"id": f"ex{i}", "input_ids": ids, "prompt_len": len(prompt), "steps": steps}) + "\n")
    return path


def base_logits(model: HamburgerModel, ids: list[list[int]]) -> torch.Tensor:
    x = torch.tensor(ids)
    with torch.no_grad():
        return model.base(input_ids=x, attention_mask=torch.ones_like(x)).logits


def perturb_lora(model: HamburgerModel, std: float = 0.3) -> None:
    """As if trained: the LoRA's B moves off zero."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.base.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def test_attached_lora_is_the_base_until_trained_and_switches_off_exactly():
    model = hamburger("llama", k=4)
    ids = [PROMPT, [40, 41, 42, 43, 44, 45, 46]]
    plain = base_logits(model, ids)
    trust = generate(model, [PROMPT], max_new_tokens=12, confidence=0.3, return_logits=True)
    model.attach_lora(4)
    assert model.config.lora_rank == 4 and model.lora.on
    torch.testing.assert_close(base_logits(model, ids), plain, rtol=0, atol=0)  # B = 0: the base exactly
    again = generate(model, [PROMPT], max_new_tokens=12, confidence=0.3, return_logits=True)
    assert again.tokens == trust.tokens and again.steps == trust.steps
    perturb_lora(model)
    assert not torch.allclose(base_logits(model, ids), plain, atol=1e-3)  # on: the adapted base
    moved = generate(model, [PROMPT], max_new_tokens=12, confidence=0.3, return_logits=True)
    assert not torch.allclose(moved.logits[0][: len(trust.logits[0])], trust.logits[0][: len(moved.logits[0])])
    with model.base_lora(False):  # verify and compress mode: the untouched base, bit for bit
        torch.testing.assert_close(base_logits(model, ids), plain, rtol=0, atol=0)
    for mode, same in (("verify", True), ("compress", True), ("trust", False)):
        with model.base_lora_for(mode):
            assert torch.equal(base_logits(model, ids), plain) == same
    assert model.lora.on  # the state before comes back after the block
    with pytest.raises(Exception, match="already has a LoRA"):
        model.attach_lora(4)


def test_lora_per_row_switch_equals_the_whole_batch_switch():
    model = hamburger("llama", k=4)
    model.attach_lora(4)
    perturb_lora(model)
    ids = [PROMPT, [40, 41, 42, 43, 44, 45, 46]]
    on = base_logits(model, ids)
    with model.base_lora(False):
        off = base_logits(model, ids)
    with model.base_lora(torch.tensor([False, True])):
        mixed = base_logits(model, ids)
    torch.testing.assert_close(mixed[0], off[0])
    torch.testing.assert_close(mixed[1], on[1])
    assert model.lora.on


def test_lora_checkpoint_round_trip(tmp_path):
    model = hamburger("llama", k=4)
    model.attach_lora(4, alpha=8.0)
    perturb_lora(model)
    model.save_pretrained(tmp_path / "ckpt")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(".lora_B" in k for k in keys) and not any(k.endswith("q_proj.base_layer.weight") for k in keys)
    fresh = hamburger("llama", k=4)  # the same base weights (seeded), its own LoRA-free copy
    loaded = HamburgerModel.from_pretrained(tmp_path / "ckpt", base=fresh.base, tokenizer=fresh.tokenizer)
    assert loaded.config.lora_rank == 4 and loaded.config.lora_alpha == 8.0
    ids = [PROMPT]
    torch.testing.assert_close(base_logits(loaded, ids), base_logits(model, ids), rtol=0, atol=0)
    with loaded.base_lora(False), model.base_lora(False):
        torch.testing.assert_close(base_logits(loaded, ids), base_logits(model, ids), rtol=0, atol=0)


def lora_run(tmp_path, name: str, checkpoint_dir, max_steps: int = 4) -> Trainer:
    """`--base-training lora` on a checkpoint that has no LoRA."""
    model = HamburgerModel.from_pretrained(checkpoint_dir)
    assert not model.config.lora_rank
    args = TrainArgs(data=str(tmp_path / "data.jsonl"), out=str(tmp_path / name), base_training="lora", lora_rank=4,
                     batch_size=4, lr=3e-3, base_lr=3e-3, max_steps=max_steps, eval_every=2, save_every=2,
                     bf16=False, eval_fraction=0.1)
    (tmp_path / name).mkdir(exist_ok=True)
    return Trainer(model, args)


def all_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.hamburger.state_dict().items()}


def test_lora_on_a_checkpoint_trains_resumes_exactly_and_leaves_the_base(tmp_path, checkpoint):
    make_data(tmp_path / "data.jsonl")
    straight = lora_run(tmp_path, "straight", checkpoint)
    plain = base_logits(straight.hamburger, [PROMPT])
    straight.fit(progress=False)
    model = straight.hamburger.eval()
    assert model.config.lora_rank == 4
    assert all(p.abs().sum() > 0 for n, p in model.base.named_parameters() if "lora_B" in n)
    assert not torch.allclose(base_logits(model, [PROMPT]), plain, atol=1e-4)
    with model.base_lora(False):
        torch.testing.assert_close(base_logits(model, [PROMPT]), plain, rtol=0, atol=0)
    first = lora_run(tmp_path, "resumed", checkpoint)
    first.total_steps = 2
    first.fit(progress=False)
    second = lora_run(tmp_path, "resumed", checkpoint)
    assert second.resume() and second.step == 2
    second.fit(progress=False)
    want, got = all_weights(straight), all_weights(second)
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    shipped = HamburgerModel.from_pretrained(tmp_path / "straight" / "hamburger")
    torch.testing.assert_close(base_logits(shipped, [PROMPT]), base_logits(model, [PROMPT]))


def test_train_cli_base_training_lora_and_the_renamed_mode(tmp_path, checkpoint, capsys):
    make_data(tmp_path / "data.jsonl")
    common = ["train", "--data", str(tmp_path / "data.jsonl"), "--model", str(checkpoint), "--max-steps", "2",
              "--batch-size", "4", "--no-bf16", "--eval-every", "2", "--save-every", "2"]
    with pytest.raises(SystemExit):
        main([*common, "--out", str(tmp_path / "old"), "--mode", "lora"])
    assert "--mode was renamed: --base-training" in capsys.readouterr().err
    assert main([*common, "--out", str(tmp_path / "run"), "--base-training", "lora", "--lora-rank", "2"]) == 0
    assert "a LoRA of rank 2" in capsys.readouterr().err
    assert HamburgerModel.from_pretrained(tmp_path / "run" / "hamburger").config.lora_rank == 2


def test_teacher_forced_logits_with_micro_context_equal_forced_step_generation():
    """A micro-step decoder that reads context trains as trust mode decodes it: the teacher-forced logits equal
    step-by-step generation with the same segmentation (smashed slots in its context)."""
    model = hamburger("llama", k=4, micro_context=3)
    with torch.no_grad():
        model.micro.context_gate.normal_(std=1.0)  # open gates: the context matters
        torch.nn.init.normal_(model.embedder.o_proj.weight, std=0.2)
    forced = [2, 4, 1, 3, 3, 4, 2]
    out = generate(model, [PROMPT], max_new_tokens=19, forced_steps=[forced], return_logits=True,
                   eos_token_ids=set())
    assert out.steps[0] == forced
    batch = collate([SegmentedExample(PROMPT + out.tokens[0], len(PROMPT), forced)], 4, PAD)
    with torch.no_grad():
        train = hamburger_loss(model, batch)
        model.micro.set_context(0)
        blind = hamburger_loss(model, batch)
    torch.testing.assert_close(train.logits, out.logits[0], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(blind.logits, train.logits, atol=1e-3)  # the context was read


def test_a_checkpoint_whose_micro_decoder_reads_context_trains(tmp_path, checkpoint):
    make_data(tmp_path / "data.jsonl")
    model = HamburgerModel.from_pretrained(checkpoint)
    model.config.micro_context = 4
    model.micro.set_context(4)
    model.save_pretrained(tmp_path / "ctx")
    trainer = lora_run(tmp_path, "ctx-run", tmp_path / "ctx", max_steps=2)
    gate = trainer.hamburger.micro.context_gate.detach().clone()
    trainer.fit(progress=False)
    assert not torch.equal(trainer.hamburger.micro.context_gate, gate)  # the gates learn with the rest


def test_train_max_minutes_stops_early_evaluates_saves_and_resumes(tmp_path, checkpoint, capsys):
    make_data(tmp_path / "data.jsonl")
    run = tmp_path / "run"
    common = ["train", "--data", str(tmp_path / "data.jsonl"), "--model", str(checkpoint), "--max-steps", "50",
              "--batch-size", "4", "--no-bf16", "--eval-every", "40", "--save-every", "40", "--out", str(run)]
    assert main([*common, "--max-minutes", "0.000001"]) == 0  # out of time after the first step
    assert "stopped at step 1/50: --max-minutes" in capsys.readouterr().err
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r] == [1]  # evaluated at the stop, not only every 40 steps
    assert json.loads((run / "state" / "trainer.json").read_text())["step"] == 1
    assert HamburgerModel.from_pretrained(run / "hamburger")
    assert main([*common, "--resume", "--max-minutes", "0.000001"]) == 0
    assert json.loads((run / "state" / "trainer.json").read_text())["step"] == 2
