"""HAMburger: faster, lighter LLM decoding by smashing each step's tokens into one KV entry (arXiv 2505.20438)."""

from hamburger.base import DEFAULT_MODEL, fingerprint, load_base
from hamburger.config import HamburgerConfig
from hamburger.data import SegmentedBatch, SegmentedExample, collate
from hamburger.errors import HamburgerError
from hamburger.generate import Generation, GenerationOutput, StepEvent, generate, stream
from hamburger.metrics import GenerationStats
from hamburger.model import HamburgerModel
from hamburger.sampling import SamplingParams

__all__ = [
    "DEFAULT_MODEL", "Generation", "GenerationOutput", "GenerationStats", "HamburgerConfig", "HamburgerError",
    "HamburgerModel", "SamplingParams", "SegmentedBatch", "SegmentedExample", "StepEvent", "collate",
    "fingerprint", "generate", "load_base", "stream",
]
__version__ = "0.1.0"
