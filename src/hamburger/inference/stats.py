"""The one definition of each measure, used by the library, the CLI, the server, the benchmarks and the tests."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class GenerationStats:
    """Counts and timings of one generation call (summed over the sequences of a batch).

    - generated_tokens: tokens emitted, EOS included, never more than max_new_tokens per sequence.
    - macro_steps: steps emitted; each adds one KV entry per layer to the base's cache (trust mode). In verify
      mode a step is what one base forward emitted (its accepted drafts and the base's own next token), and
      every token keeps its own KV entry (`unmerged`).
    - micro_steps: tokens produced by the micro-step decoder and kept (= generated_tokens - macro_steps).
    - drafted_tokens: verify mode: tokens proposed to the base (kept or not).
    - lookup_drafts, lookup_kept: verify and compress mode: the drafted tokens that came from lookup (`lookup.py`)
      instead of the micro-step decoder, and how many of them the base kept (both part of the above).
    - base_forwards: forward passes of the base model (the prefill counts as one; a batch counts once).
    - row_forwards: the same summed over the sequences each pass computed for (a batch pass counts once per
      sequence still generating), so tokens per forward is a per-sequence figure at any batch size.
    - prompt_tokens: unpadded prompt tokens (each holds one KV entry).
    - prefill_s: time to first token: the prefill forward and choosing the first token.
    - decode_s: everything after that until the last sequence finishes.
    The first token comes from the prefill, so decode speed counts the tokens after it:
    decode_tokens_per_s = (generated_tokens - sequences) / decode_s, the same for every system.
    """

    sequences: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    macro_steps: int = 0
    micro_steps: int = 0
    drafted_tokens: int = 0
    lookup_drafts: int = 0
    lookup_kept: int = 0
    base_forwards: int = 0
    row_forwards: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    unmerged: bool = False  # verify mode: one KV entry per generated token
    # compress mode with a merge window: entries the steps not merged yet hold beyond one per step (at the end)
    window_entries: int = 0

    @property
    def tokens_per_step(self) -> float:
        """Generated tokens per macro-step: the KV compression on generated tokens."""
        return self.generated_tokens / self.macro_steps if self.macro_steps else 0.0

    @property
    def kv_entries(self) -> int:
        """KV-cache entries per layer: one per prompt token plus one per macro-step (per token in verify mode; in
        compress mode with a merge window, plus the recent steps' entries beyond one each)."""
        return self.prompt_tokens + (self.generated_tokens if self.unmerged else self.macro_steps + self.window_entries)

    @property
    def kv_entries_base(self) -> int:
        """What the base model would hold for the same output: one per prompt and generated token."""
        return self.prompt_tokens + self.generated_tokens

    @property
    def kv_ratio(self) -> float:
        """KV entries against what the base holds for the same prompt and reply: the memory a mode saves per token,
        whatever the reply's length (a trust reply may be longer or shorter than the base's own)."""
        return self.kv_entries / max(1, self.kv_entries_base)

    @property
    def tokens_per_forward(self) -> float:
        """Generated tokens per base forward of a sequence (the prefill included): the speed-up's upper bound in
        any mode, the same at batch 1 and batch 16."""
        return self.generated_tokens / self.row_forwards if self.row_forwards else 0.0

    @property
    def acceptance(self) -> float:
        """Verify mode: the fraction of drafted tokens the base accepted."""
        return self.micro_steps / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        after_first = self.generated_tokens - self.sequences
        return after_first / self.decode_s if self.decode_s > 0 and after_first > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("tokens_per_step", "tokens_per_forward", "acceptance", "kv_entries", "kv_entries_base",
                     "decode_tokens_per_s"):
            out[name] = getattr(self, name)
        return out


def kv_bytes_per_entry(config: Any, dtype: Any) -> int:
    """Bytes one KV entry takes in the base's cache: over all layers, a key and a value of every KV head, in the
    cache's dtype: layers x 2 x kv_heads x head_dim x bytes per element. `config`: the base's (a transformers
    config: num_hidden_layers, num_key_value_heads, head_dim or hidden_size / num_attention_heads); `dtype`: a
    torch dtype (its `itemsize`) or bytes per element. KV bytes = KV entries (`GenerationStats.kv_entries`) x this."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    elem = dtype if isinstance(dtype, int) else dtype.itemsize
    return config.num_hidden_layers * 2 * kv_heads * head_dim * elem
