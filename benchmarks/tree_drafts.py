"""Would draft trees pay on this machine? A cheap measurement before building them (issue 51, item 2).

Verify mode checks one chain of drafts a step: lookup's (the prompt, the reply, the stored replies) where the row's
last tokens occurred before, else the micro-step decoder's. A tree would check several candidate continuations in
one pass and keep the longest the base agrees with. Whether that pays depends on two measured things: how many
more tokens a step keeps with the extra branches, and what each extra checked position costs
(`benchmarks/verify_costs.py`).

This decodes the bench's held-out prompts once in verify mode with every draft thrown away before the check, so
every step is one base position and the micro-step decoder drafts at every position of the base's own reply,
exactly as it would on arriving there (a check pass's positions equal one-position steps bit for bit); it records
its chain and, at the first micro-step, its second choice. Lookup candidates are computed on the host from the
prompt, the reply so far and the checkpoint's stored replies. Then each strategy walks the reply: at each step it
checks its candidates against the base's next tokens, keeps the longest agreeing path and moves on past it.

Strategies (`STRATEGIES`; no draft policy in any: every step drafts what it has, lookup at most `--lookup-len`
tokens): the shipped order (lookup where it matches, else the micro-step chain), the micro-step chain alone, both
chains, each with and without the micro-step decoder's second choice as another first token (one more position),
and up to 3 distinct lookup continuations (every earlier occurrence, then the store).

Each is priced with this machine's costs: a pass of w positions as `verify_costs.py` measures (1 .. 4 positions,
extrapolated by its last step past 4), plus the micro-step calls of the steps that run them. Predicted speed is
tokens per forward over the mean cost of a step, in one-position base steps (Python not counted).

    python benchmarks/tree_drafts.py --prompts-per-set 3 --max-new-tokens 256      # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import hamburger.inference.verify as verify
from hamburger.evaluation.bench_systems import bench_messages
from hamburger.inference.engine import Engine
from hamburger.inference.lookup import reply_store
from hamburger.loading import load
from hamburger.model.base import encode_chat
from hamburger.model.config import LOOKUP_DRAFTS, LOOKUP_MAX_NGRAM


def pass_costs(runner, reps: int = 30, positions: int = 8) -> list[float]:
    """A base pass of 1..positions positions at 256 cached entries, in one-position passes (medians, interleaved)."""
    from hamburger.inference.kv import KVCache

    model = runner.model
    d = model.base.config.hidden_size
    cache = KVCache.for_layers(runner.base.layers, runner.base.config, 1, 512, runner.kv_dtype, "cpu")
    times: dict[int, list[float]] = {w: [] for w in range(1, positions + 1)}
    for _ in range(reps):
        for w in times:
            x = torch.randn(1, w, d)
            pos = torch.arange(256, 256 + w)[None]
            mask = torch.ones(1, 1, w, 256 + w, dtype=torch.bool)
            mask[..., 256:] = torch.ones(w, w, dtype=torch.bool).tril()
            t = time.perf_counter()
            out = runner.base_pass(x, pos, cache, 256, mask, last=False)
            runner.head_argmax(out[0])
            times[w].append(time.perf_counter() - t)
    med = {w: sorted(v)[len(v) // 2] for w, v in times.items()}
    return [med[w] / med[1] for w in range(1, positions + 1)]


def record(engine: Engine, prompt: list[int], max_new: int) -> tuple[list[int], list[dict]]:
    """The base's reply (verify mode with every draft dropped) and, per reply position, the micro-step chain and
    the first micro-step's second choice."""
    runner = engine.runner
    steps: list[dict] = []
    picks: list[tuple[int, int]] = []
    head_argmax = runner.head_argmax

    def argmax(h, shortlist=False):
        tok = head_argmax(h, shortlist)
        if shortlist:
            logits = runner.short_logits(h.reshape(-1, h.shape[-1]))[0]
            top = logits.topk(2).indices
            second = top[1] if runner.vocab[top[0]] == tok.reshape(-1)[0] else top[0]
            picks.append((int(tok.reshape(-1)[0]), int(runner.vocab[second])))
        return tok

    check = verify.check

    def dropped(runner_, rows, n):
        nd = int(rows.n_drafts[0])
        steps.append({"chain": rows.step_tok[0, 1 : 1 + nd].tolist(), "alt": picks[0][1] if picks else None})
        picks.clear()
        rows.n_drafts[:n] = 0
        return check(runner_, rows, n)

    runner.head_argmax, verify.check = argmax, dropped
    try:
        out = engine.generate([prompt], max_new_tokens=max_new, mode="verify")
    finally:
        runner.head_argmax, verify.check = head_argmax, check
    return out.tokens[0], steps


def lookup_candidates(history: list[int], store, limit: int, most: int) -> list[list[int]]:
    """Up to `most` distinct continuations of the history's longest matching suffix: own occurrences, latest first,
    then the store's (the shipped lookup gives the first)."""
    found: list[list[int]] = []
    for n in range(LOOKUP_MAX_NGRAM, 1, -1):
        if len(history) <= n:
            continue
        key = history[-n:]
        for j in range(len(history) - n - 1, -1, -1):
            if history[j : j + n] == key:
                cont = history[j + n : j + n + limit]
                if cont and cont not in found:
                    found.append(cont)
                if len(found) >= most:
                    return found
        if found:
            return found
    if store is not None:
        cont = store.draft(history[-store.max :], limit)
        if cont:
            found.append(cont)
    return found


def kept(candidates: list[list[int]], truth: list[int]) -> int:
    best = 0
    for c in candidates:
        j = 0
        while j < len(c) and j < len(truth) and c[j] == truth[j]:
            j += 1
        best = max(best, j)
    return best


