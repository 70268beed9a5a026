"""What `hamburger bench` runs: its prompt sets, the systems it compares (each a function of prompts that returns
tokens and `GenerationStats`), and how one call is measured (peak memory, time to first token)."""

from __future__ import annotations

import copy
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import torch

from hamburger.errors import HamburgerError
from hamburger.inference.reference import left_pad
from hamburger.inference.stats import GenerationStats, kv_bytes_per_entry

SETS = ("code", "math", "chat", "long")
SYSTEMS = ("hf_generate", "engine_base", "prompt_lookup", "spec_int8_k2", "spec_int8_k4", "hamburger_ref",
           "hamburger_engine", "hamburger_forced", "hamburger_verify", "hamburger_compress", "llama_cpp",
           "llama_cpp_lookup")
BATCH1_ONLY = ("prompt_lookup", "spec_int8_k2", "spec_int8_k4", "llama_cpp", "llama_cpp_lookup")
LLAMA_CPP = ("llama_cpp", "llama_cpp_lookup")  # decode their own GGUF: one row, beside the first scheme's
HAMBURGER = ("hamburger_ref", "hamburger_engine")
TRAINED_ONLY = HAMBURGER + ("hamburger_forced", "hamburger_verify", "hamburger_compress")  # systems that need a trained checkpoint


# --- prompts ------------------------------------------------------------------------------------------------


def long_documents(count: int, min_chars: int = 1500, max_chars: int = 4000) -> list[tuple[str, str]]:
    """(module, docstring) of standard-library modules with long docstrings: summarisation-style inputs."""
    import ast
    import sysconfig

    out = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        if doc and min_chars <= len(doc) <= max_chars:
            out.append((path.stem, doc))
        if len(out) >= count:
            break
    return out


def bench_messages(name: str, count: int) -> list[list[dict[str, str]]]:
    """The first `count` held-out chat prompts of one built-in set (never the training prompts): code, math and chat
    as shipped (`bench_prompts`: nothing is generated), long from this machine's standard library."""
    from hamburger.evaluation import bench_prompts

    if name == "long":
        return [[{"role": "user", "content": f"Summarise this documentation of Python's `{module}` module in a "
                  f"few sentences.\n\n{doc}"}] for module, doc in long_documents(count)]
    if name not in SETS:
        raise HamburgerError(f"unknown prompt set {name!r}: choose from {', '.join(SETS)}")
    return bench_prompts.shipped(name, count)


# --- measuring one call ---------------------------------------------------------------------------------------


class PeakMemory:
    """Peak memory above the level at entry: CUDA's allocator on a GPU, else the process RSS sampled every 2 ms."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.peak = 0

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
            return self
        import psutil

        self.proc, self.start, self.stop = psutil.Process(), psutil.Process().memory_info().rss, False
        self.peak_rss = self.start

        def sample() -> None:
            while not self.stop:
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
                time.sleep(0.002)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.peak = torch.cuda.max_memory_allocated() - self.start
        else:
            self.stop = True
            self.thread.join()
            self.peak = self.peak_rss - self.start


class FirstTokenClock:
    """A transformers streamer that notes when the first generated token arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def hf_call(base, prompts: list[list[int]], max_new_tokens: int, eos: set[int], pad: int,
            record: dict | None = None, **kwargs) -> GenerationStats:
    """One `generate` call (left-padded batch); tokens after the first EOS of a row are not counted (nor kept in
    `record`, prompt -> generated tokens)."""
    dev = next(base.parameters()).device
    ids, mask = left_pad(prompts, pad, dev)
    width = ids.shape[1]
    clock = FirstTokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = base.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=0,
                            do_sample=False, eos_token_id=sorted(eos), pad_token_id=pad, streamer=clock, **kwargs)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    generated = 0
    for prompt, row in zip(prompts, out[:, width:].tolist()):
        n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        generated += n
        if record is not None:
            record[tuple(prompt)] = row[:n]
    first = clock.first or end
    return GenerationStats(sequences=len(prompts), prompt_tokens=sum(map(len, prompts)), generated_tokens=generated,
                           macro_steps=generated, row_forwards=generated,  # one forward per token and sequence
                           prefill_s=first - start, decode_s=end - first)


