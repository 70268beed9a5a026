"""Time to first token when many requests arrive at once: the scheduler's prefill one by one or in groups.

Submits the same N chat prompts (the built-in held-out sets of `hamburger bench-serve`) to a fresh
`Scheduler` with N rows and times its first `step()`: every prompt's prefill and the first macro-step, i.e.
the time to first token of all N requests. Budgets are run interleaved (A, B, C, then again), the median of
the repeats is printed with the prompt tokens the passes computed (padding included) against the real ones.
`prefill_tokens=1` prefills each prompt alone (what the scheduler did before grouping).

    python benchmarks/scheduler_prefill.py --model default --requests 32 --budgets 1,1024,4096 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hamburger.evaluation.bench_systems import bench_messages
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
    args = p.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.requests < 1 or args.repeats < 1 or min(budgets) < 1:
        raise SystemExit("error: --requests, --repeats and every budget must be >= 1")

    model, _ = load_model(args.model)
    tok = model.tokenizer
    pool = [m for name in args.sets.split(",") for m in bench_messages(name.strip(), args.requests)]
    prompts = [encode_chat(tok, pool[i % len(pool)]) for i in range(args.requests)]
    real = sum(map(len, prompts))
    times: dict[int, list[float]] = {b: [] for b in budgets}
    computed: dict[int, int] = {}
    for _ in range(args.repeats):
        for budget in budgets:
            sched = Scheduler(model, max_batch_size=len(prompts), max_len=max(map(len, prompts)) + 8,
                              prefill_tokens=budget)
            widths: list[int] = []
            sched._prefill = counted(sched._prefill, widths)
            for prompt in prompts:
                sched.submit(prompt, max_new_tokens=4)
            start = time.perf_counter()
            events = sched.step()
            times[budget].append(time.perf_counter() - start)
            computed[budget] = sum(widths)
            assert len(events) == len(prompts) and all(e.tokens for e in events)
    print(f"{len(prompts)} requests at once, {real} prompt tokens, {args.repeats} repeats, "
          f"{torch.get_num_threads()} threads, model {args.model}")
    print("| prefill_tokens | passes' prompt tokens (padding included) | TTFT of all (median s) | vs one by one |")
    print("| --- | --- | --- | --- |")
    alone = statistics.median(times[budgets[0]])
    for budget in budgets:
        med = statistics.median(times[budget])
        print(f"| {budget} | {computed[budget]} ({computed[budget] / real:.2f}x) | {med:.2f} | {alone / med:.2f}x |")


if __name__ == "__main__":
    main()
