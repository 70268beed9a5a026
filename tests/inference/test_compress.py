"""Compress mode ('process, then compress'): verify's drafting against a base whose past steps are each one
merged KV entry. Held to the merger's step-by-step reference, to the plain base where merging is the identity,
and to one cache entry per step."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import base_greedy, hamburger, random_merger
from hamburger import HamburgerError
from hamburger.cli import main
from hamburger.inference.engine import Engine
from hamburger.inference.reference import drain
from hamburger.model.hamburger_model import MERGER_NAME, HamburgerModel
from hamburger.model.merger import KVMerger, stepwise_forward

PROMPTS = [[5, 17, 33, 8, 60, 12, 9], [40, 41], [7, 90, 23, 23, 51]]


def merged_steps(steps: list[int]) -> list[int]:
    """The steps compress mode merged, from the steps it emitted: a pass emits [kept drafts.., t'] and merges
    [t, kept drafts..], so merged step j is as long as emitted step j+1; the last token is still pending."""
    return steps[1:] + [1]


def with_merger(arch: str, merger: KVMerger | None = None) -> HamburgerModel:
    model = hamburger(arch, k=4)
    model.attach_merger(merger or random_merger(model.base, channels=arch == "qwen2"))
    return model


def reference_next(model: HamburgerModel, prompt: list[int], tokens: list[int], closed: list[int]) -> int:
    """The merger's reference decoder's greedy next token: the prompt, `closed` steps (covering the first
    tokens) as one merged entry each (those of the model's merge window still as their own entries), the rest
    of `tokens` as the open step's own entries."""
    steps = closed + [len(tokens) - sum(closed) + 1]  # the open step, and the next token (a dummy 0)
    logits = stepwise_forward(model.base, model.merger, prompt + tokens + [0], len(prompt), steps,
                              window=model.config.merge_window)[0]
    return int(logits[-1].argmax())


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compress_decoding_equals_the_mergers_stepwise_reference(arch, window, monkeypatch):
    """Every emitted token is the argmax of the merger's reference decoder (a list cache holding the prompt
    and one merged entry per closed step) over the steps the run closed. Batch of 3, left-padded, rows
    accepting different numbers of drafts: the drafts are the reference's own tokens, a third of them spoilt.
    With a merge window of 3, the steps of the latest 3 positions keep their own entries (moved down in the
    cache whenever an older step is merged): the same reference with that window."""
    model = with_merger(arch)
    model.config.merge_window = window
    rng = random.Random(0)

    seen: dict[int, list[int]] = {}  # each row's steps so far, read off the growth of its history

    def drafter(ids, histories, room):
        rows = []
        for b, hist, limit in zip(ids, histories, room):
            steps = seen.setdefault(b, [])
            steps.append(len(hist) - sum(steps))  # this pass's step: its kept drafts and the base's token 0
            toks, closed, drafts = list(hist), steps[1:], []
            for _ in range(min(limit, 3)):
                nxt = reference_next(model, PROMPTS[b], toks, closed)
                drafts.append(nxt if rng.random() > 0.3 else (nxt + 1) % 96)
                toks.append(drafts[-1])
            rows.append(drafts)
        return rows

    gen = Engine(model, drafter=drafter).stream(PROMPTS, max_new_tokens=20, confidence=0.5, mode="compress")
    out = drain(gen)
    for prompt, tokens, steps in zip(PROMPTS, out.tokens, out.steps):
        assert sum(steps) == len(tokens)
        logits = stepwise_forward(model.base, model.merger, prompt + tokens, len(prompt), merged_steps(steps),
                                  window=window)[0]
        assert logits.argmax(-1).tolist() == tokens, steps
    lengths = [n for steps in out.steps for n in steps[1:]]
    assert len(set(lengths)) >= 3, lengths  # steps of several lengths were merged
    stats = out.stats
    assert stats.kv_entries == stats.prompt_tokens + stats.macro_steps + stats.window_entries < stats.kv_entries_base
    assert (stats.window_entries > 0) == (window > 1)


def test_a_window_longer_than_the_reply_is_the_base(arch):
    """With a merge window longer than any reply nothing is ever merged: compress mode is then verify mode,
    exactly the base's greedy output whatever the merger, one KV entry per token."""
    model = with_merger(arch)
    model.config.merge_window = 1000
    out = Engine(model).generate(PROMPTS, max_new_tokens=16, confidence=0.01, mode="compress")
    for prompt, tokens in zip(PROMPTS, out.tokens):
        assert tokens == base_greedy(model, prompt, 16)
    assert out.stats.drafted_tokens > 0
    assert out.stats.kv_entries == out.stats.kv_entries_base


def reference_greedy(model: HamburgerModel, prompt: list[int], n: int, k: int) -> list[int]:
    """Greedy tokens of the reference decoder when every closed step is k tokens (from the first response token)."""
    tokens: list[int] = []
    while len(tokens) < n:
        tokens.append(reference_next(model, prompt, tokens, [k] * (len(tokens) // k)))
    return tokens


def test_with_drafts_that_are_always_right_every_step_is_k_tokens(monkeypatch):
    """Drafts from an oracle (the reference decoder's own greedy tokens) are all kept: steps of K tokens, one
    merged entry each, and the output is still the reference decoder's."""
    model = with_merger("llama")
    prompt, n = PROMPTS[0], 24
    expected = reference_greedy(model, prompt, n, 4)
    assert 1 not in expected  # no EOS: the run goes the whole way

    def oracle(ids, histories, room):
        return [expected[len(h): len(h) + min(r, 3)] for h, r in zip(histories, room)]

    out = Engine(model, drafter=oracle).generate([prompt], max_new_tokens=n, confidence=0.5, mode="compress")
    assert out.tokens[0] == expected
    assert out.steps[0] == [1, 4, 4, 4, 4, 4, 3]  # the last step cut by the token budget
    stats = out.stats
    assert stats.base_forwards == 7 and stats.tokens_per_forward == n / 7
    assert stats.kv_entries == len(prompt) + 7  # one KV entry per step, not per token


def test_an_identity_merge_is_the_base(arch):
    """An untrained merger (mean of the step's tokens, bias log k) with one-token steps changes nothing: at
    confidence 1.0 (no drafts) compress mode is exactly the base's greedy output."""
    model = hamburger(arch, k=4)
    model.attach_merger(KVMerger.for_base(model.base.config, 4, gates=True))
    out = Engine(model).generate(PROMPTS, max_new_tokens=16, confidence=1.0, mode="compress")
    for prompt, tokens in zip(PROMPTS, out.tokens):
        assert tokens == base_greedy(model, prompt, 16)[: len(tokens)]
        assert len(tokens) == 16 or tokens[-1] == 1


def test_compress_needs_a_merger_for_steps_as_long():
    model = hamburger("llama", k=4)
    with pytest.raises(HamburgerError, match="needs a KV merger"):
        Engine(model).generate(PROMPTS, max_new_tokens=4, mode="compress")
    model.attach_merger(KVMerger.for_base(model.base.config, 2))
    with pytest.raises(HamburgerError, match="steps of up to 2"):
        Engine(model).generate(PROMPTS, max_new_tokens=4, mode="compress")
    with pytest.raises(HamburgerError, match="do not apply to compress mode"):
        model.attach_merger(KVMerger.for_base(model.base.config, 4))
        Engine(model).generate(PROMPTS, max_new_tokens=4, mode="compress", forced_steps=[[2]] * 3)


def test_the_merger_travels_with_the_checkpoint(tmp_path, checkpoint, capsys):
    model = HamburgerModel.from_pretrained(checkpoint)
    assert model.merger is None
    assert main(["generate", "w5 w6", "--model", str(checkpoint), "--mode", "compress", "--max-new-tokens", "4"]) == 2
    assert "needs a KV merger" in capsys.readouterr().err
    merger = random_merger(model.base)
    model.attach_merger(merger)
    model.save_pretrained(tmp_path / "with-merger")
    again = HamburgerModel.from_pretrained(tmp_path / "with-merger")
    assert torch.equal(again.merger.k_logits, merger.k_logits) and torch.equal(again.merger.c, merger.c)
    assert main(["generate", "w5 w6", "--model", str(tmp_path / "with-merger"), "--mode", "compress",
                 "--max-new-tokens", "6"]) == 0
    # A merger fitted to another base is refused when the checkpoint loads.
    merger.save(tmp_path / "with-merger" / MERGER_NAME, base_fingerprint="0123456789abcdef")
    with pytest.raises(HamburgerError, match="fitted to another base"):
        HamburgerModel.from_pretrained(tmp_path / "with-merger")
    (tmp_path / "with-merger" / MERGER_NAME).write_bytes(b"not safetensors")
    assert main(["generate", "w5 w6", "--model", str(tmp_path / "with-merger"), "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert f"{MERGER_NAME}: not a readable safetensors file" in err and "Traceback" not in err


def test_bench_and_eval_run_compress_mode(tmp_path, checkpoint, capsys):
    """`bench` (system hamburger_compress) and `eval --mode compress` on a checkpoint with a merger; without
    one both refuse before decoding."""
    model = HamburgerModel.from_pretrained(checkpoint)
    assert main(["bench", "--model", str(checkpoint), "--systems", "hamburger_compress", "--sets", "chat",
                 "--batch-sizes", "1", "--max-new-tokens", "4", "--runs", "1"]) == 2
    assert "needs a KV merger" in capsys.readouterr().err
    model.attach_merger(random_merger(model.base))
    model.save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(tmp_path / "ckpt"), "--systems", "engine_base,hamburger_verify,"
                 "hamburger_compress", "--sets", "code,chat", "--batch-sizes", "1,2", "--max-new-tokens", "8",
                 "--runs", "1", "--verify-confidence", "0.2", "--json", str(out)]) == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    rows = {(r["system"], r["batch_size"]): r for r in result["rows"]}
    for batch in (1, 2):
        compress, verify = rows["hamburger_compress", batch], rows["hamburger_verify", batch]
        assert compress["confidence"] == 0.2 and compress["generated_tokens"] > 0
        assert compress["kv_entries"] == compress["prompt_tokens"] + compress["macro_steps"]
        assert verify["kv_entries"] == verify["prompt_tokens"] + verify["generated_tokens"]  # verify keeps them all
        assert f"compress_vs_base_b{batch}" in result["summary"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w5 w6 w7"}\n{"prompt": "w9 w10"}\n')
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(tmp_path / "ckpt"), "--tasks", "prompts", "--prompts", str(prompts),
                 "--mode", "verify,compress", "--max-new-tokens", "6", "--json", str(out)]) == 0
    systems = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert {"base", "verify@0.3", "compress@0.3"} <= systems.keys()
    assert systems["verify@0.3"]["agreement"] == 1.0


def test_the_merger_follows_the_model_to_another_device_and_keeps_its_dtype():
    model = hamburger("llama", k=4)
    model.attach_merger(random_merger(model.base))
    model.to("meta")
    assert model.merger.a.device.type == "meta" and model.merger.a.dtype == torch.float32
    model.to(torch.bfloat16)
    assert model.merger.a.dtype == torch.float32  # the base's dtype changes, the merger's stays
