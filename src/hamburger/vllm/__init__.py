"""HAMburger's drafts inside vLLM (`pip install "hamburger[vllm]"`): verify mode's drafts, checked by vLLM.

vLLM verifies every draft with its own rejection sampler, so its output stays its own greedy output; what moves to
vLLM is where the drafts come from. Only verify mode maps onto vLLM: its paged KV cache keeps one entry per token, so
trust and compress mode (one entry per step) stay in our engine (`hamburger serve`).

- `proposer.LookupDrafts`: a vLLM `custom_class` proposer drafting by lookup in the request's prompt, its reply and
  the checkpoint's stored replies (`inference/lookup.py`), as verify mode does;
- `launch`: the folder vLLM loads for a model (the embedded default converted to a plain Hugging Face folder), the
  `--speculative-config` that names the proposer, the `vllm serve` command line, and the check that vLLM imports.

Nothing here imports vLLM at module level: the package imports (and its tests run) where vLLM is absent. Importing
it shields a media package that cannot import (the registry's CUDA torchvision on a CPU-only torch: `media.py`).
"""

from __future__ import annotations

# what `speculative_config["model"]` names for vLLM's `custom_class` method
LOOKUP_PROPOSER = "hamburger.vllm.proposer.LookupDrafts"
MICRO_PROPOSER = "hamburger.vllm.micro.MicroDrafts"

from hamburger.vllm.media import shield_vision  # noqa: E402 - after the names launch imports

shield_vision()
