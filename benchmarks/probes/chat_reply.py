"""Probe: `make demo`'s short chat reply, base and verify alternating on one pair of engines, what each verify step
did (drafts by source, kept, micro-step calls) and the decode time each way.

    python benchmarks/probes/chat_reply.py --runs 10
"""
import argparse
import time

import torch

from hamburger.evaluation.demo import PROMPTS
from hamburger.inference.engine import Engine
from hamburger.loading import load
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import HamburgerModel

p = argparse.ArgumentParser()
p.add_argument("--runs", type=int, default=10)
p.add_argument("--prompt", type=int, default=2)
p.add_argument("--max-new-tokens", type=int, default=256)
a = p.parse_args()
model, _ = load("default", quantize="auto", decode_only=True)
ids = encode_chat(model.tokenizer, [{"role": "user", "content": PROMPTS[a.prompt]}])
engines = {"base": (Engine(HamburgerModel.plain(model.base, model.tokenizer)), {}),
           "verify": (Engine(model), {"mode": "verify"})}
t = {k: 0.0 for k in engines}
n = {k: 0 for k in engines}
with torch.inference_mode():
    for e, kw in engines.values():
        e.generate([ids], max_new_tokens=16, **kw)
    for r in range(a.runs):
        for name in (("base", "verify") if r % 2 == 0 else ("verify", "base")):
            e, kw = engines[name]
            gen = e.stream([ids], max_new_tokens=a.max_new_tokens, **kw)
            events = iter(gen)
            first = next(events)
            t0 = time.perf_counter()
            steps = 0
            for _ in events:
                steps += 1
            dt = time.perf_counter() - t0
            out = gen.output()
            toks = len(out.tokens[0]) - len(first.tokens[0])
            t[name] += dt
            n[name] += toks
            if name == "verify" and r < 2:
                print(out.stats)
            print(f"run {r} {name}: {toks} tokens in {steps} steps, {dt * 1e3:.1f} ms, {dt / toks * 1e3:.3f} ms a token",
                  flush=True)
ms = {k: t[k] / n[k] * 1e3 for k in engines}
print(f"over {a.runs} runs: base {ms['base']:.3f} ms a token, verify {ms['verify']:.3f}: verify {ms['base'] / ms['verify']:.3f}x the base")