def int8_draft(base):
    """A dynamically quantised INT8 copy of the base (Linear layers), the paper's speculative-decoding draft."""
    import warnings

    from torch.ao.quantization import quantize_dynamic

    draft = copy.deepcopy(base).float().cpu()
    with warnings.catch_warnings():  # deprecated in favour of torchao, still the plain-PyTorch way to do it
        warnings.simplefilter("ignore")
        draft = quantize_dynamic(draft, {torch.nn.Linear}, dtype=torch.qint8)
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0  # always propose k tokens
    return draft.eval()


# --- the systems -----------------------------------------------------------------------------------------------


class ForcedSteps:
    """Step lengths drawn (seeded) from the step-length distribution of segmented data: the speed the engine
    gives at the tokens per step of the training data, whatever the stop head of a checkpoint would choose."""

    def __init__(self, path: str | Path, k: int, seed: int = 0) -> None:
        from hamburger.training.examples import read_examples

        lengths = [s for _, ex in read_examples(Path(path)) for s in ex.steps]
        if any(s > k for s in lengths):
            raise HamburgerError(f"{path} has steps longer than the model's K = {k}")
        self.lengths, self.seed = lengths, seed
        self.tokens_per_step = sum(lengths) / len(lengths)

    def draw(self, rows: int, max_new_tokens: int) -> list[list[int]]:
        import random

        rng = random.Random(self.seed)  # the same draw every run: runs differ only in time
        return [[rng.choice(self.lengths) for _ in range(max_new_tokens)] for _ in range(rows)]


def make_system(name: str, hamburger_model, plain_model, confidence: float,
                forced: ForcedSteps | None = None, verify_confidence: float | None = None,
                record: dict | None = None, draft_rows: int | str | None = "auto", lookup: int | None = None,
                ) -> Callable[[list[list[int]], int], GenerationStats]:
    """A function (prompts, max_new_tokens) -> GenerationStats for one named system; with `record`, each call
    also notes every prompt's generated tokens there (prompt tuple -> tokens). `draft_rows`: `Engine`'s, for
    hamburger_verify; `lookup`: `Engine`'s, for hamburger_verify and hamburger_compress."""
    from hamburger.inference.engine import Engine, ReferenceEngine

    def kept(prompts: list[list[int]], out) -> GenerationStats:
        if record is not None:
            for prompt, tokens in zip(prompts, out.tokens):
                record[tuple(prompt)] = list(tokens)
        return out.stats

    if name in ("hf_generate", "prompt_lookup", *LLAMA_CPP) or name.startswith("spec_int8_k"):
        return outside_system(name, hamburger_model, plain_model, record)
    if name == "hamburger_forced":
        if forced is None:
            raise HamburgerError("the hamburger_forced system needs --forced-steps SEGMENTED_JSONL")
        engine = Engine(hamburger_model)
        return lambda prompts, n: kept(prompts, engine.generate(prompts, max_new_tokens=n,
                                                                forced_steps=forced.draw(len(prompts), n),
                                                                mode="trust"))
    if name in ("hamburger_verify", "hamburger_compress"):
        engine = Engine(hamburger_model, draft_rows=draft_rows, lookup=lookup)
        from hamburger.inference.modes import check_merger, parse_mode

        mode = parse_mode(name.removeprefix("hamburger_"))
        if mode.merged:
            check_merger(hamburger_model)
        return lambda prompts, n: kept(prompts, engine.generate(prompts, max_new_tokens=n, mode=mode,
                                                                confidence=verify_confidence))
    engines = {"engine_base": (Engine, plain_model), "hamburger_ref": (ReferenceEngine, hamburger_model),
               "hamburger_engine": (Engine, hamburger_model)}
    if name not in engines:
        raise HamburgerError(f"unknown system {name!r}: choose from {', '.join(SYSTEMS)}")
    cls, model = engines[name]
    engine = cls(model)
    conf = confidence if name in HAMBURGER else 1.0
    return lambda prompts, n: kept(prompts, engine.generate(prompts, max_new_tokens=n, confidence=conf, mode="trust"))


