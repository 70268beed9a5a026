"""The `hamburger` CLI on a tiny local model: JSON output, info, checkpoints, and bad input without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hamburger.cli import main


def run_json(capsys, *args) -> dict:
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_on_a_base_model(capsys, tiny_model_dir):
    out = run_json(capsys, "generate", "w1 w2 w3", "--model", str(tiny_model_dir), "--max-new-tokens", "7", "--json")
    assert {"text", "generated_tokens", "macro_steps", "tokens_per_step", "kv_entries", "decode_tokens_per_s"} <= out.keys()
    assert out["hamburger"] is False and out["tokens_per_step"] == 1.0
    assert out["generated_tokens"] <= 7 and out["kv_entries"] == out["prompt_tokens"] + out["macro_steps"]


def test_generate_json_on_a_checkpoint(capsys, checkpoint):
    out = run_json(capsys, "generate", "w5 w6", "--model", str(checkpoint), "--max-new-tokens", "12",
                   "--confidence", "0.2", "--json")
    assert out["hamburger"] is True
    assert sum(out["steps"]) == out["generated_tokens"] and out["macro_steps"] == len(out["steps"])
    assert out["tokens_per_step"] > 1.0


def test_generate_streams_text_and_sampling_is_seeded(capsys, checkpoint):
    args = ["generate", "w5 w6", "--model", str(checkpoint), "--max-new-tokens", "10", "--temperature", "0.9",
            "--top-p", "0.9", "--seed", "3", "--json"]
    assert run_json(capsys, *args)["text"] == run_json(capsys, *args)["text"]
    assert main(["generate", "w5", "--model", str(checkpoint), "--max-new-tokens", "6", "--raw"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "tokens/forward" in captured.err


def test_info(capsys, checkpoint, tiny_model_dir):
    out = run_json(capsys, "info", "--model", str(checkpoint), "--json")
    assert out["hamburger_checkpoint"] is True and out["architecture"] == "LlamaForCausalLM"
    assert set(out["parameters"]) == {"base", "embedder", "micro", "stop_head"} and out["feature_layers"] == [1, 2, 3, 4]
    assert all(v > 0 for v in out["parameters"].values())
    assert main(["info", "--model", str(tiny_model_dir)]) == 0
    assert "a base model" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["generate", "", "--model", "MODEL"], "prompt is empty"),
    (["generate", "   ", "--model", "MODEL"], "prompt is empty"),
    (["generate", "w1", "--model", "MODEL", "--max-new-tokens", "0"], "max-new-tokens"),
    (["generate", "w1", "--model", "MODEL", "--max-new-tokens", "-5"], "max-new-tokens"),
    (["generate", "w1", "--model", "MODEL", "--confidence", "0"], "confidence"),
    (["generate", "w1", "--model", "MODEL", "--confidence", "1.01"], "confidence"),
    (["generate", "w1", "--model", "MODEL", "--temperature", "-1"], "temperature"),
    (["generate", "w1", "--model", "./no/such/model"], "does not exist"),
    (["generate", "w1", "--model", "/no/such/model"], "does not exist"),
    (["info", "--model", "/no/such/model"], "does not exist"),
    (["info", "--model", "no such/hub id"], "neither a local path nor a valid hub id"),
    (["generate", "w1", "--model", "MODEL", "--device", "not-a-device"], "not usable here"),
])
def test_bad_input_exits_nonzero_with_a_message(capsys, tiny_model_dir, args, message):
    args = [str(tiny_model_dir) if a == "MODEL" else a for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_prompt_from_stdin(capsys, monkeypatch, tiny_model_dir):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("w7 w8 w9\n"))
    out = run_json(capsys, "generate", "-", "--model", str(tiny_model_dir), "--raw", "--max-new-tokens", "3", "--json")
    assert out["prompt_tokens"] == 3


def test_unreachable_hub_id_fails_fast(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["info", "--model", "nobody-here/no-model"]) == 2
    assert "hub cannot be reached" in capsys.readouterr().err


def test_checkpoint_for_another_base_is_refused(capsys, tmp_path, checkpoint):
    from conftest import tiny_base, tiny_tokenizer

    other = tmp_path / "other-base"
    tiny_base("llama", seed=42).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    assert main(["generate", "w1", "--model", str(checkpoint), "--base", str(other)]) == 2
    err = capsys.readouterr().err
    assert "fingerprint" in err and "Traceback" not in err


def test_a_folder_that_is_not_a_model(capsys, tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{not json")
    assert main(["generate", "w1", "--model", str(tmp_path / "junk")]) == 2
    assert "could not load model" in capsys.readouterr().err


def test_console_script_bad_input_has_no_traceback(tiny_model_dir):
    proc = subprocess.run([sys.executable, "-m", "hamburger.cli", "generate", "w1", "--model", str(tiny_model_dir),
                           "--confidence", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "confidence must be in (0, 1]" in proc.stderr and "Traceback" not in proc.stderr
