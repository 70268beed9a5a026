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
  base was loaded from, batch 1, threads = cores: the CPU anchor (`hamburger.evaluation.llamacpp`);
- `hamburger_compress`: compress mode (needs a KV merger in the checkpoint): verify's drafting, checked by a
  base that keeps each decided step as one merged KV entry (same confidence as `hamburger_verify`).

With `--quantize none,fp16,int8,int4` every system runs under each weight-only quantization scheme in the same run
(`hamburger.kernels.quantize`: the base, micro-step decoder and LM head; rows `engine_base+int8`, ...), each scheme on
a freshly loaded copy of the model, on the same prompts and settings. The "× base engine" ratio is against the
`engine_base` of the same weights (like for like), "× float base" against the float one; quantized rows also give
the weights' MB and their greedy agreement with the
same system in float (`same_as_float`: share of replies token for token equal; `prefix_vs_float`: share of
tokens before the first difference).

Every system is timed the same way: time to first token (prefill and the first token), then decode
tokens/s = (generated tokens - 1 per sequence) / time after the first token (`stats.GenerationStats`).
Each figure is the median over `--runs` runs after one short warm-up per system. Under each scheme the
systems' runs interleave (run 1 of every system, then run 2, ...), so a slow spell of a shared machine falls
on all of them alike and the ratios measured side by side hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hamburger.evaluation.bench_costs import step_costs
from hamburger.evaluation.bench_report import find
from hamburger.evaluation.bench_systems import (
    BATCH1_ONLY,
    HAMBURGER,
    LLAMA_CPP,
    TRAINED_ONLY,
    ForcedSteps,
    entry_bytes,
    make_system,
    measure,
)
from hamburger.evaluation.llamacpp import Unavailable

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
              confidences: Sequence[float], max_new: int, runs: int,
              log: Callable[[str], None] = lambda s: None, forced: ForcedSteps | None = None,
              verify_confidence: float | None = None, schemes: Sequence[str] = ("none",),
              load_quantized: Callable[[str], object] | None = None, draft_rows: int | str | None = "auto",
              lookup: int | None = None) -> dict:
    """Every system at every batch size (HAMburger at every confidence), every scheme: rows, summary, KV curve.

    `hamburger_model` is the float model (scheme "none"); `load_quantized(scheme)` gives a freshly loaded model
    quantized with that scheme (a copy would share the slot adapters' hooks with the float model). Schemes run
    one after the other, the quantized model freed before the next. `draft_rows`: verify mode drafts only while
    at most that many rows decode (`Engine`); `lookup`: verify and compress mode's lookup drafts (`Engine`; None:
    the checkpoint's).
    """
    from hamburger.kernels.quantize import model_bytes
    from hamburger.model.hamburger_model import HamburgerModel

    if any(s != "none" for s in schemes) and load_quantized is None:
        raise ValueError("quantized schemes need load_quantized")
    device = next(hamburger_model.parameters()).device
    default_conf = hamburger_model.config.default_confidence
    main_conf = default_conf if default_conf in confidences else confidences[0]
    rows, outputs = [], {}  # outputs: (scheme, system, confidence, batch) -> {prompt: generated tokens}
    costs: dict[str, dict] = {}  # the cost model under each scheme (HAMburger systems only)
    skipped: dict[str, str] = {}  # systems that cannot run here, and why
    for scheme in schemes:
        model = hamburger_model if scheme == "none" else load_quantized(scheme)
        plain = HamburgerModel.plain(model.base, model.tokenizer)
        weights = {"hamburger": model_bytes(model), "base": model_bytes(model.base)}
        per_entry = entry_bytes(model)  # the scheme's engine's cache (float16 where the native layers run)

        def make(name: str, conf: float | None, record: dict, model=model, plain=plain):
            return make_system(name, model, plain, conf or 1.0, forced, verify_confidence, record,
                               draft_rows, lookup)

        jobs, labels, planned = plan_jobs(make, scheme, schemes, systems, prompts, batch_sizes, confidences, main_conf,
                                          skipped, log)
        # The systems' runs interleave (`measure`), so their ratios hold on a machine with slow spells.
        for (name, conf, batch, system, record), measured in zip(planned, measure(jobs, max_new, runs, device, log,
                                                                                  labels) if jobs else []):
            checked = name in ("hamburger_verify", "hamburger_compress")
            row = {"system": name + ("" if name in LLAMA_CPP or scheme == "none" else f"+{scheme}"),
                   "quantize": "gguf" if name in LLAMA_CPP else scheme, "batch_size": batch, "max_new_tokens": max_new,
                   "confidence": (verify_confidence or model.config.verify_confidence) if checked else conf, **measured}
            add_kv_memory(row, name, getattr(system, "kv_bytes_per_entry", per_entry))
            # The weights the system decodes with (spec_*: the base; its INT8 draft copy is not counted).
            row["weights_mb"] = (getattr(system, "weights_bytes", None) or
                                 weights["hamburger" if name in TRAINED_ONLY else "base"]) / 2**20
            outputs[scheme, name, conf, batch] = record
            if scheme != "none" and ("none", name, conf, batch) in outputs:
                row.update(agreement(outputs["none", name, conf, batch], record))
            rows.append(row)
        del jobs, planned, make
        if any(n in TRAINED_ONLY for n in systems):
            costs[scheme] = step_costs(model)
        del model, plain
    return {"rows": rows, "summary": {**summarize(rows, main_conf), **llama_identical(outputs, schemes[0])},
            "skipped": skipped, "step_costs": costs.get(schemes[0], {}), "step_costs_by_scheme": costs,
            "confidence": main_conf, "kv_curve": kv_curve(hamburger_model, prompts, max_new, main_conf),
            "device": describe_device(device), "kv_bytes_per_entry": per_entry}


