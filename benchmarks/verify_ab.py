"""Verify mode against the base in the same engine, interleaved prompt by prompt: a fair ratio on a noisy machine.

A shared machine has slow spells (seen here: the same base at 23 and at 29 tokens/s within minutes).
`hamburger bench` interleaves its systems run by run (a run: every prompt, ~40 s here); this interleaves
finer, prompt by prompt: it decodes each of the bench's prompts with the base and then in verify mode,
alternating which goes first, `--rounds` times, and reports the summed decode time of each, the ratio per
round and its median and spread. Greedy, batch 1.

    python benchmarks/verify_ab.py runs/ctx-gate16-2400/export --quantize fp16 --confidence 0.4    # ~6 min
"""

from __future__ import annotations

import argparse
import statistics

import torch

from hamburger.evaluation.bench_systems import SETS, bench_messages
from hamburger.inference.engine import Engine
from hamburger.inference.quantize import DEFAULT_SKIP, quantize_model
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import HamburgerModel, load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", default="default")
    p.add_argument("--quantize", default="none", choices=["none", "fp16"])
    p.add_argument("--confidence", type=float, default=None, help="verify confidence (default: the checkpoint's)")
    p.add_argument("--prompts-per-set", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    model, _ = load_model(a.model)
    model.eval()
    if a.quantize == "fp16":
        quantize_model(model, "fp16", skip=DEFAULT_SKIP)
    base = Engine(HamburgerModel.plain(model.base, model.tokenizer))
    verify = Engine(model)
    prompts = [encode_chat(model.tokenizer, m) for s in SETS for m in bench_messages(s, a.prompts_per_set)]
    runs = {"base": lambda ids: base.generate([ids], max_new_tokens=a.max_new_tokens),
            "verify": lambda ids: verify.generate([ids], max_new_tokens=a.max_new_tokens, mode="verify",
                                                  confidence=a.confidence)}
    ratios, totals = [], {name: [0.0, 0, 0] for name in runs}  # decode s, tokens and base forwards after the first
    with torch.inference_mode():
        for fn in runs.values():
            fn(prompts[0][:16])  # warm up
        for r in range(a.rounds):
            spent = dict.fromkeys(runs, 0.0)
            tokens = dict.fromkeys(runs, 0)
            for i, ids in enumerate(prompts):
                order = list(runs) if (i + r) % 2 == 0 else list(runs)[::-1]
                for name in order:
                    out = runs[name](ids)
                    spent[name] += out.stats.decode_s
                    tokens[name] += out.stats.generated_tokens - 1  # the first comes with the prefill
                    totals[name][2] += out.stats.row_forwards - 1
            if tokens["base"] != tokens["verify"]:
                raise SystemExit(f"verify generated {tokens['verify']} tokens, the base {tokens['base']}: not lossless")
            for name in runs:
                totals[name][0] += spent[name]
                totals[name][1] += tokens[name]
            ratios.append(spent["base"] / spent["verify"])
            print(f"round {r + 1}: base {tokens['base'] / spent['base']:.1f} tok/s, verify "
                  f"{tokens['verify'] / spent['verify']:.1f} tok/s, {ratios[-1]:.3f}x", flush=True)
    conf = a.confidence if a.confidence is not None else model.config.verify_confidence
    print(f"{a.model} ({a.quantize}), verify confidence {conf:g}, {len(prompts)} prompts x {a.rounds} rounds, "
          f"{a.max_new_tokens} new tokens, batch 1, interleaved:")
    print("| system | decode tok/s | tokens / base forward |\n| --- | --- | --- |")
    for name, (s, n, fwd) in totals.items():
        print(f"| {name} | {n / s:.1f} | {n / max(fwd, 1):.2f} |")
    print(f"verify x base: median {statistics.median(ratios):.3f}x over rounds (min {min(ratios):.3f}, "
          f"max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
