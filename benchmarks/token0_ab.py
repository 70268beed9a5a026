"""Verify mode's token 0 from its check pass's logits against a head of its own each step, beside the base.

After a check pass the base's token after the kept drafts is known from the pass's own logits; the macro-step used
to compute the LM head again for it (one more read of the head's weights a step). This decodes the bench's prompts
(2 a set, 256 new tokens, batch 1) with the base, with verify mode as it was (emulated: the check pass's token 0
discarded, so the macro-step computes the head) and as it is, interleaved prompt by prompt over 2 rounds, and with
fp16 weights stops if any reply differs from the base's.

    python benchmarks/token0_ab.py fp16      # 4 min on 2 cores
    python benchmarks/token0_ab.py int4
"""

from __future__ import annotations

import sys

import torch

import hamburger.inference.verify as cr
from hamburger.evaluation.bench_systems import SETS, bench_messages
from hamburger.inference.engine import Engine
from hamburger.kernels.quantize import DEFAULT_SKIP, quantize_model
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import HamburgerModel, load_model

BEFORE, AFTER = "head per step (before)", "token 0 from the check pass"
accept = cr.accept


def accept_as_before(runner, rows, n, which, final, width):
    """The acceptance as before: greedy rows' token 0 not kept, so the macro-step computes the head for it."""
    at = accept(runner, rows, n, which, final, width)
    rows.next_t0[which] = -1  # the checked rows (every request here is greedy)
    return at


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in ("fp16", "int8", "int4"):
        raise SystemExit("usage: python benchmarks/token0_ab.py fp16|int8|int4")
    scheme = sys.argv[1]
    model, _ = load_model("default")
    model.eval()
    quantize_model(model, scheme, skip=DEFAULT_SKIP)
    plain = HamburgerModel.plain(model.base, model.tokenizer)
    prompts = [encode_chat(model.tokenizer, m) for s in SETS for m in bench_messages(s, 2)]
    base, engine = Engine(plain), Engine(model)
    names = ["base", BEFORE, AFTER]
    spent, tokens = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    with torch.inference_mode():
        for r in range(2):
            for i, prompt in enumerate(prompts):
                outs = {}
                for name in names[(i + r) % 3:] + names[:(i + r) % 3]:
                    cr.accept = accept_as_before if name == BEFORE else accept
                    out = (base.generate([prompt], max_new_tokens=256) if name == "base"
                           else engine.generate([prompt], max_new_tokens=256, mode="verify"))
                    outs[name] = out.tokens
                    spent[name] += out.stats.decode_s
                    tokens[name] += out.stats.generated_tokens - 1
                if scheme == "fp16" and not outs[BEFORE] == outs["base"] == outs[AFTER]:
                    raise SystemExit(f"prompt {i}: verify mode's reply is not the base's")
    for name in names:
        print(f"{scheme} {name}: {tokens[name] / spent[name]:.1f} tok/s, {spent['base'] / spent[name]:.3f}x the base")


if __name__ == "__main__":
    main()
