"""How much of its slot adapters' rank a checkpoint uses: held-out acc@0 with the adapters cut to each rank.

Token 0 after a smashed slot is the base's own prediction, read through the slot adapters; the micro-step decoder
plays no part in it. This loads a checkpoint, cuts its slot adapters to each `--ranks` (the best rank-r
approximation of each adapter, as `hamburger export --slot-adapter-rank` does) and evaluates the held-out split of
`hamburger train` (the same hash split), also with no adapters at all (rank 0: up weights zeroed). Printed per rank:
acc@0, the slot states' distance to the base's (`state_loss`), and the number of adapter bytes a smashed pass reads
in float32. A micro-step decoder with context is evaluated without it (the training forward has none); acc@0 and
`state_loss` do not depend on it.

    python benchmarks/slot_rank.py default --ranks 12,8,6,4,2,1,0        # ~5 min on 2 CPU cores

`--train-sample N` first evaluates the uncut checkpoint on N examples of the training split too (seeded): a gap to
the held-out figure says the data is what is short, no gap that the model underfits what it was trained on.
"""

from __future__ import annotations

import argparse
import random
import time
import torch
from heldout_split import load_for_acc0, splits

from hamburger.errors import HamburgerError
from hamburger.training.examples import evaluate


def cut_error(adapters, original: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The largest relative Frobenius distance of an adapter's up @ down to the checkpoint's own."""
    worst = 0.0
    with torch.no_grad():
        for key, (up, down) in original.items():
            full = up.float() @ down.float()
            now = adapters.up[key].weight.float() @ adapters.down[key].weight.float()
            worst = max(worst, ((now - full).norm() / full.norm().clamp(min=1e-12)).item())
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a checkpoint with slot adapters (or `default`)")
    p.add_argument("--ranks", default="12,8,6,4,2,1,0", help="comma list, highest first; 0 = no adapters")
    p.add_argument("--data", default="data/segmented/train-k4-a0.2-r0.5.jsonl")
    p.add_argument("--eval-fraction", type=float, default=0.04, help="the training run's held-out fraction")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--train-sample", type=int, default=0, help="also evaluate on this many training examples")
    args = p.parse_args()
    try:
        ranks = sorted({int(r) for r in args.ranks.split(",")}, reverse=True)
        train, held = splits(args.data, args.eval_fraction)
        model = load_for_acc0(args.model)
        adapters = model.slot_adapters
        if not adapters.rank:
            raise HamburgerError(f"{args.model} has no slot adapters")
        if ranks[0] > adapters.rank or ranks[-1] < 0:
            raise HamburgerError(f"ranks must be within 0..{adapters.rank}, got {args.ranks}")
        pad = model.tokenizer.pad_token_id or 0

        def acc0(examples) -> dict[str, float]:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                return evaluate(model, [ex for _, ex in examples], model.config.max_step_tokens, pad, args.batch_size,
                                "cpu", dense=True)

        if args.train_sample:
            sample = random.Random(0).sample(train, min(args.train_sample, len(train)))
            m = acc0(sample)
            print(f"training split, {len(sample)} examples, rank {adapters.rank}: acc@0 {m['token_acc@0']:.4f}, "
                  f"state_loss {m['state_loss']:.4f}")
        print(f"{len(held)} held-out examples of {args.data}; {args.model}: slot adapters of rank {adapters.rank}")
        print("| rank | acc@0 | state_loss | largest relative error | adapter MB a smashed pass (float32) | s |")
        print("| --- | --- | --- | --- | --- | --- |")
        original = {k: (adapters.up[k].weight.detach().clone(), adapters.down[k].weight.detach().clone())
                    for k in adapters.down}
        for rank in ranks:  # highest first: the best rank-r cut of a best rank-(r+n) cut is the best rank-r cut
            if rank == 0:
                with torch.no_grad():
                    for w in adapters.up.parameters():
                        w.zero_()
            elif rank < adapters.rank:
                adapters.truncate(rank)
            error = cut_error(adapters, original)
            start = time.perf_counter()
            m = acc0(held)
            mb = sum(w.numel() for w in adapters.parameters()) * 4 / 1e6 if rank else 0.0
            print(f"| {rank} | {m['token_acc@0']:.4f} | {m['state_loss']:.4f} | {error:.3f} | {mb:.1f} | "
                  f"{time.perf_counter() - start:.0f} |", flush=True)
    except (HamburgerError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
