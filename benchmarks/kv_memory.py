"""KV memory as capacity: how long a reply a row of N KV entries holds in each mode, and what that makes of a fixed
KV memory (issue 37).

Every mode runs the same prompts (the bench's held-out code, math and chat sets) in rows of the same size: the
longest prompt + `--reply-entries` entries. Requests ask for far more tokens than a row holds and are admitted
regardless (`entries_per_token` set near zero), so each reply runs until EOS or until its row's entries are used up
(finish reason "length"). Verify mode keeps one entry per token: its output is the base's, and so is its KV use.
Compress and trust mode keep one entry per step.

Printed per mode: tokens per reply (mean), replies that filled their row, KV entries per generated token, tokens
per row against verify's (the same memory), base-NLL per token against verify's (the base's own output), decode
tokens/s of the batch; then, at a fixed KV memory `--kv-memory`, how many rows of a reply of `--reply-tokens`
tokens each mode holds (rows sized by its measured entries per token).

    python benchmarks/kv_memory.py --reply-entries 96 --prompts-per-set 3 --max-new-tokens 512
"""

from __future__ import annotations

import argparse
import time

import torch

import hamburger
from hamburger.evaluation.bench_systems import bench_messages
from hamburger.evaluation.tasks import base_nll
from hamburger.inference.scheduler import Scheduler
from hamburger.inference.stats import kv_bytes_per_entry
from hamburger.model.base import encode_chat
from hamburger.model.config import MODES


def run_mode(model, prompts: list[list[int]], mode: str, max_len: int, max_new: int) -> dict:
    sched = Scheduler(model, max_batch_size=len(prompts), max_len=max_len, interleave_prefill=False,
                      entries_per_token=dict.fromkeys(MODES, 1e-3))
    ids = [sched.submit(p, max_new, mode=mode) for p in prompts]
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
    nll_sum, nll_count = base_nll(model.base, prompts, out, batch_size=4)
    return {"mode": mode, "tokens": out, "per_reply": generated / len(ids),
            "filled": sum(reasons[i] == "length" for i in ids), "entries_per_token": entries / generated,
            "nll": nll_sum / nll_count, "tok_s": (generated - len(ids)) / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reply-entries", type=int, default=96, help="a row's entries beyond the longest prompt")
    p.add_argument("--prompts-per-set", type=int, default=3)
    p.add_argument("--sets", default="code,math,chat")
    p.add_argument("--max-new-tokens", type=int, default=512, help="asked of every request (more than a row holds)")
    p.add_argument("--modes", default="verify,compress,trust")
    p.add_argument("--kv-memory", type=float, default=256e6, help="bytes of base KV cache for the rows table")
    p.add_argument("--reply-tokens", type=int, default=256, help="the reply each request of the rows table asks for")
    args = p.parse_args()
    torch.manual_seed(0)
    model, _ = hamburger.load(quiet=False)
    messages = [m for name in args.sets.split(",") for m in bench_messages(name, args.prompts_per_set)]
    prompts = [encode_chat(model.tokenizer, m) for m in messages]
    longest = max(map(len, prompts))
    max_len = longest + args.reply_entries
    rows = [run_mode(model, prompts, mode, max_len, args.max_new_tokens) for mode in args.modes.split(",")]
    ref = next((r for r in rows if r["mode"] == "verify"), rows[0])
    print(f"\nrows of {max_len} KV entries (the longest prompt, {longest} tokens, + {args.reply_entries}); "
          f"{len(prompts)} prompts, each asking for {args.max_new_tokens} tokens; {model.config.max_step_tokens=}")
    print("| mode | tokens per reply | rows filled | KV entries / token | tokens per row (x verify) | "
          "base-NLL / token (x verify) | decode tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['per_reply']:.1f} | {r['filled']}/{len(prompts)} | {r['entries_per_token']:.3f} | "
              f"{r['per_reply'] / ref['per_reply']:.2f}x | {r['nll']:.3f} ({r['nll'] / ref['nll']:.3f}x) | "
              f"{r['tok_s']:.1f} |")
    per_entry = kv_bytes_per_entry(model.base.config, next(model.parameters()).dtype)
    prompt = sum(map(len, prompts)) / len(prompts)
    print(f"\nat {args.kv_memory / 1e6:.0f} MB of KV ({per_entry} bytes an entry), requests of a {prompt:.0f}-token "
          f"prompt and a {args.reply_tokens}-token reply, rows sized by each mode's measured entries per token:")
    print("| mode | entries a request | rows held (x verify) |")
    print("| --- | --- | --- |")
    base_rows = None
    for r in rows:
        need = prompt + args.reply_tokens * r["entries_per_token"]
        held = int(args.kv_memory // (need * per_entry))
        base_rows = base_rows or held
        print(f"| {r['mode']} | {need:.0f} | {held} ({held / base_rows:.2f}x) |")


if __name__ == "__main__":
    main()
