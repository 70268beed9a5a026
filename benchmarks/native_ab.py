"""The native kernels (`kernels/native.c`) against PyTorch's, side by side: the base and verify mode at batch 1.

Two copies of the default with the same weights scheme, one quantized and run with the native kernels (the engine's
default where they build), one with PyTorch's (FBGEMM's float16 GEMM or the packed int4 kernel, and the fast
layers), decode the bench's prompts (2 a set, 256 new tokens, greedy), interleaved prompt by prompt over 2 rounds.
It prints tok/s of each, and how many replies are the same text: verify mode against its own base (the native
kernels compute each position of a check pass as a one-position step does, so all of them), and each native reply
against PyTorch's (the same model to float32's rounding: most, not all, replies the same).

    python benchmarks/native_ab.py fp16      # 4 min on 2 cores
    python benchmarks/native_ab.py int4
"""

from __future__ import annotations

import sys
import time

import torch

from hamburger.evaluation.bench_systems import SETS, bench_messages
from hamburger.inference.engine import Engine
from hamburger.kernels import native
from hamburger.kernels.quantize import DEFAULT_SKIP, quantize_model
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import HamburgerModel, load_model


def engines(scheme: str) -> tuple[Engine, Engine]:
    """(base, HAMburger) engines over one freshly loaded and quantized copy of the default."""
    model, _ = load_model("default")
    model.eval()
    quantize_model(model, scheme, skip=DEFAULT_SKIP)
    return Engine(HamburgerModel.plain(model.base, model.tokenizer)), Engine(model)


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in ("fp16", "int4"):
        raise SystemExit("usage: python benchmarks/native_ab.py fp16|int4")
    scheme = sys.argv[1]
    if (why := native.why_unavailable()) is not None:
        raise SystemExit(f"the native kernels are not available here: {why}")
    started = time.perf_counter()
    systems = {"native": engines(scheme)}
    with native.turned_off():
        systems["torch"] = engines(scheme)
    assert systems["native"][0].runner.native is not None and systems["torch"][0].runner.native is None
    tokenizer = systems["native"][1].model.tokenizer
    prompts = [encode_chat(tokenizer, m) for s in SETS for m in bench_messages(s, 2)]
    names = [(k, mode) for k in systems for mode in ("base", "verify")]
    spent, tokens = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    same = {"verify = its base (native)": 0, "verify = its base (torch)": 0, "native base = torch base": 0}
    with torch.inference_mode():
        for r in range(2):
            for i, prompt in enumerate(prompts):
                shift = (i + r) % len(names)
                outs = {}
                for kernels, mode in names[shift:] + names[:shift]:
                    base, engine = systems[kernels]
                    out = (base.generate([prompt], max_new_tokens=256) if mode == "base"
                           else engine.generate([prompt], max_new_tokens=256, mode="verify"))
                    outs[kernels, mode] = out.tokens
                    spent[kernels, mode] += out.stats.decode_s
                    tokens[kernels, mode] += out.stats.generated_tokens - 1
                same["verify = its base (native)"] += outs["native", "verify"] == outs["native", "base"]
                same["verify = its base (torch)"] += outs["torch", "verify"] == outs["torch", "base"]
                same["native base = torch base"] += outs["native", "base"] == outs["torch", "base"]
                print(f"round {r + 1} prompt {i + 1}/{len(prompts)} done", flush=True)
    runs = 2 * len(prompts)
    print(f"\n{scheme}, batch 1, {len(prompts)} prompts x 2 rounds, 256 new tokens "
          f"({time.perf_counter() - started:.0f} s in all)\n")
    print("| kernels | mode | tok/s | x PyTorch's |")
    print("| --- | --- | ---: | ---: |")
    for kernels, mode in names:
        rate = tokens[kernels, mode] / spent[kernels, mode]
        ref = tokens["torch", mode] / spent["torch", mode]
        print(f"| {kernels} | {mode} | {rate:.1f} | {rate / ref:.2f}x |")
    print()
    for what, count in same.items():
        print(f"{what}: {count}/{runs} replies the same text")


if __name__ == "__main__":
    main()
