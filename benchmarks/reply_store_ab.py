"""Do more stored replies give verify mode more tokens per forward? The shipped reply store against it with more of
the base's replies put before it (`--replies`: distilled JSONL, as `hamburger export --replies` reads it).

One model (the embedded default, int4/int8 as loaded with no flags), two engines that differ only in the stored
replies their lookup drafts fall back to; verify mode drafts at every step (`draft_policy=False`, so the count does
not depend on the machine's timing) over the bench's held-out prompts, greedy, one at a time. Prints tokens per base
forward (the prefill left out) in all and per set, lookup drafts kept, and whether the text is the same (it must be:
drafts never change verify mode's output).

    python benchmarks/reply_store_ab.py --replies runs/gpu-h200-probe/distill.jsonl     # about 3 minutes
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hamburger.evaluation.bench_systems import bench_messages
from hamburger.inference.engine import Engine
from hamburger.loading import load
from hamburger.model.base import encode_chat, eos_ids
from hamburger.training.export import reply_tokens

SETS = ("code", "math", "chat")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replies", action="append", required=True, help="distilled JSONL to add (repeatable)")
    p.add_argument("--prompts-per-set", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=256)
    a = p.parse_args()
    model, _ = load("default", quantize="auto", decode_only=True)
    tok, ids = model.tokenizer, eos_ids(model)
    eos = tok.eos_token_id if tok.eos_token_id in ids else min(ids)
    shipped = model.reply_tokens
    # the added replies first: where both hold an n-gram, the later (shipped) continuation wins (`ReplyStore`)
    more = torch.cat([*(reply_tokens(Path(r), tok, eos) for r in a.replies), shipped])
    prompts = [(s, encode_chat(tok, m)) for s in SETS for m in bench_messages(s, a.prompts_per_set)]
    results = {}
    for name, store in (("shipped", shipped), ("more", more)):
        model.reply_tokens = store  # the runner reads it when the engine is made
        engine = Engine(model, draft_policy=False)
        rows = []
        for s, prompt in prompts:
            out = engine.generate([prompt], max_new_tokens=a.max_new_tokens, mode="verify")
            st = out.stats
            rows.append((s, st.generated_tokens, st.base_forwards - 1, st.lookup_drafts, st.lookup_kept, out.tokens[0]))
        results[name] = (len(store), rows)
    print(f"{len(prompts)} held-out prompts, {a.max_new_tokens} new tokens, verify mode drafting at every step\n")
    print("| reply store | tokens | tokens per forward | " + " | ".join(SETS) + " | lookup drafts kept |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in SETS) + " | ---: |")
    for name, (size, rows) in results.items():
        per = {s: sum(r[1] for r in rows if r[0] == s) / sum(r[2] for r in rows if r[0] == s) for s in SETS}
        print(f"| {name} | {size:,} | {sum(r[1] for r in rows) / sum(r[2] for r in rows):.3f} | "
              + " | ".join(f"{per[s]:.2f}" for s in SETS)
              + f" | {sum(r[4] for r in rows)} of {sum(r[3] for r in rows)} |")
    same = all(x[5] == y[5] for x, y in zip(results["shipped"][1], results["more"][1]))
    print(f"\nthe same text with both stores: {same}")
    if not same:
        raise SystemExit("verify mode's text changed with the drafts: a bug")


if __name__ == "__main__":
    main()
