"""`hamburger bench` end to end on a tiny checkpoint: every system, the table, JSON, plots, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from hamburger.cli import main
from hamburger.evaluation.bench_systems import bench_messages, long_documents


def test_bench_runs_every_system(tmp_path, checkpoint, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--model", str(checkpoint), "--sets", "code,chat", "--batch-sizes", "1,2",
                 "--max-new-tokens", "6", "--runs", "1", "--confidence", "0.3,0.8", "--json", str(out),
                 "--plot", str(tmp_path / "plots")])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    systems = {(r["system"], r["batch_size"], r["confidence"]) for r in result["rows"]}
    for name in ("hf_generate", "engine_base", "hamburger_ref", "hamburger_engine"):
        assert any(s[0] == name and s[1] == 2 for s in systems)
    for name in ("prompt_lookup", "spec_int8_k2", "spec_int8_k4"):  # batch 1 only in transformers
        assert (name, 1, None) in systems and (name, 2, None) not in systems
    assert ("hamburger_engine", 1, 0.3) in systems and ("hamburger_engine", 2, 0.3) not in systems
    for row in result["rows"]:
        assert row["generated_tokens"] > 0 and row["decode_tokens_per_s"] > 0
        assert row["kv_entries"] >= row["prompt_tokens"]
    base = next(r for r in result["rows"] if r["system"] == "engine_base" and r["batch_size"] == 1)
    assert base["tokens_per_step"] == 1.0 and base["kv_entries_per_generated_token"] == 1.0
    entry = result["kv_bytes_per_entry"]
    assert base["kv_bytes_per_generated_token"] == entry  # one entry per generated token
    for row in result["rows"]:  # KV as memory beside the entries: per generated token and per request
        if row["system"] != "llama_cpp":  # its cache is float16 (`entry_bytes`)
            assert row["kv_bytes_per_generated_token"] == pytest.approx(row["kv_entries_per_generated_token"] * entry)
        assert row["kv_bytes_per_request"] == pytest.approx(row["kv_bytes"] / row["sequences"])
    ham = next(r for r in result["rows"] if r["system"] == "hamburger_engine" and r["batch_size"] == 1)
    assert ham["kv_bytes_per_generated_token"] == pytest.approx(entry / ham["tokens_per_step"])
    summary = result["summary"]
    assert {"hamburger_vs_base_b1", "hamburger_vs_hf_generate_b1", "kv_entries_per_generated_token"} <= summary.keys()
    assert "hamburger_vs_base_b16" not in summary  # 16 was not among the batch sizes
    costs = result["step_costs"]
    assert costs["base_step_s"] > 0 and costs["micro_over_base"] > 0
    curve = result["kv_curve"]
    assert curve["hamburger"][-1] <= curve["base"][-1]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "confidence_sweep.png", "kv_entries.png", "tokens_per_s.png"]
    out = capsys.readouterr().out
    assert "decode tok/s" in out and "KV KB/gen token" in out and "KV MB/request" in out


def test_bench_prompt_sets_are_held_out_and_long():
    assert len(bench_messages("code", 2)) == 2 and len(bench_messages("chat", 2)) == 2
    assert all(len(doc) >= 1500 for _, doc in long_documents(2))


def test_bench_prompts_are_shipped_and_nothing_is_generated(monkeypatch):
    from hamburger.evaluation import bench_prompts
    from hamburger.training import sources

    def never(*args, **kwargs):
        raise AssertionError("a benchmark generated prompts")

    for name in ("gsm_prompts", "chat_prompts", "code_prompts", "_generate_gsm"):
        monkeypatch.setattr(sources, name, never)
    for name, count in bench_prompts.COUNTS.items():
        got = bench_messages(name, 1000)
        assert len(got) == count and len(bench_messages(name, 3)) == 3
        assert bench_messages(name, 3) == got[:3]  # the first prompts, whatever the count asked
        assert all(m and m[-1]["role"] == "user" and m[-1]["content"].strip() for m in got)
    # the held-out split's rule, checked on the shipped text: a chat question and a GSM template are held out
    assert all(sources._held_out(m[0]["content"]) for m in bench_messages("chat", 1000))
    assert len({m[0]["content"] for m in bench_messages("math", 1000)}) == bench_prompts.COUNTS["math"]


@pytest.mark.parametrize("args,message", [
    (["--batch-sizes", "0"], "positive"),
    (["--systems", "nope"], "unknown systems"),
    (["--sets", "poems"], "unknown prompt sets"),
    (["--runs", "0"], ">= 1"),
    (["--confidence", "1.5"], "confidence"),
    (["--quantize", "none,int3"], "--quantize must be a comma list from auto, none, fp16, int8, int4"),
    (["--quantize", "int4", "--group-size", "48"], "group_size must be one of"),
])
def test_bench_bad_input(checkpoint, capsys, args, message):
    assert main(["bench", "--model", str(checkpoint), *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_forced_steps_replay_the_data_distribution(tmp_path, checkpoint, capsys):
    import random

    rows = []
    rng = random.Random(0)
    for i in range(8):
        steps = [rng.choice([1, 2, 4]) for _ in range(6)]
        rows.append({"id": f"x{i}", "input_ids": [5, 6] + [7] * sum(steps), "prompt_len": 2, "steps": steps})
    data = tmp_path / "seg.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "b.json"
    assert main(["bench", "--model", str(checkpoint), "--sets", "code", "--systems", "engine_base,hamburger_forced",
                 "--batch-sizes", "1", "--max-new-tokens", "16", "--runs", "1", "--forced-steps", str(data),
                 "--profile", "--json", str(out)]) == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["profile"] and all(p["self_ms_per_step"] >= 0 for p in result["profile"])
    summary = result["summary"]
    assert summary["forced_steps_tokens_per_step_b1"] > 1.5 and summary["forced_steps_vs_base_b1"] > 0


def test_bench_quantized_schemes_side_by_side(tmp_path, checkpoint, capsys):
    out = tmp_path / "q.json"
    code = main(["bench", "--model", str(checkpoint), "--sets", "code,chat",
                 "--systems", "engine_base,hamburger_engine", "--quantize", "none,int8", "--batch-sizes", "1,2", "--max-new-tokens", "8", "--runs", "1",
                 "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(out.read_text())
    assert result["quantize"] == ["none", "int8"]
    rows = {(r["system"], r["batch_size"]): r for r in result["rows"]}
    assert set(rows) == {(s + q, b) for s in ("engine_base", "hamburger_engine") for q in ("", "+int8") for b in (1, 2)}
    for (system, batch), row in rows.items():
        plain = rows[system.removesuffix("+int8"), batch]
        assert row["prompt_tokens"] == plain["prompt_tokens"]  # the same prompts for every scheme
        if system.endswith("+int8"):
            assert row["quantize"] == "int8" and row["weights_mb"] < plain["weights_mb"]
            assert 0 <= row["prefix_vs_float"] <= 1 and row["compared_replies"] == 2
            assert f"{system}_b{batch}_vs_base" in result["summary"]
            same = result["summary"].get(f"{system}_b{batch}_vs_same_weights_base")
            assert (same is None) == (system == "engine_base+int8")  # like for like: against engine_base+int8
            if same is not None:
                want = row["decode_tokens_per_s"] / rows["engine_base+int8", batch]["decode_tokens_per_s"]
                assert abs(same - want) < 1e-9
        else:
            assert row["quantize"] == "none" and "same_as_float" not in row
    # int8 does not flip the tiny base's (peaky) greedy choices: the base's replies are the float ones.
    assert rows["engine_base+int8", 1]["same_as_float"] == 1.0
    assert "hamburger_vs_base_b1" in result["summary"]  # the float comparison is still there
    assert "engine_base+int8" in captured.out and "weights MB" in captured.out and "× float base" in captured.out
    assert captured.err.count("quantize: int8:") == 1  # one quantized load for the whole run


def test_bench_agreement():
    from hamburger.evaluation.bench import agreement

    ref = {(1,): [5, 6, 7, 1], (2,): [8, 9]}
    assert agreement(ref, ref) == {"same_as_float": 1.0, "prefix_vs_float": 1.0, "compared_replies": 2}
    got = agreement(ref, {(1,): [5, 6, 0, 1], (2,): [8, 9, 10, 11]})
    assert got["same_as_float"] == 0 and got["prefix_vs_float"] == (2 / 4 + 2 / 4) / 2


def test_llama_cpp_is_skipped_with_the_reason(tmp_path, checkpoint, capsys, monkeypatch):
    """Without llama-cpp-python (or without a GGUF base) the system is skipped, the reason logged and kept."""
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    from hamburger.evaluation.llamacpp import Unavailable, llama_cpp_system

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    for lookup in (False, True):
        with pytest.raises(Unavailable, match="llama-cpp-python is not installed"):
            llama_cpp_system(gguf, {1}, lookup=lookup)
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(checkpoint), "--systems", "engine_base,llama_cpp", "--sets", "chat",
                 "--batch-sizes", "1", "--max-new-tokens", "4", "--runs", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["system"] for r in result["rows"]] == ["engine_base"]
    assert "llama.cpp needs the base as a .gguf file" in result["skipped"]["llama_cpp"]  # a tiny HF-format base
    assert "llama_cpp: skipped" in capsys.readouterr().err


def test_llama_cpp_system_times_greedy_generation(tmp_path, monkeypatch):
    """The llama_cpp system against a stand-in for llama-cpp-python: greedy settings, a fresh cache per prompt,
    EOS and the token limit respected, the figures counted like every other system's."""
    import sys
    import types

    calls = []

    class FakeLlama:
        def __init__(self, model_path, **kwargs):
            calls.append(("init", model_path, kwargs["n_batch"], kwargs["n_threads"]))

        def reset(self):
            calls.append(("reset",))

        def generate(self, tokens, temp, top_k, repeat_penalty, **kwargs):
            assert temp == 0.0 and top_k == 1 and repeat_penalty == 1.0
            yield from [len(tokens) + 10, len(tokens) + 11, 1, 99, 99]  # EOS (1) at the third token

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    from hamburger.evaluation.llamacpp import llama_cpp_system

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" * 10)
    record: dict = {}
    run = llama_cpp_system(gguf, {1}, record=record)
    stats = run([[5, 6], [7, 8, 9]], 8)
    assert stats.sequences == 2 and stats.prompt_tokens == 5 and stats.generated_tokens == 6
    assert record[(5, 6)] == [12, 13, 1] and record[(7, 8, 9)] == [13, 14, 1]
    assert run([[5, 6]], 2).generated_tokens == 2  # the token limit
    assert calls[0][2] == 1 and [c for c in calls if c == ("reset",)] == [("reset",)] * 3
    assert run.weights_bytes == 40


