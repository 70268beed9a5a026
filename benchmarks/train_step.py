"""Training throughput of `hamburger train`'s objectives, side by side on the same batches.

Times forward + backward of one micro-batch for each objective, interleaved (objective A, B, C, ... then
again), so the machine's drift hits every row alike, and prints target tokens per second (median of the
repeats) and the ratio to the paper's objective (cross-entropy + stop only).

    python benchmarks/train_step.py --data runs/teacher/train-k4-a0.2-r0.5.jsonl \
        --model src/hamburger/checkpoints/SmolLM2-135M-Instruct --batches 3 --repeats 3

`--data` needs a teacher cache beside it (`hamburger segment --teacher-top-k K`) for the cached row.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from hamburger.model.hamburger_model import load_model
from hamburger.training.data import SegmentedExample, collate
from hamburger.training.examples import attach_teacher, read_examples, split_eval
from hamburger.training.loss import hamburger_loss

OBJECTIVES = {  # name: (kd_weight, state_weight, use the cached teacher)
    "CE + stop (the paper's)": (0.0, 0.0, False),
    "+ KD, base run per batch": (1.0, 0.0, False),
    "+ KD, cached top-k": (1.0, 0.0, True),
    "+ KD + state (base run per batch)": (1.0, 1.0, False),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="default")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    model, _ = load_model(args.model)
    model.base.requires_grad_(False)
    rows = read_examples(Path(args.data))
    k = attach_teacher(rows, Path(args.data), model)
    if not k:
        raise SystemExit(f"no teacher cache beside {args.data}: run `hamburger segment --teacher-top-k 32` first")
    train, _ = split_eval(rows, 0.04)
    rng = random.Random(args.seed)
    pad = model.tokenizer.pad_token_id or 0
    cfg = model.config.max_step_tokens
    picked = [sorted(rng.sample(range(len(train)), args.batch_size)) for _ in range(args.batches)]
    batches = [collate([train[j][1] for j in idx], cfg, pad) for idx in picked]
    plain = [collate([SegmentedExample(train[j][1].input_ids, train[j][1].prompt_len, train[j][1].steps) for j in idx],
                     cfg, pad) for idx in picked]
    times: dict[str, list[float]] = {name: [0.0] * args.repeats for name in OBJECTIVES}  # seconds per repeat
    tokens = 0
    model.train()
    for rep in range(args.repeats):
        for b, (cached, live) in enumerate(zip(batches, plain)):
            for name, (kd, state, use_cache) in OBJECTIVES.items():
                t0 = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = hamburger_loss(model, cached if use_cache else live, verified_stops=True, kd_weight=kd,
                                         state_weight=state)
                out.loss.backward()
                times[name][rep] += time.perf_counter() - t0
                model.zero_grad(set_to_none=True)
                if rep == 0 and name == next(iter(OBJECTIVES)):
                    tokens += out.targets.numel()
    base = statistics.median(times[next(iter(OBJECTIVES))])
    print(f"{args.batches} batches of {args.batch_size} ({tokens} target tokens), {args.repeats} repeats, "
          f"teacher top-{k}, {torch.get_num_threads()} threads")
    print("| objective | s for the batches (median of repeats) | target tokens/s | speed vs CE + stop |")
    print("| --- | --- | --- | --- |")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} | {tokens / med:.0f} | {base / med:.2f}x |")


if __name__ == "__main__":
    main()
