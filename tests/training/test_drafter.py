"""`hamburger train-drafter`: dense KL distillation of the micro-step decoder + stop head, on tiny random models."""

from __future__ import annotations

import contextlib
import io
import json
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import VOCAB, hamburger, randomize_new_modules
from hamburger import HamburgerConfig, HamburgerModel, load_base
from hamburger.cli import main
from hamburger.training import drafter
from hamburger.training.drafter import (
    DrafterArgs,
    DrafterTrainer,
    draft_batch,
    draft_forward,
    draft_loss,
    drafted,
    evaluate_drafter,
)

K = 4


def write_data(path, n: int = 16, seed: int = 0, short: int = 0) -> str:
    """Segmented JSONL of random examples; the first `short` have a response too short to draft from."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [rng.randrange(5, VOCAB) for _ in range(rng.randrange(2, 6))]
        response = [rng.randrange(5, VOCAB) for _ in range(1 if i < short else rng.randrange(6, 14))]
        rows.append({"id": f"ex{i}", "input_ids": prompt + response, "prompt_len": len(prompt),
                     "steps": [1] * len(response)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def ckpt(tmp_path, tiny_model_dir):
    """A small HAMburger checkpoint (one micro layer, slot adapters) on the tiny local base."""
    base, tok = load_base(str(tiny_model_dir))
    cfg = HamburgerConfig(max_step_tokens=K, micro_layers=1, slot_adapter_rank=2)
    randomize_new_modules(HamburgerModel.wrap(base, tok, cfg)).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def read_log(run) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def argv(ckpt, data, out, *extra) -> list[str]:
    return ["train-drafter", "--model", str(ckpt), "--data", data, "--out", str(out), "--positions", "6",
            "--eval-fraction", "0.25", "--lr", "3e-3", "--warmup", "1", *extra]


def quiet(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


# --- the batch and the forward ----------------------------------------------------------------------------------


def test_draft_batch_targets_are_the_base_at_every_position_and_the_forward_is_the_engines():
    model = hamburger(k=K, micro_layers=1)
    ids, p = [7, 30, 51, 12, 9, 88, 40, 23, 64, 17, 5, 70], 3
    b = draft_batch(model, ids, p, None)
    s = torch.arange(p - 1, len(ids) - K)  # last prompt token .. T-K-1
    assert len(b.inputs) == len(s)
    with torch.no_grad():
        out = model.base(torch.tensor([ids]), output_hidden_states=True)
    logits = out.logits[0]
    for n, pos in enumerate(s.tolist()):
        assert b.inputs[n].tolist() == ids[pos + 1 : pos + K]  # micro inputs: tokens s+1 .. s+K-1
        rows = logits[pos + 1 : pos + K]  # the base's predictions of tokens s+2 .. s+K
        assert b.greedy[n].tolist() == rows.argmax(-1).tolist()
        torch.testing.assert_close(b.teacher[n], F.log_softmax(rows.float(), -1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b.h0, out.hidden_states[-1][0, s], atol=1e-4, rtol=1e-4)

    # The micro logits are those the engine drafts with: normed features at s, then the embeddings of tokens.
    micro_logits, stop_logits = draft_forward(model, b)
    assert micro_logits.shape == (len(s), K - 1, VOCAB) and stop_logits.shape == (len(s), K - 1)
    with torch.no_grad():
        hidden = model.base_forward(model.embed(torch.tensor([ids])), torch.ones(1, len(ids), dtype=torch.long),
                                    torch.arange(len(ids))[None])
        x = torch.cat([model.micro.features(hidden, (torch.zeros_like(s), s)), model.embed(b.inputs)], 1)
        states = model.micro(x)[:, model.micro.num_features :]
        torch.testing.assert_close(micro_logits, model.lm_head(states).float(), atol=1e-4, rtol=1e-4)
        expected_stop = model.stop_head(torch.cat([b.h0[:, None], states[:, :-1]], 1))  # states of tokens 0..K-2
        torch.testing.assert_close(stop_logits, expected_stop, atol=1e-4, rtol=1e-4)

    sampled = draft_batch(model, ids, p, 3, torch.Generator().manual_seed(0))
    assert len(sampled.inputs) == 3 and all(row.tolist() in b.inputs.tolist() for row in sampled.inputs)
    # Nothing to draft from (and no error): a response shorter than K-1, a prompt cut by max_len.
    assert draft_batch(model, ids[: p + 1], p, None) is None
    assert draft_batch(model, ids[: p + K - 1], p, None) is None
    assert draft_batch(model, ids[:2], p, None) is None
    assert draft_batch(model, ids[: p + K], p, None) is not None


def test_a_micro_vocab_shortlist_changes_only_the_indexing():
    model = hamburger(k=K, micro_layers=1)
    examples = [type("Ex", (), {"input_ids": ids, "prompt_len": 3})()
                for ids in ([7, 30, 51, 12, 9, 88, 40, 23, 64, 17], [11, 5, 60, 61, 62, 33, 8, 90, 44])]
    full = evaluate_drafter(model, examples, 512)
    b = draft_batch(model, examples[0].input_ids, 3, None)
    loss = draft_loss(model, b, 0.5)[0]

    model.micro_vocab = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))  # every token, reordered
    assert evaluate_drafter(model, examples, 512) == pytest.approx(full, abs=1e-5)
    torch.testing.assert_close(draft_loss(model, draft_batch(model, examples[0].input_ids, 3, None), 0.5)[0], loss)

    model.micro_vocab = torch.arange(5, 50)  # a strict shortlist: drafts and teacher live on it
    b = draft_batch(model, examples[0].input_ids, 3, None)
    assert b.teacher.shape[-1] == 45
    torch.testing.assert_close(b.teacher.exp().sum(-1), torch.ones(b.teacher.shape[:2]))
    ids = drafted(model, draft_forward(model, b)[0])
    assert ((ids >= 5) & (ids < 50)).all()


def test_evaluate_drafter_with_an_oracle_drafter(monkeypatch):
    """Drafts made equal to the base's greedy: accuracy 1 and K tokens per base forward; ECE from the stop head."""
    model = hamburger(k=K, micro_layers=1)
    examples = [type("Ex", (), {"input_ids": [7, 30, 51, 12, 9, 88, 40, 23, 64, 17, 5, 70], "prompt_len": 3})()]
    real = drafter.draft_forward

    def oracle(wrong_at: int | None, stop: str):
        def forward(model, b):
            logits, _ = real(model, b)
            target = b.greedy.clone()
            if wrong_at is not None:
                target[:, wrong_at] = (target[:, wrong_at] + 1) % VOCAB
            right = target == b.greedy
            stop_logits = torch.where(right, -30.0, 30.0) if stop == "calibrated" else torch.zeros(right.shape)
            return F.one_hot(target, logits.shape[-1]).float() * 50, stop_logits
        return forward

    monkeypatch.setattr(drafter, "draft_forward", oracle(None, "calibrated"))
    row = evaluate_drafter(model, examples, 512)
    assert row["positions"] == 12 - K - 2
    assert [row[f"micro_acc@{i}"] for i in range(1, K)] == [1.0] * (K - 1)
    assert row["tokens_per_forward"] == pytest.approx(K)
    assert row["stop_ece"] == pytest.approx(0.0, abs=1e-6)

    monkeypatch.setattr(drafter, "draft_forward", oracle(1, "constant"))  # micro token 2 always wrong
    row = evaluate_drafter(model, examples, 512)
    assert [row[f"micro_acc@{i}"] for i in range(1, K)] == [1.0, 0.0, 1.0]
    assert row["tokens_per_forward"] == pytest.approx(2.0)  # the chain stops at the first wrong draft
    assert row["stop_ece"] == pytest.approx(abs(0.5 - 2 / 3), abs=1e-6)  # P = 0.5 everywhere, right 2/3 of the time


