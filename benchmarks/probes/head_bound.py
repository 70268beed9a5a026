"""Probe: could the LM head's greedy token come exactly from a 4-bit copy of the head plus a few exact rows?

The default's head (49152 x 576, Q8_0) is read whole at every step. A Q4_1 copy is half the bytes; if a worst-case
bound E_j on |exact_j - approx_j| were tight, only the rows j with approx_j + E_j >= max_i(approx_i - E_i) would
need their exact product, and the argmax would be exact. This collects the head's inputs from real decoding (the
bench's prompts, verify mode) and counts those candidate rows under three bounds on (w8_j - w4_j) . x:
Cauchy-Schwarz (||d_j|| ||x||), per block of 32 (sum_b ||d_jb|| ||x_b||) and per element (sum_b max|d_jb| ||x_b||_1),
each with a float-rounding margin.

    python benchmarks/probes/head_bound.py
"""
import torch

import hamburger.inference.runner as runner_mod
from hamburger.evaluation.bench_systems import bench_messages
from hamburger.inference.engine import Engine
from hamburger.kernels import native
from hamburger.kernels.qlinear import Int4Linear
from hamburger.loading import load
from hamburger.model.base import encode_chat

torch.manual_seed(0)
model, _ = load("default", quantize="auto", decode_only=True)
head = model.base.get_output_embeddings()
states = []
original = runner_mod.ModelRunner.head_argmax


def recording(self, h, shortlist=False):
    if not shortlist:
        states.append(h.reshape(-1, h.shape[-1]).clone())
    return original(self, h, shortlist)


runner_mod.ModelRunner.head_argmax = recording
prompts = [encode_chat(model.tokenizer, m) for s in ("code", "math", "chat") for m in bench_messages(s, 2)]
engine = Engine(model)
with torch.inference_mode():
    for p in prompts:
        engine.generate([p], max_new_tokens=128, mode="verify")
x = torch.cat(states)
w8 = head.dequantize().float()
linear = torch.nn.Linear(w8.shape[1], w8.shape[0], bias=False)
linear.weight.data = w8.clone()
approx_head = Int4Linear.from_linear(linear, 32)
w4 = approx_head.dequantize().float()
diff = (w8 - w4).view(w8.shape[0], -1, 32)
xb = x.view(x.shape[0], -1, 32)
with torch.inference_mode():
    exact = native.linear(x.contiguous(), head.native_desc())
    approx = native.linear(x.contiguous(), approx_head.native_desc())
margin = 1e-5 * (w8.norm(dim=1) + w4.norm(dim=1))[None] * x.norm(dim=1, keepdim=True)  # float rounding, generous
bounds = {"Cauchy-Schwarz": diff.flatten(1).norm(dim=1)[None] * x.norm(dim=1, keepdim=True),
          "per block": xb.norm(dim=2) @ diff.norm(dim=2).T,
          "per element": xb.abs().sum(2) @ diff.abs().amax(2).T}
print(f"{x.shape[0]} head inputs from {len(prompts)} prompts; |exact - approx| over the Cauchy-Schwarz bound: "
      f"mean {((exact - approx).abs() / bounds['Cauchy-Schwarz']).mean():.3f}\n")
print("| bound | candidate rows: mean | median | 90th percentile | the exact argmax among them |")
print("| --- | ---: | ---: | ---: | --- |")
for name, bound in bounds.items():
    e = bound + margin
    candidates = approx + e >= (approx - e).max(1, keepdim=True).values
    n = candidates.sum(1).float()
    inside = bool(candidates.gather(1, exact.argmax(1, keepdim=True)).all())
    print(f"| {name} | {n.mean():.0f} | {n.median():.0f} | {n.quantile(0.9):.0f} | {inside} |")
