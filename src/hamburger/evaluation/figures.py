"""The paper's Figure 3 from `hamburger eval` results: quality against KV compression, one point per confidence.

One panel per task. x: KV compression on generated tokens (= tokens per step: generated tokens per KV entry
they occupy); y: the task's quality (HumanEval pass@1, GSM accuracy) or, for tasks without references,
the base-NLL of the outputs (lower is better). The base model is the dashed reference line.
"""

from __future__ import annotations

from pathlib import Path

from hamburger.errors import HamburgerError


def plot_eval(rows: list[dict], directory: str | Path, title: str = "") -> Path:
    try:
        import matplotlib
    except ImportError as exc:
        raise HamburgerError("--plot needs matplotlib: pip install 'hamburger[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        task_rows = [r for r in rows if r["task"] == task]
        base = next((r for r in task_rows if r["system"] == "base"), None)
        # Verify mode keeps one KV entry per token (no compression) and is exactly the base: the base line shows it.
        points = sorted((r for r in task_rows if r["system"] != "base" and r.get("mode", "trust") == "trust"),
                        key=lambda r: r["confidence"])
        key, label = ("quality", task_rows[0].get("metric") or "quality") if task_rows[0].get("quality") is not None \
            else ("nll", "base-NLL per token (lower is better)")
        xs = [r["tokens_per_step"] for r in points]
        ys = [r[key] for r in points]
        ax.plot(xs, ys, "o-", color="C1", label="HAMburger")
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
