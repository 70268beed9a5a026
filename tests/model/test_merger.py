"""The KV merger ('process, then compress'): parallel form = stepwise form = the plain base where it must be."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import VOCAB, random_merger, tiny_base
from hamburger.cli import main
from hamburger.model.base import fingerprint
from hamburger.model.merger import WEIGHTS, KVMerger, Layout, parallel_forward, stepwise_forward
from hamburger.training.train_merger import MergerArgs, MergerTrainer, evaluate_merger, random_steps


def examples(n: int, seed: int = 0, max_response: int = 20) -> list[tuple[list[int], int, list[int]]]:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p, r = rng.randint(1, 6), rng.randint(1, max_response)
        out.append(([rng.randrange(5, VOCAB) for _ in range(p + r)], p, random_steps(r, 4, gen)))
    return out


def base_logits(base, ids: list[int], p: int) -> torch.Tensor:
    with torch.no_grad():
        return base(torch.tensor([ids])).logits[0, p - 1 : len(ids) - 1]


def test_merge_of_one_token_is_that_token():
    merger = random_merger(tiny_base(), gates=False)
    k, v = torch.randn(3, 2, 4, 16), torch.randn(3, 2, 4, 16)
    ones = torch.ones(3, dtype=torch.long)
    mk, mv = merger.merge(1, k, v, ones)
    assert torch.equal(mk, k[:, :, :1]) and torch.equal(mv, v[:, :, :1])
    assert torch.allclose(merger.bias(1, ones), merger.c[1].expand(3, -1))  # a * log 1 + c


def test_untrained_merge_is_the_mean_of_the_steps_own_tokens():
    merger = KVMerger.for_base(tiny_base().config, 4)
    k, v = torch.randn(2, 5, 2, 4, 16), torch.randn(2, 5, 2, 4, 16)
    lengths = torch.randint(1, 5, (2, 5))
    mk, mv = merger.merge(0, k, v, lengths)
    assert mk.shape == (2, 5, 2, 1, 16)
    for b in range(2):
        for s in range(5):
            n = int(lengths[b, s])
            assert torch.allclose(mk[b, s, :, 0], k[b, s, :, :n].mean(1), atol=1e-6)
            assert torch.allclose(mv[b, s, :, 0], v[b, s, :, :n].mean(1), atol=1e-6)
    assert torch.allclose(merger.bias(0, lengths), torch.log(lengths.float())[..., None].expand(-1, -1, 4))


def test_merger_weights_are_offsets_from_the_steps_end():
    merger = KVMerger.for_base(tiny_base().config, 4)
    with torch.no_grad():
        merger.k_logits[0, :, 0] = 50.0  # all weight on offset 0: the step's last token
    k = torch.randn(1, 2, 4, 16)
    for n in range(1, 5):
        mk, _ = merger.merge(0, k, k, torch.tensor([n]))
        assert torch.allclose(mk[:, :, 0], k[:, :, n - 1], atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_parallel_form_equals_stepwise_decoding(arch):
    base = tiny_base(arch)
    merger = random_merger(base, channels=arch == "qwen2")  # per-head weights on one, per-channel on the other
    batch = examples(4, seed=1)
    together = parallel_forward(base, merger, *zip(*batch))  # a right-padded batch of 4
    layout = Layout.build(*zip(*batch))
    for b, (ids, p, steps) in enumerate(batch):
        reference = stepwise_forward(base, merger, ids, p, steps)[0]
        r = len(ids) - p
        assert int(layout.valid[b].sum()) == r
        assert torch.allclose(together[b, :r], reference, atol=1e-4), (b, steps)
        assert torch.allclose(parallel_forward(base, merger, ids, p, steps)[0], reference, atol=1e-4)
        if max(steps) > 1 and r > steps[0]:  # merging did change something
            assert not torch.allclose(reference, base_logits(base, ids, p), atol=1e-2)


@pytest.mark.parametrize("window", [2, 5, 1000])
def test_parallel_form_with_a_merge_window_equals_stepwise_decoding(window):
    """Compress mode's merge window in the training form: the steps that end within `window` positions before a
    query's step are read as their own tokens. Equal to the stepwise reference; a window longer than the
    reply is the plain base; a window changes the logits where steps were merged."""
    base = tiny_base()
    merger = random_merger(base)
    batch = examples(4, seed=1)
    together = parallel_forward(base, merger, *zip(*batch), window=window)
    for b, (ids, p, steps) in enumerate(batch):
        reference = stepwise_forward(base, merger, ids, p, steps, window=window)[0]
        r = len(ids) - p
        assert torch.allclose(together[b, :r], reference, atol=1e-4), (b, steps)
        if window == 1000:
            assert torch.allclose(reference, base_logits(base, ids, p), atol=1e-4)
        elif max(steps) > 1 and r > sum(steps[:3]):
            assert not torch.allclose(reference, stepwise_forward(base, merger, ids, p, steps)[0], atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_merging_off_is_the_plain_base(arch):
    base = tiny_base(arch)
    for ids, p, steps in examples(3, seed=2):
        expected = base_logits(base, ids, p)
        assert torch.allclose(parallel_forward(base, None, ids, p, steps, merged=False)[0], expected, atol=1e-4)
        assert torch.allclose(stepwise_forward(base, None, ids, p, steps, merged=False)[0], expected, atol=1e-4)


def test_steps_of_one_token_merged_untrained_are_the_plain_base():
    base = tiny_base()
    merger = KVMerger.for_base(base.config, 4, gates=True)  # c = 0, gates 1: a one-token entry is the token
    for ids, p, _ in examples(3, seed=3):
        ones = [1] * (len(ids) - p)
        assert torch.allclose(parallel_forward(base, merger, ids, p, ones)[0], base_logits(base, ids, p), atol=1e-4)


def write_data(path, n: int = 8, seed: int = 0) -> str:
    with open(path, "w") as f:
        for i, (ids, p, steps) in enumerate(examples(n, seed, max_response=16)):
            f.write(json.dumps({"id": f"ex-{i}", "input_ids": ids, "prompt_len": p, "steps": steps}) + "\n")
    return str(path)


def test_training_lowers_the_kl_and_resumes_exactly(tmp_path):
    data = write_data(tmp_path / "data.jsonl")
    base = tiny_base()

    def trainer(out: str, steps: int, **kw) -> MergerTrainer:
        args = MergerArgs(data=data, out=str(tmp_path / out), max_steps=steps, lr=0.05, eval_fraction=0.3,
                          eval_every=3, save_every=3, **kw)
        return MergerTrainer(base, args)

    fit = trainer("fit", 8, batch_size=7, gates=True)  # every training example in every step
    assert fit.held and len(fit.train) == 7, "the split keeps one example out"
    seen = [(ex.input_ids, ex.prompt_len, ex.steps) for ex in fit.train]
    before = evaluate_merger(base, fit.merger, seen)["kl"]
    fit.fit()
    assert evaluate_merger(base, fit.merger, seen)["kl"] < 0.8 * before

    straight = trainer("straight", 6, batch_size=2, random_steps=True, gates=True)
    straight.fit()
    interrupted = trainer("resumed", 6, batch_size=2, random_steps=True, gates=True)
    for _ in range(3):  # then killed after its save at step 3
        interrupted.train_step()
    interrupted.save()
    resumed = trainer("resumed", 6, batch_size=2, random_steps=True, gates=True)
    assert resumed.resume() and resumed.step == 3
    resumed.fit()
    for (name, a), b in zip(straight.merger.state_dict().items(), resumed.merger.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    loaded = KVMerger.load(tmp_path / "straight" / WEIGHTS)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), straight.merger.state_dict().values()))
    assert loaded.meta["base_fingerprint"] == fingerprint(base) and loaded.config["gates"]
    rows = [json.loads(line) for line in (tmp_path / "straight" / "log.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and {"heldout_step_start_acc", "heldout_all_acc"} <= rows[0].keys()


def test_train_merger_command(tmp_path, tiny_model_dir, capsys):
    data = write_data(tmp_path / "data.jsonl", n=8)
    out = tmp_path / "run"
    argv = ["train-merger", "--model", str(tiny_model_dir), "--data", data, "--out", str(out),
            "--max-steps", "2", "--eval-every", "1", "--eval-fraction", "0.3"]
    assert main(argv) == 0
    assert (out / WEIGHTS).stat().st_size < 1 << 20
    assert main(argv) == 2  # a used run folder needs --resume
    assert main(argv + ["--max-steps", "3", "--resume"]) == 0
    steps = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert steps[0] == 0 and steps[-1] == 3
    assert "resumed at step 2" in capsys.readouterr().err
    # --init a fitted merger, --max-steps 0: only its held-out figures, here with a merge window of 3
    evaluated = ["train-merger", "--model", str(tiny_model_dir), "--data", data, "--eval-fraction", "0.3",
                 "--init", str(out / WEIGHTS), "--max-steps", "0"]
    assert main(evaluated + ["--out", str(tmp_path / "eval0")]) == 0
    assert main(evaluated + ["--out", str(tmp_path / "eval3"), "--merge-window", "3"]) == 0
    first = [json.loads((tmp_path / d / "log.jsonl").read_text().splitlines()[0]) for d in ("eval0", "eval3")]
    assert first[0]["heldout_kl"] > first[1]["heldout_kl"]  # the window's recent steps are read exactly
    final = [json.loads(line)["heldout_kl"] for line in (out / "log.jsonl").read_text().splitlines()
             if "heldout_kl" in json.loads(line)][-1]
    assert abs(first[0]["heldout_kl"] - final) < 1e-6  # the fitted merger, not a fresh one
    assert main(["train-merger", "--model", str(tiny_model_dir), "--data", data, "--out", str(tmp_path / "bad"),
                 "--init", str(tmp_path / "missing.safetensors")]) == 2
    assert "no such merger file" in capsys.readouterr().err


def test_per_channel_weights_merge_each_channel_on_its_own():
    merger = KVMerger.for_base(tiny_base().config, 4, channels=True)
    with torch.no_grad():  # channel 0 takes the step's last token, channel 1 its first, the rest the mean
        merger.k_logits[0, :, 0, 0] = 50.0
        merger.k_logits[0, :, 2, 1] = 50.0
    k = torch.randn(1, 2, 3, 16)
    mk, _ = merger.merge(0, k, k, torch.tensor([3]))
    assert torch.allclose(mk[0, :, 0, 0], k[0, :, 2, 0], atol=1e-5)
    assert torch.allclose(mk[0, :, 0, 1], k[0, :, 0, 1], atol=1e-5)
    assert torch.allclose(mk[0, :, 0, 2:], k[0, :, :, 2:].mean(1), atol=1e-5)
    # The decoder's all-layers form agrees with the per-layer one.
    ks = torch.randn(4, 2, 2, 4, 16)  # (L, B, kvh, width, hd)
    lengths = torch.tensor([2, 4])
    with torch.no_grad():
        merger.k_logits.normal_()
        merger.v_logits.normal_()
    mk_all, mv_all = merger.merge_all_layers(ks, ks * 2, lengths)
    for layer in range(4):
        mk, mv = merger.merge(layer, ks[layer], ks[layer] * 2, lengths)
        assert torch.allclose(mk_all[layer], mk[:, :, 0], atol=1e-5)
        assert torch.allclose(mv_all[layer], mv[:, :, 0], atol=1e-5)


def test_a_merger_saved_with_per_head_weights_still_loads(tmp_path):
    """Mergers saved before per-channel weights existed hold (layers, kv_heads, K) logits."""
    from safetensors.torch import save_file

    merger = random_merger(tiny_base(), gates=False)
    state = {k: v.detach().clone() for k, v in merger.state_dict().items()}
    state["k_logits"], state["v_logits"] = state["k_logits"][..., 0], state["v_logits"][..., 0]
    config = {k: v for k, v in merger.config.items() if k != "channels"}
    save_file(state, str(tmp_path / "old.safetensors"), metadata={"config": json.dumps(config)})
    again = KVMerger.load(tmp_path / "old.safetensors")
    assert torch.equal(again.k_logits, merger.k_logits) and torch.equal(again.a, merger.a)


def test_train_merger_reports_to_a_tracker(tmp_path, tiny_model_dir):
    """`--report-to tensorboard`: every row of log.jsonl (training and held-out) also goes to TensorBoard, by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = write_data(tmp_path / "data.jsonl", n=8)
    out = tmp_path / "run"
    assert main(["train-merger", "--model", str(tiny_model_dir), "--data", data, "--out", str(out), "--max-steps", "2",
                 "--eval-every", "1", "--eval-fraction", "0.3", "--report-to", "tensorboard"]) == 0
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(next((out / "tracker").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    held = [(e.step, e.value) for e in events.Scalars("eval/heldout_all_acc")]
    assert held == [(r["step"], pytest.approx(r["heldout_all_acc"], abs=1e-4)) for r in logged if "heldout_all_acc" in r]
    assert len(held) == 3
    assert main(["train-merger", "--model", str(tiny_model_dir), "--data", data, "--out", str(tmp_path / "bad"),
                 "--report-to", "tensorbored"]) == 2
    assert not (tmp_path / "bad").exists()  # refused before anything was written
