"""Compress mode at batch 16 against its base: what its drafts cost, and what capping them buys (issue 51, "compress
>= 0.9x at batch 16").

Compress mode always drafts (its steps are what the merger makes one KV entry of): each row checks token 0 and up
to K-1 drafts a pass, so a pass over 16 rows computes 16 x (1 + drafts) positions where the base computes 16. On a
CPU where a pass of many rows is bound by its products' instructions, every checked position costs about a row's
time, kept or not. This runs the base and compress mode over the same 16 held-out prompts in one batch, round after
round, and compress again with each row's drafts capped at `--caps` (lookup and micro-step drafts alike: a probe,
set by wrapping the scheduler's `drafts_wanted`; no such option exists for users): decode tokens per second, tokens
per row and pass, drafts made and kept, KV entries per generated token.

    python benchmarks/compress_batch.py --caps 2,1 --rounds 2       # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json

import hamburger.inference.scheduler as scheduler
from hamburger.evaluation.bench_systems import bench_messages
from hamburger.inference.engine import Engine
from hamburger.loading import load
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import HamburgerModel

_wanted = scheduler.drafts_wanted
CAP: list[int | None] = [None]


def capped_wanted(runner, rows, n):
    """The draft policy's (lookup, micro-step) drafts per row, each at most CAP[0] (None: as they are)."""
    wants = _wanted(runner, rows, n)
    return wants if CAP[0] is None else [(min(look, CAP[0]), min(micro, CAP[0])) for look, micro in wants]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--caps", default="2,1", help="draft caps to run compress mode with too (comma-separated)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quantize", default="auto")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    scheduler.drafts_wanted = capped_wanted
    model, _ = load("default", quantize=a.quantize, decode_only=True)
    prompts = [encode_chat(model.tokenizer, m) for s in ("code", "math", "chat")
               for m in bench_messages(s, -(-a.batch_size // 3))][: a.batch_size]
    base, comp = Engine(HamburgerModel.plain(model.base, model.tokenizer)), Engine(model)
    systems = [("base", base, None, None), ("compress", comp, "compress", None)]
    systems += [(f"compress, drafts <= {c}", comp, "compress", int(c)) for c in a.caps.split(",") if c]
    for _, eng, mode, _ in systems[:2]:  # warm-up
        eng.generate(prompts[:2], max_new_tokens=8, mode=mode)
    rows = []
    for rnd in range(a.rounds):
        base_tps = None
        for name, eng, mode, cap in systems:
            CAP[0] = cap
            s = eng.generate(prompts, max_new_tokens=a.max_new_tokens, mode=mode).stats
            tps = (s.generated_tokens - s.sequences) / s.decode_s
            base_tps = base_tps or tps
            row = {"round": rnd + 1, "system": name, "decode_tok_s": round(tps, 1), "x_base": round(tps / base_tps, 3),
                   "tokens_per_row_pass": round(s.generated_tokens / s.row_forwards, 2),
                   "drafted": s.drafted_tokens, "lookup_drafted": s.lookup_drafts, "lookup_kept": s.lookup_kept,
                   "kv_per_token": round((s.kv_entries - s.prompt_tokens) / s.generated_tokens, 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{len(prompts)} prompts in one batch, {a.max_new_tokens} new tokens, weights {a.quantize}\n")
    print("| round | system | decode tok/s | x base | tokens per row and pass | drafted | lookup kept | KV entries per token |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['round']} | {r['system']} | {r['decode_tok_s']} | {r['x_base']:.2f}x | {r['tokens_per_row_pass']} | "
              f"{r['drafted']} | {r['lookup_kept']} / {r['lookup_drafted']} | {r['kv_per_token']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
