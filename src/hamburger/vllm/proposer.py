"""`LookupDrafts`: verify mode's lookup drafts as a vLLM `custom_class` proposer.

vLLM (0.32) builds the class named by `speculative_config["model"]` with its `VllmConfig`, calls `load_model(model)`
once with the target model, then after every step `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
slot_mappings=...)`: per row of its batch, the tokens the step just sampled (empty: the row does not decode now), how
many tokens the row holds (prompt and output, the sampled ones included) and the tokens themselves, one row of
`token_ids_cpu` each. It returns each row's drafts; vLLM checks them with its rejection sampler, so its greedy output
is unchanged. vLLM marks this interface experimental.

The drafts are the ones verify mode drafts by lookup (`inference/lookup.py`): what followed the row's last
`lookup`..3 tokens where they occurred before in its prompt or reply (`NgramIndex`), else what followed its last
2..4 tokens in the checkpoint's stored replies (`ReplyStore`, the base's own greedy replies to training prompts).

Settings come from vLLM's `additional_config` (`--additional-config '{"hamburger": {...}}'`):
`checkpoint` (a HAMburger checkpoint folder whose stored replies and `lookup` setting to use; default: the packaged
checkpoint when vLLM serves its base, the embedded default; "none": no stored replies) and `lookup` (the shortest
n-gram a draft needs, 1..3; default: the checkpoint's, else 2).

Importing this module does not import vLLM: the proposer only reads the arrays vLLM hands it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hamburger.errors import HamburgerError
from hamburger.inference.lookup import NgramIndex, ReplyStore, reply_store
from hamburger.model.base import DEFAULT_MODEL
from hamburger.model.config import LOOKUP_MAX_NGRAM, HamburgerConfig, check_lookup
from hamburger.model.files import read_safetensors
from hamburger.model.hamburger_model import REPLIES_NAME, packaged_checkpoint

SETTINGS_KEY = "hamburger"  # the key of vLLM's `additional_config` this package reads


def settings(vllm_config: Any) -> dict:
    """The `{"hamburger": {...}}` part of vLLM's `additional_config` ({} when absent)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    found = extra.get(SETTINGS_KEY, {}) if isinstance(extra, dict) else {}
    if not isinstance(found, dict):
        raise HamburgerError(f"additional_config[{SETTINGS_KEY!r}] must be an object, got {found!r}")
    return found


def serves_default(vllm_config: Any) -> bool:
    """Whether vLLM serves the embedded default's base (its converted folder or its hub id), by the model's name."""
    model = getattr(getattr(vllm_config, "model_config", None), "model", None) or ""
    return DEFAULT_MODEL.lower() in Path(str(model)).name.lower()


def checkpoint_for(vllm_config: Any) -> Path | None:
    """The checkpoint folder whose stored replies and lookup setting the proposer uses (None: none)."""
    named = settings(vllm_config).get("checkpoint")
    if named is None:
        return packaged_checkpoint() if serves_default(vllm_config) else None
    if str(named).lower() in ("", "none", "off"):
        return None
    path = Path(str(named)).expanduser()
    if not HamburgerConfig.is_checkpoint(path):
        raise HamburgerError(f"additional_config hamburger.checkpoint: {path} is not a HAMburger checkpoint")
    return path


def in_vocab(drafts: list[int], vocab: int) -> list[int]:
    """A draft is a continuation: it ends before its first token vLLM cannot take."""
    return drafts[: next((i for i, t in enumerate(drafts) if not 0 <= t < vocab), len(drafts))]


def load_store(checkpoint: Path | None) -> ReplyStore | None:
    """The checkpoint's stored replies as a `ReplyStore` (None: no checkpoint, or one without replies)."""
    if checkpoint is None or not (checkpoint / REPLIES_NAME).is_file():
        return None
    return reply_store(read_safetensors(checkpoint / REPLIES_NAME)["tokens"])


class RowIndexes:
    """One `NgramIndex` per row of vLLM's batch, extended as the row grows. vLLM moves requests between rows (a
    finished row is filled from the end), so a row's index is kept only while its tokens are a prefix of the row's
    history now, else built again."""

    def __init__(self, min_ngram: int) -> None:
        self.min_ngram = min_ngram
        self.rows: dict[int, tuple[NgramIndex, np.ndarray]] = {}

    def get(self, row: int, history: np.ndarray) -> NgramIndex:
        kept = self.rows.get(row)
        if kept is not None:
            index, seen = kept
            if len(seen) <= len(history) and np.array_equal(history[: len(seen)], seen):
                index.extend(history[len(seen):].tolist())
                self.rows[row] = (index, history.copy())
                return index
        index = NgramIndex(history.tolist(), self.min_ngram, LOOKUP_MAX_NGRAM)
        self.rows[row] = (index, history.copy())
        return index

    def keep_first(self, n: int) -> None:
        """Forget rows past the batch's first `n`."""
        for row in [r for r in self.rows if r >= n]:
            del self.rows[row]


class LookupDrafts:
    """vLLM `custom_class` proposer: up to `num_speculative_tokens` lookup drafts per decoding row."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_len = int(vllm_config.model_config.max_model_len)
        self.vocab = int(vllm_config.model_config.get_vocab_size())
        checkpoint = checkpoint_for(vllm_config)
        lookup = settings(vllm_config).get("lookup")
        if lookup is None:
            lookup = HamburgerConfig.load(checkpoint).lookup if checkpoint is not None else 0
        self.min_ngram = check_lookup(int(lookup)) or 2  # a checkpoint with lookup off still drafts from n >= 2
        self.store = load_store(checkpoint)
        self.indexes = RowIndexes(self.min_ngram)
        self.model = None

    def load_model(self, model: Any = None, *args: Any, **kwargs: Any) -> None:
        """vLLM's CPU runner calls this with the target model; lookup needs nothing of it."""
        self.model = model

    def draft(self, row: int, history: np.ndarray, limit: int) -> list[int]:
        """Up to `limit` drafts after batch row `row`'s `history`: lookup in the history itself, else in the stored
        replies."""
        if limit <= 0 or len(history) == 0:
            return []
        index = self.indexes.get(row, history)
        found = index.draft(limit)
        if not found and self.store is not None:
            found = self.store.draft(index.tokens[-self.store.max:], limit)
        return in_vocab(found[:limit], self.vocab)

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                *args: Any, **kwargs: Any) -> list[list[int]]:
        out = []
        for row, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[row])
            if not sampled or n >= self.max_len:
                out.append([])
                continue
            out.append(self.draft(row, np.asarray(token_ids_cpu[row, :n]), min(self.k, self.max_len - n - 1)))
        self.indexes.keep_first(len(sampled_token_ids))
        return out
