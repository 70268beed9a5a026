# One-off probe of 2026-11-28 (HISTORY (18)); removed in the next commit. Run: python benchmarks/probes/norm_skip.py
import torch, time
from hamburger.loading import load
from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache
model, _ = load("default", quantize="auto", decode_only=True)
eng = Engine(model); r = eng.runner; base = r.base
cache = KVCache.for_layers(base.layers, base.config, 1, 900, torch.float32, "cpu")
emb = model.base.get_input_embeddings().weight
depth = len(base.layers)
with torch.inference_mode():
    h = r.prefill([list(range(100, 400))], cache, torch.tensor([0]))
    for rep in range(2):
      for use_norm in (True, False):
        t = 0.0; n = 150
        for i in range(n):
            pos = 300 + i + (rep * 2 + use_norm) * 150
            x = emb[5 + i].view(1, 1, -1).clone()
            mask = torch.ones(1, 1, 1, pos + 1, dtype=torch.bool)
            xs = r.native.run(x, r.rope(torch.tensor([[pos]])), cache, pos, mask, [depth])
            b = time.perf_counter()
            y = base.norm(xs[depth]) if use_norm else xs[depth]
            tok = r.head_argmax(y[:, -1])
            tl = tok.tolist()
            t += time.perf_counter() - b
        print("norm" if use_norm else "no norm", round(t / n * 1e6, 1), "us from the pass's end to the token")
