"""The teacher-forced training loss of a `HamburgerModel` on segmented batches (`hamburger_loss`), and the teacher of
its dense losses (`teacher_states`, the unmerged base).

The model itself holds no loss: `bind_loss` makes `hamburger_loss` the forward of one model instance for the
trainer, so that accelerate's wrappers (DDP) call it as they call any module.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from hamburger.model.base import eos_ids
from hamburger.model.hamburger_model import HamburgerModel
from hamburger.model.outputs import STOP_LOSS_WEIGHT, HamburgerOutput, sparse_kl
from hamburger.training.data import SegmentedBatch


@dataclass
class StepStates:
    """The states that predict every target token of a batch's steps, in sequence order (T, d), and where they sit."""

    chosen: torch.Tensor  # (T, d)
    valid: torch.Tensor  # (N, span): token i of step n exists
    idx: torch.Tensor  # (span,)
    span: int  # tokens in the longest step of the batch


def bind_loss(model: HamburgerModel) -> HamburgerModel:
    """`model(batch, **kw)` computes `hamburger_loss(model, batch, **kw)` from now on (what the trainer's wrappers
    call); returns the model."""
    model.forward = types.MethodType(hamburger_loss, model)
    return model


@torch.no_grad()
def teacher_states(model: HamburgerModel, batch: SegmentedBatch) -> tuple[torch.Tensor, ...]:
    """The unmerged base's hidden states over the batch's examples, one token per position (no slot adapters,
    which act only at merged slots; the base's LoRA off): the teacher of the dense losses."""
    with model.base_lora(False):
        out = model.base.base_model(input_ids=batch.full_ids, attention_mask=batch.full_mask,
                                    output_hidden_states=True)
    return out.hidden_states


def micro_context_states(model: HamburgerModel, micro_in: torch.Tensor, cache: DynamicCache, batch: SegmentedBatch,
                         rows: torch.Tensor) -> torch.Tensor:
    """A micro-step decoder with context (`micro_context` > 0) over the inputs (M, q, d) of the steps `rows`: each
    micro layer also reads the base's keys and values of its source layer over the latest `context` slots up to
    the step's own (the slots in use when the step starts, as the engine's `micro_context`), and its inputs take
    the positions after the slot's."""
    micro = model.micro
    b, s = batch.step_batch[rows], batch.step_slot[rows]  # (M,)
    window, q = micro.context, micro_in.shape[1]
    dev = micro_in.device
    slots = s[:, None] - (window - 1) + torch.arange(window, device=dev)  # (M, W) the latest W slots up to s
    seen = slots >= 0
    slots = slots.clamp(min=0)
    keys, values = [], []
    for src in micro.context_layers:
        layer = cache.layers[src]  # keys, values (B, kv_heads, S, hd)
        keys.append(layer.keys[b[:, None], :, slots].permute(0, 2, 1, 3))  # (M, kv_heads, W, hd)
        values.append(layer.values[b[:, None], :, slots].permute(0, 2, 1, 3))
    own = torch.ones(q, q, dtype=torch.bool, device=dev).tril()
    mask = torch.cat([seen[:, None, :].expand(-1, q, -1), own.expand(len(rows), -1, -1)], -1)[:, None]
    positions = batch.position_ids[b, s][:, None] + 1 + torch.arange(q, device=dev)
    return micro.forward_context(micro_in, positions, keys, values, mask)


