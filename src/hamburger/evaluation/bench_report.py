"""Output of `hamburger bench`: the table and the figures of a run's rows."""

from __future__ import annotations

import json
from pathlib import Path

from hamburger.errors import HamburgerError
from hamburger.evaluation.bench_costs import reachable_speedup

# --- output -------------------------------------------------------------------------------------------------


def find(rows: list[dict], system: str, batch: int, conf: float | None = None) -> dict | None:
    for row in rows:
        if row["system"] == system and row["batch_size"] == batch and (conf is None or row["confidence"] == conf):
            return row
    return None


def table(result: dict) -> tuple[list[str], list[list[str]]]:
    quantized = any(r.get("quantize", "none") != "none" for r in result["rows"])
    header = ["system", "conf", "batch", "decode tok/s", "× base engine", *(["× float base"] if quantized else []),
              "TTFT s", "tok/step", "tok/forward", "KV entries", "KV/gen token", "KV KB/gen token", "KV MB/request",
              "peak MB", "weights MB",
              "= float"]
    body = []

    def ratio(r: dict, base: dict | None) -> str:
        return f"{r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}×" if base and base["decode_tokens_per_s"] \
            else "-"

    for r in result["rows"]:
        scheme = r.get("quantize", "none")
        if scheme == "gguf":  # llama.cpp on its GGUF: "× base" beside the first scheme's base, which it ran beside
            scheme = (result.get("quantize") or ["none"])[0]
        same = find(result["rows"], "engine_base" + ("" if scheme == "none" else f"+{scheme}"), r["batch_size"])
        float_base = find(result["rows"], "engine_base", r["batch_size"])
        body.append([r["system"], "-" if r["confidence"] is None else f"{r['confidence']:g}", str(r["batch_size"]),
                     f"{r['decode_tokens_per_s']:.1f}", ratio(r, same), *([ratio(r, float_base)] if quantized else []),
                     f"{r['ttft_s']:.3f}", f"{r['tokens_per_step']:.2f}",
                     f"{r['tokens_per_forward']:.2f}" if "tokens_per_forward" in r else "-", str(r["kv_entries"]),
                     f"{r['kv_entries_per_generated_token']:.2f}", *kv_memory_cells(r),
                     f"{r['peak_memory_mb']:.0f}", f"{r['weights_mb']:.0f}" if "weights_mb" in r else "-",
                     f"{r['prefix_vs_float']:.0%}" if "prefix_vs_float" in r else "-"])
    return header, body


def kv_memory_cells(row: dict) -> list[str]:
    """A row's KV cache as memory (`bench.add_kv_memory`): KB per generated token, MB per request; "-" in a row
    saved before they were measured."""
    if "kv_bytes_per_generated_token" not in row:
        return ["-", "-"]
    return [f"{row['kv_bytes_per_generated_token'] / 2**10:.1f}", f"{row['kv_bytes_per_request'] / 2**20:.2f}"]


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    header, body = table(result)
    quantized = [s for s in result.get("quantize", ()) if s != "none"]
    weights = f", weights {', '.join(result['quantize'])}" if quantized else ""
    if "int4" in quantized:
        weights += f" (int4 groups of {result['group_size']})"
    t = Table(title=f"hamburger bench on {result['device']}: {result['max_new_tokens']} new tokens, greedy, "
                    f"median of {result['runs']} runs{weights}")
    for h in header:
        t.add_column(h, justify="left" if h == "system" else "right")
    for row in body:
        t.add_row(*row)
    console = Console(width=200)
    console.print(t)
    console.print("summary: " + json.dumps({k: round(v, 3) for k, v in result["summary"].items()}))
    by_scheme = result.get("step_costs_by_scheme") or ({"none": result["step_costs"]} if result.get("step_costs") else {})
    for scheme, costs in by_scheme.items():
        weights = "" if scheme == "none" else f", weights {scheme}"
        line = (f"cost model (batch 1, {costs['context']} cached slots{weights}): base step "
                f"{costs['base_step_s'] * 1e3:.1f} ms, "
                f"micro-step {costs['micro_step_s'] * 1e3:.1f} ms = {costs['micro_over_base']:.2f} of a base step")
        if "micro_shortlist_over_base" in costs:
            line += (f"; with the {costs['shortlist']}-token shortlist {costs['micro_step_shortlist_s'] * 1e3:.1f} ms = "
                     f"{costs['micro_shortlist_over_base']:.2f}")
        c = costs.get("micro_shortlist_over_base", costs["micro_over_base"])
        line += "; reachable speed-up at 1.5/1.8/2.0/2.5 tokens/step: " + ", ".join(
            f"{reachable_speedup(t, c):.2f}×" for t in (1.5, 1.8, 2.0, 2.5))
        console.print(line)
    if prof := result.get("profile"):
        console.print("profile of one macro-step (2 tokens, batch 1), top ops by self CPU time: " + "; ".join(
            f"{p['op']} {p['self_ms_per_step']:.2f} ms ({p['share']:.0%})" for p in prof))


def plot(result: dict, directory: Path) -> list[Path]:
    """tokens/s by system and batch size; KV entries against output length; the confidence sweep."""
    try:
        import matplotlib
    except ImportError as exc:
        raise HamburgerError("--plot needs matplotlib: pip install 'hamburger[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    rows, conf, paths = result["rows"], result["confidence"], []
    main = [r for r in rows if r["confidence"] in (None, conf)]
    batches = sorted({r["batch_size"] for r in main})
    names = list(dict.fromkeys(r["system"] for r in main))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(batches)
    for j, batch in enumerate(batches):
        values = [(find(main, n, batch) or {}).get("decode_tokens_per_s", 0) for n in names]
        ax.bar([i + j * width for i in range(len(names))], values, width, label=f"batch {batch}")
    ax.set_xticks([i + width * (len(batches) - 1) / 2 for i in range(len(names))], names, rotation=20, ha="right")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Decode speed, {result['max_new_tokens']} new tokens (HAMburger at confidence {conf:g})")
    ax.legend()
    fig.tight_layout()
    paths.append(directory / "tokens_per_s.png")
    fig.savefig(paths[-1], dpi=120)

    curve = result["kv_curve"]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.plot(curve["generated"], curve["base"], label="base: one entry per token")
    ax.plot(curve["generated"], curve["hamburger"], label=f"HAMburger @ {conf:g}: one entry per step")
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("KV entries per layer")
    ax.set_title("KV cache growth")
    ax.legend()
    fig.tight_layout()
    paths.append(directory / "kv_entries.png")
    fig.savefig(paths[-1], dpi=120)

    sweep = sorted((r for r in rows if r["system"] == "hamburger_engine" and r["batch_size"] == 1),
                   key=lambda r: r["confidence"])
    if len(sweep) > 1:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        xs = [r["confidence"] for r in sweep]
        ax.plot(xs, [r["decode_tokens_per_s"] for r in sweep], "o-", color="C0", label="decode tokens/s")
        base = find(rows, "engine_base", 1)
        if base:
            ax.axhline(base["decode_tokens_per_s"], color="C0", linestyle=":", label="base (fast engine)")
        ax.set_xlabel("confidence")
        ax.set_ylabel("decode tokens/s")
        ax2 = ax.twinx()
        ax2.plot(xs, [r["tokens_per_step"] for r in sweep], "s--", color="C1", label="tokens per step")
        ax2.set_ylabel("tokens per step")
        fig.legend(loc="upper right")
        ax.set_title("Confidence sweep (batch 1)")
        fig.tight_layout()
        paths.append(directory / "confidence_sweep.png")
        fig.savefig(paths[-1], dpi=120)
    plt.close("all")
    return paths
