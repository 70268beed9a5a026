"""The benchmarks' held-out prompt sets, shipped as data (`bench_prompts.json` beside this file).

Generating them takes minutes on a fresh machine (the math set enumerates each held-out GSM template's constrained
values; template 40 alone takes several) and the code set depends on the Python version's standard library, so
they are generated once, here, and shipped: every machine benchmarks the same prompts and none waits for them.
`python -m hamburger.evaluation.bench_prompts` writes the file anew from the prompt sources (`training.sources`,
held-out splits only, never a training prompt).
"""

from __future__ import annotations

import json
import os
import sys
from functools import cache
from pathlib import Path

from hamburger.errors import HamburgerError

SHIPPED = Path(__file__).with_name("bench_prompts.json")
COUNTS = {"code": 64, "math": 20, "chat": 64}  # the most prompts of each set (the held-out math set has 20)


def generate() -> dict[str, list[list[dict[str, str]]]]:
    """Each set's held-out prompts, in the order the benchmarks take them (the first `count` of a set)."""
    from hamburger.training import sources

    items = {"code": sources.code_prompts("heldout", limit=COUNTS["code"]),
             "math": sources.gsm_prompts("heldout", per_template=1)[: COUNTS["math"]],
             "chat": sources.chat_prompts("heldout")[: COUNTS["chat"]]}
    return {name: [p.messages for p in prompts] for name, prompts in items.items()}


@cache
def _shipped() -> dict[str, list[list[dict[str, str]]]]:
    try:
        return json.loads(SHIPPED.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise HamburgerError(f"{SHIPPED}: the shipped benchmark prompts could not be read ({exc}); reinstall "
                             "hamburger or run `python -m hamburger.evaluation.bench_prompts`") from exc


def shipped(name: str, count: int) -> list[list[dict[str, str]]]:
    """The first `count` prompts of the shipped set `name` (fewer where the set has fewer)."""
    sets = _shipped()
    if name not in sets:
        raise HamburgerError(f"no shipped prompt set {name!r}: choose from {', '.join(sets)}")
    return [list(m) for m in sets[name][:count]]


def main() -> None:
    data = generate()
    tmp = SHIPPED.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    os.replace(tmp, SHIPPED)
    print(f"{SHIPPED}: " + ", ".join(f"{k} {len(v)}" for k, v in data.items()), file=sys.stderr)


if __name__ == "__main__":
    main()