# --- training -----------------------------------------------------------------------------------------------------


def test_kl_distillation_learns_and_leaves_the_rest_alone(tmp_path):
    model = hamburger(k=K, micro_layers=1, slot_adapter_rank=2)
    frozen = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith(("micro.", "stop_head."))}
    args = DrafterArgs(data=write_data(tmp_path / "data.jsonl"), out=str(tmp_path / "run"), max_steps=40,
                       positions=16, lr=1e-2, warmup=1, eval_fraction=0.25, eval_every=1000, save_every=1000,
                       bf16=False)
    trainer = DrafterTrainer(model, args)
    assert len(trainer.train) == 13 and len(trainer.held) == 3
    fixed = draft_batch(model, trainer.train[0].input_ids, trainer.train[0].prompt_len, None)
    kl0 = draft_loss(model, fixed, 0.5)[1]["kl"]
    before = evaluate_drafter(model, trainer.train, 512)
    (tmp_path / "run").mkdir()
    quiet(trainer.fit)
    after = evaluate_drafter(model, trainer.train, 512)
    assert after["micro_acc@1"] > before["micro_acc@1"] + 0.2  # 0.03 -> 0.4 on this seed
    assert after["tokens_per_forward"] > before["tokens_per_forward"] + 0.2
    assert after["stop_ece"] < before["stop_ece"]
    assert draft_loss(model, fixed, 0.5)[1]["kl"] < 0.7 * kl0
    for key, value in model.state_dict().items():  # base, embedder and slot adapters: bit for bit
        if key in frozen:
            assert torch.equal(value, frozen[key]), key


