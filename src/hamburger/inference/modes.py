"""The one place a request's decoding mode and confidence are decided and checked.

Three modes (`config.MODES`): trust (the paper's: the micro-step decoder's tokens are kept and each step is smashed
into one KV entry), verify (they are drafts the base checks: the base's own output) and compress (checked drafts,
and each decided step's KV entries merged into one by the checkpoint's KV merger).
"""

from __future__ import annotations

from hamburger.errors import HamburgerError
from hamburger.model.config import check_confidence, check_mode
from hamburger.model.hamburger_model import HamburgerModel

CHECKED = ("verify", "compress")  # modes whose micro tokens are drafts that the next base pass checks


def check_merger(model: HamburgerModel) -> None:
    """Compress mode needs a KV merger fitted to the base, for steps as long as the model makes."""
    merger = model.merger
    if merger is None:
        raise HamburgerError("compress mode needs a KV merger in the checkpoint (merger.safetensors): fit one with "
                             "`hamburger train-merger` and copy its merger.safetensors into the checkpoint folder")
    if merger.max_step_tokens < model.config.max_step_tokens:
        raise HamburgerError(f"the KV merger takes steps of up to {merger.max_step_tokens} tokens, the model makes "
                             f"steps of up to {model.config.max_step_tokens}")


def resolve_mode(model: HamburgerModel, mode: str | None = None, confidence: float | None = None,
                 engine: object | None = None) -> tuple[str, float]:
    """A request's mode and confidence, checked: the mode (None: the checkpoint's `default_mode`; compress needs
    the checkpoint's KV merger; an `engine` with `trust_only` set, the reference engine, runs trust mode only) and its
    confidence (None: `default_confidence` for trust mode, `verify_confidence` for verify and compress mode, which
    draft alike). The engines, the scheduler, the service, generate and the demo all decide here."""
    cfg = model.config
    resolved = check_mode(cfg.default_mode if mode is None else mode)
    if getattr(engine, "trust_only", False) and resolved != "trust":
        why = f"{resolved} mode" if mode is not None else f"this checkpoint's default mode, {resolved},"
        raise HamburgerError(f"{why} runs on the fast engine only (Llama, Mistral, Qwen2, Qwen3 bases); the "
                             "reference engine runs trust mode only: add --mode trust")
    if resolved == "compress":
        check_merger(model)
    default = cfg.default_confidence if resolved == "trust" else cfg.verify_confidence
    return resolved, check_confidence(default if confidence is None else confidence)
