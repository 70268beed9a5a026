"""The paper's Figure 3 from `hamburger eval` results: quality against KV compression, one point per confidence.

One panel per task. x: KV compression on generated tokens (generated tokens per KV entry they occupy: trust mode's
tokens per step; compress mode's, its exact window included; verify mode's 1.0); y: the task's quality (HumanEval
pass@1, GSM accuracy, a long-context score) or, for tasks without references, the base-NLL of the outputs (lower is
better). Trust mode is a line over its confidences, verify and compress mode a marker per confidence; the base model
is the dashed reference line.
"""

from __future__ import annotations

from pathlib import Path

from hamburger.errors import HamburgerError


def compression(row: dict) -> float:
    """Generated tokens per KV entry they occupy (`stats.GenerationStats`: kv_entries counts the prompt's too)."""
    entries = row["kv_entries"] - row["prompt_tokens"]
    return row["generated_tokens"] / entries if entries else 1.0


def plot_eval(rows: list[dict], directory: str | Path, title: str = "") -> Path:
    try:
        import matplotlib
    except ImportError as exc:
        raise HamburgerError("--plot needs matplotlib: pip install 'hamburger[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hamburger.inference.modes import COMPRESS, TRUST, VERIFY

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        task_rows = [r for r in rows if r["task"] == task]
        base = next((r for r in task_rows if r["system"] == "base"), None)
        key, label = ("quality", task_rows[0].get("metric") or "quality") if task_rows[0].get("quality") is not None \
            else ("nll", "base-NLL per token (lower is better)")
        for mode, style, color in ((TRUST, "o-", "C1"), (COMPRESS, "s", "C2"), (VERIFY, "^", "C3")):
            points = sorted((r for r in task_rows if r["system"] != "base"
                             and r.get("mode", TRUST.name) == mode.name),
                            key=lambda r: r["confidence"])
            if not points:
                continue
            xs, ys = [compression(r) for r in points], [r[key] for r in points]
            ax.plot(xs, ys, style, color=color, label=f"{mode} mode" if mode.checked else "trust mode (HAMburger)")
            for r, x, y in zip(points, xs, ys):
                ax.annotate(f"{r['confidence']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        if base is not None:
            ax.axhline(base[key], color="C0", linestyle="--", label="base model")
        ax.set_xlabel("KV compression (generated tokens per KV entry)")
        ax.set_ylabel(label)
        ax.set_title(f"{task} ({task_rows[0]['items']} items)")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "quality_vs_kv_compression.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
