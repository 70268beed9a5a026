"""What the micro-step decoder's context costs: one macro-step's micro-steps with and without it, side by side.

A checkpoint trained with `train-drafter --micro-context W` reads, in each micro layer, the base's cached keys
and values of the latest W entries through a gated second softmax. This times the engine's micro-step
(`Engine._micro`, batch `--batch`, the first call with the m features and token 0, then K-2 one-token calls)
after `--cached` base entries, with the checkpoint's context and with the context switched off (the same
weights; the outputs differ, the work is what is compared). Rounds alternate between the two, so a slow spell
of a shared machine falls on both alike; reported: median milliseconds per macro-step's micro-steps and the
ratio, and one base decode step at the same cache length for scale.

    python benchmarks/micro_context.py runs/ctx-gate16/export --quantize fp16          # about 1 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hamburger.inference.core import MicroContext
from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache
from hamburger.inference.quantize import DEFAULT_SKIP, quantize_model
from hamburger.model.hamburger_model import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="a checkpoint trained with --micro-context")
    p.add_argument("--quantize", default="none", choices=["none", "fp16"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cached", type=int, default=256)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--reps", type=int, default=10, help="macro-steps per round and setting")
    a = p.parse_args()
    torch.manual_seed(0)
    model, _ = load_model(a.model)
    model.eval()
    window = model.micro.context
    if not window:
        raise SystemExit(f"{a.model} has no micro-step context (train it with --micro-context W)")
    if a.quantize == "fp16":
        quantize_model(model, "fp16", skip=DEFAULT_SKIP)
    engine = Engine(model)
    cfg, k, m, b = model.base.config, engine.k, model.micro.num_features, a.batch
    d = cfg.hidden_size
    base_cache = KVCache.for_layers(engine.base.layers, cfg, b, a.cached + 1, engine.dtype, engine.device)
    base_cache.k.normal_(), base_cache.v.normal_()
    micro_cache = KVCache.for_layers(model.micro.layers, cfg, b, m + k, engine.dtype, engine.device)
    visible = torch.arange(a.cached)[None].expand(b, -1) >= a.cached - window
    context = MicroContext(base_cache, visible, torch.full((b,), a.cached - 1))
    first = torch.randn(b, m + 1, d)
    nxt = torch.randn(b, 1, d)

    def micro_steps(ctx) -> None:
        engine._micro(first, micro_cache, 0, ctx)
        for j in range(1, k - 1):
            engine._micro(nxt, micro_cache, m + j, ctx)

    def base_step() -> None:
        mask = torch.ones(b, 1, 1, a.cached + 1, dtype=torch.bool)
        engine._base(torch.randn(b, 1, d), torch.full((b, 1), a.cached), base_cache, a.cached, mask)

    runs = {"micro-steps, features only": lambda: micro_steps(None),
            f"micro-steps, context W={window}": lambda: micro_steps(context), "base step": base_step}
    times = {name: [] for name in runs}
    with torch.inference_mode():
        for fn in runs.values():
            fn()  # warm up
        for _ in range(a.rounds):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                for _ in range(a.reps):
                    fn()
                times[name].append((time.perf_counter() - t0) / a.reps * 1e3)
    plain = statistics.median(times["micro-steps, features only"])
    print(f"{a.model} ({a.quantize}), batch {b}, {a.cached} cached base entries, K = {k} "
          f"({k - 1} micro-steps per macro-step), median of {a.rounds} rounds:")
    print("| setting | ms per macro-step | x features only |\n| --- | --- | --- |")
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"| {name} | {ms:.2f} | {ms / plain:.2f}x |")


if __name__ == "__main__":
    main()
