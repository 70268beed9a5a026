"""Long-context tasks for `hamburger eval`, built offline from the documentation that ships with Python (the
standard library's module docstrings): no download, the same inputs on every machine with the same Python.

- `needle`: a haystack of 2-6 k tokens of documentation with one planted sentence, "The secret password is
  <word>.", at a seeded depth; the question at the end asks for the password. Quality: the reply contains it.
- `summary`: a haystack of 2-6 k tokens to summarise. Quality: ROUGE-L F1 of the reply against the base's own
  summary of the same input (the base scores 1.0: the measure is fidelity to the base, not to a reference).
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from functools import cache
from pathlib import Path

from hamburger.training.sources import Prompt

# Haystack sizes in characters: about 2 k, 4 k and 6 k tokens of the default base's tokenizer.
LENGTHS = (8000, 16000, 24000)
ITEMS = 12
WORDS = ("amber", "falcon", "quartz", "meadow", "harbor", "cobalt", "lantern", "orchid", "glacier", "saffron",
         "tundra", "velvet", "juniper", "marble", "cinder", "walnut")
NEEDLE_QUESTION = "What is the secret password mentioned in the text above? Reply with the password only."
SUMMARY_REQUEST = "Summarise the text above in a few sentences."


@cache
def documents(min_chars: int = 600) -> tuple[tuple[str, str], ...]:
    """(module, docstring) of the standard library's modules with a docstring of at least `min_chars`, by name."""
    out = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        if doc and len(doc) >= min_chars:
            out.append((path.stem, doc))
    return tuple(out)


def haystack(chars: int, start: int) -> str:
    """Module documentation from the `start`-th long docstring on, each under its module's name, until `chars`."""
    docs, parts, size, i = documents(), [], 0, start
    while size < chars:
        module, doc = docs[i % len(docs)]
        parts.append(f"Documentation of the Python module `{module}`:\n\n{doc}")
        size += len(parts[-1]) + 2
        i += 1
    return "\n\n".join(parts)[:chars]


def plant(text: str, sentence: str, depth: float) -> str:
    """`sentence` as a paragraph of its own at the paragraph break nearest `depth` (0..1) of `text`."""
    breaks = [m.start() for m in re.finditer(r"\n\n", text)] or [len(text)]
    at = min(breaks, key=lambda b: abs(b - depth * len(text)))
    return f"{text[:at]}\n\n{sentence}{text[at:]}"


def long_items(task: str, count: int = ITEMS, seed: int = 0) -> list[Prompt]:
    """`count` items of `needle` or `summary`, haystack lengths in turn from LENGTHS, seeded."""
    rng = random.Random(f"{task}-{seed}")
    items = []
    for i in range(count):
        text = haystack(LENGTHS[i % len(LENGTHS)], start=7 * i)
        if task == "needle":
            word = rng.choice(WORDS)
            text = plant(text, f"The secret password is {word}.", rng.uniform(0.1, 0.9))
            items.append(Prompt(f"needle-{i}", "python-docs", [{"role": "user", "content": f"{text}\n\n{NEEDLE_QUESTION}"}],
                                answer=word, meta={"chars": len(text)}))
        else:
            items.append(Prompt(f"summary-{i}", "python-docs", [{"role": "user", "content": f"{text}\n\n{SUMMARY_REQUEST}"}],
                                meta={"chars": len(text)}))
    return items


def found(reply: str, word: str | None) -> bool:
    """Whether the reply names the planted word (case and punctuation aside)."""
    return word is not None and word.lower() in re.findall(r"[a-z]+", reply.lower())


def rouge_l(reply: str, reference: str) -> float:
    """ROUGE-L F1 over lower-cased words: the longest common subsequence against both lengths."""
    a, b = re.findall(r"\w+", reply.lower()), re.findall(r"\w+", reference.lower())
    if not a or not b:
        return float(a == b)
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)
