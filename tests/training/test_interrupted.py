"""Interrupted work resumes (issue 53, item 5): `train`, `distill` and `segment` killed with SIGKILL in the middle
of their work and run again end with exactly the result of an uninterrupted run, and a kill leaves no file
half-written under its final name.

Each command runs as a real child process (`python -c` around `hamburger.cli.main`) on the tiny base and kills
itself with SIGKILL at a fixed point inside its work, so the test does not depend on timing: mid-way through
writing a checkpoint's weights (train: the file is cut to half its bytes first, as a kill during the write leaves
it), or while replies or entropies are computed after some records were written (distill, segment). The
uninterrupted and the resumed runs run in this process. Where a kill could cut an appended record, the resume is
run from every kind of cut of real output (mid-line, before the newline, at a record's end) instead of relying on
where a kill lands.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_pipeline import make_data, write_jsonl

from conftest import VOCAB
from hamburger.cli import main
from hamburger.training import segment as segment_module
from hamburger.training.atomic import read_lines, replace_dir, settle_dir, staging
from hamburger.training.distill import done_ids
from hamburger.training.segment import read_chats

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

# The child: installs a hook that SIGKILLs the process at the n-th call of one function, then runs the CLI.
CHILD = r"""
import json, os, signal, sys
argv, where, n = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
calls = 0

def die_at_nth(real, tear=False):
    def hooked(*args, **kwargs):
        global calls
        calls += 1
        if calls == n:
            if tear:  # the weights' file written, then cut to half its bytes: a kill during the write
                real(*args, **kwargs)
                os.truncate(args[1], os.path.getsize(args[1]) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    return hooked

if where == "weights":  # every safetensors file written (accelerate's state, the shipped checkpoint)
    import accelerate.utils.other, safetensors.torch, hamburger.model.hamburger_model, hamburger.training.train
    def hook_everywhere(real):
        hooked = die_at_nth(real, tear=True)
        for module in list(sys.modules.values()):
            for name, value in list(vars(module).items()):
                if value is real:
                    setattr(module, name, hooked)
    hook_everywhere(safetensors.torch.save_file)
elif where == "decode":  # a step of distill's continuous-batching scheduler
    from hamburger.inference.scheduler import Scheduler
    Scheduler.step = die_at_nth(Scheduler.step)
elif where == "entropies":  # a batch of segment's base passes
    import hamburger.training.segment as segment
    segment.response_entropies = die_at_nth(segment.response_entropies)
from hamburger.cli import main
sys.exit(main(argv))
"""


def run_killed(argv: list[str], where: str, n: int) -> None:
    """`hamburger ARGV` in a child process that SIGKILLs itself at the n-th call of the hooked function."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(torch.get_num_threads())}  # our arithmetic
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argv), where, str(n)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


