"""The decoding modes as types: a request's mode is resolved once, at submit, into a `Mode`, and the code
downstream asks it what to do (`mode.checked`, `mode.merged`, ...) instead of comparing names.

Three modes (`config.MODES` names them): trust (the paper's: the micro-step decoder's tokens are kept and each step
is smashed into one KV entry), verify (they are drafts the base checks: the base's own output) and compress
(checked drafts, and each decided step's KV entries merged into one by the checkpoint's KV merger).
"""

from __future__ import annotations

from dataclasses import dataclass

from hamburger.errors import HamburgerError
from hamburger.model.config import MODES, check_confidence
from hamburger.model.hamburger_model import HamburgerModel


@dataclass(frozen=True)
class Mode:
    """What a decoding mode does; `name` is what users type (`--mode`, the API's `mode`)."""

    name: str
    # The micro tokens are drafts that the next base pass checks, keeping the prefix it agrees with (verify,
    # compress); False: they are the step itself, smashed into one entry (trust).
    checked: bool
    # Each decided step's KV entries merged into one by the KV merger (compress).
    merged: bool
    # The proposers that run after token 0: lookup in the prompt, the reply and the stored replies, or a custom
    # drafter (checked modes), then the micro-step decoder (every mode).
    lookup: bool
    # Drafting only while few rows run and (greedy rows) while the drafts pay for their cost (`draft_policy`);
    # False: every step drafts (compress: its steps are what it merges; trust: its micro tokens are the step).
    paced: bool
    # The checkpoint's config field that gives the mode's default confidence.
    confidence_field: str
    # KV entries per generated token admitted before any reply has been measured (`admission.EntriesEstimate`);
    # a mode with one entry per token (`per_token`) keeps it, the others learn it from their replies.
    entries_prior: float
    per_token: bool

    def __str__(self) -> str:
        return self.name

    @property
    def base_lora(self) -> bool:
        """Runs the base with a LoRA checkpoint's adapters on: the unchecked mode, whose base was trained with them;
        the checked modes check against the untouched base."""
        return not self.checked

    def default_confidence(self, model: HamburgerModel) -> float:
        return getattr(model.config, self.confidence_field)


TRUST = Mode("trust", checked=False, merged=False, lookup=False, paced=False, confidence_field="default_confidence",
             entries_prior=1.0, per_token=False)
VERIFY = Mode("verify", checked=True, merged=False, lookup=True, paced=True, confidence_field="verify_confidence",
              entries_prior=1.0, per_token=True)
# compress: 0.45-0.65 entries per token on the default checkpoint past its exact window (docs/RESULTS.md, section
# 0), bounded up to 0.75 until its own replies are measured.
COMPRESS = Mode("compress", checked=True, merged=True, lookup=True, paced=False, confidence_field="verify_confidence",
                entries_prior=0.75, per_token=False)
BY_NAME = {m.name: m for m in (TRUST, VERIFY, COMPRESS)}
assert tuple(BY_NAME) == MODES


def parse_mode(mode: str | Mode) -> Mode:
    """The `Mode` a user's string names (a `Mode` as it is): the one place a mode's name is read."""
    if isinstance(mode, Mode):
        return mode
    if mode not in BY_NAME:
        raise HamburgerError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return BY_NAME[mode]


def check_merger(model: HamburgerModel) -> None:
    """Compress mode needs a KV merger fitted to the base, for steps as long as the model makes."""
    merger = model.merger
    if merger is None:
        raise HamburgerError("compress mode needs a KV merger in the checkpoint (merger.safetensors): fit one with "
                             "`hamburger train-merger` and copy its merger.safetensors into the checkpoint folder")
    if merger.max_step_tokens < model.config.max_step_tokens:
        raise HamburgerError(f"the KV merger takes steps of up to {merger.max_step_tokens} tokens, the model makes "
                             f"steps of up to {model.config.max_step_tokens}")


def resolve_mode(model: HamburgerModel, mode: str | Mode | None = None, confidence: float | None = None,
                 engine: object | None = None) -> tuple[Mode, float]:
    """A request's mode and confidence, checked: the mode (None: the checkpoint's `default_mode`; compress needs
    the checkpoint's KV merger; an `engine` with `trust_only` set, the reference engine, runs trust mode only) and its
    confidence (None: the mode's default, `Mode.default_confidence`). The engines, the scheduler, the service,
    generate and the demo all decide here."""
    resolved = parse_mode(model.config.default_mode if mode is None else mode)
    if getattr(engine, "trust_only", False) and resolved.checked:
        why = f"{resolved} mode" if mode is not None else f"this checkpoint's default mode, {resolved},"
        raise HamburgerError(f"{why} runs on the fast engine only (Llama, Mistral, Qwen2, Qwen3 bases); the "
                             "reference engine runs trust mode only: add --mode trust")
    if resolved.merged:
        check_merger(model)
    default = resolved.default_confidence(model)
    return resolved, check_confidence(default if confidence is None else confidence)