def step_states(model: HamburgerModel, batch: SegmentedBatch, hidden: tuple[torch.Tensor, ...],
                cache: DynamicCache | None) -> StepStates:
    """token 0 of a step from the base's final state at its slot; tokens 1.. from the micro-step decoder."""
    h0 = hidden[-1][batch.step_batch, batch.step_slot]  # (N, d): the state that predicts token 0 of each step
    n, d = h0.shape
    lengths = batch.step_lengths
    span = int(lengths.max())
    idx = torch.arange(span, device=h0.device)
    valid = idx[None] < lengths[:, None]  # (N, span)
    if span == 1:
        return StepStates(h0, valid, idx, span)
    # The micro-step decoder only runs over steps of >= 2 tokens (a one-token step's only target comes from the
    # base) and only as far as the longest of them; it is causal, so cutting the padding changes no output.
    # States: [h0 of every step; micro outputs of the multi-token steps, flattened].
    micro = model.micro
    rows = (lengths > 1).nonzero().squeeze(1)  # (M,)
    feats = micro.features(hidden, (batch.step_batch[rows], batch.step_slot[rows]))  # (M, m, d)
    micro_in = torch.cat([feats, model.embed(batch.step_tokens[rows, : span - 1])], dim=1)
    out = micro(micro_in) if cache is None else micro_context_states(model, micro_in, cache, batch, rows)
    micro_out = out[:, micro.num_features :]  # (M, span-1, d): tokens 1..span-1
    row_of = torch.zeros(n, dtype=torch.long, device=h0.device)
    row_of[rows] = torch.arange(len(rows), device=h0.device)
    where = torch.cat([torch.arange(n, device=h0.device)[:, None],  # token 0: h0 of its own step
                       n + row_of[:, None] * (span - 1) + idx[None, : span - 1]], dim=1)  # (N, span)
    chosen = torch.cat([h0, micro_out.reshape(-1, d)])[where[valid]]  # (T, d) in sequence order
    return StepStates(chosen, valid, idx, span)