def test_measure_interleaves_the_systems_runs():
    """Run r of every system before run r + 1 of any, each round starting one system later: a slow spell of the
    machine then falls on all systems alike. Each system's figures are its own runs' median."""
    from hamburger.evaluation.bench_systems import measure  # noqa: PLC0415
    from hamburger.inference.stats import GenerationStats  # noqa: PLC0415

    calls = []

    def system(name, seconds):
        def run(prompts, n):
            calls.append((name, n))
            return GenerationStats(sequences=len(prompts), generated_tokens=11 * len(prompts), decode_s=seconds)
        return run

    rows = measure([(system("a", 1.0), [[1], [2]], 2), (system("b", 2.0), [[1], [2]], 1)], max_new=16, runs=3,
                   device=torch.device("cpu"))
    assert calls == [("a", 8), ("b", 8),  # warm-ups
                     ("a", 16), ("b", 16), ("b", 16),  # run 1: a (one batch of 2), b (two batches of 1)
                     ("b", 16), ("b", 16), ("a", 16),  # run 2 starts with b
                     ("a", 16), ("b", 16), ("b", 16)]  # run 3 with a again
    assert rows[0]["decode_tokens_per_s"] == 20 / 1.0 and rows[1]["decode_tokens_per_s"] == 20 / 4.0
    assert len(rows[0]["runs_tokens_per_s"]) == 3


