"""Probe: the base's decode time a token against the prompt's length (50 to 2,000 tokens of README.md), the default,
greedy, batch 1, 128 new tokens, the better of two runs each.

    python benchmarks/probes/context_length.py
"""
import time, torch
from hamburger.inference.engine import Engine
from hamburger.loading import load
from hamburger.model.hamburger_model import HamburgerModel
model, _ = load("default", quantize="auto", decode_only=True)
e = Engine(HamburgerModel.plain(model.base, model.tokenizer))
text = open(__file__.rsplit("/benchmarks/", 1)[0] + "/README.md").read()
ids = model.tokenizer.encode(text)
with torch.inference_mode():
    e.generate([ids[:50]], max_new_tokens=8)
    for n in (50, 500, 1000, 2000):
        best = []
        for _ in range(2):
            gen = e.stream([ids[:n]], max_new_tokens=128, eos_token_ids=set())
            ev = iter(gen); first = next(ev); t0 = time.perf_counter()
            for _ in ev: pass
            dt = time.perf_counter() - t0
            best.append(dt / (len(gen.output().tokens[0]) - len(first.tokens[0])) * 1e3)
        print(f"prompt {n} tokens: {min(best):.2f} ms a token (base, 128 new tokens)", flush=True)
