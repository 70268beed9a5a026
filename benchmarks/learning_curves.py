"""Learning curves of `hamburger train` runs side by side: held-out acc@0, acc@1 and CE against the optimizer step,
one line per run, read from each run folder's log.jsonl (the held-out evaluations: lines with "token_acc@0").

    python benchmarks/learning_curves.py runs/ab39-48-frozen runs/ab39-48-full --out docs/figures/ab39_learning_curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curve(run: Path) -> list[dict]:
    """The run's held-out evaluations, by step."""
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if "token_acc@0" in r and "step" in r), key=lambda r: r["step"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run folders (each with log.jsonl)")
    p.add_argument("--out", type=Path, required=True, help="the figure (.png)")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("token_acc@0", "held-out acc@0"), ("token_acc@1", "held-out acc@1"), ("ce_loss", "held-out CE"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for run in args.runs:
        points = curve(run)
        if not points:
            raise SystemExit(f"{run}: no held-out evaluations in log.jsonl")
        for ax, (key, _) in zip(axes, panels):
            ax.plot([r["step"] for r in points], [r[key] for r in points], "o-", label=run.name)
        print(run.name, " ".join(f"{r['step']}:{r['token_acc@0']:.4f}/{r['ce_loss']:.4f}" for r in points))
    for ax, (_, label) in zip(axes, panels):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
