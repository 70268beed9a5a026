"""The engine beside llama.cpp on the default's own GGUF, interleaved prompt by prompt, at batch 1.

`hamburger bench` runs each system over all its prompts before the next; on a machine whose speed drifts by tens of
percent over minutes (this one's llama.cpp read 148 and 203 tok/s in two bench runs an hour apart) the ratios drift
with it. Here every prompt is decoded by every system in turn (the order rotating), over `--rounds` rounds, so a
slow spell falls on all alike. Systems: llama.cpp's plain decoding (the `llama_cpp` bench system: the GGUF, the
same prompt ids, greedy, the machine's threads), and the engine's base and verify mode (the default mode) with
each weights scheme of `--schemes`. Prints decode tok/s (the bench's definition: tokens after the first over the
time after the first) and each against llama.cpp, and whether verify's replies are its base's.

    pip install llama-cpp-python==0.3.36     # not part of `make setup`
    python benchmarks/llama_cpp_ab.py --schemes fp16,int4/fp16,int4     # ~12 min on 2 cores
"""

from __future__ import annotations

import argparse
import time

import torch

from hamburger.evaluation.bench_systems import SETS, bench_messages, outside_system
from hamburger.inference.engine import Engine
from hamburger.inference.reference import eos_ids
from hamburger.inference.stats import GenerationStats
from hamburger.loading import quantize_loaded
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import HamburgerModel, load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default="fp16,int4/fp16,int4", help="comma list of weights schemes (SCHEME/HEAD ok)")
    p.add_argument("--prompts-per-set", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    started = time.perf_counter()
    engines = {}
    for spec in [s.strip() for s in args.schemes.split(",") if s.strip()]:
        model, _ = load_model("default")
        model.eval()
        quantize_loaded(model, spec, quiet=True)  # SCHEME/HEAD, +a8: as the command line's --quantize
        plain = HamburgerModel.plain(model.base, model.tokenizer)
        engines[f"base {spec}"] = (Engine(plain), None)
        engines[f"verify {spec}"] = (Engine(model), "verify")
    model, _ = load_model("default")
    plain = HamburgerModel.plain(model.base, model.tokenizer)
    llama = outside_system("llama_cpp", model, plain)
    eos = eos_ids(plain)
    prompts = [encode_chat(model.tokenizer, m) for s in SETS for m in bench_messages(s, args.prompts_per_set)]
    names = ["llama.cpp", *engines]
    stats = {name: GenerationStats() for name in names}
    same = {name: 0 for name in engines if name.startswith("verify")}
    with torch.inference_mode():
        for r in range(args.rounds):
            for i, prompt in enumerate(prompts):
                shift = (i + r) % len(names)
                replies = {}
                for name in names[shift:] + names[:shift]:
                    if name == "llama.cpp":
                        got = llama([prompt], args.max_new_tokens)
                    else:
                        engine, mode = engines[name]
                        kw = {"mode": mode} if mode else {}
                        out = engine.generate([prompt], max_new_tokens=args.max_new_tokens, eos_token_ids=eos, **kw)
                        got, replies[name] = out.stats, out.tokens[0]
                    total = stats[name]
                    total.generated_tokens += got.generated_tokens
                    total.sequences += got.sequences
                    total.decode_s += got.decode_s
                for name in same:
                    same[name] += replies[name] == replies[name.replace("verify", "base", 1)]
                print(f"round {r + 1} prompt {i + 1}/{len(prompts)} done", flush=True)
    ref = stats["llama.cpp"].decode_tokens_per_s
    print(f"\nbatch 1, {len(prompts)} prompts x {args.rounds} rounds, {args.max_new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads ({time.perf_counter() - started:.0f} s in all)\n")
    print("| system | decode tok/s | x llama.cpp | verify = its base |")
    print("| --- | ---: | ---: | ---: |")
    for name in names:
        rate = stats[name].decode_tokens_per_s
        exact = f"{same[name]}/{len(prompts) * args.rounds}" if name in same else "-"
        print(f"| {name} | {rate:.1f} | {rate / ref:.2f}x | {exact} |")


if __name__ == "__main__":
    main()
