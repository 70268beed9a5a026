"""llama.cpp as a bench system (`hamburger bench --systems llama_cpp`): the CPU anchor a user would compare with.

The same GGUF file the base was loaded from, the same prompt token ids, greedy, the same token limit and EOS
set, threads = CPU cores, batch 1. Needs `llama-cpp-python` (not part of `make setup`: it compiles llama.cpp);
without it the system is skipped with the reason. `n_batch` is 1: larger prompt batches crashed
(segmentation fault) while evaluating a prompt on the project's development CPU, so llama.cpp's time to first
token here is a token-by-token prefill; its decode speed is unaffected.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from hamburger.errors import HamburgerError
from hamburger.inference.stats import GenerationStats


class Unavailable(Exception):
    """The system cannot run here; the message says why (the bench skips it and reports the reason)."""


def gguf_path(refs: list[str | None]) -> Path:
    """The GGUF file behind the first of `refs` (a .gguf path, or the embedded default) that has one."""
    from hamburger.model.base import DEFAULT_GGUF, default_model_dir, is_default

    for ref in refs:
        if ref is not None and str(ref).endswith(".gguf") and Path(ref).is_file():
            return Path(ref)
        if is_default(ref) or ref == "default":
            return default_model_dir() / DEFAULT_GGUF
    raise Unavailable("llama.cpp needs the base as a .gguf file (--model path/to/model.gguf or the embedded default)")


def llama_cpp_system(gguf: Path, eos: set[int], n_ctx: int = 4096,
                     record: dict | None = None) -> Callable[[list[list[int]], int], GenerationStats]:
    """A bench system (prompts, max_new_tokens) -> GenerationStats running llama.cpp on `gguf`, one prompt at a time."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise Unavailable("llama-cpp-python is not installed (pip install llama-cpp-python)") from exc
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                          n_batch=1, verbose=False)

    def run(prompts: list[list[int]], max_new_tokens: int) -> GenerationStats:
        total = GenerationStats()
        for prompt in prompts:
            if len(prompt) + max_new_tokens > n_ctx:
                raise HamburgerError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceed the "
                                     f"llama_cpp system's context of {n_ctx}")
            llm.reset()  # no reuse of the previous prompt's cache: every prefill is timed whole
            tokens: list[int] = []
            start = time.perf_counter()
            first = None
            for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                if first is None:
                    first = time.perf_counter()
                tokens.append(int(tok))
                if tok in eos or len(tokens) >= max_new_tokens:
                    break
            end = time.perf_counter()
            if record is not None:
                record[tuple(prompt)] = tokens
            first = first or end
            total.sequences += 1
            total.prompt_tokens += len(prompt)
            total.generated_tokens += len(tokens)
            total.macro_steps += len(tokens)
            total.base_forwards += len(tokens)
            total.row_forwards += len(tokens)
            total.prefill_s += first - start
            total.decode_s += end - first
        return total

    run.weights_bytes = gguf.stat().st_size  # what it decodes with: the quantized file itself
    return run
