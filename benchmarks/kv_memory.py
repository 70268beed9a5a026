"""KV memory as capacity: how long a reply a row of N KV entries holds in each mode, and what that makes of a fixed
KV memory (issue 37).

Every mode runs the same prompts (the bench's held-out code, math and chat sets) in rows of the same size: the
longest prompt + each of `--reply-entries` entries. Requests ask for far more tokens than a row holds and are
admitted regardless (an admission estimate of no entries), so each reply runs until EOS or until its row's entries
are used up (finish reason "length"); with `--ignore-eos` (vLLM's, as capacity benchmarks use) only the row's
entries end it. Verify mode keeps one entry per token: its output is the base's, and so is its KV use. Compress and
trust mode keep one entry per step (compress: after its exact window of recent tokens).

Printed per row size and mode: tokens per reply (mean, and over the replies that filled their row: the longest reply
the row holds), KV entries per generated token, tokens per row against verify's (the same memory), base-NLL per
token against the base's own reply of the same length (like for like: the base's reply to each prompt, cut to the
mode's reply length), decode tokens/s of the batch; then, at a fixed KV memory `--kv-memory`, how many rows of a
reply of `--reply-tokens` tokens each mode holds (rows sized by its measured entries per token).

    python benchmarks/kv_memory.py --reply-entries 96,256 --prompts-per-set 3 --max-new-tokens 1024 --ignore-eos
"""

from __future__ import annotations

import argparse
import time

import torch

import hamburger
from hamburger.evaluation.bench_systems import bench_messages, entry_bytes
from hamburger.evaluation.tasks import base_nll
from hamburger.inference.admission import EntriesEstimate
from hamburger.inference.scheduler import Scheduler
from hamburger.model.base import encode_chat
from hamburger.model.config import MODES


def run_mode(model, prompts: list[list[int]], mode: str, max_len: int, max_new: int, ignore_eos: bool) -> dict:
    sched = Scheduler(model, max_batch_size=len(prompts), max_len=max_len, interleave_prefill=False)
    sched.entries = EntriesEstimate(0, dict.fromkeys(MODES, 1e-3))  # every request admitted, however long
    ids = [sched.submit(p, max_new, mode=mode, eos_token_ids=set() if ignore_eos else None) for p in prompts]
    tokens = {i: [] for i in ids}
    reasons, stats = {}, {}
    start = time.perf_counter()
    first = None
    while sched.has_work():
        for event in sched.step():
            tokens[event.id] += event.tokens
            stats[event.id] = event.stats
            if event.finished:
                reasons[event.id] = event.finish_reason
        first = first or time.perf_counter()
    wall = time.perf_counter() - (first or start)
    out = [tokens[i] for i in ids]
    generated = sum(map(len, out))
    entries = sum(stats[i].kv_entries - stats[i].prompt_tokens for i in ids)
    filled = [len(t) for t, i in zip(out, ids) if reasons[i] == "length"]
    return {"mode": mode, "tokens": out, "full": [reasons[i] == "length" for i in ids], "entries": [stats[i].kv_entries - stats[i].prompt_tokens for i in ids],
            "per_reply": generated / len(ids), "filled": len(filled),
            "per_filled": sum(filled) / len(filled) if filled else float("nan"),
            "entries_per_token": entries / generated, "tok_s": (generated - len(ids)) / wall}


