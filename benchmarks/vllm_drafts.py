"""HAMburger's drafts inside vLLM beside vLLM's own methods, on the same machine and model.

Each configuration (vLLM plain, vLLM's n-gram method, vLLM's suffix method where it runs, vLLM with HAMburger's
lookup drafts, and with lookup in the prompt and reply else the micro-step decoder's drafts) runs in a fresh process (`python -m hamburger.vllm.offline`) on the same held-out prompts (the first
of each shipped set: code, math, chat), greedy, at batch 1 (prompts one after another) and at a concurrency (all
prompts submitted at once, at most that many decoded together). Reported per run: tokens per second, vLLM's
SpecDecoding metrics (mean acceptance length = 1 + accepted / drafts, and the acceptance rate at each draft
position), tokens per target forward (generated / (generated - accepted): every forward of a request emits one
token of its own plus the drafts it accepted, so this counts the steps without drafts too, which the mean
acceptance length leaves out), and whether every reply's tokens equal vLLM plain's at the same concurrency.

Run it with the Python that has vLLM (`pip install "hamburger[vllm]"`), for example on a shared 2-core machine:

    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind python benchmarks/vllm_drafts.py --per-set 4 --max-tokens 128 \\
        --concurrency 8 --out /tmp/vllm_drafts.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from hamburger.evaluation.bench_prompts import shipped

METHODS = ("none", "ngram", "suffix", "lookup", "micro")
NAMES = {"none": "vLLM plain", "ngram": "vLLM ngram", "suffix": "vLLM suffix", "lookup": "vLLM + HAMburger lookup",
         "micro": "vLLM + HAMburger lookup/micro-step decoder"}


def run_one(prompts, drafts: str, concurrency: int, args) -> dict:
    """One configuration in a process of its own: its result, or {"error": the last line it printed}."""
    spec = {"prompts": prompts, "drafts": drafts, "max_tokens": args.max_tokens, "concurrency": concurrency,
            "num_drafts": args.num_drafts, "model": args.model}
    if drafts == "micro" and args.micro_min_prob:
        spec["settings"] = {"min_prob": args.micro_min_prob}
    cmd = [sys.executable, "-m", "hamburger.vllm.offline", json.dumps(spec)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=dict(os.environ))
    for line in proc.stdout.splitlines():
        if line.startswith("HAMBURGER_RESULT "):
            result = json.loads(line.split(" ", 1)[1])
            result["wall_s"] = time.perf_counter() - start
            return result
    errors = [ln for ln in (proc.stderr + proc.stdout).splitlines() if "Error" in ln or "error" in ln]
    return {"drafts": drafts, "concurrency": concurrency, "error": (errors or ["exit %d" % proc.returncode])[-1][-300:]}


def row(result: dict, plain: dict | None) -> str:
    name = NAMES[result["drafts"]] + (f" (min_prob {result['min_prob']})" if result.get("min_prob") else "")
    if "error" in result:
        return f"| {name} | {result['concurrency']} | does not run: {result['error']} | | | | |"
    spec = result["spec"]
    mal = spec["mean_acceptance_length"]
    same = "—" if plain is None or "error" in plain else (
        f"{sum(a == b for a, b in zip(result['tokens'], plain['tokens']))}/{len(plain['tokens'])}")
    per = " / ".join(f"{r:.2f}" for r in spec["per_position_rate"]) or "—"
    per_forward = result["generated"] / max(result["generated"] - spec["accepted"], 1)
    return (f"| {name} | {result['concurrency']} | {result['tokens_per_s']:.1f} | "
            f"{'—' if mal is None else f'{mal:.2f}'} | {per} | {per_forward:.2f} | {same} |")


HEADER = ("| system | concurrency | tokens/s | mean acceptance length | acceptance per position | tokens per forward "
          "| output = plain |\n| --- | --- | --- | --- | --- | --- | --- |")


def table(results: list[dict]) -> None:
    """The table of saved results (`--out`), plain first at each concurrency."""
    print(HEADER)
    for concurrency in sorted({r["concurrency"] for r in results}):
        runs = [r for r in results if r["concurrency"] == concurrency]
        plain = next((r for r in runs if r["drafts"] == "none"), None)
        for r in runs:
            print(row(r, plain))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-set", type=int, default=4, help="prompts from each shipped held-out set (code, math, chat)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8, help="the loaded run's concurrency (batch 1 runs too)")
    p.add_argument("--num-drafts", type=int, default=4, help="num_speculative_tokens of every drafting method")
    p.add_argument("--methods", default=",".join(METHODS), help=f"a subset of {','.join(METHODS)}")
    p.add_argument("--model", default=None, help="default: the embedded default, converted")
    p.add_argument("--micro-min-prob", type=float, default=0.0,
                   help="the micro-step decoder's drafts end before a token it gives less probability (0: never)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a configuration may take")
    p.add_argument("--out", default=None, help="write every result (tokens included) here as JSON")
    p.add_argument("--table", default=None, metavar="JSON", help="print the table of saved --out files (comma-separated) "
                   "and exit")
    args = p.parse_args()
    if args.table:
        results = []
        for path in args.table.split(","):
            with open(path, encoding="utf-8") as f:
                results += json.load(f)["results"]
        table(results)
        return
    prompts = [m for name in ("code", "math", "chat") for m in shipped(name, args.per_set)]
    methods = [m for m in args.methods.split(",") if m]
    results = []
    print(HEADER)
    for concurrency in (1, args.concurrency):
        plain = None
        for method in methods:
            result = run_one(prompts, method, concurrency, args)
            if method == "micro" and args.micro_min_prob:
                result["min_prob"] = args.micro_min_prob
            results.append(result)
            if method == "none":
                plain = result
            print(row(result, plain), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"prompts": len(prompts), "max_tokens": args.max_tokens, "results": results}, f)


if __name__ == "__main__":
    main()
