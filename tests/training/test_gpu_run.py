"""benchmarks/gpu_run.py, the GPU run of issue 39: its CPU smoke mode on a tiny model (so the script cannot rot) and
the GGUF's split and join."""

from __future__ import annotations

import importlib.util
import json
import tarfile
from pathlib import Path

import pytest
from conftest import randomize_new_modules

from hamburger import load_base
from hamburger.model.config import HamburgerConfig
from hamburger.model.hamburger_model import HamburgerModel

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_run.py"


def gpu_run():
    spec = importlib.util.spec_from_file_location("gpu_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_split_and_join_round_trip(tmp_path):
    run = gpu_run()
    source = tmp_path / "base.gguf"
    source.write_bytes(bytes(range(256)) * 9000)  # 2.2 MiB: three parts of 1 MiB
    manifest = run.split_file(source, tmp_path / "parts", 1)
    assert manifest["parts"] == ["part-00", "part-01", "part-02"]
    joined = run.join_file(tmp_path / "parts", tmp_path / "there")
    assert joined.read_bytes() == source.read_bytes()
    (tmp_path / "parts" / "part-01").unlink()
    with pytest.raises(SystemExit, match="part-01"):
        run.join_file(tmp_path / "parts", tmp_path / "again")


def test_smoke_runs_the_whole_stage_and_the_probe_on_a_tiny_model(tmp_path, tiny_model_dir, checkpoint):
    out = tmp_path / "out"
    gpu_run().main(["smoke", "--model", str(tiny_model_dir), "--checkpoint", str(checkpoint), "--out", str(out)])
    assert json.loads((out / "bench-b1.json").read_text())
    log = (out / "run.log").read_text()
    assert "stopped at its time limit" not in log and "Traceback" not in log, log[-3000:]
    parts = sorted(out.glob("ckpt.tar.part-*"))
    assert parts and all(p.stat().st_size <= 15 << 20 for p in parts)
    (tmp_path / "ckpt.tar").write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(tmp_path / "ckpt.tar") as t:
        names = t.getnames()
    assert "export/config.json" in names and "export/model.safetensors" in names
    config = json.loads(tarfile.open(tmp_path / "ckpt.tar").extractfile("export/config.json").read())
    assert config["hamburger"]["lora_rank"] == 2  # the LoRA trained on the checkpoint travels with it

    # `probe` on the segmented data the stage made: the acc@0 probe's arms (slot adapters needed) and a distill, each
    # in its own process, every arm's held-out rows back in probe-ARM.jsonl
    base, tok = load_base(str(tiny_model_dir))
    with_adapters = tmp_path / "ckpt-slots"
    cfg = HamburgerConfig(max_step_tokens=4, slot_adapter_rank=2)
    randomize_new_modules(HamburgerModel.wrap(base, tok, cfg)).save_pretrained(with_adapters)
    probe = tmp_path / "probe"
    gpu_run().main(["smoke", "--probe", str(out / "work" / "segmented.jsonl"), "--model", str(tiny_model_dir),
                    "--checkpoint", str(with_adapters), "--out", str(probe)])
    for arm in ("slot", "reader", "base"):
        rows = [json.loads(line) for line in (probe / f"probe-{arm}.jsonl").read_text().splitlines()]
        assert rows[0]["step"] == 0 and rows[-1].get("final") and rows[-1]["step"] >= 1, (arm, rows)
        assert "acc@0" in rows[-1] and "Traceback" not in (probe / f"{arm}.log").read_text()
    assert "Traceback" not in (probe / "distill.log").read_text()


def test_whole_lines_drops_a_half_written_last_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n{"b": 2}\n{"c": ')
    assert gpu_run().whole_lines(path) == 2 and path.read_text() == '{"a": 1}\n{"b": 2}\n'
