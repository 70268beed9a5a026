"""Probe: the native passes' outputs with a float32 cache, saved to compare two checkouts bit for bit (the code before
the float16 cache, 5ff4d94, against the code after): 12 base passes of 1-4 positions over 37, 300 and 100 cached
slots (batch 1, 1, 3; a padded row) and 3 micro-step passes with context, the default's int4/int8 weights.

    HAMBURGER_CACHE=/tmp/a PYTHONPATH=<old checkout>/src python benchmarks/probes/float32_cache_bits.py /tmp/old.pt
    HAMBURGER_CACHE=/tmp/b python benchmarks/probes/float32_cache_bits.py /tmp/new.pt
    python -c "import torch; a, b = torch.load('/tmp/old.pt'), torch.load('/tmp/new.pt'); print(all(torch.equal(a[k], b[k]) for k in a))"
"""
import sys, torch
from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache
from hamburger.loading import quantize_loaded
from hamburger.model.hamburger_model import load_model
from hamburger.inference.core import micro_context
torch.manual_seed(0)
model, _ = load_model("default"); model.eval()
quantize_loaded(model, "int4/int8", quiet=True)
engine = Engine(model)
cfg = model.base.config; d = cfg.hidden_size
out = {}
with torch.inference_mode():
    for b, s in [(1, 37), (1, 300), (3, 100)]:
        cache = KVCache.for_layers(engine.runner.base.layers, cfg, b, s + 4, engine.runner.dtype, engine.runner.device)
        g = torch.Generator().manual_seed(s)
        cache.k.copy_(torch.randn(cache.k.shape, generator=g)); cache.v.copy_(torch.randn(cache.v.shape, generator=g))
        for n in range(1, 5):
            mask = torch.ones(b, 1, n, s + n, dtype=torch.bool).tril(s)
            if b > 1: mask[1, :, :, :5] = False
            x = torch.randn(b, n, d, generator=g)
            st = engine.runner.base_pass(x, torch.arange(s, s + n)[None].expand(b, -1), cache, s, mask, last=False)
            out[f"{b}-{s}-{n}"] = st[0].clone()
        m = model.micro.num_features
        mc = KVCache.for_layers(model.micro.layers, cfg, b, m + 4, engine.runner.dtype, engine.runner.device)
        ctx = micro_context(engine.runner, cache, s, torch.full((b,), s - 1))
        h = engine.runner.micro_pass(torch.randn(b, m + 1, d, generator=g), mc, 0, ctx)
        out[f"micro-{b}-{s}"] = (h[0] if isinstance(h, tuple) else h).clone()
torch.save(out, sys.argv[1])
print(len(out))
