"""`hamburger bench`: decode speed, time to first token, KV entries and memory of HAMburger against what a
user would run instead, all on the same prompts in the same run, greedy, stopping at EOS or the same limit.

Systems (`--systems`):
- `hf_generate`: the base through transformers' `generate` (what users run today);
- `engine_base`: the base through our fast engine (one token per step): the like-for-like baseline;
- `prompt_lookup`: transformers assisted generation with prompt lookup (batch 1 only in transformers);
- `spec_int8_k2`, `spec_int8_k4`: speculative decoding, an INT8 dynamically quantised copy of the base as
  draft proposing k tokens (the paper's SD baseline; batch 1 only in transformers);
- `hamburger_ref`: HAMburger on the transformers reference path; `hamburger_engine`: on the fast engine;
- `hamburger_forced` (with `--forced-steps DATA`): the fast engine with step lengths drawn from segmented
  data instead of the stop head: the speed at the data's tokens per step (the tokens are not the point);
- `hamburger_verify`: verify mode on the fast engine: the micro-step decoder drafts, the base checks, the
  output is exactly the base's (at the checkpoint's verify confidence, or `--verify-confidence`);
- `llama_cpp`: llama.cpp (`llama-cpp-python`, skipped with the reason when it is not installed) on the GGUF the
  base was loaded from, batch 1, threads = cores: the CPU anchor (`hamburger.inference.llamacpp`);
- `hamburger_compress`: compress mode (needs a KV merger in the checkpoint): verify's drafting, checked by a
  base that keeps each decided step as one merged KV entry (same confidence as `hamburger_verify`).

With `--quantize none,int8,int4` every system runs under each weight-only quantization scheme in the same run
(`hamburger.inference.quantize`: the base, micro-step decoder and LM head; rows `engine_base+int8`, ...), each scheme on
a freshly loaded copy of the model, on the same prompts and settings. The "× base engine" ratio stays
against the float `engine_base`; quantized rows also give the weights' MB and their greedy agreement with the
same system in float (`same_as_float`: share of replies token for token equal; `prefix_vs_float`: share of
tokens before the first difference).

Every system is timed the same way: time to first token (prefill and the first token), then decode
tokens/s = (generated tokens - 1 per sequence) / time after the first token (`metrics.GenerationStats`).
Each figure is the median over `--runs` runs after one short warm-up per system.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path

import torch

from hamburger.errors import HamburgerError
from hamburger.inference.llamacpp import Unavailable
from hamburger.inference.reference import left_pad
from hamburger.inference.stats import GenerationStats

SETS = ("code", "math", "chat", "long")
SYSTEMS = ("hf_generate", "engine_base", "prompt_lookup", "spec_int8_k2", "spec_int8_k4", "hamburger_ref",
           "hamburger_engine", "hamburger_forced", "hamburger_verify", "hamburger_compress", "llama_cpp")
BATCH1_ONLY = ("prompt_lookup", "spec_int8_k2", "spec_int8_k4", "llama_cpp")
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
    """`count` held-out chat prompts of one built-in set (never the training prompts)."""
    from hamburger.training import sources

    if name == "code":
        items = sources.code_prompts("heldout", limit=count)
    elif name == "math":
        items = sources.gsm_prompts("heldout", per_template=1)[:count]
    elif name == "chat":
        items = sources.chat_prompts("heldout")[:count]
    elif name == "long":
        return [[{"role": "user", "content": f"Summarise this documentation of Python's `{module}` module in a "
                  f"few sentences.\n\n{doc}"}] for module, doc in long_documents(count)]
    else:
        raise HamburgerError(f"unknown prompt set {name!r}: choose from {', '.join(SETS)}")
    return [item.messages for item in items]


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
        from hamburger.training.train import read_examples

        lengths = [s for _, ex in read_examples(Path(path)) for s in ex.steps]
        if any(s > k for s in lengths):
            raise HamburgerError(f"{path} has steps longer than the model's K = {k}")
        self.lengths, self.seed = lengths, seed
        self.tokens_per_step = sum(lengths) / len(lengths)

    def draw(self, rows: int, max_new_tokens: int) -> list[list[int]]:
        import random

        rng = random.Random(self.seed)  # the same draw every run: runs differ only in time
        return [[rng.choice(self.lengths) for _ in range(max_new_tokens)] for _ in range(rows)]


def make_system(name: str, hamburger_model, plain_model, confidence: float, compile: bool,
                forced: ForcedSteps | None = None, verify_confidence: float | None = None,
                record: dict | None = None) -> Callable[[list[list[int]], int], GenerationStats]:
    """A function (prompts, max_new_tokens) -> GenerationStats for one named system; with `record`, each call
    also notes every prompt's generated tokens there (prompt tuple -> tokens)."""
    from hamburger.inference.engine import Engine, ReferenceEngine
    from hamburger.inference.reference import eos_ids

    def kept(prompts: list[list[int]], out) -> GenerationStats:
        if record is not None:
            for prompt, tokens in zip(prompts, out.tokens):
                record[tuple(prompt)] = list(tokens)
        return out.stats

    base = plain_model.base
    eos = eos_ids(plain_model)
    pad = getattr(plain_model.tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else min(eos)
    if name == "hf_generate":
        return lambda prompts, n: hf_call(base, prompts, n, eos, pad, record)
    if name == "prompt_lookup":
        return lambda prompts, n: hf_call(base, prompts, n, eos, pad, record, prompt_lookup_num_tokens=10)
    if name.startswith("spec_int8_k"):
        if next(base.parameters()).device.type != "cpu":
            raise HamburgerError("the INT8 draft (dynamic quantisation) runs on the CPU only")
        draft = int8_draft(base)
        draft.generation_config.num_assistant_tokens = int(name.removeprefix("spec_int8_k"))
        return lambda prompts, n: hf_call(base, prompts, n, eos, pad, record, assistant_model=draft)
    if name == "llama_cpp":
        from hamburger.inference.llamacpp import gguf_path, llama_cpp_system

        refs = [getattr(base.config, "hamburger_ref", None), hamburger_model.config.base_model]
        system = llama_cpp_system(gguf_path([r for r in refs if r]), eos, record=record)
        # llama.cpp keeps keys and values in float16 by default
        system.kv_bytes_per_entry = kv_bytes_per_entry(plain_model) // next(base.parameters()).element_size() * 2
        return system
    if name == "hamburger_forced":
        if forced is None:
            raise HamburgerError("the hamburger_forced system needs --forced-steps SEGMENTED_JSONL")
        engine = Engine(hamburger_model, compile=compile)
        return lambda prompts, n: kept(prompts, engine.generate(prompts, max_new_tokens=n,
                                                                forced_steps=forced.draw(len(prompts), n)))
    if name in ("hamburger_verify", "hamburger_compress"):
        engine, mode = Engine(hamburger_model, compile=compile), name.removeprefix("hamburger_")
        if mode == "compress":
            from hamburger.inference.engine import check_merger

            check_merger(hamburger_model)
        return lambda prompts, n: kept(prompts, engine.generate(prompts, max_new_tokens=n, mode=mode,
                                                                confidence=verify_confidence))
    engines = {"engine_base": (Engine, plain_model), "hamburger_ref": (ReferenceEngine, hamburger_model),
               "hamburger_engine": (Engine, hamburger_model)}
    if name not in engines:
        raise HamburgerError(f"unknown system {name!r}: choose from {', '.join(SYSTEMS)}")
    cls, model = engines[name]
    engine = cls(model, compile=compile) if cls is Engine else cls(model)
    conf = confidence if name in HAMBURGER else 1.0
    return lambda prompts, n: kept(prompts, engine.generate(prompts, max_new_tokens=n, confidence=conf, mode="trust"))


def kv_bytes_per_entry(model) -> int:
    """Bytes one KV entry takes over all layers of the base: keys and values."""
    cfg = model.base.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = next(model.base.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem


def measure(system: Callable, prompts: list[list[int]], batch: int, max_new: int, runs: int,
            device: torch.device) -> dict:
    """Median over runs of one system on all prompts in chunks of `batch`; one short warm-up first."""
    system(prompts[:batch], min(8, max_new))
    per_run = []
    for _ in range(runs):
        parts = []
        with PeakMemory(device) as mem:
            for i in range(0, len(prompts), batch):
                parts.append(system(prompts[i:i + batch], max_new))
        total = GenerationStats(**{f.name: sum(getattr(s, f.name) for s in parts) for f in fields(GenerationStats)})
        per_run.append((total, mem.peak, statistics.mean(s.prefill_s for s in parts)))
    tps = [r[0].decode_tokens_per_s for r in per_run]
    median_run = sorted(per_run, key=lambda r: r[0].decode_tokens_per_s)[len(per_run) // 2]
    stats = median_run[0]
    return {"decode_tokens_per_s": statistics.median(tps), "runs_tokens_per_s": tps,
            "ttft_s": statistics.median(r[2] for r in per_run), "peak_memory_mb": max(r[1] for r in per_run) / 2**20,
            "tokens_per_step": stats.tokens_per_step, "generated_tokens": stats.generated_tokens,
            "macro_steps": stats.macro_steps, "prompt_tokens": stats.prompt_tokens, "sequences": stats.sequences,
            "kv_entries": stats.kv_entries, "tokens_per_forward": stats.tokens_per_forward,
            "acceptance": stats.acceptance}


# --- the cost model ---------------------------------------------------------------------------------------------


def step_costs(model, context: int = 256, repeats: int = 20) -> dict:
    """Wall time of one base decode step and of one micro-step (batch 1, `context` cached slots), median of repeats.

    A base step = base forward over one slot + LM head + stop head; a micro-step = one micro-step decoder
    input + LM head (full, and the shortlist if the checkpoint has one) + stop head. At t tokens per step a
    macro-step costs 1 + c (t - 1) base steps (c = micro / base), so the reachable speed-up is t / (1 + c (t - 1)).
    """
    from hamburger.inference.engine import Engine
    from hamburger.inference.kv import KVCache

    engine = Engine(model)
    cfg, dev, dtype = model.base.config, engine.device, engine.dtype
    cache = KVCache.for_layers(engine.base.layers, cfg, 1, context + 1, dtype, dev)
    m = model.micro.num_features
    micro_cache = KVCache.for_layers(model.micro.layers, cfg, 1, m + 2, dtype, dev)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, context + 1), generator=gen).to(dev)
    mask = torch.ones(1, 1, context + 1, context + 1, dtype=torch.bool, device=dev).tril()

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    with torch.inference_mode():
        engine._base(model.embed(ids[:, :context]), torch.arange(context, device=dev)[None], cache, 0,
                     mask[:, :, :context, :context])
        pos = torch.tensor([[context]], device=dev)

        def base_step() -> None:
            states = engine.step_fn(model.embed(ids[:, context:]), pos, cache, context, mask[:, :, -1:], None)
            model.lm_head(states[0]).argmax(-1)
            model.stop_head(states[0])

        x0 = torch.randn(1, m + 1, cfg.hidden_size, generator=gen).to(dev, dtype)
        engine._micro(x0, micro_cache, 0)
        x1 = model.embed(ids[:, :1])

        def micro_step(shortlist: bool) -> Callable[[], None]:
            def run() -> None:
                h = engine._micro(x1, micro_cache, m + 1)
                if shortlist:
                    torch.nn.functional.linear(h, engine.short_head).argmax(-1)
                else:
                    model.lm_head(h).argmax(-1)
                model.stop_head(h)
            return run

        base_s = timed(base_step)
        out = {"context": context, "base_step_s": base_s, "micro_step_s": timed(micro_step(False))}
        out["micro_over_base"] = out["micro_step_s"] / base_s
        if engine.vocab is not None:
            out["shortlist"] = len(engine.vocab)
            out["micro_step_shortlist_s"] = timed(micro_step(True))
            out["micro_shortlist_over_base"] = out["micro_step_shortlist_s"] / base_s
    return out


def profile_steps(model, prompt: list[int], steps: int = 32, step_tokens: int = 2, top: int = 12) -> list[dict]:
    """torch.profiler over `steps` macro-steps of `step_tokens` forced tokens (batch 1, after the prefill):
    the ops that take the time, as (op, calls, self CPU ms per macro-step, share)."""
    from torch.profiler import ProfilerActivity, profile

    from hamburger.inference.engine import Engine

    k = min(step_tokens, model.config.max_step_tokens)
    gen = Engine(model).stream([prompt], max_new_tokens=1 + k * (steps + 1), forced_steps=[[1] + [k] * (steps + 2)],
                               eos_token_ids=set())
    events = iter(gen)
    next(events)  # prefill and the first step stay outside the profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            next(events)
    table = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in table) or 1
    return [{"op": e.key, "calls_per_step": e.count / steps, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
             "share": e.self_cpu_time_total / total} for e in table[:top]]


