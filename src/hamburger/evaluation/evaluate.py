"""`hamburger eval`: task quality and fidelity of a HAMburger checkpoint beside its own base, offline.

Every task is decoded greedily by the "base" system (the same base weights, one token per step:
exactly the base model's greedy output) and, for a trained checkpoint, by "hamburger@c" for each
confidence c. For each task x system:

- quality: HumanEval pass@1 (the reply's code plus the problem's tests, run in a subprocess with a time
  limit) or GSM answer accuracy (the reply's final number against the reference); none for chat/prompts.
- nll: mean negative log-likelihood per output token under the base (`base_nll`), and its ratio to the
  base row's (the base scoring its own greedy output).
- agreement: mean over items of `token_agreement` with the base's greedy output; identical: the fraction
  of items whose output equals it token for token.
- tokens per step, KV entries, timings: `GenerationStats` (hamburger.inference.stats), summed over batches.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from hamburger.errors import HamburgerError
from hamburger.evaluation.long_context import found, rouge_l
from hamburger.evaluation.tasks import (
    answer_correct,
    base_nll,
    humaneval_program,
    run_humaneval_test,
    token_agreement,
)
from hamburger.inference.stats import GenerationStats
from hamburger.training.sources import Prompt

if TYPE_CHECKING:
    from rich.progress import Progress

    from hamburger.model.hamburger_model import HamburgerModel

TASKS = ("humaneval", "gsm", "chat", "prompts", "needle", "summary")
DEFAULT_TASKS = ("humaneval", "gsm", "chat")
MAX_NEW_TOKENS = {"humaneval": 384, "gsm": 320, "chat": 256, "prompts": 256, "needle": 16, "summary": 192}
QUALITY = {"humaneval": "pass@1", "gsm": "accuracy", "needle": "found", "summary": "ROUGE-L vs base"}
PROGRESS_EVERY_S = 30.0  # stderr not a terminal (a log file): a plain progress line at most this often

# --- running systems --------------------------------------------------------------------------------------


def run_system(model: HamburgerModel, prompts: list[list[int]], max_new_tokens: int, confidence: float,
               batch_size: int, advance: Callable[[int], None] = lambda n: None, engine: str = "auto",
               mode: str = "trust", lookup: int | None = None,
               ) -> tuple[list[list[int]], list[list[int]], GenerationStats]:
    """Greedy tokens and step lengths of every prompt (batches of similar prompt length), and the batches'
    `GenerationStats` summed field by field (counts and seconds add up; the measures derive from the sums).
    `lookup`: verify and compress mode's lookup drafts (`Engine`; None: the checkpoint's)."""
    from hamburger.inference.engine import make_engine

    # Verify mode drafts at every batch size and every step here: eval reports what the drafts give (tokens per base
    # forward), which the engine's speed rules (`draft_rows`: only while few rows decode; the draft policy: only
    # while drafts pay on this machine's timings) would hide or make depend on the machine.
    decoder = make_engine(model, engine, draft_rows=None, lookup=lookup, draft_policy=False)

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # less left padding per batch
    tokens: list[list[int]] = [[] for _ in prompts]
    steps: list[list[int]] = [[] for _ in prompts]
    parts = []
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        out = decoder.generate([prompts[i] for i in chunk], max_new_tokens=max_new_tokens, confidence=confidence,
                               mode=mode)
        for i, toks, st in zip(chunk, out.tokens, out.steps):
            tokens[i], steps[i] = toks, st
        parts.append(out.stats)
        advance(len(chunk))
    stats = GenerationStats(**{f.name: sum(getattr(s, f.name) for s in parts) for f in fields(GenerationStats)})
    return tokens, steps, stats


def score(task: str, items: list[Prompt], texts: list[str], timeout: float,
          advance: Callable[[int], None] = lambda n: None, base_texts: list[str] | None = None,
          ) -> list[float] | None:
    """Per-item scores for tasks with references (HumanEval tests run 2 at a time; the needle's planted word; a
    summary's ROUGE-L against the base's own, `base_texts`), else None."""
    if task == "needle":
        return [float(found(text, item.answer)) for item, text in zip(items, texts)]
    if task == "summary":
        return [rouge_l(text, base) for text, base in zip(texts, base_texts or texts)]
    if task == "humaneval":
        programs = [humaneval_program(item.meta["problem"], text) for item, text in zip(items, texts)]

        def run(program: str) -> bool:
            passed = run_humaneval_test(program, timeout)
            advance(1)
            return passed

        with ThreadPoolExecutor(max_workers=2) as pool:
            return list(pool.map(run, programs))
    if task == "gsm":
        return [answer_correct(text, item.answer) for item, text in zip(items, texts)]
    return None


def _encode(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Chat-templated prompt ids; a tokenizer without a chat template gets the turns' text joined."""
    from hamburger.model.base import encode_chat

    if getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, messages)
    return tokenizer("\n\n".join(m["content"] for m in messages), add_special_tokens=True)["input_ids"]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _progress(progress: Progress, label: str, total: int) -> Callable[[int], None]:
    """The callback that advances a system's progress bar; where stderr is not a terminal (the bars draw only
    there), it also prints `eval: <label>: done/total` at most every PROGRESS_EVERY_S seconds, so a log file
    shows a long run's progress."""
    bar, done, last = progress.add_task(label, total=total), [0], [time.monotonic()]
    plain = not sys.stderr.isatty()

    def step(n: int) -> None:
        progress.advance(bar, n)
        done[0] += n
        if plain and done[0] < total and time.monotonic() - last[0] >= PROGRESS_EVERY_S:
            last[0] = time.monotonic()
            print(f"eval: {label}: {done[0]}/{total}", file=sys.stderr, flush=True)

    return step