def test_llama_cpp_runs_once_beside_the_first_scheme(tmp_path, checkpoint, monkeypatch):
    """llama.cpp decodes its own GGUF: one row, named without a scheme and marked `gguf`, run beside the first
    scheme listed (not only beside float32), and every scheme's base compared with it in the summary."""
    from hamburger.evaluation import bench as bench_mod
    from hamburger.inference.stats import GenerationStats

    real = bench_mod.make_system

    def fake(name, *args, **kwargs):
        if name != "llama_cpp":
            return real(name, *args, **kwargs)
        return lambda prompts, n: GenerationStats(sequences=len(prompts), prompt_tokens=sum(map(len, prompts)),
                                                  generated_tokens=n * len(prompts), macro_steps=n * len(prompts),
                                                  base_forwards=n, row_forwards=n * len(prompts), decode_s=0.01)

    monkeypatch.setattr(bench_mod, "make_system", fake)
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(checkpoint), "--systems", "engine_base,llama_cpp", "--sets", "chat",
                 "--batch-sizes", "1", "--max-new-tokens", "4", "--runs", "1", "--quantize", "int8,none",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["system"], r["quantize"]) for r in result["rows"]] == [
        ("engine_base+int8", "int8"), ("llama_cpp", "gguf"), ("engine_base", "none")]
    assert "engine_base+int8_vs_llama_cpp_b1" in result["summary"] and "engine_base_vs_llama_cpp_b1" in result["summary"]


def test_kv_bytes_per_entry_is_layers_kv_heads_head_dim_and_dtype(checkpoint):
    """One definition (`stats.kv_bytes_per_entry`): layers x 2 (K and V) x KV heads x head dim x the cache dtype's
    bytes; the bench's entries take the dtype of the base's parameters, llama.cpp's float16."""
    from types import SimpleNamespace

    from hamburger.evaluation.bench_systems import entry_bytes
    from hamburger.inference.stats import kv_bytes_per_entry
    from hamburger.model.hamburger_model import load_model

    smol = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, num_attention_heads=9, hidden_size=576)
    assert kv_bytes_per_entry(smol, torch.float32) == 30 * 2 * 3 * 64 * 4 == 46080
    assert kv_bytes_per_entry(smol, torch.bfloat16) == kv_bytes_per_entry(smol, 2) == 23040
    assert kv_bytes_per_entry(SimpleNamespace(**vars(smol), head_dim=128), torch.float16) == 30 * 2 * 3 * 128 * 2
    model = load_model(str(checkpoint))[0]
    cfg = model.base.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    want = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim
    assert entry_bytes(model) == want * next(model.base.parameters()).element_size()
    assert entry_bytes(model, torch.float16) == want * 2
