"""llama.cpp as bench systems: the CPU anchor a user would compare with.

- `llama_cpp`: plain greedy decoding; `llama_cpp_lookup`: with llama.cpp's own prompt-lookup decoding
  (`LlamaPromptLookupDecoding`), its draft length the fastest of `LOOKUP_DRAFTS` on the first prompt.

The same GGUF file the base was loaded from, the same prompt token ids, greedy, the same token limit and EOS
set, threads = CPU cores, batch 1. Needs `llama-cpp-python` (not part of `make setup`: it compiles llama.cpp);
without it the systems are skipped with the reason. `n_batch` (prompt tokens per prefill pass) is 512 where a
child process shows it works (a real prefill, for the time to the first token), else 1: larger prompt batches
crashed (segmentation fault) while evaluating a prompt on one development CPU; decode speed is unaffected.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from functools import cache
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


LOOKUP_DRAFTS = (2, 3, 5, 10)  # llama_cpp_lookup's draft lengths tried; the fastest decodes the bench
PROBE = """
import llama_cpp, sys
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
draft = int(sys.argv[3])
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=1024, n_batch=int(sys.argv[2]), verbose=False, logits_all=draft > 0,
                      draft_model=LlamaPromptLookupDecoding(num_pred_tokens=draft) if draft else None)
for n, _ in enumerate(llm.generate(list(range(10, 300)), temp=0.0, top_k=1, reset=True)):
    if n >= 8:
        break
"""


def probe(gguf: Path, n_batch: int, draft: int = 0) -> bool:
    """Whether llama.cpp evaluates a 290-token prompt and decodes a few tokens with these settings, in a child
    process: a native abort (one CPU's segmentation fault with n_batch > 1; llama-cpp-python 0.3.36's assertion in
    prompt-lookup decoding with n_batch 1) must not take the bench with it."""
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE, str(gguf), str(n_batch), str(draft)],
                              capture_output=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


@cache
def working_n_batch(gguf: Path, wanted: int = 512) -> int:
    """`wanted` where a child process shows it works, else 1."""
    return wanted if probe(gguf, wanted) else 1


def load_llama(gguf: Path, n_ctx: int, draft: int = 0):
    """llama.cpp on `gguf` with threads = cores, the n_batch that works here, and prompt-lookup drafts of `draft`
    tokens (0: none)."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise Unavailable("llama-cpp-python is not installed (pip install llama-cpp-python)") from exc
    drafter = None
    if draft:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        drafter = LlamaPromptLookupDecoding(num_pred_tokens=draft)
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                           n_batch=working_n_batch(gguf), verbose=False, logits_all=bool(draft),  # drafts: every
                           draft_model=drafter)  # position


def fastest_draft(gguf: Path, prompt: list[int], eos: set[int], n_ctx: int, tokens: int = 96) -> int:
    """The LOOKUP_DRAFTS length that decodes `tokens` tokens of `prompt` fastest here."""
    timed = {}
    for draft in LOOKUP_DRAFTS:
        llm = load_llama(gguf, n_ctx, draft)
        start = time.perf_counter()
        for n, tok in enumerate(llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                             reset=True), 1):
            if tok in eos or n >= tokens:
                break
        timed[draft] = (time.perf_counter() - start) / n
        del llm
    return min(timed, key=timed.get)


def llama_cpp_system(gguf: Path, eos: set[int], n_ctx: int = 4096, record: dict | None = None,
                     lookup: bool = False) -> Callable[[list[list[int]], int], GenerationStats]:
    """A bench system (prompts, max_new_tokens) -> GenerationStats running llama.cpp on `gguf`, one prompt at a time;
    `lookup`: with its prompt-lookup decoding, the draft length chosen on the first prompt of the first call."""
    try:
        import llama_cpp  # noqa: F401 - here, so a missing package skips the system before any run
    except ImportError as exc:
        raise Unavailable("llama-cpp-python is not installed (pip install llama-cpp-python)") from exc
    if lookup and not probe(gguf, working_n_batch(gguf), LOOKUP_DRAFTS[0]):
        raise Unavailable("llama.cpp's prompt-lookup decoding aborts on this machine (a child process running it "
                          f"failed, n_batch {working_n_batch(gguf)})")
    llm = None if lookup else load_llama(gguf, n_ctx)

    def run(prompts: list[list[int]], max_new_tokens: int) -> GenerationStats:
        nonlocal llm
        if llm is None:
            run.draft = fastest_draft(gguf, prompts[0], eos, n_ctx)
            llm = load_llama(gguf, n_ctx, run.draft)
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
    run.n_batch, run.draft = working_n_batch(gguf), 0
    return run