def evaluate_task(task: str, items: list[Prompt], model: HamburgerModel, base_system: HamburgerModel,
                  systems: list[tuple[str, float, str]], args: argparse.Namespace, progress: Progress,
                  ) -> tuple[list[dict], list[dict]]:
    """Decode a task with every system (the base first) and score it: one row per system, one record per item."""
    tokenizer = model.tokenizer
    prompts = [_encode(tokenizer, item.messages) for item in items]
    max_new = args.max_new_tokens or MAX_NEW_TOKENS[task]
    rows: list[dict] = []
    per_item: list[dict] = []
    base_tokens: list[list[int]] = []
    base_texts: list[str] = []
    for name, confidence, mode in systems:
        total = len(items) * (2 if task == "humaneval" else 1)
        step = _progress(progress, f"{task} {name}", total)
        system = base_system if name == "base" else model
        tokens, steps, stats = run_system(system, prompts, max_new, confidence, args.batch_size, step,
                                          getattr(args, "engine", "auto"), mode, getattr(args, "lookup", None))
        base_tokens = base_tokens or tokens
        texts = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
        base_texts = base_texts or texts
        correct = score(task, items, texts, args.test_timeout, step, base_texts)
        with model.base_lora(False):  # the untouched base scores every system (a LoRA checkpoint's is switched off)
            nll_sum, nll_count = base_nll(model.base, prompts, tokens, args.batch_size)
        agreement = [token_agreement(t, b) for t, b in zip(tokens, base_tokens)]
        nll = nll_sum / nll_count if nll_count else None
        base_row_nll = rows[0]["nll"] if rows else nll
        rows.append({
            "task": task, "system": name, "mode": mode, "confidence": confidence, "items": len(items),
            "max_new_tokens": max_new,
            "metric": QUALITY.get(task), "quality": _mean(correct) if correct is not None else None,
            "nll": nll, "nll_tokens": nll_count,
            "nll_ratio": nll / base_row_nll if nll is not None and base_row_nll else None,
            "agreement": _mean(agreement), "identical": _mean([t == b for t, b in zip(tokens, base_tokens)]),
            **stats.to_dict(),
        })
        if not sys.stderr.isatty():  # the progress bars draw only on a terminal: one plain line per system for logs
            r = rows[-1]
            print(f"eval: {task} {name}: {len(items)} items, quality {r['quality']}, base-NLL x{r['nll_ratio'] or 0:.3f}, "
                  f"agreement {r['agreement']:.3f}, {r['tokens_per_step']:.2f} tokens/step", file=sys.stderr, flush=True)
        per_item += [{"task": task, "system": name, "id": item.id, "text": text, "tokens": len(toks), "steps": st,
                      "correct": None if correct is None else correct[i], "agreement": agreement[i]}
                     for i, (item, text, toks, st) in enumerate(zip(items, texts, tokens, steps))]
    return rows, per_item


