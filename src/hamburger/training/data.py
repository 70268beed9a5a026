"""Segmented training examples and their batching into base slots and micro-step targets.

The position rule lives here for training and in `inference/reference.py` and `inference/engine.py` for inference, and a test pins them
together: a merged slot for step j gets the position id of the last token of step j in the full sequence.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

import torch

from hamburger.errors import HamburgerError


@dataclass
class SegmentedExample:
    """A templated sequence (prompt + response) whose response is cut into steps of 1..K tokens."""

    input_ids: list[int]
    prompt_len: int
    steps: list[int]
    # The base's top-k next tokens at every response token (`hamburger.training.teacher`), (response tokens, k) each.
    teacher_ids: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    # Per step: whether it ends at a cut (`cut_steps`) rather than at a segment's end; no stop label there.
    cut: list[bool] | None = None

    @property
    def num_slots(self) -> int:
        """Base slots this example takes in a batch: one per prompt token, one per response step but the last."""
        return self.prompt_len + len(self.steps) - 1

    def validate(self, max_step_tokens: int) -> None:
        response = len(self.input_ids) - self.prompt_len
        if self.prompt_len < 1 or response < 1:
            raise HamburgerError(f"an example needs >= 1 prompt and response token (prompt_len={self.prompt_len})")
        if self.cut is not None and len(self.cut) != len(self.steps):
            raise HamburgerError(f"{len(self.cut)} cut flags for {len(self.steps)} steps")
        if sum(self.steps) != response or any(not 1 <= s <= max_step_tokens for s in self.steps):
            raise HamburgerError(
                f"steps {self.steps} must be lengths in 1..{max_step_tokens} summing to the response length {response}"
            )
        if self.teacher_ids is not None and (self.teacher_ids.shape[0] != response
                                             or self.teacher_logprobs.shape != self.teacher_ids.shape):
            raise HamburgerError(f"the teacher holds {self.teacher_ids.shape[0]} positions for a response of "
                                 f"{response} tokens: it was cached for other data (re-run `hamburger segment`)")


@dataclass
class SegmentedBatch:
    """Tensors for one training forward.

    Base side (B, S): every slot holds 1..K tokens; prompt tokens are one-token slots, and each response
    step but the last is one merged slot. Micro side (N steps): the step's tokens and the base slot whose
    hidden states predict it (the last prompt slot for the first step, the previous step's slot after).
    """

    slot_tokens: torch.Tensor  # (B, S, K)
    slot_lengths: torch.Tensor  # (B, S)
    attention_mask: torch.Tensor  # (B, S)
    position_ids: torch.Tensor  # (B, S)
    step_batch: torch.Tensor  # (N,)
    step_slot: torch.Tensor  # (N,)
    step_tokens: torch.Tensor  # (N, K)
    step_lengths: torch.Tensor  # (N,)
    # The same examples unmerged, one token per position (right-padded), for the teacher of the dense losses:
    # a slot's position id indexes it, so token i of step n is predicted there at position_ids[step] + i.
    full_ids: torch.Tensor  # (B, T)
    full_mask: torch.Tensor  # (B, T)
    # The cached teacher (when every example has one): the base's top-k at each target, in the targets'
    # order (examples in batch order, each one's response tokens in order), (T, k) each.
    teacher_ids: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    step_cut: torch.Tensor | None = None  # (N,) the step ends at a cut (`cut_steps`): no stop label on its last token

    def to(self, device: torch.device | str) -> SegmentedBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return SegmentedBatch(**{k: v if v is None else v.to(device) for k, v in moved.items()})


def step_positions(prompt_len: int, steps: list[int]) -> list[int]:
    """Position id of each step's merged slot: the index of the step's last token in the full sequence."""
    positions, end = [], prompt_len
    for s in steps:
        end += s
        positions.append(end - 1)
    return positions


def cut_steps(ex: SegmentedExample, rng: random.Random, p: float) -> SegmentedExample:
    """The example with each step of >= 2 tokens cut in two at a random point with probability p.

    Training then also merges step prefixes, as inference does when the stop head or the confidence ends a
    step before the segment's end (the paper trains on whole entropy segments only). Tokens, and so the
    cached teacher, stay where they are. The first part of a cut step ends where the segment goes on, so it
    gets no stop label (`cut`): the stop head keeps learning the segments' ends.
    """
    steps, cuts = [], []
    for s in ex.steps:
        if s > 1 and rng.random() < p:
            at = rng.randint(1, s - 1)
            steps += [at, s - at]
            cuts += [True, False]
        else:
            steps.append(s)
            cuts.append(False)
    return SegmentedExample(ex.input_ids, ex.prompt_len, steps, ex.teacher_ids, ex.teacher_logprobs, cuts)


def _slots_and_steps(examples: list[SegmentedExample], k: int):
    """Per example its base slots [(tokens, position id)], and every step (example, predicting slot, tokens)."""
    rows, steps_out = [], []
    for b, ex in enumerate(examples):
        ex.validate(k)
        p = ex.prompt_len
        slots = [([tok], i) for i, tok in enumerate(ex.input_ids[:p])]
        start = p
        for s, pos in zip(ex.steps[:-1], step_positions(p, ex.steps[:-1])):
            slots.append((ex.input_ids[start : start + s], pos))
            start += s
        rows.append(slots)
        start = p
        for j, s in enumerate(ex.steps):
            steps_out.append((b, p - 1 + j, ex.input_ids[start : start + s]))
            start += s
    return rows, steps_out


def _base_side(rows: list, k: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """The (B, S) slot tensors, right-padded."""
    bsz, width = len(rows), max(len(r) for r in rows)
    slot_tokens = torch.full((bsz, width, k), pad_token_id, dtype=torch.long)
    slot_lengths = torch.ones(bsz, width, dtype=torch.long)  # padding slots count as one token: no empty attention
    attention_mask = torch.zeros(bsz, width, dtype=torch.long)
    position_ids = torch.zeros(bsz, width, dtype=torch.long)
    for b, slots in enumerate(rows):
        for i, (toks, pos) in enumerate(slots):
            slot_tokens[b, i, : len(toks)] = torch.tensor(toks)
            slot_lengths[b, i] = len(toks)
            position_ids[b, i] = pos
        attention_mask[b, : len(slots)] = 1
    return {"slot_tokens": slot_tokens, "slot_lengths": slot_lengths, "attention_mask": attention_mask,
            "position_ids": position_ids}


def _unmerged_and_teacher(examples: list[SegmentedExample], pad_token_id: int) -> dict[str, torch.Tensor | None]:
    """The examples one token per position (the dense losses' teacher reads them) and the cached teacher, if any."""
    full_ids = torch.full((len(examples), max(len(ex.input_ids) for ex in examples)), pad_token_id, dtype=torch.long)
    full_mask = torch.zeros_like(full_ids)
    for b, ex in enumerate(examples):
        full_ids[b, : len(ex.input_ids)] = torch.tensor(ex.input_ids)
        full_mask[b, : len(ex.input_ids)] = 1
    teacher_ids = teacher_logprobs = None
    cached = [ex.teacher_ids is not None for ex in examples]
    if all(cached):
        # Cast before concatenating: under CPU autocast, cat refuses float16 inputs.
        teacher_ids = torch.cat([ex.teacher_ids.long() for ex in examples])
        teacher_logprobs = torch.cat([ex.teacher_logprobs.float() for ex in examples])
    elif any(cached):
        raise HamburgerError("a batch mixes examples with and without a cached teacher")
    return {"full_ids": full_ids, "full_mask": full_mask, "teacher_ids": teacher_ids,
            "teacher_logprobs": teacher_logprobs}


def collate(examples: list[SegmentedExample], max_step_tokens: int, pad_token_id: int) -> SegmentedBatch:
    k = max_step_tokens
    rows, steps_out = _slots_and_steps(examples, k)
    step_cut = None
    if any(ex.cut for ex in examples):
        step_cut = torch.tensor([c for ex in examples for c in (ex.cut or [False] * len(ex.steps))], dtype=torch.bool)
    step_tokens = torch.full((len(steps_out), k), pad_token_id, dtype=torch.long)
    for n, (_, _, toks) in enumerate(steps_out):
        step_tokens[n, : len(toks)] = torch.tensor(toks)
    return SegmentedBatch(
        **_base_side(rows, k, pad_token_id),
        step_batch=torch.tensor([b for b, _, _ in steps_out], dtype=torch.long),
        step_slot=torch.tensor([s for _, s, _ in steps_out], dtype=torch.long),
        step_tokens=step_tokens,
        step_lengths=torch.tensor([len(t) for _, _, t in steps_out], dtype=torch.long),
        **_unmerged_and_teacher(examples, pad_token_id),
        step_cut=step_cut,
    )