def stop_labels(model: HamburgerModel, batch: SegmentedBatch, st: StepStates, logits: torch.Tensor,
                targets: torch.Tensor, verified_stops: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The stop head's targets (T,) and which of them count (T,) bool."""
    lengths, idx, valid = batch.step_lengths, st.idx, st.valid
    last = idx[None] == lengths[:, None] - 1
    stop_targets = last[valid].float()
    if verified_stops:
        wrong = (logits.detach().argmax(-1) != targets).float()
        wrong_next = torch.zeros_like(wrong)
        wrong_next[:-1] = wrong[1:]  # the next token in sequence order; it is in this step unless this one ends it
        stop_targets = torch.maximum(stop_targets, wrong_next)
    in_step = idx.expand_as(valid)[valid]
    eos = torch.tensor(sorted(eos_ids(model)), dtype=targets.dtype, device=targets.device)
    stop_mask = (in_step < model.config.max_step_tokens - 1) & ~torch.isin(targets, eos)
    if batch.step_cut is not None:  # a cut step's last token: the segment goes on there, so no stop label
        stop_mask &= ~(last & batch.step_cut[:, None])[valid]
    return stop_targets, stop_mask


def kd_loss(model: HamburgerModel, batch: SegmentedBatch, st: StepStates, logits: torch.Tensor,
            teacher: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """KL(base || model) of the next-token distribution at every target: from the batch's cached top-k teacher
    when `teacher` is None, else from the unmerged base's states."""
    if teacher is None:
        return sparse_kl(logits, batch.teacher_ids, batch.teacher_logprobs).mean()
    step_pos = batch.position_ids[batch.step_batch, batch.step_slot]  # (N,) where the base predicts token 0
    tb = batch.step_batch[:, None].expand_as(st.valid)[st.valid]
    tp = (step_pos[:, None] + st.idx[None])[st.valid]  # token i of a step: predicted at step_pos + i
    with torch.no_grad():
        want = F.log_softmax(model.lm_head(teacher[-1][tb, tp]).float(), -1)
    return F.kl_div(F.log_softmax(logits, -1), want, log_target=True, reduction="none").sum(-1).mean()


def state_loss(batch: SegmentedBatch, hidden: tuple[torch.Tensor, ...], teacher: tuple[torch.Tensor, ...],
               merged: torch.Tensor) -> torch.Tensor:
    """At every merged slot, ||h - h_base||^2 / ||h_base||^2 at each layer's output, averaged over the layers, where
    h_base is the base's state at the step's last token (the slot's position)."""
    if not bool(merged.any()):
        return hidden[-1].sum() * 0.0
    mb, ms = merged.nonzero(as_tuple=True)
    mp = batch.position_ids[mb, ms]
    parts = []
    for got, ref in zip(hidden[1:], teacher[1:]):
        g, r = got[mb, ms].float(), ref[mb, mp].float()
        parts.append(((g - r).square().sum(-1) / r.square().sum(-1).clamp(min=1e-6)).mean())
    return torch.stack(parts).mean()


def dense_losses(model: HamburgerModel, batch: SegmentedBatch, st: StepStates, logits: torch.Tensor,
                 hidden: tuple[torch.Tensor, ...], need_state: bool, full_kl: bool):
    """(kd, state or None, merged slots). The batch's cached teacher (`segment --teacher-top-k`) spares the base's
    second forward when only KD trains; held-out figures (`full_kl`) always take the full KL, one definition to
    compare by."""
    from_cache = batch.teacher_ids is not None and not full_kl
    teacher = None if from_cache and not need_state else teacher_states(model, batch)
    kd = kd_loss(model, batch, st, logits, None if from_cache else teacher)
    merged = (batch.slot_lengths > 1) & batch.attention_mask.bool()
    state = None if teacher is None else state_loss(batch, hidden, teacher, merged)
    return kd, state, int(merged.sum())


def hamburger_loss(model: HamburgerModel, batch: SegmentedBatch, verified_stops: bool = False,
                   kd_weight: float = 0.0, state_weight: float = 0.0, dense_metrics: bool = False) -> HamburgerOutput:
    """Teacher-forced loss on a segmented batch.

    `verified_stops`: the stop head also learns to end a step before a token the micro-step decoder gets wrong
    (its argmax differs from the data's token), not only where the segmentation ends it; with self-distilled data
    this makes the confidence knob track agreement with the base.

    Dense losses against the unmerged base (`teacher_states`), added with their weights:
    `kd_weight`: KL(base || model) of the next-token distribution at every target (token 0 after a smashed slot and
    the micro tokens), where the base reads the step's tokens one per position; `state_weight`: `state_loss` at
    every merged slot. `dense_metrics` computes both (for held-out figures) whatever their weights.

    A micro-step decoder with context (`micro_context`) reads the base's keys and values of the batch's slots, as
    trust mode decodes (`micro_context_states`).
    """
    k = model.config.max_step_tokens
    b, s, _ = batch.slot_tokens.shape
    slots = model.smash(batch.slot_tokens.view(b * s, k), batch.slot_lengths.view(-1)).view(b, s, -1)
    cache = DynamicCache() if model.micro.context and k > 1 else None
    hidden = model.base_forward(slots, batch.attention_mask, batch.position_ids, cache=cache,
                                merged=batch.slot_lengths > 1)
    st = step_states(model, batch, hidden, cache)
    logits = model.lm_head(st.chosen).float()
    stop_logits = model.stop_head(st.chosen).float()
    targets = batch.step_tokens[:, : st.span][st.valid]
    stop_targets, stop_mask = stop_labels(model, batch, st, logits, targets, verified_stops)
    ce = F.cross_entropy(logits, targets)
    bce = F.binary_cross_entropy_with_logits(stop_logits, stop_targets, reduction="none")
    stop = (bce * stop_mask).sum() / stop_mask.sum().clamp(min=1)
    loss, kd, state, n_merged = ce + STOP_LOSS_WEIGHT * stop, None, None, 0
    if kd_weight or state_weight or dense_metrics:
        kd, state, n_merged = dense_losses(model, batch, st, logits, hidden, bool(state_weight), dense_metrics)
        loss = loss + kd_weight * kd + (state_weight * state if state is not None else 0.0)
    return HamburgerOutput(loss=loss, kd_loss=kd, state_loss=state, merged_slots=n_merged, ce_loss=ce,
                           stop_loss=stop, logits=logits, targets=targets,
                           in_step_index=st.idx.expand_as(st.valid)[st.valid], stop_logits=stop_logits,
                           stop_targets=stop_targets, stop_mask=stop_mask)
