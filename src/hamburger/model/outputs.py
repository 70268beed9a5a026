"""What the training forward returns (`HamburgerOutput`) and the one definition of the held-out metrics: token
accuracy at each in-step index, stop accuracy and calibration (ECE), the dense losses; summed over batches, then
divided once (`metrics_from_counts`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

STOP_LOSS_WEIGHT = 0.5
ECE_BINS = 10  # probability bins of the stop head's calibration error (stop_ece)


@dataclass
class HamburgerOutput:
    """Training forward results. Token-level tensors run over response tokens in sequence order."""

    loss: torch.Tensor
    ce_loss: torch.Tensor
    stop_loss: torch.Tensor
    logits: torch.Tensor  # (T, V)
    targets: torch.Tensor  # (T,)
    in_step_index: torch.Tensor  # (T,) index of each token inside its step, 0..K-1
    stop_logits: torch.Tensor  # (T,)
    stop_targets: torch.Tensor  # (T,) 1 on the last token of each step
    # (T,) the stop labels that count (loss and accuracy): not at in-step index K-1 nor on an EOS token, where
    # a step always ends at inference whatever the stop head says, so the label is always 1 and never used
    stop_mask: torch.Tensor
    # dense losses (computed only when asked for, else None): KL(unmerged base || model) over every target,
    # and the merged slots' relative squared distance to the unmerged base's states, averaged over layers
    kd_loss: torch.Tensor | None = None
    state_loss: torch.Tensor | None = None
    merged_slots: int = 0  # how many slots state_loss is a mean over

    def metric_counts(self, max_step_tokens: int) -> dict[str, tuple[float, int]]:
        """(sum, count) of each metric over this batch's tokens: add them up over batches, then
        `metrics_from_counts` gives set-wide means (acc@k = right at k / targets at k over the whole set)."""
        correct = self.logits.argmax(-1) == self.targets
        t, m = self.targets.numel(), int(self.stop_mask.sum())
        out = {"ce_loss": (self.ce_loss.item() * t, t), "stop_loss": (self.stop_loss.item() * m, m),
               "token_acc": (correct.sum().item(), t)}
        for k in range(max_step_tokens):
            at_k = self.in_step_index == k
            out[f"token_acc@{k}"] = (correct[at_k].sum().item(), int(at_k.sum()))
        stop_right = ((self.stop_logits > 0) == (self.stop_targets > 0.5))[self.stop_mask]
        out["stop_acc"] = (stop_right.sum().item(), m)
        # Calibration of P(stop): per probability bin, the sum of (p - label) and the count; ECE is
        # sum over bins of |sum(p - label)| / all counted labels (`metrics_from_counts`).
        p = torch.sigmoid(self.stop_logits.float())[self.stop_mask]
        gap = p - self.stop_targets.float()[self.stop_mask]
        which = (p * ECE_BINS).long().clamp(max=ECE_BINS - 1)
        for b in range(ECE_BINS):
            out[f"_stop_bin{b}"] = (gap[which == b].sum().item(), int((which == b).sum()))
        if self.kd_loss is not None:
            out["kd_loss"] = (self.kd_loss.item() * t, t)
        if self.state_loss is not None:
            out["state_loss"] = (self.state_loss.item() * self.merged_slots, self.merged_slots)
        return out

    def metrics(self, max_step_tokens: int) -> dict[str, float]:
        """Loss parts, token accuracy by position in the step, and stop accuracy (on the stop labels that count)."""
        return metrics_from_counts(self.metric_counts(max_step_tokens))


def metrics_from_counts(counts: dict[str, tuple[float, int]]) -> dict[str, float]:
    """Means from (sum, count) pairs summed over batches; a metric with no count (e.g. acc@3 with no 4-token
    step) is left out. `loss` is recombined from its parts as the training loss is."""
    out = {key: total / n for key, (total, n) in counts.items() if n and not key.startswith("_")}
    bins = [counts[key] for key in counts if key.startswith("_stop_bin")]
    if bins and sum(n for _, n in bins):
        out["stop_ece"] = sum(abs(total) for total, _ in bins) / sum(n for _, n in bins)
    if "ce_loss" in out:
        out = {"loss": out["ce_loss"] + STOP_LOSS_WEIGHT * out.get("stop_loss", 0.0), **out}
    return out


def sparse_kl(logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(teacher || model) per row over the teacher's top-k tokens plus one bucket for all other tokens.

    logits (T, V) of the model; ids (T, k) and logprobs (T, k) of the teacher. With k = V this is the full
    KL; otherwise it is the KL between the two distributions coarsened to k + 1 outcomes (a lower bound).
    """
    logq = F.log_softmax(logits.float(), dim=-1)
    q_top = logq.gather(-1, ids.long())  # (T, k)
    p_top = logprobs.float()
    p = p_top.exp()
    kl = (p * (p_top - q_top)).sum(-1)
    p_rest = (1 - p.sum(-1)).clamp(min=0)
    q_rest = (1 - q_top.exp().sum(-1)).clamp(min=1e-8)
    rest = torch.where(p_rest > 1e-6, p_rest * (p_rest.clamp(min=1e-8).log() - q_rest.log()), torch.zeros_like(p_rest))
    return kl + rest
