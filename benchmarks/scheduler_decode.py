"""Time per token of one request in the server's scheduler against the batch engine at batch 1, side by side.

The same prompts (built-in held-out chat set), greedy, a fixed number of new tokens (EOS ignored), run
interleaved: the engine, the scheduler with 1 request in a batch of `--rows` rows (as the server preallocates
them), and the scheduler with a single row. Time per token counts the tokens after the first (the first comes
with the prefill), median over prompts and repeats. No HTTP: this is the scheduler's own cost.

    python benchmarks/scheduler_decode.py --model default --rows 32 --max-new-tokens 64 --repeats 2 [--quantize fp16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hamburger.evaluation.bench_systems import bench_messages
from hamburger.inference.engine import Engine
from hamburger.inference.scheduler import Scheduler
from hamburger.loading import quantize_loaded
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import load_model


def scheduler_time_per_token(model, prompt: list[int], rows: int, new_tokens: int) -> float:
    sched = Scheduler(model, max_batch_size=rows, max_len=len(prompt) + new_tokens + 8)
    sched.submit(prompt, new_tokens, eos_token_ids=set())
    sched.step()  # the prefill and the first macro-step
    start, n = time.perf_counter(), 0
    while sched.has_work():
        n += sum(len(e.tokens) for e in sched.step())
    return (time.perf_counter() - start) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quantize", default="none", help="none, fp16, int8 or int4 (as the CLI's --quantize)")
    args = p.parse_args()
    if min(args.prompts, args.rows, args.repeats) < 1 or args.max_new_tokens < 2:
        raise SystemExit("error: --prompts, --rows and --repeats must be >= 1, --max-new-tokens >= 2")
    model, _ = load_model(args.model)
    quantize_loaded(model, args.quantize)
    prompts = [encode_chat(model.tokenizer, m) for m in bench_messages("chat", args.prompts)]
    engine = Engine(model)
    names = ("engine, batch 1", f"scheduler, 1 request in {args.rows} rows", "scheduler, 1 row")
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.repeats):
        for prompt in prompts:
            out = engine.generate([prompt], max_new_tokens=args.max_new_tokens, eos_token_ids=set())
            times[names[0]].append(out.stats.decode_s / (out.stats.generated_tokens - 1))
            times[names[1]].append(scheduler_time_per_token(model, prompt, args.rows, args.max_new_tokens))
            times[names[2]].append(scheduler_time_per_token(model, prompt, 1, args.max_new_tokens))
    print(f"{len(prompts)} prompts x {args.repeats} repeats, {args.max_new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, model {args.model}, weights {args.quantize}")
    print("| system | ms per token (median) | vs engine |")
    print("| --- | --- | --- |")
    ref = statistics.median(times[names[0]])
    for name in names:
        med = statistics.median(times[name])
        print(f"| {name} | {med * 1000:.1f} | {med / ref:.2f}x |")


if __name__ == "__main__":
    main()
