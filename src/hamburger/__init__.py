"""HAMburger: faster, lighter LLM decoding by smashing each step's tokens into one KV entry (arXiv 2505.20438).

The names below load on first use (PEP 562): `hamburger --help` or an import of `hamburger.model.config` must not
pay for torch and transformers (seconds) when all they need is a parser or a constant.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from hamburger.errors import HamburgerError

if TYPE_CHECKING:
    from hamburger.inference.engine import Engine, make_engine
    from hamburger.inference.reference import Generation, GenerationOutput, StepEvent, generate, stream
    from hamburger.inference.sampling import SamplingParams
    from hamburger.inference.stats import GenerationStats
    from hamburger.loading import load
    from hamburger.model.base import DEFAULT_MODEL, encode_chat, fingerprint, load_base
    from hamburger.model.config import HamburgerConfig
    from hamburger.model.hamburger_model import HamburgerModel
    from hamburger.training.data import SegmentedBatch, SegmentedExample, collate

_WHERE = {
    "Generation": "hamburger.inference.reference", "GenerationOutput": "hamburger.inference.reference",
    "StepEvent": "hamburger.inference.reference", "generate": "hamburger.inference.reference",
    "stream": "hamburger.inference.reference", "SamplingParams": "hamburger.inference.sampling",
    "GenerationStats": "hamburger.inference.stats", "DEFAULT_MODEL": "hamburger.model.base",
    "fingerprint": "hamburger.model.base", "load_base": "hamburger.model.base", "encode_chat": "hamburger.model.base",
    "HamburgerConfig": "hamburger.model.config", "HamburgerModel": "hamburger.model.hamburger_model",
    "SegmentedBatch": "hamburger.training.data", "SegmentedExample": "hamburger.training.data",
    "collate": "hamburger.training.data", "load": "hamburger.loading", "Engine": "hamburger.inference.engine",
    "make_engine": "hamburger.inference.engine",
}

__all__ = [
    "DEFAULT_MODEL", "Engine", "Generation", "GenerationOutput", "GenerationStats", "HamburgerConfig", "HamburgerError",
    "HamburgerModel", "SamplingParams", "SegmentedBatch", "SegmentedExample", "StepEvent", "collate",
    "encode_chat", "fingerprint", "generate", "load", "load_base", "make_engine", "stream",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'hamburger' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once: later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
