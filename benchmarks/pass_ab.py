"""A base pass of 1..4 positions, in one-position passes, for several weights schemes interleaved in one process.

`verify_costs.py` measures one scheme a process; on a machine whose speed moves between runs (the AMD EPYC of
RESULTS.md section 13 read a 4-position pass of the same default as 1.27x and 1.46x one an hour apart) two such runs
do not compare. This loads the default once per scheme (`quantize_loaded`: SCHEME/HEAD, +a8, as --quantize) and
times each scheme's passes in turn, the order alternating, `--rounds` rounds; prints each scheme's medians and
every round's 4-position figure.

    python benchmarks/pass_ab.py --schemes int4/int8,int4/int8+a8 --rounds 6      # about a minute on 2 cores
"""

from __future__ import annotations

import argparse

import torch
from tree_drafts import pass_costs

from hamburger.inference.engine import Engine
from hamburger.loading import quantize_loaded
from hamburger.model.hamburger_model import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schemes", default="int4/int8,int4/int8+a8")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=10, help="passes timed per width, scheme and round")
    a = p.parse_args()
    engines = {}
    for spec in [s.strip() for s in a.schemes.split(",") if s.strip()]:
        model, _ = load_model("default")
        model.eval()
        quantize_loaded(model, spec, quiet=True)
        engines[spec] = Engine(model)
    rounds: dict[str, list[list[float]]] = {s: [] for s in engines}
    with torch.inference_mode():
        for r in range(a.rounds):
            order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]
            for spec, engine in order:
                rounds[spec].append(pass_costs(engine.runner, reps=a.reps, positions=4))
    print(f"a base pass of 1 / 2 / 3 / 4 positions in one-position passes, medians of {a.rounds} interleaved rounds:\n")
    print("| weights | 1 / 2 / 3 / 4 positions | 4 positions, each round |\n| --- | --- | --- |")
    for spec, rows in rounds.items():
        med = [sorted(row[i] for row in rows)[len(rows) // 2] for i in range(4)]
        print(f"| {spec} | {' / '.join(f'{v:.3f}' for v in med)} | {' '.join(f'{row[3]:.3f}' for row in rows)} |")


if __name__ == "__main__":
    main()
