"""The default with a float16 KV cache (the default where the native layers run) against a float32 one,
interleaved in one process, the same int4/int8 weights: decode tok/s of the base and of verify mode on the bench's
prompts (256 new tokens, batch 1), the base's text with each cache, and the base's time a token at long prompts
(README.md's first 500 / 1,000 / 2,000 tokens, 128 new tokens, EOS ignored) and its first token's wait.

    python benchmarks/kv_cache_ab.py [rounds]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from hamburger.evaluation.bench_systems import bench_messages
from hamburger.inference.engine import Engine
from hamburger.loading import load
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import HamburgerModel

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
model, _ = load("default", quantize="auto", decode_only=True)
plain = HamburgerModel.plain(model.base, model.tokenizer)
engines = {(kv, mode): Engine(model if mode == "verify" else plain, kv_dtype=kv)
           for kv in ("float16", "float32") for mode in ("base", "verify")}
assert engines["float16", "base"].runner.kv_dtype == torch.float16
prompts = [encode_chat(model.tokenizer, m) for s in ("code", "math", "chat") for m in bench_messages(s, 3)]


def timed(engine, prompt, n, mode, eos=True, wait=None):
    """The tokens and the decode tok/s after the first token (whose wait goes into `wait`, a list, if given)."""
    kw = {} if eos else {"eos_token_ids": set()}
    start = time.perf_counter()
    gen = engine.stream([prompt], max_new_tokens=n, mode="verify" if mode == "verify" else None, **kw)
    events = iter(gen)
    first = next(events)
    t0 = time.perf_counter()
    if wait is not None:
        wait.append(t0 - start)
    for _ in events:
        pass
    dt = time.perf_counter() - t0
    toks = gen.output().tokens[0]
    return toks, (len(toks) - len(first.tokens[0])) / dt


with torch.inference_mode():
    for e in engines.values():
        e.generate([prompts[0]], max_new_tokens=8)
    rate = {k: [] for k in engines}
    texts = {k: {} for k in engines}
    order = list(engines)
    for r in range(rounds):
        for i, p in enumerate(prompts):
            for k in order[(i + r) % 4:] + order[:(i + r) % 4]:
                toks, tps = timed(engines[k], p, 256, k[1])
                rate[k].append(tps)
                texts[k][i] = toks
    print(f"bench prompts: {len(prompts)} x {rounds} rounds, 256 new tokens, median tok/s")
    for k, v in rate.items():
        print(f"  {k[1]:6s} cache {k[0]}: {statistics.median(v):6.1f}")
    for mode in ("base", "verify"):
        ratio = [a / b for a, b in zip(rate["float16", mode], rate["float32", mode])]
        print(f"  {mode}: float16 / float32 cache, median of per-run ratios {statistics.median(ratio):.3f}")
    same = sum(texts["float16", "base"][i] == texts["float32", "base"][i] for i in range(len(prompts)))
    ver = sum(texts["float16", "verify"][i] == texts["float16", "base"][i] for i in range(len(prompts)))
    print(f"  the base's text, float16 cache = float32 cache: {same}/{len(prompts)}; verify = its base (float16): "
          f"{ver}/{len(prompts)}")
    for i in range(len(prompts)):
        a, b = texts["float16", "base"][i], texts["float32", "base"][i]
        if a != b:
            at = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
            print(f"    prompt {i}: the texts part at token {at} of the output ({len(a)} / {len(b)} tokens)")
    ids = model.tokenizer.encode((Path(__file__).resolve().parents[1] / "README.md").read_text())
    for n in (500, 1000, 2000):
        ms, ttft = ({kv: [] for kv in ("float16", "float32")} for _ in range(2))
        for r in range(rounds):
            for kv in (("float16", "float32") if r % 2 == 0 else ("float32", "float16")):
                _, tps = timed(engines[kv, "base"], ids[:n], 128, "base", eos=False, wait=ttft[kv])
                ms[kv].append(1e3 / tps)
        print(f"prompt {n} tokens, the base: float16 cache {min(ms['float16']):.2f} ms a token, float32 "
              f"{min(ms['float32']):.2f} (best of {rounds}): {min(ms['float32']) / min(ms['float16']):.2f}x; first "
              f"token after {min(ttft['float16']):.2f} s / {min(ttft['float32']):.2f} s", flush=True)
