"""Probe (before the float16 cache was built): a base pass of 1 and 4 positions over S cached slots with the float32
cache against a scratch build of native.c that reads and writes float16 keys and values at the same element strides
(attend_head through vf_load_h, the cache writes through hb_f2h), interleaved in one process.

    python benchmarks/probes/pass_kv16_ab.py /tmp/f16/f16.so 8 32,256,512,1024,2048
"""
import ctypes, sys, time, statistics, torch
from hamburger.kernels import native
from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache
from hamburger.loading import quantize_loaded
from hamburger.model.hamburger_model import load_model
torch.manual_seed(0)
model, _ = load_model("default"); model.eval()
quantize_loaded(model, "int4/int8", quiet=True)
engine = Engine(model)
real = native.library()
libs = {"f32": real, "f16": ctypes.CDLL(sys.argv[1])}
for fn in ("hb_layers", "hb_scratch_floats", "hb_linear", "hb_linear_argmax", "hb_isa"):
    f, g = getattr(real, fn), getattr(libs["f16"], fn)
    g.argtypes, g.restype = f.argtypes, f.restype
cfg = model.base.config; d = cfg.hidden_size
cur = ["f32"]
native.library = lambda: libs[cur[0]]
rounds, reps = int(sys.argv[2]), 10
with torch.inference_mode():
    for s in [int(x) for x in sys.argv[3].split(",")]:
        caches = {}
        for name in libs:
            c = KVCache.for_layers(engine.runner.base.layers, cfg, 1, s + 4, engine.runner.dtype, engine.runner.device)
            if name == "f32":
                c.k.normal_(), c.v.normal_()
            else:
                n = c.k.numel()
                c.k.view(-1).view(torch.float16)[:n].normal_(), c.v.view(-1).view(torch.float16)[:n].normal_()
            caches[name] = c
        for n in (1, 4):
            mask = torch.ones(1, 1, n, s + n, dtype=torch.bool).tril(s)
            x = torch.randn(1, n, d)
            pos = torch.arange(s, s + n)[None]
            t = {name: [] for name in libs}
            for r in range(rounds):
                for name in libs:
                    cur[0] = name
                    engine.runner.base_pass(x, pos, caches[name], s, mask, last=False)
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        engine.runner.base_pass(x, pos, caches[name], s, mask, last=False)
                    t[name].append((time.perf_counter() - t0) / reps * 1e3)
            a, b = statistics.median(t["f32"]), statistics.median(t["f16"])
            print(f"S={s:5d} n={n}: float32 cache {a:6.2f} ms  float16 cache {b:6.2f} ms  f16/f32 {b/a:.3f}", flush=True)
