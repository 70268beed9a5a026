"""`hamburger export`: a trained run's new modules (and the micro-step shortlist) as a checkpoint that loads the base
from its reference."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch

from hamburger.errors import HamburgerError
from hamburger.inference.reference import eos_ids
from hamburger.model.config import check_confidence, check_lookup, check_mode
from hamburger.model.hamburger_model import HamburgerModel
from hamburger.training.data import SegmentedExample
from hamburger.training.examples import read_examples


def micro_vocab(rows: list[tuple[str, SegmentedExample]], size: int, always: list[int]) -> tuple[torch.Tensor, float]:
    """The `size` most frequent response tokens of segmented data (plus `always`, e.g. EOS), and their coverage."""
    if size < 1:
        raise HamburgerError(f"--micro-vocab-size must be >= 1, got {size}")
    counts = Counter(t for _, ex in rows for t in ex.input_ids[ex.prompt_len:])
    chosen = list(dict.fromkeys(always + [t for t, _ in counts.most_common(size)]))[:max(size, len(always))]
    covered = sum(counts[t] for t in set(chosen))
    return torch.tensor(sorted(chosen), dtype=torch.long), covered / max(1, sum(counts.values()))


def reply_tokens(path: Path, tokenizer, eos: int) -> torch.Tensor:
    """The replies of a distilled JSONL (`hamburger distill`: the base's own replies) as one int32 tensor, each
    reply's tokens then `eos` then -1: verify mode's stored replies to draft from (`lookup.ReplyStore`)."""
    out: list[int] = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise HamburgerError(f"--replies: cannot read {path}: {exc}") from exc
    for i, line in enumerate(lines):
        try:
            reply = json.loads(line)["messages"][-1]
        except (ValueError, KeyError, IndexError, TypeError):
            raise HamburgerError(f"--replies: {path} line {i + 1} is not a distilled chat (messages)") from None
        if reply.get("role") != "assistant":
            raise HamburgerError(f"--replies: {path} line {i + 1} does not end with the assistant's reply")
        out += tokenizer(reply["content"], add_special_tokens=False)["input_ids"] + [eos, -1]
    if not out:
        raise HamburgerError(f"--replies: {path} has no replies")
    return torch.tensor(out, dtype=torch.int32)


def export_checkpoint(checkpoint: str, out: Path, dtype: str = "bfloat16", merge_lora: bool = False,
                      shortlist_data: str | None = None, shortlist_size: int = 8192,
                      slot_adapter_rank: int | None = None, default_confidence: float | None = None,
                      verify_confidence: float | None = None, merge_window: int | None = None,
                      lookup: int | None = None, default_mode: str | None = None, force: bool = False,
                      replies: str | None = None) -> dict:
    """A checkpoint for shipping: optionally LoRA merged into the base, weights stored in a smaller dtype, a
    micro-step shortlist from `shortlist_data` (segmented JSONL), slot adapters cut to a rank, the base's replies
    of `replies` (distilled JSONL) for verify mode's lookup drafts, and the decoding defaults it carries (None: as
    they are). Returns what was written: checkpoint, bytes, parameters."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise HamburgerError(f"{out} is not empty: pass --force to replace its files")
    model = HamburgerModel.from_pretrained(checkpoint)
    if shortlist_data:
        model.micro_vocab, coverage = micro_vocab(read_examples(Path(shortlist_data)), shortlist_size,
                                                  sorted(eos_ids(model)))
        print(f"micro-step shortlist: {len(model.micro_vocab)} tokens covering {coverage:.2%} of the response "
              f"tokens in {shortlist_data}", file=sys.stderr)
    if slot_adapter_rank is not None:
        if not model.config.slot_adapter_rank:
            raise HamburgerError(f"{checkpoint} has no slot adapters to cut")
        error = model.truncate_slot_adapters(slot_adapter_rank)
        print(f"slot adapters cut to rank {slot_adapter_rank}: largest relative error {error:.3f}", file=sys.stderr)
    if default_confidence is not None:
        model.config.default_confidence = check_confidence(default_confidence)
    if verify_confidence is not None:
        model.config.verify_confidence = check_confidence(verify_confidence)
    if lookup is not None:
        model.config.lookup = check_lookup(lookup)
    if merge_window is not None:
        if merge_window < 0:
            raise HamburgerError(f"--merge-window must be >= 0, got {merge_window}")
        model.config.merge_window = merge_window
    if default_mode is not None:
        model.config.default_mode = check_mode(default_mode)
    if replies:
        ids, tok = eos_ids(model), model.tokenizer
        model.reply_tokens = reply_tokens(Path(replies), tok, tok.eos_token_id if tok.eos_token_id in ids else min(ids))
        print(f"stored replies: {int((model.reply_tokens < 0).sum())} replies, {len(model.reply_tokens)} tokens "
              f"from {replies}", file=sys.stderr)
    if merge_lora:
        if not model.config.lora_rank:
            raise HamburgerError(f"{checkpoint} has no LoRA adapters to merge")
        model.merge_lora()
    model.save_pretrained(out, dtype=getattr(torch, dtype))
    return {"checkpoint": str(out), "bytes": (out / "model.safetensors").stat().st_size,
            "parameters": model.parameter_counts()}