def jsonl(path: Path) -> list[dict]:
    """Every line of a JSONL file, parsed (a torn line fails here)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n")[:-1]]


def assert_intact(folder: Path) -> None:
    """Every file of a finished folder reads: weights load, JSON parses, pickles unpickle."""
    for path in sorted(folder.iterdir()):
        if path.suffix == ".safetensors":
            load_file(str(path))
        elif path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix in (".bin", ".pkl", ".pt"):
            torch.load(path, weights_only=False)


# --- train ------------------------------------------------------------------------------------------------------


def train_argv(tmp_path: Path, model: Path, out: str) -> list[str]:
    return ["train", "--data", str(tmp_path / "data.jsonl"), "--out", str(tmp_path / out), "--model", str(model),
            "--micro-layers", "2", "--batch-size", "4", "--lr", "3e-3", "--max-steps", "6", "--save-every", "2",
            "--eval-every", "2", "--eval-fraction", "0.1", "--no-bf16"]


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in rows]


@pytest.mark.parametrize("nth,resumes_at", [(3, 2), (4, 4)], ids=["mid-state", "mid-checkpoint"])
def test_train_killed_while_saving_resumes_to_the_same_weights(tmp_path, tiny_model_dir, capsys, nth, resumes_at):
    """Two safetensors files a save (state/ then hamburger/); the 3rd and 4th writes are the second save's."""
    make_data(tmp_path / "data.jsonl", n=40)
    assert main(train_argv(tmp_path, tiny_model_dir, "straight")) == 0
    argv = train_argv(tmp_path, tiny_model_dir, "run")
    run_killed(argv, "weights", nth)
    run = tmp_path / "run"
    for folder in ("state", "hamburger"):  # the torn file is under a temporary name, never under the final one
        assert_intact(run / folder)
    jsonl(run / "log.jsonl")
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    assert f"resumed at step {resumes_at}" in capsys.readouterr().err
    want, got = (load_file(str(tmp_path / r / "hamburger" / "model.safetensors")) for r in ("straight", "run"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert without_timing(jsonl(run / "log.jsonl")) == without_timing(jsonl(tmp_path / "straight" / "log.jsonl"))
    assert sorted(p.name for p in run.iterdir()) == sorted(p.name for p in (tmp_path / "straight").iterdir())


def test_a_swap_cut_between_its_renames_settles_on_the_new_folder(tmp_path):
    """replace_dir renames the old folder aside, then the new one in: a kill between the two leaves no `state/`;
    settle_dir (run before a resume reads it) finishes the swap, and drops a half-written staging folder."""
    final = tmp_path / "state"
    for text in ("old", "new"):
        staging(final).mkdir()
        (staging(final) / "trainer.json").write_text(text)
        if text == "new":
            final.rename(final.with_name("state.old"))  # the first rename done, the kill before the second
        else:
            replace_dir(final)
    settle_dir(final)
    assert (final / "trainer.json").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["state"]
    staging(final).mkdir()  # a save killed while writing: the last complete folder stays
    (staging(final) / "trainer.json").write_text("torn")
    settle_dir(final)
    assert (final / "trainer.json").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["state"]


# --- distill ----------------------------------------------------------------------------------------------------


def distill_argv(tmp_path: Path, model: Path, out: str) -> list[str]:
    rng = random.Random(0)
    prompts = [{"id": f"p{i}", "prompt": " ".join(f"w{rng.randrange(VOCAB - 5)}" for _ in range(rng.randrange(2, 8)))}
               for i in range(10)]
    write_jsonl(tmp_path / "prompts.jsonl", prompts)
    return ["distill", "--sources", str(tmp_path / "prompts.jsonl"), "--out", str(tmp_path / out), "--model",
            str(model), "--engine", "fast", "--batch-size", "3", "--max-new-tokens", "8"]


def test_distill_killed_mid_decoding_resumes_to_the_same_rows(tmp_path, tiny_model_dir, capsys):
    assert main(distill_argv(tmp_path, tiny_model_dir, "straight.jsonl")) == 0
    want = (tmp_path / "straight.jsonl").read_bytes()
    argv = distill_argv(tmp_path, tiny_model_dir, "run.jsonl")
    run_killed(argv, "decode", 12)
    kept = jsonl(tmp_path / "run.jsonl")  # whole rows only: each finished group is written at once
    assert 0 < len(kept) < 10
    capsys.readouterr()
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1])["already_done"] == len(kept)
    assert (tmp_path / "run.jsonl").read_bytes() == want  # the same rows, in the prompts' order


@pytest.mark.parametrize("cut", ["mid-line", "before-newline", "after-newline", "out-of-order"])
def test_distill_resumes_from_a_cut_append(tmp_path, tiny_model_dir, cut):
    """A kill can cut an append anywhere: what a resume reads is every complete line, and a line without its
    newline is torn even where it parses (the next append would join it). Rows appended in another order (as the
    replies of a run resumed elsewhere ended) are put in the prompts' order."""
    assert main(distill_argv(tmp_path, tiny_model_dir, "straight.jsonl")) == 0
    want = (tmp_path / "straight.jsonl").read_bytes()
    end = [i for i, b in enumerate(want) if b == ord("\n")][3]
    if cut == "out-of-order":
        (tmp_path / "run.jsonl").write_bytes(b"".join(reversed(want.splitlines(keepends=True))))
    else:
        at = {"mid-line": end - 10, "before-newline": end, "after-newline": end + 1}[cut]
        (tmp_path / "run.jsonl").write_bytes(want[:at])
    assert len(done_ids(tmp_path / "run.jsonl")) == {"out-of-order": 10, "after-newline": 4}.get(cut, 3)
    assert main(distill_argv(tmp_path, tiny_model_dir, "run.jsonl")) == 0
    assert (tmp_path / "run.jsonl").read_bytes() == want


