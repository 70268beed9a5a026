"""`hamburger bench-serve` on a tiny checkpoint and its plain base: a table and JSON rows per concurrency."""

from __future__ import annotations

import json

from hamburger.cli import main
from hamburger.evaluation.bench_serve import ServeBench, _bodies, percentile
from hamburger.evaluation.bench_systems import bench_messages


def test_percentile():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 90) == 1.9
    assert percentile([5.0], 99) == 5.0


def test_bench_serve_base_and_hamburger(checkpoint, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "serve.json"
    code = main(["bench-serve", "--models", f"{checkpoint},{tiny_model_dir}", "--requests", "4", "--concurrency", "1,2",
                 "--max-tokens", "4", "--max-len", "256", "--sets", "chat", "--confidence", "0.3", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["hamburger"], r["concurrency"]) for r in rows] == [(True, 1), (True, 2), (False, 1), (False, 2)]
    for r in rows:
        assert r["requests"] == 4 and r["requests_per_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert r["completion_tokens"] <= 16 and r["tokens_per_step"] >= 1.0
    assert all(r["tokens_per_step"] == 1.0 for r in rows if not r["hamburger"])
    for r in rows:  # KV as memory: entries per generated token from `usage`, bytes from the served model
        if not r["hamburger"]:
            assert r["kv_entries_per_generated_token"] == 1.0
        assert r["kv_bytes_per_generated_token"] == r["kv_entries_per_generated_token"] * r["kv_bytes_per_entry"]
        assert r["kv_bytes_per_request"] == r["kv_entries_per_request"] * r["kv_bytes_per_entry"] > 0
    out = capsys.readouterr().out
    assert "TTFT p50" in out and "KV KB/gen token" in out


def test_bench_serve_bad_arguments(capsys):
    assert main(["bench-serve", "--concurrency", "1,x"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert main(["bench-serve", "--url", "http://127.0.0.1:9", "--quantize", "fp16"]) == 2  # not silently ignored
    assert "apply to the in-process server" in capsys.readouterr().err
    assert main(["bench-serve", "--quantize", "int3"]) == 2
    assert "--quantize must be one of" in capsys.readouterr().err


def test_per_set_takes_the_first_prompts_of_each_set_in_turn(capsys):
    """`--per-set 2` with 6 requests: the first two of code, of math and of chat (the prompts benchmarks/vllm_drafts.py
    sends vLLM, for a like-for-like load); without it, the first sets' first prompts."""
    bodies = _bodies(ServeBench(requests=6, per_set=2, sets=("code", "math", "chat")), "m", "verify")
    want = [m for name in ("code", "math", "chat") for m in bench_messages(name, 2)]
    assert [b["messages"] for b in bodies] == want and all(b["mode"] == "verify" for b in bodies)
    assert [b["messages"] for b in _bodies(ServeBench(requests=2, sets=("code", "math")), "m", "trust")] == \
        bench_messages("code", 2)
    assert main(["bench-serve", "--per-set", "0"]) == 2
    assert "--per-set" in capsys.readouterr().err


def test_bench_serve_quantized(checkpoint, tmp_path):
    out = tmp_path / "serve.json"
    code = main(["bench-serve", "--models", str(checkpoint), "--quantize", "int8", "--requests", "2", "--concurrency",
                 "1", "--max-tokens", "4", "--max-len", "256", "--sets", "chat", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["quantize"] == "int8" and data["rows"][0]["completion_tokens"] >= 2


def test_bench_serve_both_modes(checkpoint, tmp_path, capsys):
    out = tmp_path / "serve.json"
    code = main(["bench-serve", "--models", str(checkpoint), "--modes", "trust,verify", "--requests", "3",
                 "--concurrency", "2", "--max-tokens", "4", "--max-len", "256", "--sets", "chat", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["model"].endswith(f"[{r['mode']}]")) for r in rows] == [("trust", True), ("verify", True)]
    assert all(r["completion_tokens"] >= 3 for r in rows)
    assert main(["bench-serve", "--modes", "trust,fast"]) == 2
    assert "--modes" in capsys.readouterr().err


def test_bench_serve_at_a_kv_memory_fills_the_rows_it_holds(checkpoint, tmp_path, capsys):
    """`--kv-memory`: as many clients as the memory holds rows; `--max-tokens 0 --ignore-eos`: each request gets
    all its row holds (one entry a token in verify mode: the row's entries less the prompt's), ended by "length"."""
    out = tmp_path / "serve.json"
    code = main(["bench-serve", "--models", str(checkpoint), "--modes", "verify", "--requests", "4", "--max-tokens",
                 "0", "--ignore-eos", "--max-len", "96", "--kv-memory", "320entries", "--sets", "chat",
                 "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    row = data["rows"][0]
    assert data["kv_memory"] == [320, "entries"] and row["concurrency"] == 3  # 3 rows of 96 entries and spare slots
    assert row["ended_by_length"] == 4
    prompt = row["kv_entries_per_request"] - row["tokens_per_request"]  # verify: one entry per prompt and reply token
    assert 0 < prompt < 96 and row["kv_entries_per_request"] in (96, 97)
    assert main(["bench-serve", "--url", "http://127.0.0.1:9", "--kv-memory", "1GB"]) == 2
    assert "apply to the in-process server" in capsys.readouterr().err
