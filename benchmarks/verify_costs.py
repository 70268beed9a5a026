"""What one verify pass costs on this machine, in base forwards: the constants of `accept_rule.py --costs`.

Verify mode spends, per base forward: the base over t0 and the n drafts (1 + n positions, the LM head at each,
to check them), the first micro-step (the m features and t0 through the micro-step decoder) and n - 1 later
ones (one token each), each micro-step with the shortlist head and the stop head. This times each of them in
the engine (batch `--batch`, `--cached` entries in the cache, rounds alternating so that a slow spell of a
shared machine falls on all alike) and prints them as multiples of a one-position base forward. For a
checkpoint trained with `train-drafter --micro-context W` it also times its micro-steps with the context
switched off (the same weights; the outputs differ, the work is what is compared): what the context costs.

    python benchmarks/verify_costs.py runs/ctx-gate16/export --quantize fp16        # about 1 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hamburger.inference.core import micro_context
from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache
from hamburger.loading import quantize_loaded
from hamburger.model.hamburger_model import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", default="default")
    p.add_argument("--quantize", default="none", help="none, fp16, int8, int4 or SCHEME/HEAD (e.g. int4/int8), +a8 for 8-bit inputs")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cached", type=int, default=256)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=5, help="calls per round and item")
    a = p.parse_args()
    torch.manual_seed(0)
    model, _ = load_model(a.model)
    model.eval()
    quantize_loaded(model, a.quantize, quiet=True)  # SCHEME/HEAD, +a8: as the command line's --quantize
    engine = Engine(model)
    cfg, k, m, b, s = model.base.config, engine.k, model.micro.num_features, a.batch, a.cached
    if k < 2:
        raise SystemExit(f"{a.model} takes one token per step: it drafts nothing")
    d = cfg.hidden_size
    kv = engine.runner.kv_dtype  # the engine's caches
    base_cache = KVCache.for_layers(engine.runner.base.layers, cfg, b, s + k, kv, engine.runner.device)
    base_cache.k.normal_(), base_cache.v.normal_()
    micro_cache = KVCache.for_layers(model.micro.layers, cfg, b, m + k, engine.runner.kv_dtype, engine.runner.device)
    context = micro_context(engine.runner, base_cache, s, torch.full((b,), s - 1))

    def heads(h: torch.Tensor) -> None:  # what each micro-step also computes: the draft's head and the stop head
        engine.runner.short_logits(h) if engine.runner.vocab is not None else model.lm_head(h)
        model.stop_head(h)

    def base(n: int) -> None:
        mask = torch.ones(b, 1, n, s + n, dtype=torch.bool).tril(s)
        states = engine.runner.base_pass(torch.randn(b, n, d), torch.arange(s, s + n)[None].expand(b, -1), base_cache, s, mask,
                              last=False)
        model.lm_head(states[0])

    items = {f"base forward, {n} position{'s' * (n > 1)}": (lambda n=n: base(n)) for n in range(1, k + 1)}
    items["first micro-step (features + t0)"] = lambda: heads(engine.runner.micro_pass(torch.randn(b, m + 1, d), micro_cache, 0,
                                                                            context))
    items["later micro-step (one token)"] = lambda: heads(engine.runner.micro_pass(torch.randn(b, 1, d), micro_cache, m + 1,
                                                                        context))
    if context is not None:
        items["first micro-step, context off"] = lambda: heads(engine.runner.micro_pass(torch.randn(b, m + 1, d), micro_cache, 0))
        items["later micro-step, context off"] = lambda: heads(engine.runner.micro_pass(torch.randn(b, 1, d), micro_cache, m + 1))
    times = {name: [] for name in items}
    with torch.inference_mode():
        for fn in items.values():
            fn()  # warm up
        for _ in range(a.rounds):
            for name, fn in items.items():
                t0 = time.perf_counter()
                for _ in range(a.reps):
                    fn()
                times[name].append((time.perf_counter() - t0) / a.reps * 1e3)
    ms = {name: statistics.median(ts) for name, ts in times.items()}
    one = ms["base forward, 1 position"]
    ctx = f"context W={model.micro.context}" if context is not None else "features only"
    print(f"{a.model} ({a.quantize}, micro-step decoder: {len(model.micro.layers)} layers, {ctx}), batch {b}, "
          f"{s} cached entries, median of {a.rounds} rounds:")
    print("| item | ms | base forwards |\n| --- | --- | --- |")
    for name, v in ms.items():
        print(f"| {name} | {v:.2f} | {v / one:.3f} |")
    position = (ms[f"base forward, {k} positions"] / one - 1) / (k - 1)
    print(f"accept_rule.py --costs {position:.3f} {ms['first micro-step (features + t0)'] / one:.3f} "
          f"{ms['later micro-step (one token)'] / one:.3f}")


if __name__ == "__main__":
    main()
