"""Damaged or mismatched files give one line that names the file and what is wrong, and exit status 2: never a
traceback, never a silently wrong model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from conftest import random_merger
from hamburger import HamburgerModel
from hamburger.cli import main


def damaged_copy(tmp_path, checkpoint):
    target = tmp_path / "damaged"
    shutil.copytree(checkpoint, target)
    return target


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("hamburger: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_a_truncated_checkpoint(tmp_path, checkpoint, capsys):
    ck = damaged_copy(tmp_path, checkpoint)
    weights = ck / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    line = one_line_error(capsys, ["info", "--model", str(ck)])
    assert str(weights) in line and "truncated or corrupted" in line


def test_a_corrupted_header(tmp_path, checkpoint, capsys):
    ck = damaged_copy(tmp_path, checkpoint)
    weights = ck / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header's first bytes
    weights.write_bytes(bytes(data))
    assert str(weights) in one_line_error(capsys, ["info", "--model", str(ck)])


def test_weights_of_the_wrong_shapes(tmp_path, checkpoint, capsys):
    ck = damaged_copy(tmp_path, checkpoint)
    config = json.loads((ck / "config.json").read_text())
    config["hamburger"]["max_step_tokens"] = 6  # the modules' shapes follow K: the weights no longer fit
    (ck / "config.json").write_text(json.dumps(config))
    line = one_line_error(capsys, ["info", "--model", str(ck)])
    assert str(ck / "model.safetensors") in line or str(ck) in line


def test_a_config_that_is_not_json(tmp_path, checkpoint, capsys):
    ck = damaged_copy(tmp_path, checkpoint)
    (ck / "config.json").write_text('{"hamburger": {')
    assert "config.json" in one_line_error(capsys, ["info", "--model", str(ck)])


def test_a_base_folder_with_a_damaged_config_or_weights(tmp_path, tiny_model_dir, capsys):
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    (base / "model.safetensors").write_bytes(b"\x00" * 64)
    line = one_line_error(capsys, ["generate", "w5", "--model", str(base), "--max-new-tokens", "2", "--raw"])
    assert "model.safetensors" in line


def test_a_base_without_its_tokenizer(tmp_path, tiny_model_dir, capsys):
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    for f in base.glob("tokenizer*"):
        f.unlink()
    line = one_line_error(capsys, ["generate", "w5", "--model", str(base), "--max-new-tokens", "2", "--raw"])
    assert "tokenizer" in line.lower()


def test_a_damaged_merger_and_reply_store(tmp_path, checkpoint, capsys):
    model = HamburgerModel.from_pretrained(checkpoint)
    model.attach_merger(random_merger(model.base))
    model.reply_tokens = torch.tensor([5, 6, -1], dtype=torch.int32)
    ck = tmp_path / "with-extras"
    model.save_pretrained(ck)
    merger = ck / "merger.safetensors"
    merger.write_bytes(merger.read_bytes()[:100])
    assert str(merger) in one_line_error(capsys, ["info", "--model", str(ck)])
    model.save_pretrained(ck)
    save_file({"other": torch.zeros(2)}, str(ck / "replies.safetensors"))
    assert "replies.safetensors" in one_line_error(capsys, ["info", "--model", str(ck)])


@pytest.mark.parametrize("name", ["merger.safetensors"])
def test_a_merger_file_that_is_not_a_merger(tmp_path, checkpoint, capsys, name):
    ck = damaged_copy(tmp_path, checkpoint)
    save_file({"x": torch.zeros(2)}, str(ck / name))
    assert "not a KV merger" in one_line_error(capsys, ["info", "--model", str(ck)])


def test_two_processes_converting_the_default_at_once_keep_one_whole_copy(tmp_path, recwarn):
    """The converted default is written in a folder of its own and renamed into place: the second of two
    conversions into one place finds the first's copy there and drops its own, without a warning or a leftover."""
    from conftest import tiny_base, tiny_tokenizer
    from hamburger.model.base import _convert_default

    target = tmp_path / "cache" / "default-converted"
    for _ in range(2):
        model = tiny_base("llama")
        model.config.quantization_config = None  # as a GGUF-loaded model has one
        _convert_default(target, model, tiny_tokenizer())
    assert (target / "config.json").is_file() and not [w for w in recwarn if "could not cache" in str(w.message)]
    assert [p.name for p in target.parent.iterdir()] == ["default-converted"]  # no half-written folder left
