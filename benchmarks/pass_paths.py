"""A base pass's time by path and size: one native call (`inference/native_layers.py`) against the model's modules
one by one (`kv.layer_forward`), on the embedded default as `hamburger` loads it (int4/int8), passes of B rows x T
positions after `--cached` cached slots: decode steps and check passes (T of 1 to 4, B up to 32) and prefills (B 1,
T up to 256). What decides `NATIVE_ROWS`, the most rows a pass runs natively. The paths take turns within each
round; the best of the rounds is printed.

    python benchmarks/pass_paths.py            # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import time

import torch

import hamburger.inference.native_layers as native_layers
from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache
from hamburger.loading import load

SHAPES = "1x1,1x4,16x4,32x1,32x4,1x64,1x128,1x256"


def pass_ms(engine: Engine, b: int, t: int, cached: int, budget_rows: int = 40) -> float:
    cfg = engine.runner.base.config
    cache = KVCache.for_layers(engine.runner.base.layers, cfg, b, cached + t + 8, engine.runner.kv_dtype, "cpu")
    x = torch.randn(b, t, cfg.hidden_size)
    positions = torch.arange(cached, cached + t)[None].expand(b, -1)
    mask = torch.ones(t, cached + t, dtype=torch.bool).tril(cached)[None, None]
    calls = max(1, int(budget_rows / (b * t) ** 0.7))
    with torch.inference_mode():
        engine.runner.base_pass(x, positions, cache, cached, mask)  # warm
        start = time.perf_counter()
        for _ in range(calls):
            engine.runner.base_pass(x, positions, cache, cached, mask)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="comma list of BxT (rows x positions)")
    p.add_argument("--cached", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    model, _ = load("default", decode_only=True)
    engines = {"native": Engine(model), "modules": Engine(model, native_layers=False)}
    if engines["native"].runner.native is None:
        raise SystemExit("the native call does not run here (no native kernels for this CPU or compiler)")
    native_layers.NATIVE_ROWS = 1 << 20  # every size natively, to compare
    times: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for b, t in shapes:
            for name, engine in engines.items():
                times.setdefault((b, t, name), []).append(pass_ms(engine, b, t, args.cached))
    print(f"base pass, ms (best of {args.rounds}); {args.cached} cached slots; torch threads {torch.get_num_threads()}")
    print("| B x T | rows | native | modules | modules / native |\n| --- | ---: | ---: | ---: | ---: |")
    for b, t in shapes:
        nat, mod = min(times[b, t, "native"]), min(times[b, t, "modules"])
        print(f"| {b} x {t} | {b * t} | {nat:.1f} | {mod:.1f} | {mod / nat:.2f}x |")


if __name__ == "__main__":
    main()
