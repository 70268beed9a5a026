"""What the held-out probes share (`slot_rank.py`, `acc0_where.py`, `slot_readers.py`): the training split and the
held-out split of `hamburger train` (the same hash split), and a checkpoint loaded for the teacher-forced forward."""

from __future__ import annotations

from pathlib import Path

from hamburger.errors import HamburgerError
from hamburger.model.hamburger_model import load_model
from hamburger.training.examples import read_examples, split_eval


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
