"""`hamburger demo`: side-by-side streaming of the base and HAMburger on a tiny checkpoint."""

from __future__ import annotations

import io

import torch

from hamburger.cli import main
from hamburger.kernels.qlinear import fp16_unavailable


def test_demo_runs_built_in_prompts(checkpoint, capsys):
    assert main(["demo", "--model", str(checkpoint), "--max-new-tokens", "8", "--confidence", "0.3",
                 "--quantize", "none"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert out.count("the base's decode tokens/s") == 3  # one line per built-in prompt
    assert "KV entries" in out and "forwards" in out
    # the CPU's speed tip, only where float weights ran and fp16 could (FBGEMM, x86)
    assert ("--quantize fp16 decodes both lanes" in out) == (fp16_unavailable("cpu") is None)
    assert [line for line in captured.err.splitlines() if line.startswith("hamburger: ")] == [
        f"hamburger: cpu ({torch.get_num_threads()} threads), float32 weights, trust mode: HAMburger's steps, drafts "
        "kept unchecked (close to the float32 base's output, not equal)"]
    assert main(["demo", "--model", str(checkpoint), "--max-new-tokens", "2"]) == 0  # --quantize auto
    assert "--quantize fp16 decodes" not in capsys.readouterr().out


def test_demo_in_verify_mode_says_why_float_weights_draft_nothing(checkpoint, capsys):
    assert main(["demo", "--model", str(checkpoint), "--max-new-tokens", "6", "--mode", "verify",
                 "--prompt", "hi", "--quantize", "none"]) == 0
    out = capsys.readouterr().out
    assert "drafted nothing" in out and "trust: the paper's method" in out  # float32 on a CPU: no drafts
    if fp16_unavailable("cpu") is None:  # --quantize auto: fp16 weights, with which drafts pay
        assert main(["demo", "--model", str(checkpoint), "--max-new-tokens", "6", "--mode", "verify",
                     "--prompt", "hi"]) == 0
        out = capsys.readouterr().out
        assert "drafted nothing" not in out and "trust: the paper's method" in out


def test_demo_chat_reads_prompts_until_an_empty_line(checkpoint, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("w5 w6\nw7\n\n"))
    assert main(["demo", "--model", str(checkpoint), "--chat", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.count("the base's decode tokens/s") == 2


def test_demo_needs_a_checkpoint(tiny_model_dir, capsys):
    assert main(["demo", "--model", str(tiny_model_dir)]) == 2
    assert "base model" in capsys.readouterr().err


def test_demo_closes_with_every_mode_and_whether_its_text_is_the_bases(checkpoint, capsys):
    """The closing table: base, verify and trust (compress only with a KV merger, which this checkpoint lacks), per
    prompt and in total; verify's text is the base's, and the table says so."""
    assert main(["demo", "--model", str(checkpoint), "--max-new-tokens", "8", "--prompt", "w5 w6", "--prompt", "w7",
                 "--quantize", "none", "--mode", "verify"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("Every mode on these prompts"):]
    rows = [line for line in table.splitlines() if "│" in line]
    systems = [r.split("│")[2].strip() for r in rows if len(r.split("│")) > 7]
    assert systems.count("base") == 3 and systems.count("verify") == 3  # 2 prompts and the total
    assert systems.count("trust") == 3 and "compress" not in systems
    verify_rows = [r.split("│") for r in rows if len(r.split("│")) > 7 and r.split("│")[2].strip() == "verify"]
    assert [cells[7].strip() for cells in verify_rows] == ["yes", "yes", "2/2"]
    assert main(["demo", "--model", str(checkpoint), "--max-new-tokens", "4", "--prompt", "w5", "--quantize", "none",
                 "--no-table"]) == 0
    assert "Every mode" not in capsys.readouterr().out


def test_the_closing_tables_kv_ratio_is_against_the_bases_entries_for_the_same_text():
    """A mode whose reply is longer than the base's holds more entries than the base did, and fewer than the base
    would for that reply: the table compares with the latter (one definition: `GenerationStats.kv_ratio`)."""
    from rich.console import Console

    from hamburger.evaluation.demo import ModeRun, mode_table
    from hamburger.inference.stats import GenerationStats

    base = GenerationStats(sequences=1, prompt_tokens=10, generated_tokens=20, macro_steps=20, unmerged=True,
                           decode_s=1.0)
    trust = GenerationStats(sequences=1, prompt_tokens=10, generated_tokens=30, macro_steps=25, decode_s=1.0)
    console = Console(width=200, record=True)
    console.print(mode_table(["p"], [[ModeRun("base", [1] * 20, base), ModeRun("trust", [2] * 30, trust)]]))
    rows = {cells[2].strip(): cells[6].strip() for line in console.export_text().splitlines()
            if len(cells := line.split("│")) > 7}
    assert rows["base"] == "30 (1.00×)"
    assert rows["trust"] == "35 (0.88×)"  # 35 entries where the base would hold 40 for this text (not 35 / 30)
