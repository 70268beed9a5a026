"""The teacher cache: `segment --teacher-top-k` stores the base's top-k, `train --kd-weight` reads it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import PAD, hamburger, tiny_base, tiny_tokenizer
from hamburger import (
    HamburgerConfig,
    HamburgerError,
    HamburgerModel,
    SegmentedExample,
    collate,
    load_base,
)
from hamburger.cli import main
from hamburger.training import loss
from hamburger.training.loss import hamburger_loss
from hamburger.training.teacher import read_teacher, sparse_kl, teacher_dir, top_k
from hamburger.training.train import TrainArgs, Trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

EXAMPLES = [
    SegmentedExample([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], 4, [2, 1, 3]),
    SegmentedExample([20, 21, 22, 23, 24, 25, 26], 2, [4, 1]),
]


def test_sparse_kl_is_the_full_kl_with_the_whole_vocabulary_and_a_lower_bound_below():
    torch.manual_seed(0)
    student, teacher = torch.randn(6, 50) * 3, torch.randn(6, 50) * 3
    full = torch.nn.functional.kl_div(torch.log_softmax(student, -1), torch.log_softmax(teacher, -1),
                                      log_target=True, reduction="none").sum(-1)
    ids, logp = top_k(teacher, 50)
    torch.testing.assert_close(sparse_kl(student, ids, logp), full, atol=2e-3, rtol=2e-3)  # float16 log-probs
    for k in (1, 5, 20):
        ids, logp = top_k(teacher, k)
        coarse = sparse_kl(student, ids, logp)
        assert (coarse >= -1e-4).all() and (coarse <= full + 2e-3).all(), k
    ids, logp = top_k(teacher, 5)
    assert sparse_kl(teacher, ids, logp).abs().max() < 2e-3  # the teacher itself: no divergence


def with_teacher(model, examples, k):
    """The examples with their teacher: the base's top-k where it predicts each response token."""
    out = []
    for ex in examples:
        with torch.no_grad():
            logits = model.base(torch.tensor([ex.input_ids])).logits[0, ex.prompt_len - 1 : len(ex.input_ids) - 1]
        out.append(SegmentedExample(ex.input_ids, ex.prompt_len, ex.steps, *top_k(logits, k)))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_kd_from_the_cache_equals_kd_from_the_base_and_skips_its_forward(arch, monkeypatch):
    model = hamburger(arch, k=4)
    vocab = model.base.config.vocab_size
    live = hamburger_loss(model, collate(EXAMPLES, 4, PAD), kd_weight=0.7)
    cached = collate(with_teacher(model, EXAMPLES, vocab), 4, PAD)
    calls = []
    monkeypatch.setattr(loss, "teacher_states", lambda model, batch: calls.append(1))
    out = hamburger_loss(model, cached, kd_weight=0.7)
    assert not calls and out.state_loss is None  # KD alone from the cache: no second base forward
    torch.testing.assert_close(out.kd_loss, live.kd_loss, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out.loss, out.ce_loss + 0.5 * out.stop_loss + 0.7 * out.kd_loss)
    out.loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.micro.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as training and held-out evaluation run it
        half = hamburger_loss(model, collate(with_teacher(model, EXAMPLES, vocab), 4, PAD), kd_weight=0.7)
    torch.testing.assert_close(half.kd_loss, out.kd_loss, atol=0.1, rtol=0.1)
    small = hamburger_loss(model, collate(with_teacher(model, EXAMPLES, 3), 4, PAD), kd_weight=0.7)
    assert 0 <= small.kd_loss <= out.kd_loss + 1e-3  # top-3 plus the rest: a lower bound


def test_a_teacher_that_does_not_fit_the_example_is_refused():
    ex = SegmentedExample([5, 6, 7, 8, 9], 2, [2, 1], torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4))
    with pytest.raises(HamburgerError, match="other data"):
        collate([ex], 4, PAD)
    with pytest.raises(HamburgerError, match="mixes"):
        collate([EXAMPLES[0], with_teacher(hamburger("llama", k=4), EXAMPLES[1:], 4)[0]], 4, PAD)