def outside_system(name: str, hamburger_model, plain_model, record: dict | None = None,
                   ) -> Callable[[list[list[int]], int], GenerationStats]:
    """The systems outside our engine: transformers' `generate` (plain, prompt lookup, an INT8 speculative draft)
    and llama.cpp on the base's GGUF (`make_system` for the arguments)."""
    from hamburger.inference.reference import eos_ids

    base = plain_model.base
    eos = eos_ids(plain_model)
    pad = getattr(plain_model.tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else min(eos)
    if name in ("hf_generate", "prompt_lookup"):
        extra = {"prompt_lookup_num_tokens": 10} if name == "prompt_lookup" else {}

        def system(prompts, n):
            return hf_call(base, prompts, n, eos, pad, record, **extra)

        system.kv_bytes_per_entry = entry_bytes(plain_model, next(base.parameters()).dtype)  # transformers' cache
        return system
    if name.startswith("spec_int8_k"):
        if next(base.parameters()).device.type != "cpu":
            raise HamburgerError("the INT8 draft (dynamic quantisation) runs on the CPU only")
        draft = int8_draft(base)
        draft.generation_config.num_assistant_tokens = int(name.removeprefix("spec_int8_k"))
        return lambda prompts, n: hf_call(base, prompts, n, eos, pad, record, assistant_model=draft)
    if name not in LLAMA_CPP:
        raise HamburgerError(f"unknown system {name!r}: choose from {', '.join(SYSTEMS)}")
    from hamburger.evaluation.llamacpp import gguf_path, llama_cpp_system

    refs = [getattr(base.config, "hamburger_ref", None), hamburger_model.config.base_model]
    system = llama_cpp_system(gguf_path([r for r in refs if r]), eos, record=record, lookup=name == "llama_cpp_lookup")
    system.kv_bytes_per_entry = entry_bytes(plain_model, torch.float16)  # llama.cpp's cache: float16 by default
    return system


def entry_bytes(model, dtype: torch.dtype | None = None) -> int:
    """Bytes one KV entry of `model`'s base takes (`stats.kv_bytes_per_entry`), in `dtype` (default: the dtype our
    engine's cache takes, `runner.engine_kv_dtype`)."""
    from hamburger.inference.runner import engine_kv_dtype

    return kv_bytes_per_entry(model.base.config, dtype or engine_kv_dtype(model))


def measure(jobs: list[tuple[Callable, list[list[int]], int]], max_new: int, runs: int, device: torch.device,
            log: Callable[[str], None] = lambda s: None, labels: list[str] | None = None) -> list[dict]:
    """Median over runs of each job (system, prompts, batch): all prompts in chunks of `batch`, one short warm-up
    first. The jobs' runs are interleaved (run 1 of every job, then run 2, each round starting one job later),
    so a slow spell of a shared machine falls on all systems alike rather than on whichever ran then."""
    for system, prompts, batch in jobs:
        system(prompts[:batch], min(8, max_new))
    per_run: list[list] = [[] for _ in jobs]
    for r in range(runs):
        for j in [(r + i) % len(jobs) for i in range(len(jobs))]:
            system, prompts, batch = jobs[j]
            if labels:
                log(f"run {r + 1}/{runs}: {labels[j]}")
            parts = []
            with PeakMemory(device) as mem:
                for i in range(0, len(prompts), batch):
                    parts.append(system(prompts[i:i + batch], max_new))
            total = GenerationStats(**{f.name: sum(getattr(s, f.name) for s in parts) for f in fields(GenerationStats)})
            per_run[j].append((total, mem.peak, statistics.mean(s.prefill_s for s in parts)))
    return [summarize_runs(job_runs) for job_runs in per_run]


def summarize_runs(per_run: list) -> dict:
    """One job's runs -> the median decode speed (and every run's), the median TTFT, the peak memory and the
    counts of the median run."""
    tps = [r[0].decode_tokens_per_s for r in per_run]
    median_run = sorted(per_run, key=lambda r: r[0].decode_tokens_per_s)[len(per_run) // 2]
    stats = median_run[0]
    return {"decode_tokens_per_s": statistics.median(tps), "runs_tokens_per_s": tps,
            "ttft_s": statistics.median(r[2] for r in per_run), "peak_memory_mb": max(r[1] for r in per_run) / 2**20,
            "tokens_per_step": stats.tokens_per_step, "generated_tokens": stats.generated_tokens,
            "macro_steps": stats.macro_steps, "prompt_tokens": stats.prompt_tokens, "sequences": stats.sequences,
            "kv_entries": stats.kv_entries, "tokens_per_forward": stats.tokens_per_forward,
            "acceptance": stats.acceptance}
