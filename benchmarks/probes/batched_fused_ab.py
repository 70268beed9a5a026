"""Probe: the batched step's check reading its greedy tokens from the pass's own call (verify.check now) against
the head's own call after it (verify.check before, `verify_before.py`: commit c982748's), interleaved prompt by
prompt: compress mode at batch 1 and verify mode on the batched step (Engine(alone=False)), the default, 256 tokens.

    python benchmarks/probes/batched_fused_ab.py --rounds 2
"""
import argparse
import importlib.util
import pathlib
import time

import torch

import hamburger.inference.verify as verify
from hamburger.evaluation.bench_systems import bench_messages
from hamburger.inference.engine import Engine
from hamburger.loading import load
from hamburger.model.base import encode_chat

spec = importlib.util.spec_from_file_location("verify_before", pathlib.Path(__file__).with_name("verify_before.py"))
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)
new_check = verify.check
p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=2)
a = p.parse_args()
model, _ = load("default", quantize="auto", decode_only=True)
prompts = [encode_chat(model.tokenizer, m) for s in ("code", "math", "chat") for m in bench_messages(s, 3)]
systems = {(mode, version): (Engine(model, alone=False), mode) for mode in ("compress", "verify")
           for version in ("now", "before")}
t = {k: 0.0 for k in systems}
n = {k: 0 for k in systems}
outs = {}
with torch.inference_mode():
    for (mode, version), (e, _) in systems.items():
        verify.check = new_check if version == "now" else before.check
        e.generate([prompts[0]], max_new_tokens=16, mode=mode)
    order = list(systems)
    for r in range(a.rounds):
        for i, prompt in enumerate(prompts):
            k0 = (i + r) % len(order)
            for k in order[k0:] + order[:k0]:
                e, mode = systems[k]
                verify.check = new_check if k[1] == "now" else before.check
                gen = e.stream([prompt], max_new_tokens=256, mode=mode)
                events = iter(gen)
                first = next(events)
                t0 = time.perf_counter()
                for _ in events:
                    pass
                t[k] += time.perf_counter() - t0
                n[k] += len(gen.output().tokens[0]) - len(first.tokens[0])
                outs.setdefault((i, k), gen.output().tokens[0])
        print(f"round {r}: " + ", ".join(f"{k[0]} {k[1]} {t[k] / n[k] * 1e3:.3f} ms/tok" for k in systems), flush=True)
for mode in ("compress", "verify"):
    now, old = t[(mode, "now")] / n[(mode, "now")], t[(mode, "before")] / n[(mode, "before")]
    same = sum(outs[(i, (mode, "now"))] == outs[(i, (mode, "before"))] for i in range(len(prompts)))
    print(f"{mode}: now {now * 1e3:.3f} ms a token, before {old * 1e3:.3f}: now {old / now:.3f}x; same replies {same}/{len(prompts)}")
