"""Probe: the final norms inside the native call (`native_layers.FinalNorm`), and the LM head's argmax after them in
the same call (`hb_pass.head`), against PyTorch's norm and the head's own call after the layers' call, interleaved
prompt by prompt in one process, base and verify, the default (int4/int8), greedy, batch 1. Variants: "head" (both
in the call), "norm" (the norm in the call, the head's own call), "torch" (neither).

    python benchmarks/probes/final_norm_ab.py --rounds 3
"""
import argparse
import time

import torch

import hamburger.inference.runner as runner_mod

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
VARIANTS = ("head", "norm", "torch")
native_head = runner_mod.native_head
for fused in VARIANTS:
    for name, m, mode in (("base", HamburgerModel.plain(model.base, model.tokenizer), None), ("verify", model, "verify")):
        e = Engine(m)
        if fused == "torch":
            e.runner._norm = e.runner._micro_norm = None
        systems[(name, fused)] = (e, mode)
times = {k: 0.0 for k in systems}
toks = {k: 0 for k in systems}
outs = {}
with torch.inference_mode():
    for k, (e, mode) in systems.items():
        runner_mod.native_head = native_head if k[1] == "head" else (lambda *args: None)
        e.generate([prompts[0]], max_new_tokens=16, mode=mode)
    order = list(systems)
    for r in range(a.rounds):
        for i, prompt in enumerate(prompts):
            rot = order[(i + r) % len(order):] + order[:(i + r) % len(order)]
            for k in rot:
                e, mode = systems[k]
                runner_mod.native_head = native_head if k[1] == "head" else (lambda *args: None)
                gen = e.stream([prompt], max_new_tokens=a.max_new_tokens, mode=mode)
                events = iter(gen)
                first = next(events)
                t0 = time.perf_counter()
                for _ in events:
                    pass
                times[k] += time.perf_counter() - t0
                out = gen.output().tokens[0]
                toks[k] += len(out) - len(first.tokens[0])
                outs.setdefault((i, k[0], k[1]), out)
        print(f"round {r}: " + ", ".join(f"{k[0]} {k[1]} {times[k] / toks[k] * 1e3:.3f} ms/tok" for k in systems),
              flush=True)
ms = {k: times[k] / toks[k] * 1e3 for k in systems}
for name in ("base", "verify"):
    print(f"{name}: ms a token " + ", ".join(f"{v} {ms[(name, v)]:.3f}" for v in VARIANTS)
          + f"; torch over head {ms[(name, 'torch')] / ms[(name, 'head')]:.3f}x, norm over head "
          f"{ms[(name, 'norm')] / ms[(name, 'head')]:.3f}x, torch over norm {ms[(name, 'torch')] / ms[(name, 'norm')]:.3f}x")
n = len(prompts)
same = sum(outs[(i, m, v)] == outs[(i, m, "torch")] for i in range(n) for m in ("base", "verify") for v in VARIANTS[:2])
vb = sum(outs[(i, "verify", v)] == outs[(i, "base", v)] for i in range(n) for v in VARIANTS)
print(f"replies the same as with torch's norm and the head's own call: {same}/{4 * n}; verify = base: {vb}/{3 * n}")
