"""Verify mode against the base in the same engine, interleaved prompt by prompt: a fair ratio on a noisy machine.

A shared machine has slow spells (seen here: the same base at 23 and at 29 tokens/s within minutes).
`hamburger bench` interleaves its systems run by run (a run: every prompt, ~40 s here); this interleaves
finer, prompt by prompt: it decodes each of the bench's prompts with the base and then with each verify
variant, rotating which goes first, `--rounds` times, and reports each system's summed decode time, its ratio
to the base per round (median and spread) and tokens per base forward (per row). Greedy, batch 1 (or
`--batch-size B`: batches of B prompts take the turns). Every variant must give the base's tokens (verify mode
is lossless), or the script stops; except with `--quantize int8|int4` (or any scheme with +bf16, whose passes of 8 or
more rows compute in bfloat16), whose bfloat16 activations round each
projection's input, so the last-bit differences between the base's one-position and multi-position passes
(attention) can flip a near-tie: there the table counts the replies equal to the base's instead.

Variants (`--variants`, a comma list): `micro` (drafts from the micro-step decoder only: lookup 0), `lookup`
(drafts by lookup only: the micro-step decoder never runs, confidence 1.0), `both` (lookup drafts where a row's
last tokens occurred before, micro-step drafts elsewhere), `every` (`both` drafting at every step: the draft
policy off); `--lookup N` is the shortest n-gram that lookup matches.

    python benchmarks/verify_ab.py default --quantize fp16 --variants micro,lookup,both --lookup 2    # ~15 min
    python benchmarks/verify_ab.py default --quantize fp16 --variants micro,lookup --batch-size 16 --rounds 2

`--module-layers` adds each system
again with the decoder layers run module by module (`Engine(native_layers=False)`: no native call).

    python benchmarks/verify_ab.py default --quantize fp16 --variants both --module-layers --max-new-tokens 256

`--against CKPT` adds each variant again with another checkpoint's modules on the same base (e.g. a retrained
drafter beside the shipped one), interleaved with the rest:
    python benchmarks/verify_ab.py --quantize int4/int8 --variants micro,both --against runs/drafter-v4/export
`--batched-step` adds each system again with a lone request stepped by the batched step (`Engine(alone=False)`),
not on host integers (`solo.py`):

    python benchmarks/verify_ab.py --quantize int4/int8 --variants both --batched-step --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hamburger.evaluation.bench_systems import SETS, bench_messages
from hamburger.inference.engine import Engine
from hamburger.kernels.quantize import DEFAULT_SKIP, quantize_model
from hamburger.loading import split_wide
from hamburger.model.base import encode_chat, fingerprint
from hamburger.model.config import parse_draft_rows
from hamburger.model.hamburger_model import HamburgerModel, load_model

VARIANTS = ("micro", "lookup", "both", "every")
AGAINST = ", against"  # the systems of --against's checkpoint


def _loaded(ref: str, quantize: str) -> tuple[HamburgerModel, str]:
    """The checkpoint, quantized as asked, and its base's fingerprint as loaded (before quantizing)."""
    model, _ = load_model(ref)
    model.eval()
    base = fingerprint(model.base)
    if quantize != "none":
        scheme, wide = split_wide(quantize)
        scheme, _, head = scheme.partition("/")
        quantize_model(model, scheme, head=head or None, skip=DEFAULT_SKIP, wide=wide)
    return model, base


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", default="default")
    p.add_argument("--quantize", default="none", choices=["none", "fp16", "int8", "int4", "fp16+bf16", "int8+bf16",
                                                          "int4+bf16", "int4/int8"],
                   help="int4/int8: the embedded default's own GGUF blocks (what --quantize auto gives it)")
    p.add_argument("--confidence", type=float, default=None, help="verify confidence (default: the checkpoint's)")
    p.add_argument("--variants", default="micro", help=f"comma list from {', '.join(VARIANTS)}")
    p.add_argument("--lookup", type=int, default=2, help="shortest n-gram lookup drafts match (lookup, both)")
    p.add_argument("--sets", default=",".join(SETS), help=f"prompt sets, from {', '.join(SETS)}")
    p.add_argument("--prompts-per-set", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--draft-rows", type=parse_draft_rows, default="auto", metavar="N",
                   help="the variants' engines draft only in batches of at most N rows ('all': always; default auto)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="decode the prompts in batches of this many (cycled to fill the last), a batch per turn")
    p.add_argument("--module-layers", action="store_true",
                   help="also every system with the decoder layers module by module (Engine(native_layers=False))")
    p.add_argument("--batched-step", action="store_true",
                   help="also every system with a lone request on the batched step (Engine(alone=False))")
    p.add_argument("--against", metavar="MODEL",
                   help=f"also every variant with this checkpoint's modules (the same base), as \"{AGAINST[2:]}\"")
    a = p.parse_args()
    if a.batch_size < 1:
        raise SystemExit("--batch-size must be >= 1")
    variants = [v.strip() for v in a.variants.split(",")]
    if not variants or any(v not in VARIANTS for v in variants):
        raise SystemExit(f"--variants: a comma list from {', '.join(VARIANTS)}, got {a.variants!r}")
    model, base = _loaded(a.model, a.quantize)
    other = None
    if a.against:
        other, other_base = _loaded(a.against, a.quantize)
        if other_base != base:
            raise SystemExit(f"--against {a.against}: its base is not {a.model}'s (the same base is compared)")
    plain = HamburgerModel.plain(model.base, model.tokenizer)
    conf = a.confidence if a.confidence is not None else model.config.verify_confidence
    settings = {"micro": (0, conf), "lookup": (a.lookup, 1.0), "both": (a.lookup, conf), "every": (a.lookup, conf)}
    kinds = {"": {}}  # Engine's settings
    if a.module_layers:
        kinds[", module layers"] = {"native_layers": False}
    if a.batched_step:
        kinds[", batched step"] = {"alone": False}
    bases = {c: Engine(plain, **kw) for c, kw in kinds.items()}
    engines = {(v, c): Engine(model, lookup=settings[v][0], draft_rows=a.draft_rows, **kw,
                              **({"draft_policy": False} if v == "every" else {}))
               for v in variants for c, kw in kinds.items()}
    if other is not None:
        other_conf = a.confidence if a.confidence is not None else other.config.verify_confidence
        for v in variants:
            engines[v, AGAINST] = Engine(other, lookup=settings[v][0], draft_rows=a.draft_rows,
                                         **({"draft_policy": False} if v == "every" else {}))
    sets = [s.strip() for s in a.sets.split(",")]
    prompts = [encode_chat(model.tokenizer, m) for s in sets for m in bench_messages(s, a.prompts_per_set)]
    b = a.batch_size
    cycled = [prompts[i % len(prompts)] for i in range(-(-len(prompts) // b) * b)]
    units = [cycled[i : i + b] for i in range(0, len(cycled), b)]  # what one turn decodes
    runs = {}
    for c in kinds:
        runs[f"base{c}"] = lambda batch, c=c: bases[c].generate(batch, max_new_tokens=a.max_new_tokens)
        for v in variants:
            runs[f"verify ({v}{c})"] = (lambda batch, v=v, c=c: engines[v, c].generate(
                batch, max_new_tokens=a.max_new_tokens, mode="verify", confidence=settings[v][1]))
    if other is not None:
        for v in variants:
            runs[f"verify ({v}{AGAINST})"] = (lambda batch, v=v: engines[v, AGAINST].generate(
                batch, max_new_tokens=a.max_new_tokens, mode="verify",
                confidence=1.0 if v == "lookup" else other_conf))
    names = list(runs)
    ratios = {name: [] for name in names[1:]}
    # decode s, tokens after the first, base forwards after the prefill, drafts, drafts kept, lookup drafts, kept
    totals = {name: [0.0, 0, 0, 0, 0, 0, 0] for name in names}
    same = dict.fromkeys(names, 0)  # replies equal to the base's
    with torch.inference_mode():
        for name, fn in runs.items():
            start = time.perf_counter()
            fn([p[:16] for p in units[0]])  # warm up
            print(f"warm-up {name}: {time.perf_counter() - start:.1f} s", flush=True)
        for r in range(a.rounds):
            spent, tokens = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
            for i, batch in enumerate(units):
                shift = (i + r) % len(names)
                outs = {}
                for name in names[shift:] + names[:shift]:
                    out = outs[name] = runs[name](batch)
                    s = out.stats
                    spent[name] += s.decode_s
                    tokens[name] += s.generated_tokens - len(batch)  # the first comes with the prefill
                    t = totals[name]
                    t[2] += s.row_forwards - len(batch)
                    t[3] += s.drafted_tokens
                    t[4] += s.micro_steps
                    t[5] += s.lookup_drafts
                    t[6] += s.lookup_kept
                for name in names[1:]:
                    equal = [x == y for x, y in zip(outs[name].tokens, outs["base"].tokens)]
                    if not all(equal) and a.quantize in ("none", "fp16", "int4/int8"):
                        raise SystemExit(f"{name} differs from the base on batch {i}: not lossless")
                    same[name] += sum(equal)
            for name in names:
                totals[name][0] += spent[name]
                totals[name][1] += tokens[name]
            line = [f"round {r + 1}: base {tokens['base'] / spent['base']:.1f} tok/s"]
            for name in names[1:]:
                ratios[name].append(spent["base"] / spent[name])
                line.append(f"{name} {tokens[name] / spent[name]:.1f} tok/s {ratios[name][-1]:.3f}x")
            print(", ".join(line), flush=True)
    print(f"\n{a.model} ({a.quantize}), verify confidence {conf:g}, lookup n-grams {a.lookup}..3, {len(prompts)} "
          f"prompts ({','.join(sets)}) x {a.rounds} rounds, {a.max_new_tokens} new tokens, batch {b}, draft_rows "
          f"{a.draft_rows}, interleaved{'; ratios to the first base' if len(kinds) > 1 else ''}:\n")
    replies = a.rounds * len(cycled)
    print("| system | decode tok/s | x base (median over rounds, min-max) | tokens / base forward | drafts kept "
          "| of them by lookup (kept / drafted) | replies = base |\n| --- | --- | --- | --- | --- | --- | --- |")
    for name, (s, n, fwd, drafted, kept, looked, looked_kept) in totals.items():
        if name == "base":
            ratio, share, by_lookup = "1.00x", "-", "-"
        else:
            rs = ratios[name]
            ratio = f"**{statistics.median(rs):.2f}x** ({min(rs):.2f}-{max(rs):.2f})"
            share = f"{kept / drafted:.2f}" if drafted else "-"
            by_lookup = f"{looked_kept}/{looked}" if looked else "-"
        equal = "-" if name == "base" else f"{same[name]}/{replies}"
        print(f"| {name} | {n / s:.1f} | {ratio} | {n / max(fwd, 1):.2f} | {share} | {by_lookup} | {equal} |")


if __name__ == "__main__":
    main()
