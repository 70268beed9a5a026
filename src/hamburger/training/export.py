"""`hamburger export`: a trained run's new modules (and the micro-step shortlist) as a checkpoint that loads the base
from its reference."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

from hamburger.errors import HamburgerError
from hamburger.inference.reference import eos_ids
from hamburger.model.config import check_confidence, check_lookup, check_mode
from hamburger.model.hamburger_model import (
    HamburgerModel,
)
from hamburger.training.data import SegmentedExample
from hamburger.training.examples import (
    read_examples,
)


def micro_vocab(rows: list[tuple[str, SegmentedExample]], size: int, always: list[int]) -> tuple[torch.Tensor, float]:
    """The `size` most frequent response tokens of segmented data (plus `always`, e.g. EOS), and their coverage."""
    if size < 1:
        raise HamburgerError(f"--micro-vocab-size must be >= 1, got {size}")
    counts = Counter(t for _, ex in rows for t in ex.input_ids[ex.prompt_len:])
    chosen = list(dict.fromkeys(always + [t for t, _ in counts.most_common(size)]))[:max(size, len(always))]
    covered = sum(counts[t] for t in set(chosen))
    return torch.tensor(sorted(chosen), dtype=torch.long), covered / max(1, sum(counts.values()))


def cmd_export(args: argparse.Namespace) -> int:
    """A checkpoint for shipping: optionally LoRA merged into the base, weights stored in a smaller dtype."""
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise HamburgerError(f"{out} is not empty: pass --force to replace its files")
    model = HamburgerModel.from_pretrained(args.checkpoint)
    if args.micro_vocab:
        model.micro_vocab, coverage = micro_vocab(read_examples(Path(args.micro_vocab)), args.micro_vocab_size,
                                                  sorted(eos_ids(model)))
        print(f"micro-step shortlist: {len(model.micro_vocab)} tokens covering {coverage:.2%} of the response "
              f"tokens in {args.micro_vocab}", file=sys.stderr)
    if args.slot_adapter_rank is not None:
        if not model.config.slot_adapter_rank:
            raise HamburgerError(f"{args.checkpoint} has no slot adapters to cut")
        error = model.truncate_slot_adapters(args.slot_adapter_rank)
        print(f"slot adapters cut to rank {args.slot_adapter_rank}: largest relative error {error:.3f}", file=sys.stderr)
    if args.default_confidence is not None:
        model.config.default_confidence = check_confidence(args.default_confidence)
    if args.verify_confidence is not None:
        model.config.verify_confidence = check_confidence(args.verify_confidence)
    if args.lookup is not None:
        model.config.lookup = check_lookup(args.lookup)
    if args.merge_window is not None:
        if args.merge_window < 0:
            raise HamburgerError(f"--merge-window must be >= 0, got {args.merge_window}")
        model.config.merge_window = args.merge_window
    if args.default_mode is not None:
        model.config.default_mode = check_mode(args.default_mode)
    if args.merge_lora:
        if not model.config.lora_rank:
            raise HamburgerError(f"{args.checkpoint} has no LoRA adapters to merge")
        model.merge_lora()
    model.save_pretrained(out, dtype=getattr(torch, args.dtype))
    size = (out / "model.safetensors").stat().st_size
    print(json.dumps({"checkpoint": str(out), "bytes": size, "parameters": model.parameter_counts()}), file=sys.stderr)
    return 0
