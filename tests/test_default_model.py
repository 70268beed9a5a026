"""Slow tests on the real embedded default, SmolLM2-135M-Instruct from the packaged GGUF (offline)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hamburger import HamburgerConfig, HamburgerModel, generate, load_base

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a string."]


@pytest.fixture(scope="module")
def default():
    return load_base("default")


def chat_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


def test_converted_cache_equals_the_gguf(default, tmp_path, monkeypatch):
    """The first load converts the GGUF into a plain folder; later loads read it and get the same weights."""
    from hamburger import fingerprint
    from hamburger.model.base import converted_default_dir

    monkeypatch.setenv("HAMBURGER_CACHE", str(tmp_path))
    direct, _ = load_base("default")  # parses the GGUF, writes the cache
    assert (converted_default_dir() / "model.safetensors").is_file()
    cached, tok = load_base("default")
    assert fingerprint(cached) == fingerprint(direct) == fingerprint(default[0])
    ids = torch.tensor([chat_ids(tok, "hi")])
    assert torch.equal(cached(ids).logits, direct(ids).logits)
    assert cached.config.hamburger_ref == "SmolLM2-135M-Instruct"


def test_default_loads_offline_with_its_chat_template(default):
    base, tok = default
    assert base.config.model_type == "llama" and base.config.num_hidden_layers == 30
    assert "<|im_start|>" in tok.chat_template
    assert tok.decode(chat_ids(tok, "hi")).startswith("<|im_start|>system")


@pytest.mark.parametrize("k,confidence", [(1, 0.8), (4, 1.0)])
def test_one_token_per_step_equals_base_greedy_on_default(default, k, confidence):
    base, tok = default
    model = HamburgerModel.wrap(base, tok, HamburgerConfig(max_step_tokens=k, micro_layers=1)).eval()
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    ours = generate(model, prompts, max_new_tokens=40, confidence=confidence)  # batched, left-padded
    for prompt, tokens in zip(prompts, ours.tokens):
        ids = torch.tensor([prompt])
        ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        assert tokens == ref[0, len(prompt):].tolist()
    assert ours.stats.tokens_per_step == 1.0


def test_cli_generate_json_on_default_offline():
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "hamburger.cli", "generate", "What is 2 + 3?", "--max-new-tokens", "16",
                           "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["text"] and 1 <= out["generated_tokens"] <= 16
    # the default decodes in verify mode: one KV entry per token, as the base
    assert out["mode"] == "verify" and out["decode_tokens_per_s"] > 0
    assert out["kv_entries"] == out["prompt_tokens"] + out["generated_tokens"] == out["kv_entries_base"]


def test_shipped_checkpoint_at_confidence_one_is_the_base_and_speeds_up_below():
    """The trained default in the package: confidence 1.0 never continues a step, so it is the base exactly."""
    from hamburger.model.hamburger_model import load_model, packaged_checkpoint

    if packaged_checkpoint() is None:
        pytest.skip("no trained checkpoint ships in this build")
    model, trained = load_model("default")
    assert trained and model.config.base_model == "SmolLM2-135M-Instruct"
    size = (packaged_checkpoint() / "model.safetensors").stat().st_size
    assert size <= 40 * 1024 * 1024
    prompts = [chat_ids(model.tokenizer, q) for q in QUESTIONS]
    exact = generate(model, prompts, max_new_tokens=40, confidence=1.0)
    for prompt, tokens in zip(prompts, exact.tokens):
        ids = torch.tensor([prompt])
        ref = model.base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        assert tokens == ref[0, len(prompt):].tolist()
    loose = generate(model, prompts, max_new_tokens=40, confidence=0.5)  # the trained stop head lets steps grow
    assert loose.stats.tokens_per_step > 1.0 and loose.stats.kv_entries < exact.stats.kv_entries


def test_fast_engine_on_the_shipped_default():
    """The fast engine on the real model: the base exactly at confidence 1.0, the reference path's tokens below."""
    from hamburger.inference.engine import Engine
    from hamburger.model.hamburger_model import load_model

    model, trained = load_model("default")
    prompts = [chat_ids(model.tokenizer, q) for q in QUESTIONS]
    engine = Engine(model, shortlist=False)
    exact = engine.generate(prompts, max_new_tokens=40, confidence=1.0, mode="trust")
    for prompt, tokens in zip(prompts, exact.tokens):
        ids = torch.tensor([prompt])
        ref = model.base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
        assert tokens == ref[0, len(prompt):].tolist()
    if trained:
        fast = engine.generate(prompts, max_new_tokens=40, confidence=0.5, mode="trust")
        ref = generate(model, prompts, max_new_tokens=40, confidence=0.5)
        assert fast.tokens == ref.tokens and fast.steps == ref.steps


def test_verify_mode_on_the_shipped_default_is_the_base():
    """Verify mode on the real model, batched (rows accept different numbers of drafts): the base's greedy
    tokens exactly, with drafts actually kept (more than one token per base forward)."""
    from hamburger.inference.engine import Engine
    from hamburger.model.hamburger_model import load_model

    model, trained = load_model("default")
    if not trained:
        pytest.skip("no trained checkpoint ships in this build")
    prompts = [chat_ids(model.tokenizer, q) for q in QUESTIONS]
    assert model.config.lookup == 2  # the shipped default drafts by lookup where it can
    for lookup in (2, 0):
        out = Engine(model, draft_rows=None, lookup=lookup).generate(prompts, max_new_tokens=40, confidence=0.1,
                                                                     mode="verify")
        for prompt, tokens in zip(prompts, out.tokens):
            ids = torch.tensor([prompt])
            ref = model.base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
            assert tokens == ref[0, len(prompt):].tolist()
        assert out.stats.drafted_tokens > 0 and out.stats.tokens_per_forward > 1.0
        assert (out.stats.lookup_drafts > 0) == (lookup > 0)


def test_compress_mode_on_the_shipped_default_follows_the_mergers_reference():
    """Compress mode on the real model with the shipped merger, batched: every token is the argmax of the
    merger's step-by-step reference over the steps the run closed, and the cache holds one entry per step (with
    a merge window, plus the latest steps' own entries; the shipped 48 would merge nothing in 24 tokens, so 0
    and 8 here)."""
    from hamburger.inference.engine import Engine
    from hamburger.model.hamburger_model import load_model
    from hamburger.model.merger import stepwise_forward

    model, trained = load_model("default")
    if not trained or model.merger is None:
        pytest.skip("no trained checkpoint with a KV merger ships in this build")
    prompts = [chat_ids(model.tokenizer, q) for q in QUESTIONS]
    assert model.config.merge_window == 48
    for window in (0, 8):
        model.config.merge_window = window
        out = Engine(model).generate(prompts, max_new_tokens=24, confidence=0.1, mode="compress")
        for prompt, tokens, steps in zip(prompts, out.tokens, out.steps):
            logits = stepwise_forward(model.base, model.merger, prompt + tokens, len(prompt), steps[1:] + [1],
                                      window=window)[0]
            assert logits.argmax(-1).tolist() == tokens, window
        stats = out.stats
        assert stats.kv_entries == stats.prompt_tokens + stats.macro_steps + stats.window_entries
        assert (stats.window_entries > 0) == (window > 0)
