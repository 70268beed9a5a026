# One-off probe of 2026-11-28 (HISTORY (18)); removed in the next commit. Run: python benchmarks/probes/operator_count.py
import torch, collections
from torch.utils._python_dispatch import TorchDispatchMode
from hamburger.loading import load
from hamburger.inference.engine import Engine
from hamburger.evaluation.bench_systems import bench_messages
from hamburger.model.base import encode_chat
model, _ = load("default", quantize="auto", decode_only=True)
eng = Engine(model)
p = encode_chat(model.tokenizer, bench_messages("code", 1)[0])
class Count(TorchDispatchMode):
    def __init__(self): super().__init__(); self.c = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.c[str(func)] += 1
        return func(*args, **(kwargs or {}))
with torch.inference_mode():
    eng.generate([p], max_new_tokens=16, mode="verify")
    gen = eng.stream([p], max_new_tokens=128, mode="verify")
    it = iter(gen); next(it)
    cm = Count()
    steps = 0
    with cm:
        for _ in it: steps += 1
print(steps, "steps", sum(cm.c.values()) / steps, "ops/step")
for k, v in cm.c.most_common(40): print(f"{v/steps:6.2f} {k}")