def test_train_drafter_command(tmp_path, ckpt, capsys):
    data = write_data(tmp_path / "data.jsonl", short=2)  # two examples too short to draft from: skipped
    out = tmp_path / "run"
    assert main(argv(ckpt, data, out, "--max-steps", "4", "--eval-every", "2")) == 0
    rows = read_log(out)
    assert [r["step"] for r in rows] == [0, 2, 4]
    for r in rows:
        assert {f"micro_acc@{i}" for i in range(1, K)} | {"tokens_per_forward", "stop_ece", "positions"} <= r.keys()
        assert 1.0 <= r["tokens_per_forward"] <= K and 0.0 <= r["stop_ece"] <= 1.0
    final = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert final == {"final": {k: v for k, v in rows[-1].items() if k not in ("step", "examples_seen")},
                     "checkpoint": str(out / "hamburger")}

    # The state holds only what trains; the checkpoint holds no base and loads on the unchanged base.
    assert {k.split(".")[0] for k in load_file(out / "state" / "trained.safetensors")} == {"micro", "stop_head"}
    assert not any(k.startswith("base.") for k in load_file(out / "hamburger" / "model.safetensors"))
    old = HamburgerModel.from_pretrained(ckpt).state_dict()
    new = HamburgerModel.from_pretrained(out / "hamburger").state_dict()
    assert old.keys() == new.keys() and any(k.startswith("slot_adapters.") for k in old)
    for key in old:
        if key.startswith(("micro.", "stop_head.")):
            assert not torch.equal(old[key], new[key]), f"{key} did not train"
        else:  # base, embedder, slot adapters
            assert torch.equal(old[key], new[key]), f"{key} changed"


def test_train_drafter_with_a_draft_stop_head_leaves_trust_mode_its_own(tmp_path, ckpt, capsys):
    """`--draft-stop-head`: the micro-step decoder and a new draft stop head train; trust mode's stop head stays
    exactly as it was, so one checkpoint serves both modes. Resuming without the flag goes on with the same heads."""
    data = write_data(tmp_path / "data.jsonl")
    out = tmp_path / "run"
    assert main(argv(ckpt, data, out, "--max-steps", "2", "--eval-every", "2", "--draft-stop-head")) == 0
    assert "draft stop head" in capsys.readouterr().err
    assert {k.split(".")[0] for k in load_file(out / "state" / "trained.safetensors")} == {"micro", "draft_stop_head"}
    old = HamburgerModel.from_pretrained(ckpt)
    new = HamburgerModel.from_pretrained(out / "hamburger")
    assert new.config.draft_stop_head and old.draft_stop_head is None
    for key, value in old.stop_head.state_dict().items():
        assert torch.equal(value, new.stop_head.state_dict()[key])
        assert not torch.equal(value, new.draft_stop_head.state_dict()[key]), key
    assert main(argv(ckpt, data, out, "--max-steps", "3", "--eval-every", "3", "--resume")) == 0
    assert [r["step"] for r in read_log(out)] == [0, 2, 3]
    again = HamburgerModel.from_pretrained(out / "hamburger")
    assert torch.equal(again.stop_head.net[0].weight, old.stop_head.net[0].weight)
    assert not torch.equal(again.draft_stop_head.net[0].weight, new.draft_stop_head.net[0].weight)
    # A checkpoint that has a draft stop head trains that one, with or without the flag.
    out2 = tmp_path / "run2"
    assert main(argv(out / "hamburger", data, out2, "--max-steps", "1", "--eval-every", "1")) == 0
    assert {k.split(".")[0] for k in load_file(out2 / "state" / "trained.safetensors")} == {"micro", "draft_stop_head"}


