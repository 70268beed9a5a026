"""Where token 0 goes wrong after smashed steps: held-out acc@0 split by what predicts it and how far back the last
smashed slot is.

acc@0 is the base's own prediction of a step's first token, teacher-forced on the held-out split of `hamburger
train` (the same hash split). The state that predicts it is either a smashed slot (the previous step held two or
more tokens: the slot's own reading, through the slot adapters) or a one-token position (an exact token whose
context holds smashed slots: the base's unadapted reading of them). This prints acc@0 for each, by the predicting
slot's length, and, for one-token positions, by the distance (in slots) back to the latest smashed slot, which
says whether the damage is local (recent slots) or spread over the whole compressed past. A micro-step decoder
with context is evaluated without it (acc@0 does not depend on it). `--no-adapters` zeroes the slot adapters.

    python benchmarks/acc0_where.py default                  # 15 s on 2 CPU cores
"""

from __future__ import annotations

import argparse
import torch
from heldout_split import NONE_BEFORE, load_for_acc0, slots_since_smashed, splits, token0_right

from hamburger.errors import HamburgerError

DISTANCES = ((1, 1), (2, 2), (3, 3), (4, 7), (8, 15), (16, 10**9))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a checkpoint (or `default`)")
    p.add_argument("--data", default="data/segmented/train-k4-a0.2-r0.5.jsonl")
    p.add_argument("--eval-fraction", type=float, default=0.04, help="the training run's held-out fraction")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--no-adapters", action="store_true", help="zero the slot adapters' up weights first")
    args = p.parse_args()
    try:
        _, held = splits(args.data, args.eval_fraction)
        model = load_for_acc0(args.model)
        if args.no_adapters:
            with torch.no_grad():
                for w in model.slot_adapters.up.parameters():
                    w.zero_()
    except HamburgerError as e:
        raise SystemExit(f"error: {e}") from None
    k = model.config.max_step_tokens
    counts: dict[str, list[int]] = {}

    def add(key: str, ok: torch.Tensor) -> None:
        c = counts.setdefault(key, [0, 0])
        c[0] += int(ok.sum())
        c[1] += ok.numel()

    for batch, ok, length in token0_right(model, [ex for _, ex in held], args.batch_size):
        add("all", ok)
        add("at a smashed slot", ok[length > 1])
        add("at a one-token position", ok[length == 1])
        for n in range(1, k + 1):
            add(f"at a slot of {n} token{'s' if n > 1 else ''}", ok[length == n])
        since = slots_since_smashed((batch.slot_lengths > 1) & batch.attention_mask.bool())
        back = since[batch.step_batch, batch.step_slot][length == 1]
        one = ok[length == 1]
        add("one-token, no smashed slot before", one[back >= NONE_BEFORE])
        for lo, hi in DISTANCES:
            sel = (back >= lo) & (back <= hi)
            add(f"one-token, latest smashed slot {lo}{'' if lo == hi else '+' if hi > 10**8 else f'-{hi}'} back",
                one[sel])
    print(f"{len(held)} held-out examples of {args.data}; {args.model}"
          f"{' (slot adapters zeroed)' if args.no_adapters else ''}")
    print("| token 0 predicted | acc@0 | steps |")
    print("| --- | --- | --- |")
    for key, (right, n) in counts.items():
        if n:
            print(f"| {key} | {right / n:.4f} | {n} |")


if __name__ == "__main__":
    main()