def plan_jobs(make: Callable, scheme: str, schemes: Sequence[str], systems: Sequence[str], prompts: list[list[int]],
              batch_sizes: Sequence[int], confidences: Sequence[float], main_conf: float, skipped: dict[str, str],
              log: Callable[[str], None]) -> tuple[list, list[str], list[tuple]]:
    """Under one scheme: the jobs `measure` runs (a system's call, the prompts, the batch size), their labels, and
    per job (system name, confidence, batch size, the system, the dict its outputs are kept in). A system that
    cannot run here is noted in `skipped` instead. `make(name, confidence, record)` builds a system."""
    suffix = "" if scheme == "none" else f"+{scheme}"
    jobs, labels, planned = [], [], []
    for name in systems:
        if name in LLAMA_CPP and scheme != schemes[0]:
            continue  # it decodes its own GGUF: one row (named without a scheme), beside the first scheme's
        for conf in (confidences if name in HAMBURGER else [None]):
            record: dict = {}
            try:
                system = make(name, conf, record)
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
                mine: dict = {}  # this row's outputs: the system's `record` after each of this row's calls

                def job(ps, n, system=system, record=record, mine=mine):
                    stats = system(ps, n)
                    mine.update(record)
                    return stats

                jobs.append((job, pool, batch))
                labels.append(f"{name}{'' if name == 'llama_cpp' else suffix}{'' if conf is None else f'@{conf:g}'} "
                              f"batch {batch}")
                planned.append((name, conf, batch, system, mine))
    return jobs, labels, planned


def add_kv_memory(row: dict, name: str, entry_bytes: int) -> None:
    """A measured row's KV cache as memory, beside its entries: `kv_bytes` (the run's requests together),
    `kv_bytes_per_request` (a request's entries at its end, prompt included) and `kv_bytes_per_generated_token`
    (what the cache grows by per generated token), each entry `entry_bytes` (`stats.kv_bytes_per_entry`). spec_*
    systems count their draft's cache too (the same shape as the base's)."""
    drafts = 2 if name.startswith("spec_") else 1
    generated_entries = row["kv_entries"] - row["prompt_tokens"]
    row["kv_entries"] *= drafts
    row["kv_bytes"] = row["kv_entries"] * entry_bytes
    row["kv_entries_per_generated_token"] = generated_entries * drafts / max(1, row["generated_tokens"])
    row["kv_bytes_per_generated_token"] = row["kv_entries_per_generated_token"] * entry_bytes
    row["kv_bytes_per_request"] = row["kv_bytes"] / max(1, row["sequences"])


def llama_identical(outputs: dict, scheme: str) -> dict[str, float]:
    """llama.cpp's prompt lookup is exact too: the share of prompts its greedy output equals its plain one's."""
    plain, looked = (outputs.get((scheme, name, None, 1)) for name in LLAMA_CPP)
    if not plain or not looked:
        return {}
    return {"llama_cpp_lookup_identical": sum(looked.get(p) == t for p, t in plain.items()) / len(plain)}


def beside_llama(rows: list[dict], batch: int, base: dict | None) -> dict[str, float]:
    """Each scheme's base and checked modes against llama.cpp plain and against its best configuration (plain or
    with prompt lookup, whichever decodes faster here)."""
    out: dict[str, float] = {}
    llamas = [r for r in (find(rows, name, batch) for name in LLAMA_CPP) if r and r["decode_tokens_per_s"]]
    if not llamas:
        return out
    plain = find(rows, "llama_cpp", batch)
    best = max(llamas, key=lambda r: r["decode_tokens_per_s"])
    out[f"best_llama_cpp_tok_s_b{batch}"] = best["decode_tokens_per_s"]
    if base and plain and plain["decode_tokens_per_s"]:
        out[f"engine_base_vs_llama_cpp_b{batch}"] = base["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
    for row in rows:  # each scheme's base and modes beside it
        if row["batch_size"] == batch and "+" in row["system"] and row["system"].split("+")[0] in (
                "engine_base", "hamburger_verify", "hamburger_compress"):
            if plain and plain["decode_tokens_per_s"]:
                out[f"{row['system']}_vs_llama_cpp_b{batch}"] = row["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
            out[f"{row['system']}_vs_best_llama_cpp_b{batch}"] = row["decode_tokens_per_s"] / best["decode_tokens_per_s"]
    return out


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
        out.update(beside_llama(rows, batch, base))
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
        if row.get("quantize", "none") in ("none", "gguf"):  # gguf: llama.cpp on its own weights (above)
            continue
        if row["system"].split("+")[0] in HAMBURGER and row["confidence"] != conf:
            continue  # the confidence sweep
        key, base = f"{row['system']}_b{row['batch_size']}", find(rows, "engine_base", row["batch_size"])
        if base and base["decode_tokens_per_s"]:
            out[f"{key}_vs_base"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        same = find(rows, f"engine_base+{row['quantize']}", row["batch_size"])
        if same and same["decode_tokens_per_s"] and same is not row:
            out[f"{key}_vs_same_weights_base"] = row["decode_tokens_per_s"] / same["decode_tokens_per_s"]
        if "same_as_float" in row:
            out[f"{key}_same_as_float"] = row["same_as_float"]
            out[f"{key}_prefix_vs_float"] = row["prefix_vs_float"]
    return out


def kv_curve(model, prompts: list[list[int]], max_new: int, conf: float) -> dict:
    """KV entries held after each macro-step of one long reply: HAMburger's against the base's one per token."""
    from hamburger.inference.engine import make_engine

    out = make_engine(model).generate([max(prompts, key=len)], max_new_tokens=max_new, confidence=conf,
                                      eos_token_ids=set(), mode="trust")
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