def test_train_drafter_reports_to_a_tracker(tmp_path, ckpt):
    """`--report-to tensorboard`: held-out rows go to TensorBoard as they go to log.jsonl, training losses every step;
    an unknown tracker is refused before a model is loaded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = write_data(tmp_path / "data.jsonl")
    out = tmp_path / "run"
    assert main(argv(ckpt, data, out, "--max-steps", "4", "--eval-every", "2", "--report-to", "tensorboard")) == 0
    events = EventAccumulator(str(next((out / "tracker").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    acc1 = [(e.step, e.value) for e in events.Scalars("eval/micro_acc@1")]
    assert acc1 == [(r["step"], pytest.approx(r["micro_acc@1"], abs=1e-6)) for r in read_log(out)]
    assert [e.step for e in events.Scalars("train/kl")] == [1, 2, 3, 4]
    assert main(argv(ckpt, data, tmp_path / "bad", "--report-to", "tensorbored")) == 2
    assert not (tmp_path / "bad").exists()


def test_distilled_data_trains_as_its_segmented_form(tmp_path, ckpt):
    """`--data` may be `hamburger distill`'s JSONL: the drafter trains exactly as on the same tokens segmented."""
    from hamburger.model.base import encode_chat

    tok = HamburgerModel.from_pretrained(ckpt).tokenizer
    rng = random.Random(3)
    distilled, segmented = [], []
    for i in range(12):
        messages = [{"role": "user", "content": " ".join(f"w{rng.randrange(5, 40)}" for _ in range(3))}]
        reply = [rng.randrange(5, VOCAB) for _ in range(rng.randrange(6, 12))]
        distilled.append({"id": f"d{i}", "messages": messages + [{"role": "assistant", "content": "x"}],
                          "response_ids": reply})
        prompt = encode_chat(tok, messages)
        segmented.append({"id": f"d{i}", "input_ids": prompt + reply, "prompt_len": len(prompt),
                          "steps": [2] * (len(reply) // 2) + [1] * (len(reply) % 2)})  # steps the drafter ignores
    runs = {}
    for name, rows in (("distilled", distilled), ("segmented", segmented)):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert main(argv(ckpt, str(data), tmp_path / name, "--max-steps", "2", "--eval-every", "2")) == 0
        runs[name] = (read_log(tmp_path / name), load_file(tmp_path / name / "state" / "trained.safetensors"))
    assert runs["distilled"][0] == runs["segmented"][0]
    assert all(torch.equal(v, runs["segmented"][1][k]) for k, v in runs["distilled"][1].items())


def test_resume_is_exact(tmp_path, ckpt, monkeypatch, capsys):
    data = write_data(tmp_path / "data.jsonl")
    common = ("--max-steps", "6", "--save-every", "3", "--eval-every", "3")
    assert main(argv(ckpt, data, tmp_path / "straight", *common)) == 0

    real_save = DrafterTrainer.save

    def save_then_die(self):
        real_save(self)
        raise KeyboardInterrupt  # killed right after the checkpoint at step 3

    monkeypatch.setattr(DrafterTrainer, "save", save_then_die)
    assert main(argv(ckpt, data, tmp_path / "resumed", *common)) == 130
    monkeypatch.setattr(DrafterTrainer, "save", real_save)
    assert json.loads((tmp_path / "resumed" / "state" / "trainer.json").read_text())["step"] == 3
    capsys.readouterr()
    assert main(argv(ckpt, data, tmp_path / "resumed", *common, "--resume")) == 0
    assert "resumed at step 3" in capsys.readouterr().err

    for name in ("state/trained.safetensors", "hamburger/model.safetensors"):
        a, b = load_file(tmp_path / "straight" / name), load_file(tmp_path / "resumed" / name)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-7, msg=f"{name}: {key}")
    straight, resumed = read_log(tmp_path / "straight"), read_log(tmp_path / "resumed")
    assert [r["step"] for r in straight] == [0, 3, 6] and [r["step"] for r in resumed] == [0, 3, 6]
    assert resumed[-1] == pytest.approx(straight[-1], abs=1e-6)


# --- errors -------------------------------------------------------------------------------------------------------


def one_line_error(capsys, *needles: str) -> None:
    err = capsys.readouterr().err  # may also hold the base loader's progress bars
    errors = [line for line in err.splitlines() if line.startswith("hamburger: error:")]
    assert "Traceback" not in err and len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    for needle in needles:
        assert needle in errors[0], err


def test_bad_inputs_are_one_line_errors(tmp_path, ckpt, tiny_model_dir, capsys):
    data = write_data(tmp_path / "data.jsonl")
    out = tmp_path / "run"
    run = ("--max-steps", "1")

    assert main(argv(ckpt, str(tmp_path / "missing.jsonl"), out, *run)) == 2
    one_line_error(capsys, "does not exist")
    (tmp_path / "bad.jsonl").write_text('{"input_ids": [5, 6, 7]}\n')
    assert main(argv(ckpt, str(tmp_path / "bad.jsonl"), out, *run)) == 2
    one_line_error(capsys, "bad.jsonl:1", "not a segmented or distilled example")
    assert main(argv(tiny_model_dir, data, out, *run)) == 2  # a base model, not a checkpoint
    one_line_error(capsys, "not a HAMburger checkpoint")
    assert not out.exists()
    assert main(argv(ckpt, data, out, *run, "--eval-fraction", "1.0")) == 2  # everything held out
    one_line_error(capsys, "no training examples")
    assert main(argv(ckpt, data, out, *run, "--micro-context", "-3")) == 2
    one_line_error(capsys, "--micro-context must be")
    assert main(argv(ckpt, data, out, *run, "--micro-layers", "-1")) == 2
    one_line_error(capsys, "--micro-layers must be")
    assert main(argv(ckpt, data, out, *run, "--micro-layers", "9")) == 2
    one_line_error(capsys, "can keep fewer")

    assert main(argv(ckpt, data, out, *run)) == 0
    capsys.readouterr()
    assert main(argv(ckpt, data, out, *run)) == 2  # a used run folder needs --resume
    one_line_error(capsys, "is not empty", "--resume")

    fresh = tmp_path / "fresh"  # --resume with no state yet starts the run
    assert main(argv(ckpt, data, fresh, *run, "--resume")) == 0
    assert "resumed" not in capsys.readouterr().err
    assert [r["step"] for r in read_log(fresh)] == [0, 1]


# --- the micro-step decoder with context (EAGLE-style: it also attends to the base's keys and values) ------------


@pytest.mark.parametrize("window", [3, 100])
def test_micro_context_rows_batched_as_one_sequence_equal_each_row_alone(arch, window):
    model = hamburger(arch, k=K, micro_layers=2, micro_context=window)
    micro = model.micro
    assert micro.context_layers == [2, 3]  # the top layers of the 4-layer base, which it was copied from
    ids, p = [7, 30, 51, 12, 9, 88, 40, 23, 64, 17, 5, 70, 33, 8], 3
    b = draft_batch(model, ids, p, None)
    m = micro.num_features
    norms = torch.stack([norm(b.feats[:, j]) for j, norm in enumerate(micro.feature_norms)], 1)
    x = torch.cat([norms, model.embed(b.inputs)], 1)
    with torch.no_grad():
        batched = drafter.micro_states(model, x, b, chunk=4)  # rows in chunks: the chunking is covered too
        q = x.shape[1]
        for n, s in enumerate(b.s.tolist()):
            lo = max(0, s - window + 1)
            keys = [k[:, :, lo : s + 1] for k in b.ctx_k]
            values = [v[:, :, lo : s + 1] for v in b.ctx_v]
            own = torch.ones(q, q).tril().bool()
            mask = torch.cat([torch.ones(q, s + 1 - lo, dtype=torch.bool), own], 1)[None, None]
            alone = micro.forward_context(x[n : n + 1], torch.arange(s + 1, s + 1 + q)[None], keys, values, mask)
            torch.testing.assert_close(batched[n], alone[0], atol=1e-5, rtol=1e-5)
        # The context is read: other keys of the base change the drafts (and without any, it is the plain decoder).
        b.ctx_v = [v.flip(2) for v in b.ctx_v]
        assert not torch.allclose(drafter.micro_states(model, x, b)[:, m:], batched[:, m:], atol=1e-3)
        empty = [k[:, :, :0].expand(len(x), -1, -1, -1) for k in b.ctx_k]
        plain = micro.forward_context(x, torch.arange(q)[None].expand(len(x), -1), empty, empty,
                                      torch.ones(q, q).tril().bool()[None, None])
        torch.testing.assert_close(plain, micro(x), atol=1e-5, rtol=1e-5)
        # A closed gate (as a new one starts) reads nothing: the features-only decoder, at any positions.
        micro.context_gate.zero_()
        torch.testing.assert_close(drafter.micro_states(model, x, b), micro(x), atol=1e-5, rtol=1e-5)


def test_micro_context_trains_and_is_saved(tmp_path, ckpt):
    data = write_data(tmp_path / "data.jsonl")
    out = tmp_path / "run"
    quiet(main, argv(ckpt, data, out, "--max-steps", "4", "--micro-context", "8"))
    cfg = json.loads((out / "hamburger" / "config.json").read_text())["hamburger"]
    assert cfg["micro_context"] == 8
    trained = HamburgerModel.from_pretrained(out / "hamburger").micro
    assert trained.context == 8 and trained.context_gate.abs().min() > 0  # the gates opened, and were saved
    # Trained on without context (--micro-context 0), the checkpoint has no gates and loads as features-only.
    again = tmp_path / "again"
    quiet(main, argv(out / "hamburger", data, again, "--max-steps", "1", "--micro-context", "0"))
    plain = HamburgerModel.from_pretrained(again / "hamburger").micro
    assert plain.context == 0 and plain.context_gate is None


def test_a_drafter_can_keep_fewer_micro_layers(tmp_path, tiny_model_dir):
    """--micro-layers 2: a micro-step decoder of 3 layers keeps its last two, each with the base layer it reads
    as context and its gates; the checkpoint loads as that decoder, whose engine equals the reference path
    (trust) and whose verify mode is still exactly the base."""
    from conftest import base_greedy  # noqa: PLC0415
    from hamburger import generate  # noqa: PLC0415
    from hamburger.inference.engine import Engine  # noqa: PLC0415

    base, tok = load_base(str(tiny_model_dir))
    cfg = HamburgerConfig(max_step_tokens=K, micro_layers=3, init_micro_from_top=True)
    ckpt = tmp_path / "ckpt"
    randomize_new_modules(HamburgerModel.wrap(base, tok, cfg)).save_pretrained(ckpt)
    full = HamburgerModel.from_pretrained(ckpt).micro
    assert len(full.layers) == 3
    data = write_data(tmp_path / "data.jsonl")
    out = tmp_path / "run"
    quiet(main, argv(ckpt, data, out, "--max-steps", "2", "--micro-layers", "2", "--micro-context", "8"))
    cfg = json.loads((out / "hamburger" / "config.json").read_text())["hamburger"]
    assert cfg["micro_layers"] == 2 and cfg["micro_context"] == 8
    model = HamburgerModel.from_pretrained(out / "hamburger").eval()
    micro = model.micro
    assert len(micro.layers) == 2 and micro.context_layers == full.context_layers[-2:]
    assert tuple(micro.context_gate.shape) == (2, full.layers[0].self_attn.config.num_attention_heads)
    assert [layer.self_attn.layer_idx for layer in micro.layers] == [0, 1]
    prompts = [[5, 17, 33, 8, 60, 12, 9], [40, 41]]
    out_verify = Engine(model).generate(prompts, max_new_tokens=12, mode="verify", confidence=0.1)
    assert out_verify.tokens == [base_greedy(model, p, 12) for p in prompts]

    plain = HamburgerModel.from_pretrained(ckpt).eval()  # without context: the reference path runs it too
    plain.micro.keep_top(2)
    with torch.no_grad():
        for layer in plain.micro.layers:  # trained-looking layers, so the two paths have something to disagree on
            for p in layer.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    ref = generate(plain, prompts, max_new_tokens=12, confidence=0.3)
    fast = Engine(plain).generate(prompts, max_new_tokens=12, confidence=0.3)
    assert fast.tokens == ref.tokens and fast.steps == ref.steps
    assert max(max(s) for s in ref.steps) > 1  # micro-steps were taken
