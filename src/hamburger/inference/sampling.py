"""Choosing tokens (greedy, temperature, top-k, top-p) and deciding when a macro-step ends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hamburger.errors import HamburgerError

Warper = Callable[[torch.Tensor], torch.Tensor]


def temperature_warper(temperature: float) -> Warper:
    return lambda scores: scores / temperature


def top_k_warper(top_k: int) -> Warper:
    """Keep the scores at least the k-th largest (ties kept), as transformers' `TopKLogitsWarper`."""
    def warp(scores: torch.Tensor) -> torch.Tensor:
        kth = torch.topk(scores, min(top_k, scores.size(-1)))[0][..., -1, None]
        return scores.masked_fill(scores < kth, -float("inf"))
    return warp


def top_p_warper(top_p: float) -> Warper:
    """Keep the smallest set of most likely tokens whose probabilities add up to more than top_p (at least one),
    as transformers' `TopPLogitsWarper`: the same sort, cumulative sum and comparison."""
    def warp(scores: torch.Tensor) -> torch.Tensor:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        remove[..., -1:] = False
        return scores.masked_fill(remove.scatter(-1, sorted_indices, remove), -float("inf"))
    return warp


class Warpers(list):
    """The logit warpers of a request, applied in order: `warpers(scores)`."""

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        for warp in self:
            scores = warp(scores)
        return scores


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)`: the same indices (each row's first maximal value, NaN first), through `max`, whose CPU
    kernel is the faster one over a few vocabulary-long rows of float32 (benchmarks/step_profile.py times a step's
    parts); argmax for other dtypes (float16's `max` is the slower one)."""
    return logits.max(-1).indices if logits.dtype == torch.float32 else logits.argmax(-1)


# A temperature below this samples greedily (as vLLM's does): logits divided by less can overflow to infinities, and
# a sampler fed those fails.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below `MIN_TEMPERATURE`) = greedy; top_k 0 and top_p 1.0 switch those filters off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise HamburgerError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise HamburgerError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise HamburgerError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def warpers(self) -> Warpers:
        """Temperature, then top-k, then top-p (transformers' order and arithmetic, without importing it)."""
        warpers = Warpers()
        if not self.greedy:
            warpers.append(temperature_warper(self.temperature))
            if self.top_k:
                warpers.append(top_k_warper(self.top_k))
            if self.top_p < 1.0:
                warpers.append(top_p_warper(self.top_p))
        return warpers

    def generator(self, device: torch.device | str) -> torch.Generator | None:
        if self.greedy:
            return None
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
    warpers: Warpers | None = None,
) -> torch.Tensor:
    """logits: (B, V) -> token ids (B,)."""
    if params.greedy:
        return greedy_tokens(logits)
    scores = (warpers if warpers is not None else params.warpers())(logits.float())
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def continues(stop_logits: torch.Tensor, confidence: float | torch.Tensor,
              p: torch.Tensor | None = None) -> torch.Tensor:
    """Whether a step goes on after the current token: P(continue) = sigmoid(-stop_logit) > confidence (or the
    given probability `p`, e.g. the product over the step's tokens so far, > confidence).

    The comparison is strict, so confidence 1.0 never continues a step (every step is one token and the
    output is the base model's), and lower confidence lets steps run longer.
    """
    return (torch.sigmoid(-stop_logits.float()) if p is None else p) > confidence
