"""Probe: the final norms inside the native call (`native_layers.FinalNorm`) against PyTorch's norm after it,
interleaved prompt by prompt in one process, base and verify, the default (int4/int8), greedy, batch 1.

    python benchmarks/probes/final_norm_ab.py --rounds 3
"""
import argparse
import time

import torch

from hamburger.evaluation.bench_systems import bench_messages
from hamburger.inference.engine import Engine
from hamburger.loading import load
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import HamburgerModel

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--max-new-tokens", type=int, default=256)
a = p.parse_args()
torch.manual_seed(0)
model, _ = load("default", quantize="auto", decode_only=True)
prompts = [encode_chat(model.tokenizer, m) for s in ("code", "math", "chat") for m in bench_messages(s, 3)]
systems = {}
for fused in (True, False):
    for name, m, mode in (("base", HamburgerModel.plain(model.base, model.tokenizer), None), ("verify", model, "verify")):
        e = Engine(m)
        if not fused:
            e.runner._norm = e.runner._micro_norm = None
        systems[(name, fused)] = (e, mode)
times = {k: 0.0 for k in systems}
toks = {k: 0 for k in systems}
outs = {}
with torch.inference_mode():
    for k, (e, mode) in systems.items():
        e.generate([prompts[0]], max_new_tokens=16, mode=mode)
    order = list(systems)
    for r in range(a.rounds):
        for i, prompt in enumerate(prompts):
            rot = order[(i + r) % len(order):] + order[:(i + r) % len(order)]
            for k in rot:
                e, mode = systems[k]
                gen = e.stream([prompt], max_new_tokens=a.max_new_tokens, mode=mode)
                events = iter(gen)
                first = next(events)
                t0 = time.perf_counter()
                for _ in events:
                    pass
                times[k] += time.perf_counter() - t0
                out = gen.output().tokens[0]
                toks[k] += len(out) - len(first.tokens[0])
                outs.setdefault((i, k[0] if k[0] == "base" else "v", k[1]), out)
        print(f"round {r}: " + ", ".join(f"{k[0]}{' fused' if k[1] else ' torch'} {times[k] / toks[k] * 1e3:.3f} ms/tok" for k in systems), flush=True)
for name in ("base", "verify"):
    print(f"{name}: fused {times[(name, True)] / toks[(name, True)] * 1e3:.3f} ms/token, torch norm "
          f"{times[(name, False)] / toks[(name, False)] * 1e3:.3f}: fused is "
          f"{(times[(name, False)] / toks[(name, False)]) / (times[(name, True)] / toks[(name, True)]):.3f}x")
same = sum(outs[(i, n, True)] == outs[(i, n, False)] for i in range(len(prompts)) for n in ("base", "v"))
vb = sum(outs[(i, "v", f)] == outs[(i, "base", f)] for i in range(len(prompts)) for f in (True, False))
print(f"replies the same with the fused norm as with torch's: {same}/{2 * len(prompts)}; verify = base: {vb}/{2 * len(prompts)}")
