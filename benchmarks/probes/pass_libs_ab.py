"""Probe: a base pass of 1 and 4 positions over S cached slots with two builds of native.c (the library's .so files
from two caches: before and after an attention change), interleaved in one process.

    python benchmarks/probes/pass_libs_ab.py OLD.so NEW.so 8 32,256,1024
"""
import ctypes, sys, time, statistics, torch
from hamburger.kernels import native
from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache
from hamburger.loading import quantize_loaded
from hamburger.model.hamburger_model import load_model
libs = {}
for name, path in [("old", sys.argv[1]), ("new", sys.argv[2])]:
    lib = ctypes.CDLL(path)
    native._setup(lib) if hasattr(native, "_setup") else None
    libs[name] = lib
torch.manual_seed(0)
model, _ = load_model("default"); model.eval()
quantize_loaded(model, "int4/int8", quiet=True)
engine = Engine(model)
real = native.library()
cfg = model.base.config; d = cfg.hidden_size
cur = ["new"]
native.library = lambda: libs[cur[0]]
# copy argtypes from the real library
for name in ("old", "new"):
    for fn in ("hb_layers", "hb_scratch_floats", "hb_linear", "hb_linear_argmax", "hb_isa"):
        f, g = getattr(real, fn), getattr(libs[name], fn)
        g.argtypes, g.restype = f.argtypes, f.restype
rounds, reps = int(sys.argv[3]), 10
with torch.inference_mode():
    for s in [int(x) for x in sys.argv[4].split(",")]:
        cache = KVCache.for_layers(engine.runner.base.layers, cfg, 1, s + 4, engine.runner.dtype, engine.runner.device)
        cache.k.normal_(), cache.v.normal_()
        for n in (1, 4):
            mask = torch.ones(1, 1, n, s + n, dtype=torch.bool).tril(s)
            x = torch.randn(1, n, d)
            pos = torch.arange(s, s + n)[None]
            t = {"old": [], "new": []}
            for r in range(rounds):
                for name in ("old", "new"):
                    cur[0] = name
                    engine.runner.base_pass(x, pos, cache, s, mask, last=False)
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        engine.runner.base_pass(x, pos, cache, s, mask, last=False)
                    t[name].append((time.perf_counter() - t0) / reps * 1e3)
            o, nw = statistics.median(t["old"]), statistics.median(t["new"])
            print(f"S={s:5d} n={n}: old {o:6.2f} ms  new {nw:6.2f} ms  new/old {nw/o:.3f}", flush=True)
