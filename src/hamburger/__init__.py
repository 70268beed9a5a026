"""HAMburger: faster, lighter LLM decoding by smashing each step's tokens into one KV entry (arXiv 2505.20438)."""

from hamburger.errors import HamburgerError
from hamburger.inference.reference import (
    Generation,
    GenerationOutput,
    StepEvent,
    generate,
    stream,
)
from hamburger.inference.sampling import SamplingParams
from hamburger.inference.stats import GenerationStats
from hamburger.model.base import DEFAULT_MODEL, fingerprint, load_base
from hamburger.model.config import HamburgerConfig
from hamburger.model.hamburger_model import HamburgerModel
from hamburger.training.data import SegmentedBatch, SegmentedExample, collate

__all__ = [
    "DEFAULT_MODEL", "Generation", "GenerationOutput", "GenerationStats", "HamburgerConfig", "HamburgerError",
    "HamburgerModel", "SamplingParams", "SegmentedBatch", "SegmentedExample", "StepEvent", "collate",
    "fingerprint", "generate", "load_base", "stream",
]
__version__ = "0.1.0"
