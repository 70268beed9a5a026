"""The cost model of a macro-step: wall time of one base step and of one micro-step, the speed-up they allow at t
tokens per step, and a profile of where a macro-step's time goes."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

# --- the cost model ---------------------------------------------------------------------------------------------


def median_time(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    """Median wall time of `fn` over `repeats` calls after one untimed call (CUDA synchronised after each)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_costs(model, context: int = 256, repeats: int = 20) -> dict:
    """Wall time of one base decode step and of one micro-step (batch 1, `context` cached slots), median of repeats.

    A base step = base forward over one slot + LM head + stop head; a micro-step = one micro-step decoder
    input + LM head (full, and the shortlist if the checkpoint has one) + stop head. At t tokens per step a
    macro-step costs 1 + c (t - 1) base steps (c = micro / base), so the reachable speed-up is t / (1 + c (t - 1)).
    """
    from hamburger.inference.engine import Engine
    from hamburger.inference.kv import KVCache

    engine = Engine(model)
    cfg, dev, dtype = model.base.config, engine.runner.device, engine.runner.dtype
    kv = engine.runner.kv_dtype  # the engine's caches
    cache = KVCache.for_layers(engine.runner.base.layers, cfg, 1, context + 1, kv, dev)
    m = model.micro.num_features
    micro_cache = KVCache.for_layers(model.micro.layers, cfg, 1, m + 2, kv, dev)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, context + 1), generator=gen).to(dev)
    mask = torch.ones(1, 1, context + 1, context + 1, dtype=torch.bool, device=dev).tril()

    def timed(fn: Callable[[], None]) -> float:
        return median_time(fn, repeats, dev)

    with torch.inference_mode():
        engine.runner.base_pass(model.embed(ids[:, :context]), torch.arange(context, device=dev)[None], cache, 0,
                     mask[:, :, :context, :context])
        pos = torch.tensor([[context]], device=dev)

        def base_step() -> None:
            states = engine.runner.base_pass(model.embed(ids[:, context:]), pos, cache, context, mask[:, :, -1:], None)
            model.lm_head(states[0]).argmax(-1)
            model.stop_head(states[0])

        x0 = torch.randn(1, m + 1, cfg.hidden_size, generator=gen).to(dev, dtype)
        engine.runner.micro_pass(x0, micro_cache, 0)
        x1 = model.embed(ids[:, :1])

        def micro_step(shortlist: bool) -> Callable[[], None]:
            def run() -> None:
                h = engine.runner.micro_pass(x1, micro_cache, m + 1)
                if shortlist:
                    engine.runner.short_logits(h).argmax(-1)
                else:
                    model.lm_head(h).argmax(-1)
                model.stop_head(h)
            return run

        base_s = timed(base_step)
        out = {"context": context, "base_step_s": base_s, "micro_step_s": timed(micro_step(False))}
        out["micro_over_base"] = out["micro_step_s"] / base_s
        if engine.runner.vocab is not None:
            out["shortlist"] = len(engine.runner.vocab)
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
                               eos_token_ids=set(), mode="trust")
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