def nodes(candidates: list[list[int]]) -> int:
    """Positions a tree of these chains checks (shared prefixes once), token 0 not counted."""
    return len({tuple(c[: j + 1]) for c in candidates for j in range(len(c))})


# strategy: (lookup continuations at most (0: none), micro-step chain: "never" / "else" (where lookup has none) /
# "always", the micro-step decoder's second first token as a branch)
STRATEGIES = {
    "chain (shipped order)": (1, "else", False),
    "chain, +second choice": (1, "else", True),
    "micro-step only": (0, "always", False),
    "micro-step, +second choice": (0, "always", True),
    "lookup and micro-step": (1, "always", False),
    "lookup and micro-step, +second choice": (1, "always", True),
    "3 lookups, else micro-step": (3, "else", False),
}


def walk(strategy: str, prompt: list[int], reply: list[int], steps: list[dict], store, cost, micro,
         lookup_len: int) -> dict:
    most_look, use_micro, use_alt = STRATEGIES[strategy]
    p = fwd = 0
    total_cost = 0.0
    widths = []
    while p < len(reply):
        history = prompt + reply[: p + 1]  # token 0 of this step is reply[p]
        truth = reply[p + 1 :]
        step = steps[p] if p < len(steps) else {"chain": [], "alt": None}
        chain, alt = step["chain"], step["alt"]
        look = lookup_candidates(history, store, lookup_len, most_look) if most_look else []
        micro_on = use_micro == "always" or (use_micro == "else" and not look)
        cands = look + ([chain] if micro_on else []) + ([[alt]] if micro_on and use_alt and alt is not None else [])
        cands = [c for c in cands if c]
        micro_calls = len(chain) if micro_on else 0
        w = 1 + nodes(cands)
        widths.append(w)
        k = kept(cands, truth)
        fwd += 1
        total_cost += cost(w) + (micro[0] + micro[1] * (micro_calls - 1) if micro_calls else 0.0)
        p += 1 + k
    return {"forwards": fwd, "tokens": len(reply), "cost": total_cost, "width": sum(widths) / len(widths)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sets", default="code,math,chat")
    p.add_argument("--prompts-per-set", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--micro-costs", default="0.247,0.093", help="first,later micro-step in base passes "
                   "(benchmarks/verify_costs.py)")
    p.add_argument("--pass-costs", help="a pass of 1, 2, .. positions in one-position passes, comma-separated "
                   "(default: measured here first)")
    p.add_argument("--lookup-len", type=int, default=3, help="tokens a lookup draft takes at most (the engine: up "
                   f"to {LOOKUP_DRAFTS}, as many as its draft policy finds worth their positions)")
    p.add_argument("--json")
    a = p.parse_args()
    torch.manual_seed(0)
    model, _ = load("default", quantize="auto", decode_only=True)
    engine = Engine(model, lookup=0, draft_policy=False)  # micro-step drafts at every step; lookup on the host
    store = reply_store(model.reply_tokens)
    micro = tuple(float(x) for x in a.micro_costs.split(","))
    if a.pass_costs:
        rel = [float(x) for x in a.pass_costs.split(",")]
    else:
        with torch.inference_mode():
            rel = pass_costs(engine.runner)
    cost = (lambda w: rel[w - 1] if w <= len(rel) else rel[-1] + (w - len(rel)) * (rel[-1] - rel[-2]))
    print(f"a pass of 1..{len(rel)} positions, in one-position passes:", " / ".join(f"{c:.3f}" for c in rel))
    strategies = tuple(STRATEGIES)
    totals = {s: {"forwards": 0, "tokens": 0, "cost": 0.0, "width": 0.0, "n": 0} for s in strategies}
    per_set: dict[str, dict] = {}
    with torch.inference_mode():
        for name in a.sets.split(","):
            for messages in bench_messages(name, a.prompts_per_set):
                prompt = encode_chat(model.tokenizer, messages)
                reply, steps = record(engine, prompt, a.max_new_tokens)
                for s in strategies:
                    r = walk(s, prompt, reply, steps, store, cost, micro, a.lookup_len)
                    for key in ("forwards", "tokens", "cost"):
                        totals[s][key] += r[key]
                        per_set.setdefault(name, {}).setdefault(s, {"forwards": 0, "tokens": 0})
                        if key != "cost":
                            per_set[name][s][key] += r[key]
                    totals[s]["width"] += r["width"] * r["forwards"]
    print(f"\n{a.prompts_per_set} prompts of each of {a.sets}, {a.max_new_tokens} new tokens, the default (int4/int8):\n")
    print("| strategy | tokens per forward | " + " | ".join(a.sets.split(",")) + " | mean positions a pass | "
          "cost per step (base passes) | predicted speed x base |")
    print("| --- | ---: | " + " | ".join("---:" for _ in a.sets.split(",")) + " | ---: | ---: | ---: |")
    out = {}
    for s, t in totals.items():
        tpf = t["tokens"] / t["forwards"]
        step_cost = t["cost"] / t["forwards"]
        sets = " | ".join(f"{per_set[n][s]['tokens'] / per_set[n][s]['forwards']:.2f}" for n in a.sets.split(","))
        print(f"| {s} | {tpf:.2f} | {sets} | {t['width'] / t['forwards']:.2f} | {step_cost:.3f} | "
              f"{tpf / step_cost:.2f}x |")
        out[s] = {"tokens_per_forward": tpf, "cost_per_step": step_cost, "predicted_x_base": tpf / step_cost}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"pass_costs": rel, "micro_costs": micro, "strategies": out}, f, indent=1)


if __name__ == "__main__":
    main()
