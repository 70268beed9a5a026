"""What the held-out probes share (`slot_rank.py`, `acc0_where.py`, `slot_readers.py`): the training split and the
held-out split of `hamburger train` (the same hash split), a checkpoint loaded for the teacher-forced forward, and
token 0's right/wrong per step with what predicts it."""

from __future__ import annotations

from pathlib import Path

import torch

from hamburger.errors import HamburgerError
from hamburger.model.hamburger_model import load_model
from hamburger.training.data import collate
from hamburger.training.examples import read_examples, split_eval
from hamburger.training.loss import hamburger_loss


def splits(data: str, fraction: float) -> tuple[list, list]:
    """(training, held-out) (id, example) rows of segmented data; an error if nothing is held out."""
    train, held = split_eval(read_examples(Path(data)), fraction)
    if not held:
        raise HamburgerError(f"no held-out examples at --eval-fraction {fraction}")
    return train, held


def load_for_acc0(name: str):
    """A checkpoint in eval mode with its micro-step decoder's context off: the training forward runs the
    features-only decoder, and acc@0 (the base's own head) does not read it."""
    model, _ = load_model(name)
    model.eval()
    model.micro.set_context(0)
    return model


NONE_BEFORE = 10**9  # `slots_since_smashed` where no smashed slot comes before


def slots_since_smashed(smashed: torch.Tensor) -> torch.Tensor:
    """(B, S) bool of smashed slots -> how many slots back the latest smashed slot strictly before each position is
    (NONE_BEFORE or more where there is none)."""
    idx = torch.arange(smashed.shape[1], device=smashed.device).expand_as(smashed)
    latest = torch.where(smashed, idx, torch.full_like(idx, -NONE_BEFORE)).cummax(1).values
    before = torch.cat([torch.full_like(latest[:, :1], -NONE_BEFORE), latest[:, :-1]], 1)
    return idx - before


@torch.no_grad()
def token0_right(model, examples: list, batch_size: int = 8):
    """Per batch of the held-out examples (in length order), teacher-forced under bf16 autocast: (batch, right,
    length), where `right` (N,) says whether the base's head gets token 0 of each step right and `length` (N,) is
    the number of tokens of the slot that predicts it (1: an exact one-token position; 2+: a smashed slot)."""
    k, pad = model.config.max_step_tokens, model.tokenizer.pad_token_id or 0
    examples = sorted(examples, key=lambda ex: ex.num_slots)
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=torch.bfloat16):
        for i in range(0, len(examples), batch_size):
            batch = collate(examples[i : i + batch_size], k, pad).to(device)
            out = hamburger_loss(model, batch)
            first = out.in_step_index == 0  # token 0 of every step, in step order
            yield batch, out.logits[first].argmax(-1) == out.targets[first], \
                batch.slot_lengths[batch.step_batch, batch.step_slot]