# --- tables and options ------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_cells(rows: list[dict], tasks: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """Header and body of the summary: one line per system, for each task its quality (if any), NLL (x base),
    agreement and tokens per step."""
    header = ["system"]
    for task in tasks:
        header += ([f"{task} {QUALITY[task]}"] if task in QUALITY else []) + [
            f"{task} NLL (×base)", f"{task} agree", f"{task} tok/step"]
    by = {(r["task"], r["system"]): r for r in rows}
    body = []
    for system in dict.fromkeys(r["system"] for r in rows):
        line = [system]
        for task in tasks:
            r = by[(task, system)]
            line += ([_fmt(r["quality"], ".3f")] if task in QUALITY else []) + [
                f"{_fmt(r['nll'], '.3f')} ({_fmt(r['nll_ratio'], '.2f')}×)", _fmt(r["agreement"], ".3f"),
                _fmt(r["tokens_per_step"], ".2f")]
        body.append(line)
    return header, body


def print_table(header: list[str], body: list[list[str]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 40 + 16 * len(header))
    table = Table(title=title, caption="NLL: mean per-token NLL of the output under the base (× the base's own greedy "
                  "output); agree: positional token agreement with the base's greedy output; tok/step: generated "
                  "tokens / macro-steps (verify and compress modes: per base forward)")
    for i, name in enumerate(header):
        table.add_column(name.replace(" ", "\n", 1), justify="left" if i == 0 else "right")
    for line in body:
        table.add_row(*line)
    console.print(table)


def parse_tasks(text: str | None, prompts: str | None) -> list[str]:
    """--tasks as a list; without it the defaults, or only `prompts` when --prompts is given."""
    if text is None:
        return ["prompts"] if prompts else list(DEFAULT_TASKS)
    tasks = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [t for t in tasks if t not in TASKS]
    if not tasks or unknown:
        raise HamburgerError(f"unknown task(s) {unknown or text!r}: choose from {', '.join(TASKS)}")
    if ("prompts" in tasks) != bool(prompts):
        raise HamburgerError("the task 'prompts' and --prompts PATH go together")
    return tasks


def parse_modes(text: str) -> list[str]:
    """--mode as a list: trust, verify, compress (comma-separated)."""
    from hamburger.model.config import check_mode

    modes = [check_mode(m.strip()) for m in text.split(",") if m.strip()]
    if not modes:
        raise HamburgerError("--mode is empty")
    return modes


def parse_confidences(text: str | None) -> list[float] | None:
    """--confidence as a list of values in (0, 1]; None when not given."""
    from hamburger.model.config import check_confidence

    if text is None:
        return None
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise HamburgerError(f"--confidence takes numbers separated by commas, got {text!r}") from exc
    if not values:
        raise HamburgerError("--confidence is empty")
    return list(dict.fromkeys(check_confidence(v) for v in values))


def replot(args: argparse.Namespace) -> int:
    """--from-json: the table and plots of a saved run, without decoding anything again."""
    from hamburger.evaluation.figures import plot_eval

    try:
        saved = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
        rows, tasks = saved["rows"], saved["tasks"]
    except (OSError, ValueError, KeyError) as exc:
        raise HamburgerError(f"{args.from_json} is not a `hamburger eval --json` file: {exc}") from exc
    header, body = table_cells(rows, tasks)
    print_table(header, body, f"hamburger eval: {saved.get('model')}")
    if args.plot:
        print(f"wrote {plot_eval(rows, args.plot, str(saved.get('model', '')))}", file=sys.stderr)
    return 0
