"""One base decode step of the fast engine, side by side: weights float32 / bfloat16 / fp16-packed (with q/k/v and
gate/up fused, or not). (Its `--compile` option, each setting also `torch.compile`d, went with the engine's
`--compile` on 2026-11-27: docs/engine.md.)

A step is what `hamburger bench` repeats at batch 1: the base pass over one new slot after `--cached` cached
ones, plus the full LM head. Every setting is loaded first (each its own model and cache), then they take turns:
round after round, each setting runs `--steps` steps, so a slow spell of a shared machine falls on all of them
alike. Reported per setting: milliseconds per step (median over the rounds), the ratio to the first setting
(median of the per-round ratios), and the first call's wall time. Unlike `bench`'s cost model
(`bench_costs.step_costs`, which times one step at a fixed cache length), the cache grows by one slot per step, as in
decoding.

    python benchmarks/decode_step.py --settings float32,bfloat16,fp16
    python benchmarks/decode_step.py --settings fp16-unfused,fp16 --rounds 60      # what fusing gives
    python benchmarks/decode_step.py --settings fp16 --merged --rounds 30          # what a smashed slot adds

`--merged` adds, for each setting, the same step where the new slot is a smashed step (the checkpoint's slot
adapters act on it, as on every multi-token step of trust mode at batch 1).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache
from hamburger.kernels.quantize import DEFAULT_SKIP, quantize_model
from hamburger.model.hamburger_model import load_model

SETTINGS = {"float32": (torch.float32, "none"), "bfloat16": (torch.bfloat16, "none"), "fp16": (torch.float32, "fp16"),
            "fp16-unfused": (torch.float32, "fp16"),  # fp16 with q/k/v and gate/up as separate GEMMs
            "int8": (torch.float32, "int8"), "int4": (torch.float32, "int4")}  # bfloat16 activations on CPU


class Setting:
    """One setting's model, engine and growing cache, ready to run steps."""

    def __init__(self, model_ref: str, setting: str, cached: int, total_steps: int,
                 merged: bool = False) -> None:
        dtype, scheme = SETTINGS[setting]
        model, _ = load_model(model_ref, dtype=dtype)
        model.eval()
        if scheme != "none":
            quantize_model(model, scheme, skip=DEFAULT_SKIP, fuse=not setting.endswith("-unfused"))
        self.name = setting + (" merged" if merged else "")
        self.merged = torch.ones(1, 1, dtype=torch.bool) if merged else None
        self.engine = Engine(model)
        self.cache = KVCache.for_layers(self.engine.runner.base.layers, model.base.config, 1, cached + total_steps + 8,
                                        self.engine.runner.kv_dtype, "cpu")
        self.x = model.embed(torch.tensor([[1]])).to(dtype)
        self.head = model.base.get_output_embeddings()
        self.slot = cached
        start = time.perf_counter()
        self.step()
        self.first_call_s = time.perf_counter() - start
        for _ in range(3):
            self.step()
        self.times: list[float] = []

    def step(self) -> None:
        mask = torch.ones(1, 1, 1, self.slot + 1, dtype=torch.bool)
        with torch.inference_mode():
            states = self.engine.runner.base_pass(self.x, torch.tensor([[self.slot]]), self.cache, self.slot, mask, self.merged)
            self.head(states[0])
        self.slot += 1

    def run(self, steps: int) -> None:
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.times.append((time.perf_counter() - start) / steps * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--settings", default="float32,bfloat16,fp16", help=f"comma list from {','.join(SETTINGS)}")
    p.add_argument("--merged", action="store_true", help="also each setting with the new slot a smashed step")
    p.add_argument("--cached", type=int, default=300, help="cached slots before the first timed step")
    p.add_argument("--steps", type=int, default=5, help="steps per setting per round")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if not settings or any(s not in SETTINGS for s in settings) or len(set(settings)) != len(settings):
        p.error(f"--settings is a comma list without repeats from {','.join(SETTINGS)}, got {args.settings!r}")
    if args.steps < 1 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1")
    total = args.steps * args.rounds + 8
    rows = [Setting(args.model, s, args.cached, total, merged=m) for s in settings
            for m in ([False, True] if args.merged else [False])]
    print(f"loaded {len(rows)} settings; {args.rounds} rounds of {args.steps} steps each", flush=True)
    for r in range(args.rounds):
        for row in rows:
            row.run(args.steps)
        if (r + 1) % max(1, args.rounds // 5) == 0:
            print(f"  round {r + 1}/{args.rounds}: " + ", ".join(f"{row.name} {row.times[-1]:.1f} ms" for row in rows), flush=True)
    ref = rows[0]
    print(f"\none base decode step at batch 1 ({args.cached} cached slots, growing), {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds of {args.steps} steps, settings taking turns")
    print(f"{'setting':<20} {'first call s':>12} {'ms / step':>10} {'x ' + ref.name:>14}")
    for row in rows:
        ratio = statistics.median(a / b for a, b in zip(ref.times, row.times))
        print(f"{row.name:<20} {row.first_call_s:>12.2f} {statistics.median(row.times):>10.1f} "
              f"{ratio:>13.2f}x")


if __name__ == "__main__":
    main()
