"""Held-out teacher-forced figures of checkpoints on whole steps and on the same steps cut at random points.

At inference a merged slot often holds a prefix of an entropy segment (the stop head or the confidence ended
the step early). This evaluates each checkpoint on the held-out split of `hamburger train` (same hash split)
twice: as segmented, and with each step of >= 2 tokens cut in two with probability --p (seeded, the same
cuts for every checkpoint; `hamburger.training.data.cut_steps`), and prints one table. Compare rows, not the two
halves: a cut moves mid-segment tokens, which are easier, to position 0.

    python benchmarks/heldout_cut.py default runs/dense-kdcache-partial2/hamburger
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from hamburger.errors import HamburgerError
from hamburger.model.hamburger_model import load_model
from hamburger.training.data import cut_steps
from hamburger.training.examples import evaluate, read_examples, split_eval

SHOWN = ("token_acc@0", "token_acc@1", "token_acc@2", "token_acc@3", "kd_loss", "stop_acc", "stop_ece")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="checkpoints (or `default`)")
    p.add_argument("--data", default="data/segmented/train-k4-a0.2-r0.5.jsonl")
    p.add_argument("--eval-fraction", type=float, default=0.04, help="the training run's held-out fraction")
    p.add_argument("--p", type=float, default=0.5, help="probability of cutting a step of >= 2 tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    if not 0.0 <= args.p <= 1.0:
        raise SystemExit(f"error: --p is a probability, got {args.p}")
    try:
        _, held = split_eval(read_examples(Path(args.data)), args.eval_fraction)
        if not held:
            raise HamburgerError(f"no held-out examples at --eval-fraction {args.eval_fraction}")
        rng = random.Random(args.seed)
        sets = {"whole": [ex for _, ex in held], f"cut p={args.p:g}": [cut_steps(ex, rng, args.p) for _, ex in held]}
        print(f"{len(held)} held-out examples of {args.data}")
        print("| checkpoint | steps | " + " | ".join(SHOWN) + " |")
        print("| --- | --- | " + " | ".join("---" for _ in SHOWN) + " |")
        for name in args.models:
            model, _ = load_model(name)
            model.eval()
            pad = model.tokenizer.pad_token_id or 0
            for label, examples in sets.items():
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                    m = evaluate(model, examples, model.config.max_step_tokens, pad, args.batch_size, "cpu",
                                 dense=True)
                print(f"| {name} | {label} | " + " | ".join(f"{m[k]:.4f}" if k in m else "-" for k in SHOWN) + " |",
                      flush=True)
    except HamburgerError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