def reachable_speedup(tokens_per_step: float, micro_over_base: float) -> float:
    return tokens_per_step / (1 + micro_over_base * (tokens_per_step - 1))


# --- the run ------------------------------------------------------------------------------------------------


def agreement(reference: dict, other: dict) -> dict:
    """Greedy agreement of two systems' replies to the same prompts (prompt -> generated tokens): the share of
    replies equal token for token, and the share of tokens before the first difference (of the longer reply)."""
    prompts = [p for p in reference if p in other]
    same, prefix = 0, 0.0
    for p in prompts:
        a, b = reference[p], other[p]
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += a == b
        prefix += common / max(1, len(a), len(b))
    n = max(1, len(prompts))
    return {"same_as_float": same / n, "prefix_vs_float": prefix / n, "compared_replies": len(prompts)}


def run_bench(hamburger_model, prompts: list[list[int]], systems: Sequence[str], batch_sizes: Sequence[int],
              confidences: Sequence[float], max_new: int, runs: int, compile: bool = False,
              log: Callable[[str], None] = lambda s: None, forced: ForcedSteps | None = None,
              verify_confidence: float | None = None, schemes: Sequence[str] = ("none",),
              load_quantized: Callable[[str], object] | None = None) -> dict:
    """Every system at every batch size (HAMburger at every confidence), under every quantization scheme: rows,
    a summary and the KV curve.

    `hamburger_model` is the float model (scheme "none"); `load_quantized(scheme)` gives a freshly loaded model
    quantized with that scheme (a copy would share the slot adapters' hooks with the float model). Schemes run
    one after the other, the quantized model freed before the next.
    """
    from hamburger.inference.quantize import model_bytes
    from hamburger.model.hamburger_model import HamburgerModel

    if any(s != "none" for s in schemes) and load_quantized is None:
        raise ValueError("quantized schemes need load_quantized")
    device = next(hamburger_model.parameters()).device
    default_conf = hamburger_model.config.default_confidence
    main_conf = default_conf if default_conf in confidences else confidences[0]
    entry_bytes = kv_bytes_per_entry(hamburger_model)
    rows, outputs = [], {}  # outputs: (scheme, system, confidence, batch) -> {prompt: generated tokens}
    skipped: dict[str, str] = {}  # systems that cannot run here, and why
    for scheme in schemes:
        model = hamburger_model if scheme == "none" else load_quantized(scheme)
        plain = HamburgerModel.plain(model.base, model.tokenizer)
        weights = {"hamburger": model_bytes(model), "base": model_bytes(model.base)}
        suffix = "" if scheme == "none" else f"+{scheme}"
        for name in systems:
            for conf in (confidences if name in HAMBURGER else [None]):
                record: dict = {}
                try:
                    system = make_system(name, model, plain, conf or 1.0, compile, forced, verify_confidence, record)
                except Unavailable as exc:
                    skipped[name + suffix] = str(exc)
                    log(f"{name}{suffix}: skipped ({exc})")
                    continue
                for batch in batch_sizes:
                    if name in BATCH1_ONLY and batch > 1:
                        continue
                    if conf is not None and conf != main_conf and (name != "hamburger_engine" or batch != 1):
                        continue  # the sweep runs on the fast engine at batch 1
                    pool = (prompts * (batch // len(prompts) + 1))[:max(batch, len(prompts))]
                    log(f"{name}{suffix}{'' if conf is None else f'@{conf:g}'} batch {batch}")
                    row_conf = (verify_confidence or model.config.verify_confidence) \
                        if name in ("hamburger_verify", "hamburger_compress") else conf
                    record.clear()
                    row = {"system": name + suffix, "quantize": scheme, "confidence": row_conf, "batch_size": batch,
                           "max_new_tokens": max_new, **measure(system, pool, batch, max_new, runs, device)}
                    drafts = 2 if name.startswith("spec_") else 1  # the draft keeps a cache of the same shape
                    generated_entries = row["kv_entries"] - row["prompt_tokens"]
                    row["kv_entries"] *= drafts
                    row["kv_bytes"] = row["kv_entries"] * getattr(system, "kv_bytes_per_entry", entry_bytes)
                    row["kv_entries_per_generated_token"] = generated_entries * drafts / max(1, row["generated_tokens"])
                    # The weights the system decodes with (spec_*: the base; its INT8 draft copy is not counted).
                    row["weights_mb"] = getattr(system, "weights_bytes", None) or \
                        weights["hamburger" if name in TRAINED_ONLY else "base"]
                    row["weights_mb"] /= 2**20
                    outputs[scheme, name, conf, batch] = dict(record)
                    if scheme != "none" and ("none", name, conf, batch) in outputs:
                        row.update(agreement(outputs["none", name, conf, batch], record))
                    rows.append(row)
                del system
        del model, plain
    summary = summarize(rows, main_conf)
    costs = step_costs(hamburger_model) if any(n in TRAINED_ONLY for n in systems) else {}
    return {"rows": rows, "summary": summary, "skipped": skipped, "step_costs": costs, "confidence": main_conf, "kv_curve": kv_curve(hamburger_model, prompts,
            max_new, main_conf), "device": describe_device(device), "kv_bytes_per_entry": entry_bytes}


def find(rows: list[dict], system: str, batch: int, conf: float | None = None) -> dict | None:
    for row in rows:
        if row["system"] == system and row["batch_size"] == batch and (conf is None or row["confidence"] == conf):
            return row
    return None


def summarize(rows: list[dict], conf: float) -> dict:
    """Ratios of HAMburger's decode tokens/s (fast engine, the main confidence) to the other systems."""
    out: dict[str, float | None] = {}
    for batch in sorted({r["batch_size"] for r in rows}):
        forced, base = find(rows, "hamburger_forced", batch), find(rows, "engine_base", batch)
        if forced and base and base["decode_tokens_per_s"]:
            out[f"forced_steps_vs_base_b{batch}"] = forced["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            out[f"forced_steps_tokens_per_step_b{batch}"] = forced["tokens_per_step"]
        for mode in ("verify", "compress"):
            row = find(rows, f"hamburger_{mode}", batch)
            if row and base and base["decode_tokens_per_s"]:
                out[f"{mode}_vs_base_b{batch}"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
                out[f"{mode}_tokens_per_forward_b{batch}"] = row["tokens_per_forward"]
        llama = find(rows, "llama_cpp", batch)
        if llama and base and llama["decode_tokens_per_s"]:
            out[f"engine_base_vs_llama_cpp_b{batch}"] = base["decode_tokens_per_s"] / llama["decode_tokens_per_s"]
        compress = find(rows, "hamburger_compress", batch)
        if compress:
            out[f"compress_kv_entries_per_generated_token_b{batch}"] = compress["kv_entries_per_generated_token"]
        ham = find(rows, "hamburger_engine", batch, conf)
        if ham is None:
            continue
        for other, key in (("engine_base", "base"), ("hf_generate", "hf_generate"), ("prompt_lookup", "prompt_lookup"),
                           ("spec_int8_k2", "spec_int8_k2"), ("spec_int8_k4", "spec_int8_k4"),
                           ("hamburger_ref", "hamburger_ref"), ("llama_cpp", "llama_cpp")):
            row = find(rows, other, batch, conf if other in HAMBURGER else None)
            if row and row["decode_tokens_per_s"]:
                out[f"hamburger_vs_{key}_b{batch}"] = ham["decode_tokens_per_s"] / row["decode_tokens_per_s"]
        if batch == 1:
            out["kv_entries_per_generated_token"] = ham["kv_entries_per_generated_token"]
            out["tokens_per_step"] = ham["tokens_per_step"]
    for row in rows:  # quantized systems: speed against the float engine_base, greedy agreement with their float self
        if row.get("quantize", "none") == "none":
            continue
        if row["system"].split("+")[0] in HAMBURGER and row["confidence"] != conf:
            continue  # the confidence sweep
        key, base = f"{row['system']}_b{row['batch_size']}", find(rows, "engine_base", row["batch_size"])
        if base and base["decode_tokens_per_s"]:
            out[f"{key}_vs_base"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        if "same_as_float" in row:
            out[f"{key}_same_as_float"] = row["same_as_float"]
            out[f"{key}_prefix_vs_float"] = row["prefix_vs_float"]
    return out


def kv_curve(model, prompts: list[list[int]], max_new: int, conf: float) -> dict:
    """KV entries held after each macro-step of one long reply: HAMburger's against the base's one per token."""
    from hamburger.inference.engine import make_engine

    out = make_engine(model).generate([max(prompts, key=len)], max_new_tokens=max_new, confidence=conf,
                                      eos_token_ids=set())
    prompt_len, generated, kv, points = len(max(prompts, key=len)), 0, len(max(prompts, key=len)), []
    for n in out.steps[0]:
        generated += n
        kv += 1
        points.append((generated, kv))
    return {"prompt_tokens": prompt_len, "generated": [p[0] for p in points], "hamburger": [p[1] for p in points],
            "base": [prompt_len + p[0] for p in points]}


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import os
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__})"


# --- output -------------------------------------------------------------------------------------------------


def table(result: dict) -> tuple[list[str], list[list[str]]]:
    header = ["system", "conf", "batch", "decode tok/s", "× base engine", "TTFT s", "tok/step", "tok/forward", "KV entries",
              "KV MB", "KV/gen token", "peak MB", "weights MB", "= float"]
    body = []
    for r in result["rows"]:
        base = find(result["rows"], "engine_base", r["batch_size"])
        ratio = r["decode_tokens_per_s"] / base["decode_tokens_per_s"] if base and base["decode_tokens_per_s"] else None
        body.append([r["system"], "-" if r["confidence"] is None else f"{r['confidence']:g}", str(r["batch_size"]),
                     f"{r['decode_tokens_per_s']:.1f}", "-" if ratio is None else f"{ratio:.2f}×",
                     f"{r['ttft_s']:.3f}", f"{r['tokens_per_step']:.2f}",
                     f"{r['tokens_per_forward']:.2f}" if "tokens_per_forward" in r else "-", str(r["kv_entries"]),
                     f"{r['kv_bytes'] / 2**20:.1f}", f"{r['kv_entries_per_generated_token']:.2f}",
                     f"{r['peak_memory_mb']:.0f}", f"{r['weights_mb']:.0f}" if "weights_mb" in r else "-",
                     f"{r['prefix_vs_float']:.0%}" if "prefix_vs_float" in r else "-"])
    return header, body


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    header, body = table(result)
    quantized = [s for s in result.get("quantize", ()) if s != "none"]
    weights = f", weights {', '.join(result['quantize'])}" if quantized else ""
    if "int4" in quantized:
        weights += f" (int4 groups of {result['group_size']})"
    t = Table(title=f"hamburger bench on {result['device']}: {result['max_new_tokens']} new tokens, greedy, "
                    f"median of {result['runs']} runs{weights}")
    for h in header:
        t.add_column(h, justify="left" if h == "system" else "right")
    for row in body:
        t.add_row(*row)
    console = Console(width=200)
    console.print(t)
    console.print("summary: " + json.dumps({k: round(v, 3) for k, v in result["summary"].items()}))
    if costs := result.get("step_costs"):
        line = (f"cost model (batch 1, {costs['context']} cached slots): base step {costs['base_step_s'] * 1e3:.1f} ms, "
                f"micro-step {costs['micro_step_s'] * 1e3:.1f} ms = {costs['micro_over_base']:.2f} of a base step")
        if "micro_shortlist_over_base" in costs:
            line += (f"; with the {costs['shortlist']}-token shortlist {costs['micro_step_shortlist_s'] * 1e3:.1f} ms = "
                     f"{costs['micro_shortlist_over_base']:.2f}")
        c = costs.get("micro_shortlist_over_base", costs["micro_over_base"])
        line += "; reachable speed-up at 1.5/1.8/2.0/2.5 tokens/step: " + ", ".join(
            f"{reachable_speedup(t, c):.2f}×" for t in (1.5, 1.8, 2.0, 2.5))
        console.print(line)
    if prof := result.get("profile"):
        console.print("profile of one macro-step (2 tokens, batch 1), top ops by self CPU time: " + "; ".join(
            f"{p['op']} {p['self_ms_per_step']:.2f} ms ({p['share']:.0%})" for p in prof))


def plot(result: dict, directory: Path) -> list[Path]:
    """tokens/s by system and batch size; KV entries against output length; the confidence sweep."""
    try:
        import matplotlib
    except ImportError as exc:
        raise HamburgerError("--plot needs matplotlib: pip install 'hamburger[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    rows, conf, paths = result["rows"], result["confidence"], []
    main = [r for r in rows if r["confidence"] in (None, conf)]
    batches = sorted({r["batch_size"] for r in main})
    names = list(dict.fromkeys(r["system"] for r in main))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(batches)
    for j, batch in enumerate(batches):
        values = [(find(main, n, batch) or {}).get("decode_tokens_per_s", 0) for n in names]
        ax.bar([i + j * width for i in range(len(names))], values, width, label=f"batch {batch}")
    ax.set_xticks([i + width * (len(batches) - 1) / 2 for i in range(len(names))], names, rotation=20, ha="right")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Decode speed, {result['max_new_tokens']} new tokens (HAMburger at confidence {conf:g})")
    ax.legend()
    fig.tight_layout()
    paths.append(directory / "tokens_per_s.png")
    fig.savefig(paths[-1], dpi=120)

    curve = result["kv_curve"]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.plot(curve["generated"], curve["base"], label="base: one entry per token")
    ax.plot(curve["generated"], curve["hamburger"], label=f"HAMburger @ {conf:g}: one entry per step")
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("KV entries per layer")
    ax.set_title("KV cache growth")
    ax.legend()
    fig.tight_layout()
    paths.append(directory / "kv_entries.png")
    fig.savefig(paths[-1], dpi=120)

    sweep = sorted((r for r in rows if r["system"] == "hamburger_engine" and r["batch_size"] == 1),
                   key=lambda r: r["confidence"])
    if len(sweep) > 1:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        xs = [r["confidence"] for r in sweep]
        ax.plot(xs, [r["decode_tokens_per_s"] for r in sweep], "o-", color="C0", label="decode tokens/s")
        base = find(rows, "engine_base", 1)
        if base:
            ax.axhline(base["decode_tokens_per_s"], color="C0", linestyle=":", label="base (fast engine)")
        ax.set_xlabel("confidence")
        ax.set_ylabel("decode tokens/s")
        ax2 = ax.twinx()
        ax2.plot(xs, [r["tokens_per_step"] for r in sweep], "s--", color="C1", label="tokens per step")
        ax2.set_ylabel("tokens per step")
        fig.legend(loc="upper right")
        ax.set_title("Confidence sweep (batch 1)")
        fig.tight_layout()
        paths.append(directory / "confidence_sweep.png")
        fig.savefig(paths[-1], dpi=120)
    plt.close("all")
    return paths


# --- the command ----------------------------------------------------------------------------------------------


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise HamburgerError(f"{what} must be a comma list of integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise HamburgerError(f"{what} must be positive integers, got {text!r}")
    return values


def cmd_bench(args: argparse.Namespace) -> int:
    from hamburger.cli import load_from_args, parse_schemes, quantize_loaded
    from hamburger.evaluation.evaluate import parse_confidences
    from hamburger.model.base import encode_chat

    batch_sizes = _ints(args.batch_sizes, "--batch-sizes")
    schemes = parse_schemes(args.quantize, many=True)
    if args.max_new_tokens < 1 or args.runs < 1 or args.prompts_per_set < 1:
        raise HamburgerError("--max-new-tokens, --runs and --prompts-per-set must be >= 1")
    systems = [s.strip() for s in (args.systems or ",".join(SYSTEMS)).split(",") if s.strip()]
    if unknown := [s for s in systems if s not in SYSTEMS]:
        raise HamburgerError(f"unknown systems {unknown}: choose from {', '.join(SYSTEMS)}")
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    if unknown := [s for s in sets if s not in SETS]:
        raise HamburgerError(f"unknown prompt sets {unknown}: choose from {', '.join(SETS)}")
    if args.json and Path(args.json).exists() and not args.force:
        raise HamburgerError(f"{args.json} exists: pass --force to overwrite it")
    model, trained = load_from_args(args, quantize=False)  # checks every scheme against --device/--dtype first

    def load_quantized(scheme: str):
        log(f"loading the model again, quantized {scheme}")
        quantized, _ = load_from_args(args, quantize=False)
        quantize_loaded(quantized, scheme, args.group_size)
        return quantized

    def log(s: str) -> None:
        print(f"bench: {s}", file=sys.stderr, flush=True)

    forced = ForcedSteps(args.forced_steps, model.config.max_step_tokens) if args.forced_steps else None
    if not args.forced_steps:
        systems = [s for s in systems if s != "hamburger_forced"]
    if not trained:
        systems = [s for s in systems if s not in TRAINED_ONLY]
        print(f"note: {args.model} is a base model, not a HAMburger checkpoint: HAMburger systems are skipped",
              file=sys.stderr)
    elif args.systems is None and model.merger is None and "hamburger_compress" in systems:
        systems.remove("hamburger_compress")  # named explicitly, it fails with the reason instead
        print("note: the checkpoint has no KV merger: hamburger_compress is skipped", file=sys.stderr)
    confidences = parse_confidences(args.confidence) or [model.config.default_confidence]
    messages = [m for name in sets for m in bench_messages(name, args.prompts_per_set)]
    prompts = [encode_chat(model.tokenizer, m) for m in messages]
    result = run_bench(model, prompts, systems, batch_sizes, confidences, args.max_new_tokens, args.runs,
                       args.compile, log=log, forced=forced, verify_confidence=args.verify_confidence,
                       schemes=schemes, load_quantized=load_quantized)
    result.update(model=args.model, dtype=args.dtype, sets=sets, prompts=len(prompts), runs=args.runs,
                  max_new_tokens=args.max_new_tokens, compile=args.compile, quantize=schemes,
                  group_size=args.group_size)
    if args.profile:
        result["profile"] = profile_steps(model, max(prompts, key=len))
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        for path in plot(result, Path(args.plot)):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def register(sub, add_model_args) -> None:
    from hamburger.cli import add_quantize_args

    p = sub.add_parser("bench", help="decode speed, TTFT, KV entries and memory against HF generate, prompt lookup, "
                       "INT8 speculative decoding and the base in the same engine")
    add_model_args(p)
    p.add_argument("--systems", default=None, help=f"comma list from {', '.join(SYSTEMS)} (default: all that apply)")
    p.add_argument("--sets", default=",".join(SETS), help=f"prompt sets, from {', '.join(SETS)}")
    p.add_argument("--prompts-per-set", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--confidence", default=None, help="one value or a comma sweep (the sweep runs at batch 1)")
    p.add_argument("--verify-confidence", type=float, default=None,
                   help="hamburger_verify and hamburger_compress drafting threshold (default: the checkpoint's verify confidence)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per system (the median is reported)")
    p.add_argument("--compile", action="store_true", help="torch.compile the fast engine's base step")
    add_quantize_args(p, many=True)
    p.add_argument("--forced-steps", default=None, metavar="SEGMENTED_JSONL",
                   help="adds the system hamburger_forced: step lengths drawn from this data's segmentation")
    p.add_argument("--profile", action="store_true", help="also profile macro-steps of 2 tokens (torch.profiler)")
    p.add_argument("--json", default=None)
    p.add_argument("--force", action="store_true", help="overwrite the --json file")
    p.add_argument("--plot", default=None, help="write PNG plots to this folder")
    p.set_defaults(func=cmd_bench)