def chats(path, n=30):
    rows = [{"id": f"c{i}", "prompt": f"w{i} w{i + 1}", "response": f"w{i + 2} w{i + 3} w{i + 4} w{i + 5}"}
            for i in range(5, 5 + n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_segment_caches_the_base_top_k_and_train_reads_it(tmp_path, tiny_model_dir, capsys):
    seg = tmp_path / "seg.jsonl"
    args = ["segment", "--data", str(chats(tmp_path / "chats.jsonl")), "--out", str(seg), "--model",
            str(tiny_model_dir), "--teacher-top-k", "8", "--batch-size", "5", "--abs-threshold", "1.0"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "teacher: top-8" in err and "segment 30/30 examples" in err  # plain progress when stderr is no terminal
    cache, meta = read_teacher(teacher_dir(seg))
    base, _ = load_base(str(tiny_model_dir))
    examples = [json.loads(line) for line in seg.read_text().splitlines()]
    assert meta["top_k"] == "8" and set(cache) == {ex["id"] for ex in examples} and len(examples) == 30
    for ex in examples:  # the very top-k of the base, where it predicts each response token
        ids, logp = cache[ex["id"]]
        with torch.no_grad():
            logits = base(torch.tensor([ex["input_ids"]])).logits[0, ex["prompt_len"] - 1 : -1]
        want_ids, want_logp = top_k(logits, 8)
        assert ids.dtype == torch.int32 and logp.dtype == torch.float16
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(logp, want_logp, atol=2e-3, rtol=1e-3)
    assert json.loads((tmp_path / "seg.jsonl.summary.json").read_text())["teacher_top_k"] == 8

    targs = dict(data=str(seg), batch_size=4, lr=3e-3, eval_every=2, save_every=2, bf16=False, eval_fraction=0.25,
                 max_steps=2, kd_weight=1.0)
    model = HamburgerModel.wrap(*load_base(str(tiny_model_dir)), HamburgerConfig(max_step_tokens=4, micro_layers=2))
    (tmp_path / "run").mkdir()
    run = Trainer(model, TrainArgs(out=str(tmp_path / "run"), **targs))
    assert run.teacher_top_k == 8 and run.train[0].teacher_ids.shape[1] == 8
    assert "kd_loss" in run.fit(progress=False)
    model = HamburgerModel.wrap(*load_base(str(tiny_model_dir)), HamburgerConfig(max_step_tokens=4, micro_layers=2))
    off = Trainer(model, TrainArgs(out=str(tmp_path / "run"), teacher_cache=False, **targs))
    assert off.teacher_top_k == 0 and off.train[0].teacher_ids is None

    # a cache from another base is refused, not used
    model = HamburgerModel.wrap(tiny_base("llama", seed=1), tiny_tokenizer(), HamburgerConfig(max_step_tokens=4))
    with pytest.raises(HamburgerError, match="another base"):
        Trainer(model, TrainArgs(out=str(tmp_path / "run"), **targs))

    fewer = tmp_path / "fewer.jsonl"  # data the cache was not made for is refused
    shutil.copytree(teacher_dir(seg), teacher_dir(fewer))
    fewer.write_text(seg.read_text().replace('"id": "c5"', '"id": "new"'))
    model = HamburgerModel.wrap(*load_base(str(tiny_model_dir)), HamburgerConfig(max_step_tokens=4, micro_layers=2))
    with pytest.raises(HamburgerError, match="no teacher for 1 of the 30"):
        Trainer(model, TrainArgs(out=str(tmp_path / "run"), **{**targs, "data": str(fewer)}))

    assert main(args) == 2  # no silent overwrite of the data or its cache
    plain = [a for a in args if a not in ("--teacher-top-k", "8")] + ["--force"]
    assert main(plain) == 0  # replaced without a cache: the stale one goes too
    assert not teacher_dir(seg).exists()
    assert main(["segment", "--data", str(chats(tmp_path / "twice.jsonl")).replace("twice", "twice"), "--out",
                 str(tmp_path / "t.jsonl"), "--model", str(tiny_model_dir), "--teacher-top-k", "-1"]) == 2
