"""The native kernels' products per call against the rows they multiply: fp16, int8 (GGUF's Q8_0) and int4 (Q4_1)
on the default's LM head (49152 x 576) and MLP gate/up (3072 x 576), random weights, in cache, 2 threads.

A decode step multiplies one row; a verify pass one row per checked position. What an extra row costs is what a
verify pass pays over a step (the int kernels are instruction-bound per row, fp16 is bound by its weights' bytes).
The kernels take turns within each round; the median over rounds is printed.

    python benchmarks/native_rows.py            # under a minute on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from hamburger.kernels import native
from hamburger.kernels.qlinear import Fp16Linear, Int4Linear, Int8Linear


def per_call_ms(layer: nn.Module, x: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        layer(x)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    if not native.available():
        raise SystemExit(f"the native kernels do not run here: {native.why_unavailable()}")
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    layers = {}
    for shape_name, (n, k) in (("LM head", (49152, 576)), ("gate/up", (3072, 576))):
        linear = nn.Linear(k, n, bias=False)
        for scheme, make in (("fp16", Fp16Linear.from_linear), ("int8", Int8Linear.from_linear),
                             ("int4", lambda m: Int4Linear.from_linear(m, 32))):
            layers[(shape_name, scheme)] = make(linear)
    times: dict[tuple, list[float]] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for key, layer in layers.items():
                for r in rows:
                    x = torch.randn(r, layer.in_features)
                    layer(x)
                    times.setdefault((*key, r), []).append(per_call_ms(layer, x, args.calls))
    print(f"\nms per call, median of {args.rounds} rounds, {torch.get_num_threads()} threads\n")
    print("| layer | scheme | " + " | ".join(f"{r} row{'s' if r > 1 else ''}" for r in rows) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in rows) + " |")
    for shape_name, scheme in layers:
        cells = [f"{statistics.median(times[(shape_name, scheme, r)]):.3f}" for r in rows]
        print(f"| {shape_name} | {scheme} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
