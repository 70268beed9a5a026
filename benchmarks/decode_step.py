"""One base decode step of the fast engine, side by side: weights float32 / bfloat16 / fp16-packed, eager or
`torch.compile`d (the engine's `--compile`: the base pass compiled with dynamic shapes).

A step is what `hamburger bench` repeats at batch 1: the base pass over one new slot after `--cached` cached
ones, plus the full LM head. For each setting: milliseconds per step (median of `--repeats` timings of `--steps`
steps, after a warm-up), and for compiled settings the first call's wall time (the compilation). Every setting
loads the model afresh; one setting at a time, so run it on an otherwise idle machine. Unlike `bench`'s cost
model (`bench_costs.step_costs`, which times one step at a fixed cache length), the cache grows by one slot per
step, as in decoding: that is what makes a compiled step recompile.

    python benchmarks/decode_step.py --settings float32,bfloat16,fp16 --compile     # about 8 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache
from hamburger.inference.quantize import DEFAULT_SKIP, quantize_model
from hamburger.model.hamburger_model import load_model

SETTINGS = {"float32": (torch.float32, "none"), "bfloat16": (torch.bfloat16, "none"), "fp16": (torch.float32, "fp16")}


def measure(model_ref: str, setting: str, compile: bool, cached: int, steps: int, repeats: int) -> dict:
    dtype, scheme = SETTINGS[setting]
    model, _ = load_model(model_ref, dtype=dtype)
    model.eval()
    if scheme != "none":
        quantize_model(model, scheme, skip=DEFAULT_SKIP)
    engine = Engine(model, compile=compile)
    cfg = model.base.config
    cache = KVCache.for_layers(engine.base.layers, cfg, 1, cached + steps * (repeats + 2) + 8, dtype, "cpu")
    x = model.embed(torch.tensor([[1]])).to(dtype)
    head = model.base.get_output_embeddings()
    slot = cached

    def step() -> None:
        nonlocal slot
        mask = torch.ones(1, 1, 1, slot + 1, dtype=torch.bool)
        with torch.inference_mode():
            states = engine.step_fn(x, torch.tensor([[slot]]), cache, slot, mask)
            head(states[0])
        slot += 1

    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - start) / steps * 1e3)
    return {"setting": setting, "compile": compile, "compiled": compile and engine.compiled, "first_call_s": first,
            "step_ms": statistics.median(times), "all_ms": times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--settings", default="float32,bfloat16,fp16", help=f"comma list from {','.join(SETTINGS)}")
    p.add_argument("--compile", action="store_true", help="also each setting compiled")
    p.add_argument("--cached", type=int, default=300, help="cached slots before the first timed step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if not settings or any(s not in SETTINGS for s in settings):
        p.error(f"--settings is a comma list from {','.join(SETTINGS)}, got {args.settings!r}")
    rows = []
    for setting in settings:
        for compile in ([False, True] if args.compile else [False]):
            rows.append(measure(args.model, setting, compile, args.cached, args.steps, args.repeats))
            print(f"  {setting} {'compiled' if compile else 'eager'}: {rows[-1]['step_ms']:.1f} ms", flush=True)
    ref = rows[0]["step_ms"]
    print(f"\none base decode step at batch 1 ({args.cached} cached slots), {torch.get_num_threads()} threads, "
          f"median of {args.repeats} x {args.steps} steps")
    print(f"{'setting':<10} {'mode':<9} {'first call s':>12} {'ms / step':>10} {'x ' + rows[0]['setting']:>10}")
    for r in rows:
        mode = "compiled" if r["compiled"] else ("eager" if not r["compile"] else "fell back")
        print(f"{r['setting']:<10} {mode:<9} {r['first_call_s']:>12.2f} {r['step_ms']:>10.1f} {ref / r['step_ms']:>9.2f}x")


if __name__ == "__main__":
    main()