def test_a_reply_with_a_unicode_line_separator_is_not_a_torn_line(tmp_path):
    """Rows are written with ensure_ascii=False, which leaves U+2028 and NEL raw: the readers split on newlines only
    (before, a resume took such a row for a torn line and cut the file there, every later row with it)."""
    chat = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "x\u2028y\x85z"}]
    rows = [{"id": "a", "messages": chat}, {"id": "b", "messages": chat}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    assert done_ids(path) == {"a", "b"} and len(read_lines(path)) == 2 and read_chats(path) == rows


# --- segment ----------------------------------------------------------------------------------------------------


def segment_argv(tmp_path: Path, model: Path, out: str) -> list[str]:
    rng = random.Random(1)
    words = lambda n: " ".join(f"w{rng.randrange(VOCAB - 5)}" for _ in range(n))  # noqa: E731
    chats = [{"id": f"c{i}", "messages": [{"role": "user", "content": words(rng.randrange(2, 6))},
                                          {"role": "assistant", "content": words(rng.randrange(3, 12))}]}
             for i in range(12)]
    write_jsonl(tmp_path / "chats.jsonl", chats)
    return ["segment", "--data", str(tmp_path / "chats.jsonl"), "--out", str(tmp_path / out), "--model", str(model),
            "--batch-size", "2", "--abs-threshold", "1.0", "--rel-threshold", "0.9"]


def count_batches(monkeypatch) -> list[int]:
    """Counts segment's base passes (one per batch)."""
    calls, real = [], segment_module.response_entropies
    monkeypatch.setattr(segment_module, "response_entropies", lambda *a: calls.append(1) or real(*a))
    return calls


def test_segment_killed_mid_way_resumes_from_its_last_batch(tmp_path, tiny_model_dir, monkeypatch):
    assert main(segment_argv(tmp_path, tiny_model_dir, "straight.jsonl")) == 0
    argv = segment_argv(tmp_path, tiny_model_dir, "run.jsonl")
    run_killed(argv, "entropies", 4)  # 6 batches of 2; killed computing the 4th
    assert not (tmp_path / "run.jsonl").exists() and not (tmp_path / "run.jsonl.summary.json").exists()
    part = tmp_path / "run.jsonl.part0"
    assert len(jsonl(part)) == 1 + 6  # a header, then the 3 batches done
    calls = count_batches(monkeypatch)
    assert main(argv) == 0
    assert len(calls) == 3  # only the batches the killed run had not written
    assert jsonl(tmp_path / "run.jsonl") == jsonl(tmp_path / "straight.jsonl")
    summaries = [json.loads((tmp_path / f"{r}.jsonl.summary.json").read_text()) for r in ("straight", "run")]
    assert summaries[0] == summaries[1] and not part.exists()


@pytest.mark.parametrize("cut", ["mid-line", "before-newline"])
def test_segment_resumes_from_a_cut_part(tmp_path, tiny_model_dir, monkeypatch, cut):
    """A batch cut mid-write: its complete lines are kept, the batch is computed again (the same batch, so the same
    numbers) and only its missing records written."""
    assert main(segment_argv(tmp_path, tiny_model_dir, "straight.jsonl")) == 0
    argv = segment_argv(tmp_path, tiny_model_dir, "run.jsonl")
    part = tmp_path / "run.jsonl.part0"
    monkeypatch.setattr(segment_module, "join_segment_parts", lambda *a: None)  # keep the whole part
    assert main(argv) == 0
    monkeypatch.undo()
    whole = part.read_bytes()
    end = [i for i, b in enumerate(whole) if b == ord("\n")][6]  # the header, 2 batches, 1 record of the 3rd...
    part.write_bytes(whole[: end - 5 if cut == "mid-line" else end])  # ...and its second cut
    calls = count_batches(monkeypatch)
    assert main(argv) == 0
    assert len(calls) == 4  # the 3rd batch again, then the 3 never written
    assert jsonl(tmp_path / "run.jsonl") == jsonl(tmp_path / "straight.jsonl")


def test_segment_starts_afresh_from_a_part_of_other_settings(tmp_path, tiny_model_dir, monkeypatch):
    """A part left by a run with other thresholds (or data, base, batch size) is not resumed from."""
    argv = segment_argv(tmp_path, tiny_model_dir, "run.jsonl")
    monkeypatch.setattr(segment_module, "join_segment_parts", lambda *a: None)
    assert main([*argv[:-1], "0.5"]) == 0
    monkeypatch.undo()
    calls = count_batches(monkeypatch)
    assert main(argv) == 0
    assert len(calls) == 6
    assert main(segment_argv(tmp_path, tiny_model_dir, "straight.jsonl")) == 0
    assert jsonl(tmp_path / "run.jsonl") == jsonl(tmp_path / "straight.jsonl")