def nll_like_for_like(model, prompts: list[list[int]], out: list[list[int]], ref: list[list[int]]) -> float:
    """Base-NLL per token of `out` over the base's own per-token NLL of `ref`, each reply cut to the shorter of the
    two, so both are scored over the same positions."""
    cut = [min(len(o), len(r)) for o, r in zip(out, ref)]
    mine, n = base_nll(model.base, prompts, [o[:c] for o, c in zip(out, cut)], batch_size=4)
    base, m = base_nll(model.base, prompts, [r[:c] for r, c in zip(ref, cut)], batch_size=4)
    return (mine / n) / (base / m)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reply-entries", default="96", help="comma list: a row's entries beyond the longest prompt")
    p.add_argument("--prompts-per-set", type=int, default=3)
    p.add_argument("--sets", default="code,math,chat")
    p.add_argument("--max-new-tokens", type=int, default=512, help="asked of every request (more than a row holds)")
    p.add_argument("--ignore-eos", action="store_true", help="replies go on past EOS: only the row's entries end them")
    p.add_argument("--modes", default="verify,compress,trust")
    p.add_argument("--merge-window", type=int, default=None, help="compress mode's exact window (default: the model's)")
    p.add_argument("--model", default="default", help="the checkpoint (default: the shipped one)")
    p.add_argument("--kv-memory", type=float, default=256e6, help="bytes of base KV cache for the rows table")
    p.add_argument("--reply-tokens", type=int, default=256, help="the reply each request of the rows table asks for")
    args = p.parse_args()
    torch.manual_seed(0)
    model, _ = hamburger.load(args.model, quiet=False)
    if args.merge_window is not None:
        model.config.merge_window = args.merge_window
    messages = [m for name in args.sets.split(",") for m in bench_messages(name, args.prompts_per_set)]
    prompts = [encode_chat(model.tokenizer, m) for m in messages]
    longest = max(map(len, prompts))
    # The base's own replies (verify mode: exactly the base's), long enough for every mode's: the NLL reference
    ref = run_mode(model, prompts, "verify", longest + args.max_new_tokens, args.max_new_tokens, args.ignore_eos)
    per_entry = entry_bytes(model)
    window = model.config.merge_window or 0
    past = {m: [0, 0] for m in args.modes.split(",")}  # per mode: entries and tokens past the exact window
    for reply_entries in (int(x) for x in args.reply_entries.split(",")):
        max_len = longest + reply_entries
        rows = [run_mode(model, prompts, mode, max_len, args.max_new_tokens, args.ignore_eos)
                for mode in args.modes.split(",")]
        base = next((r for r in rows if r["mode"] == "verify"), rows[0])
        eos = "EOS ignored" if args.ignore_eos else "ending at EOS"
        print(f"\nrows of {max_len} KV entries (the longest prompt, {longest} tokens, + {reply_entries}); "
              f"{len(prompts)} prompts, each asking for {args.max_new_tokens} tokens, {eos}; "
              f"{model.config.max_step_tokens=}, {model.config.merge_window=}")
        print("| mode | tokens per reply | rows filled: tokens each | KV entries / token | tokens per row (x verify) | "
              "x verify, prompts whose rows both filled | base-NLL / token (x the base's, same length) | decode tok/s |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            w = window if r["mode"] == "compress" else 0
            for t, e in zip(r["tokens"], r["entries"]):
                if len(t) > w:
                    past[r["mode"]][0] += e - w
                    past[r["mode"]][1] += len(t) - w
            nll = nll_like_for_like(model, prompts, r["tokens"], ref["tokens"])
            both = [(len(t), len(v)) for t, v, f, g in zip(r["tokens"], base["tokens"], r["full"], base["full"])
                    if f and g]
            paired = f"{sum(t for t, _ in both) / sum(v for _, v in both):.2f}x ({len(both)})" if both else "-"
            print(f"| {r['mode']} | {r['per_reply']:.1f} | {r['filled']}/{len(prompts)}: {r['per_filled']:.1f} | "
                  f"{r['entries_per_token']:.3f} | {r['per_reply'] / base['per_reply']:.2f}x | {paired} | "
                  f"{nll:.3f}x | {r['tok_s']:.1f} |")
    prompt = sum(map(len, prompts)) / len(prompts)
    print(f"\nat {args.kv_memory / 1e6:.0f} MB of KV ({per_entry} bytes an entry), requests of a {prompt:.0f}-token "
          f"prompt and a {args.reply_tokens}-token reply, rows sized by each mode's measured entries per token past "
          f"its exact window (compress: the first {window} tokens one entry each; every run above pooled):")
    print("| mode | entries per token past the window | entries a request | rows held (x verify) |")
    print("| --- | --- | --- | --- |")
    base_rows = None
    for mode, (entries, tokens) in past.items():
        rate = entries / tokens
        w = min(window if mode == "compress" else 0, args.reply_tokens)
        need = prompt + w + rate * (args.reply_tokens - w)
        held = int(args.kv_memory // (need * per_entry))
        base_rows = base_rows or held
        print(f"| {mode} | {rate:.3f} | {need:.0f} | {held} ({held / base_rows:.2f}x) |")

if __name__ == "__main__":
    main()
