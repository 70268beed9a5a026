"""Time to first token when many requests arrive at once: how the scheduler admits and prefills them.

Submits the same N chat prompts (the built-in held-out sets of `hamburger bench-serve`) to a fresh
`Scheduler` with N rows and steps it until every request has its first token, recording each request's time
to first token. Two admission policies: "all at once" (every prompt prefilled in the first step, shortest
first, in passes of at most `prefill_tokens` padded tokens, then one macro-step gives all their first tokens)
and "interleaved" (the scheduler's default: one such pass per step, of the shortest waiting prompts, each
followed by a macro-step over the rows running so far). `prefill_tokens=1` prefills each prompt alone.
Configurations run interleaved (A, B, C, then again); the medians over the repeats are printed, with the
prompt tokens the passes computed (padding included) against the real ones. `--quantize fp16`: the weights
`serve --quantize fp16` decodes with.

    python benchmarks/scheduler_prefill.py --model default --requests 32 --budgets 128,256,512 --repeats 3 --quantize fp16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hamburger.evaluation.bench_systems import bench_messages
from hamburger.kernels.quantize import DEFAULT_SKIP, quantize_model
from hamburger.inference.scheduler import Scheduler
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import load_model


def counted(prefill, widths: list[int]):
    """The scheduler's prefill, recording the prompt tokens each pass computes (rows x widest prompt)."""
    def run(reqs, rows):
        widths.append(len(reqs) * max(len(r.prompt) for r in reqs))
        return prefill(reqs, rows)
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--sets", default="code,math,chat")
    p.add_argument("--budgets", default="1,1024,4096", help="prefill_tokens values (1 = each prompt alone)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quantize", default="none", choices=["none", "fp16"], help="the server's --quantize")
    args = p.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.requests < 1 or args.repeats < 1 or min(budgets) < 1:
        raise SystemExit("error: --requests, --repeats and every budget must be >= 1")

    model, _ = load_model(args.model)
    model.eval()
    if args.quantize == "fp16":
        quantize_model(model, "fp16", skip=DEFAULT_SKIP)
    tok = model.tokenizer
    pool = [m for name in args.sets.split(",") for m in bench_messages(name.strip(), args.requests)]
    prompts = [encode_chat(tok, pool[i % len(pool)]) for i in range(args.requests)]
    real = sum(map(len, prompts))
    configs = [(interleave, budget) for interleave in (False, True) for budget in budgets]
    ttfts: dict[tuple, list[list[float]]] = {c: [] for c in configs}
    computed: dict[tuple, int] = {}
    for _ in range(args.repeats):
        for interleave, budget in configs:
            sched = Scheduler(model, max_batch_size=len(prompts), max_len=max(map(len, prompts)) + 8,
                              prefill_tokens=budget, interleave_prefill=interleave)
            widths: list[int] = []
            sched._prefill = counted(sched._prefill, widths)
            ids = [sched.submit(prompt, max_new_tokens=4) for prompt in prompts]
            first: dict[int, float] = {}
            start = time.perf_counter()
            while len(first) < len(ids):
                for ev in sched.step():
                    if ev.tokens:
                        first.setdefault(ev.id, time.perf_counter() - start)
            ttfts[interleave, budget].append(sorted(first.values()))
            computed[interleave, budget] = sum(widths)
    print(f"{len(prompts)} requests at once, {real} prompt tokens, {args.repeats} repeats, "
          f"{torch.get_num_threads()} threads, model {args.model} ({args.quantize})")
    print("| admission | prefill_tokens | passes' prompt tokens (padding included) | TTFT p50 (s) | p90 | last |")
    print("| --- | --- | --- | --- | --- | --- |")
    for interleave, budget in configs:
        runs = ttfts[interleave, budget]
        at = lambda q: statistics.median(r[min(len(r) - 1, int(q * len(r)))] for r in runs)  # noqa: E731
        c = computed[interleave, budget]
        print(f"| {'interleaved' if interleave else 'all at once'} | {budget} | {c} ({c / real:.2f}x) | "
              f"{at(0.5):.2f} | {at(0.9):.2f} | {at(1.0):.2f} |")


if __name__ == "__main__":
    main()
