"""Does more training of the slot side, or letting the base's *reading* positions adapt, lift acc@0? Equal wall time.

A probe, not a trainer (`hamburger train` is that): it starts from a checkpoint (the shipped default by default),
freezes the base, the micro-step decoder and the stop head, and trains for `--minutes` with AdamW on the
training loss of `hamburger train` (token cross-entropy in the steps and the stop loss), over the training split
in a seeded order, batch 8, bf16 autocast, then prints held-out acc@0, split by whether a smashed slot or a one-token
position predicts token 0 (`benchmarks/acc0_where.py` says why that split matters).

Arms (`--arm`):
- `slot`: the embedder and the slot adapters train (what `hamburger train` trains for acc@0), nothing new;
- `reader`: the same, plus fresh *reader adapters* (low-rank, rank `--reader-rank`, on the same projections, zero
  at the start) that act at one-token positions with a smashed slot at most `--reach` slots before them: the
  base's unadapted reading of recent smashed slots is where most of acc@0 is lost, and this lets it adapt there
  (like fine-tuning the base, as the reference implementation does, but only where a smashed slot is read, so
  with nothing smashed the base is untouched).

- `base`: the same as `slot`, and the whole base learns too (at `--base-lr`): what the reference implementation
  does, the base then differs from the untouched one everywhere.

    python benchmarks/slot_readers.py --arm slot --minutes 12      # ~13 min on 2 CPU cores
    python benchmarks/slot_readers.py --arm reader --minutes 12

On a GPU (`--device cuda`, or auto where torch sees one), with `--batch-size`, `--eval-every` for the learning curve
and `--extra-data` (more segmented data for training only; the held-out split stays `--data`'s), this is the probe
`benchmarks/gpu_run.py probe` runs for the three arms side by side.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from heldout_split import load_for_acc0, slots_since_smashed, splits, token0_right

from hamburger.errors import HamburgerError
from hamburger.loading import resolve_device
from hamburger.model.slot_adapters import SlotAdapters
from hamburger.training.data import collate
from hamburger.training.examples import read_examples
from hamburger.training.loss import hamburger_loss


def reader_mask(merged: torch.Tensor, attention_mask: torch.Tensor, reach: int) -> torch.Tensor:
    """(B, S): one-token positions with a smashed slot 1..reach slots before them."""
    smashed = merged & attention_mask.bool()
    return ~smashed & attention_mask.bool() & (slots_since_smashed(smashed) <= reach)


def held_out_acc0(model, held) -> dict[str, float]:
    model.eval()
    counts: dict[str, list[int]] = {}
    for _, ok, length in token0_right(model, held):
        for key, sel in (("acc@0", torch.ones_like(ok)), ("at smashed slots", length > 1),
                         ("at one-token positions", length == 1)):
            c = counts.setdefault(key, [0, 0])
            c[0] += int(ok[sel].sum())
            c[1] += int(sel.sum())
    model.train()
    return {key: round(r / n, 4) for key, (r, n) in counts.items() if n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--arm", choices=("slot", "reader", "base"), required=True)
    p.add_argument("--minutes", type=float, default=12.0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--base-lr", type=float, default=5e-5, help="the base's learning rate in the `base` arm")
    p.add_argument("--reader-rank", type=int, default=8)
    p.add_argument("--reach", type=int, default=10**6, help="reader adapters act this many slots after a smashed one")
    p.add_argument("--data", default="data/segmented/train-k4-a0.2-r0.5.jsonl")
    p.add_argument("--extra-data", action="append", default=[],
                   help="more segmented data, all of it for training (repeatable); the held-out split stays --data's")
    p.add_argument("--eval-fraction", type=float, default=0.04)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=0, help="held-out acc@0 every N steps too (0: at the end only)")
    p.add_argument("--device", default="auto", help="auto: cuda where torch sees a GPU, else cpu")
    p.add_argument("--log", default=None, help="also append the JSON rows to this file")
    args = p.parse_args()
    torch.manual_seed(0)
    try:
        device = resolve_device(args.device)
        train, held = splits(args.data, args.eval_fraction)
        for extra in args.extra_data:
            train += read_examples(Path(extra))
        model = load_for_acc0(args.model)  # its micro-step decoder's context off, as the training forward runs it
        if not model.slot_adapters.rank:
            raise HamburgerError(f"{args.model} has no slot adapters")
    except HamburgerError as e:
        raise SystemExit(f"error: {e}") from None
    model.to(device)
    model.base.requires_grad_(args.arm == "base")
    model.micro.requires_grad_(False)
    model.stop_head.requires_grad_(False)
    cfg = model.config
    groups = [{"params": [*model.embedder.parameters(), *model.slot_adapters.parameters()], "lr": args.lr}]
    if args.arm == "reader":
        reader = SlotAdapters(model.base, args.reader_rank, 2.0 * args.reader_rank, cfg.slot_adapter_targets)
        reader.to(device)
        groups[0]["params"] += list(reader.parameters())
        plain_forward = model.base_forward

        def base_forward(embeds, attention_mask, position_ids, cache=None, merged=None):
            with reader.gated(reader_mask(merged, attention_mask, args.reach)):
                return plain_forward(embeds, attention_mask, position_ids, cache=cache, merged=merged)

        model.base_forward = base_forward
    if args.arm == "base":
        groups.append({"params": list(model.base.parameters()), "lr": args.base_lr})
    params = [q for g in groups for q in g["params"]]
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    k, pad = cfg.max_step_tokens, model.tokenizer.pad_token_id or 0
    order = [ex for _, ex in train]
    random.Random(0).shuffle(order)
    held = [ex for _, ex in held]
    bs = args.batch_size

    def emit(row: dict) -> None:
        line = json.dumps({"arm": args.arm, **row})
        print(line, flush=True)
        if args.log:
            with open(args.log, "a") as f:
                f.write(line + "\n")

    emit({"step": 0, "device": str(device), "train examples": len(order), "held-out": len(held),
          **held_out_acc0(model, held)})
    start, step, targets = time.time(), 0, 0
    while time.time() - start < args.minutes * 60:
        at = (step * bs) % len(order)
        batch = collate(sorted(order[at : at + bs], key=lambda ex: ex.num_slots), k, pad).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = hamburger_loss(model, batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, targets = step + 1, targets + len(out.targets)
        if step % 20 == 0:
            emit({"step": step, "loss": round(out.loss.item(), 4), "min": round((time.time() - start) / 60, 2),
                  "epochs": round(step * bs / len(order), 2), "targets/s": round(targets / (time.time() - start), 1)})
        if args.eval_every and step % args.eval_every == 0:
            emit({"step": step, "min": round((time.time() - start) / 60, 2), **held_out_acc0(model, held)})
    emit({"step": step, "min": round((time.time() - start) / 60, 2), "final": True, **held_out_acc0(model, held)})


if __name__ == "__main__":
    main()
