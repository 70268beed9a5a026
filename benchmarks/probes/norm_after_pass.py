# One-off probe of 2026-11-28 (HISTORY (18)); removed in the next commit. Run: python benchmarks/probes/norm_after_pass.py
import torch, time
from hamburger.loading import load
from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache
model, _ = load("default", quantize="auto", decode_only=True)
eng = Engine(model); r = eng.runner; base = r.base
cache = KVCache.for_layers(base.layers, base.config, 1, 600, torch.float32, "cpu")
emb = model.base.get_input_embeddings().weight
depth = len(base.layers)
with torch.inference_mode():
    h = r.prefill([list(range(100, 400))], cache, torch.tensor([0]))
    t = {"native": 0, "norm1": 0, "norm2": 0, "clone": 0, "head": 0}
    n = 200
    for i in range(n):
        pos = 300 + i
        x = emb[5 + i].view(1, 1, -1).clone()
        mask = torch.ones(1, 1, 1, pos + 1, dtype=torch.bool)
        a = time.perf_counter()
        xs = r.native.run(x, r.rope(torch.tensor([[pos]])), cache, pos, mask, [depth])
        b = time.perf_counter()
        y = base.norm(xs[depth])
        c = time.perf_counter()
        y = base.norm(xs[depth])
        d = time.perf_counter()
        tok = r.head_argmax(y[:, -1])
        e = time.perf_counter()
        t["native"] += b - a; t["norm1"] += c - b; t["norm2"] += d - c; t["head"] += e - d
    print({k: round(v / n * 1e6, 1) for k, v in t.items()})
import torch.nn.functional as F
print(type(base.norm), base.norm.__class__.__module__)
w = base.norm.weight
x = torch.randn(1, 1, 576)
with torch.inference_mode():
    for f, name in ((lambda: base.norm(x), "module"), (lambda: F.rms_norm(x, (576,), w, 1e-5), "F.rms_norm"), (lambda: x.clone(), "clone"), (lambda: torch.empty(10), "empty")):
        for _ in range(100): f()
        a = time.perf_counter()
        for _ in range(2000): f()
        print(name, round((time.perf_counter() - a) / 2000 * 1e6, 2), "us")
