"""`HamburgerConfig`: the shape of the modules added to a base LM, stored as JSON beside a checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from hamburger.errors import HamburgerError


@dataclass
class HamburgerConfig:
    """Hyper-parameters of the compositional embedder, micro-step decoder and stop head.

    `feature_layers` are indices into the base's hidden states (0 = embeddings, L = final normed output);
    left empty they are derived from the base depth by `resolve`.
    """

    base_model: str = ""  # how to load the base again: hub id, local path, or the default's name
    base_fingerprint: str = ""  # `base.fingerprint` of the base the modules were trained on
    max_step_tokens: int = 4  # K: most tokens one macro-step may emit
    micro_layers: int = 4  # decoder layers of the base's own type in the micro-step decoder
    num_features: int = 4  # base layers whose hidden states condition the micro-step decoder
    feature_layers: list[int] = field(default_factory=list)
    init_micro_from_top: bool = True  # copy the base's top layers into the micro-step decoder
    # > 0: each micro-step layer also attends to the base's keys and values of the layer it was copied from, over
    # the latest `micro_context` positions (EAGLE-style context); 0: the paper's features-only decoder.
    micro_context: int = 0
    position_dim: int = 64  # size of the learned relative-position vector the embedder concatenates
    stop_hidden: int = 0  # hidden width of the stop head MLP; 0 = half the model width
    default_confidence: float = 0.8
    # Decoding mode when a request names none: "trust" (drafts are kept, steps are smashed) or "verify" (the
    # base checks every draft: its exact output, one KV entry per token); verify's own confidence default.
    default_mode: str = "trust"
    verify_confidence: float = 0.3
    # True: a second stop head (`draft_stop_head`) decides how far verify and compress mode draft, trained on
    # unmerged text by `train-drafter --draft-stop-head`; trust mode keeps `stop_head`. False: one head for all.
    draft_stop_head: bool = False
    # Compress mode: a decided step stays as its tokens' own KV entries until it lies `merge_window` positions
    # behind the newest token, then becomes one merged entry (0 or 1: merged at once). The base then reads its
    # recent past exactly and only the older past compressed.
    merge_window: int = 0
    # Verify and compress mode: where a row's last `lookup` or more tokens (up to 3) occurred before in its prompt
    # or output, the tokens that followed them there are its drafts, instead of the micro-step decoder's (no
    # micro-step spent; the base checks them like any draft). 0: micro-step drafts only.
    lookup: int = 0
    base_in_checkpoint: bool = False  # the checkpoint also carries (fine-tuned) base weights
    lora_rank: int = 0  # > 0: LoRA adapters on the base's attention projections (trained, shipped, mergeable)
    lora_alpha: float = 32.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    slot_adapter_rank: int = 0  # > 0: low-rank adapters on the base that act only at merged slots (slot_adapters.py)
    slot_adapter_alpha: float = 32.0
    slot_adapter_targets: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    def __post_init__(self) -> None:
        if self.max_step_tokens < 1:
            raise HamburgerError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if self.micro_layers < 1 or self.num_features < 1:
            raise HamburgerError("micro_layers and num_features must be >= 1")
        if self.micro_context < 0:
            raise HamburgerError(f"micro_context must be >= 0, got {self.micro_context}")
        check_confidence(self.default_confidence)
        check_confidence(self.verify_confidence)
        check_mode(self.default_mode)
        if isinstance(self.merge_window, bool) or not isinstance(self.merge_window, int) or self.merge_window < 0:
            raise HamburgerError(f"merge_window must be an int >= 0, got {self.merge_window!r}")
        check_lookup(self.lookup)

    def resolve(self, num_base_layers: int, hidden_size: int) -> HamburgerConfig:
        """Fill the fields that depend on the base: evenly spaced feature layers ending at the final output."""
        m = min(self.num_features, num_base_layers)
        layers = self.feature_layers or [round(num_base_layers * (i + 1) / m) for i in range(m)]
        if any(not 0 <= i <= num_base_layers for i in layers):
            raise HamburgerError(f"feature_layers {layers} must lie in 0..{num_base_layers}")
        return dataclasses.replace(
            self,
            num_features=len(layers),
            feature_layers=list(layers),
            micro_layers=min(self.micro_layers, num_base_layers),
            stop_hidden=self.stop_hidden or hidden_size // 2,
        )

    def save(self, directory: str | Path) -> None:
        Path(directory, "config.json").write_text(json.dumps({"hamburger": dataclasses.asdict(self)}, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> HamburgerConfig:
        path = Path(directory, "config.json")
        try:
            raw = json.loads(path.read_text())["hamburger"]
        except (OSError, ValueError, KeyError) as exc:
            raise HamburgerError(f"{directory} is not a HAMburger checkpoint ({path.name}: {exc})") from exc
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})

    @staticmethod
    def is_checkpoint(directory: str | Path) -> bool:
        path = Path(directory, "config.json")
        try:
            return path.is_file() and "hamburger" in json.loads(path.read_text())
        except (OSError, ValueError):
            return False


MODES = ("trust", "verify", "compress")


# Verify mode drafts only while at most this many rows decode; beyond, a verify step is a plain base step (the
# output is the base's either way): drafting pays at a row or two and no more at four or more, even with lookup
# drafts alone, because there a pass of more positions costs nearly in proportion (benchmarks/verify_ab.py
# --batch-size B --draft-rows B; docs/RESULTS.md, "Verify mode and the batch"). "auto" (the default of `Engine`,
# bench and serve) is this on a GPU and on a CPU with fp16-packed weights, and 0 on a CPU with float32 or bfloat16
# weights, where even one row's pass of 2 or 3 positions costs nearly 2 or 3 passes of 1 position (torch's small
# matmuls there run row by row; benchmarks/verify_costs.py). Measure yours with bench --draft-rows.
DRAFT_ROWS = 2


def parse_draft_rows(text: str) -> int | str | None:
    """--draft-rows: a count >= 0, "all" (draft at any batch size) or "auto"."""
    if text in ("all", "auto"):
        return None if text == "all" else text
    try:
        return check_draft_rows(int(text))
    except (ValueError, HamburgerError):
        raise argparse.ArgumentTypeError(f"expected a count >= 0, 'auto' or 'all', got {text!r}") from None


def check_draft_rows(rows: int | str | None) -> int | str | None:
    if rows != "auto" and rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
        raise HamburgerError(f"draft_rows must be an int >= 0, 'auto' or None (draft at any batch size), got {rows!r}")
    return rows


# Lookup drafts match n-grams of at most this many tokens (the longest first); `lookup` is the shortest.
LOOKUP_MAX_NGRAM = 3
# Verify mode drafts up to this many tokens by lookup (the micro-step decoder drafts at most K-1; compress mode
# keeps K-1 for lookup too: its merger takes steps of at most K tokens).
LOOKUP_DRAFTS = 7


def check_lookup(ngram: int) -> int:
    """`lookup` setting: 0 (off) or the shortest n-gram a lookup draft needs (1..LOOKUP_MAX_NGRAM)."""
    if isinstance(ngram, bool) or not isinstance(ngram, int) or not 0 <= ngram <= LOOKUP_MAX_NGRAM:
        raise HamburgerError(f"lookup must be 0 (off) or the shortest n-gram to match, 1..{LOOKUP_MAX_NGRAM}; "
                             f"got {ngram!r}")
    return ngram


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise HamburgerError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def check_confidence(confidence: float) -> float:
    if not 0.0 < float(confidence) <= 1.0:
        raise HamburgerError(f"confidence must be in (0, 1], got {confidence}")
    return float(confidence)
