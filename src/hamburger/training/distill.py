"""Self-distillation: the base model answers offline prompts; the answers become training data.

Output: JSONL, one row per prompt: `id`, `source`, `messages` (the prompt turns plus the assistant's
reply), `answer` (reference, where the source has one), `finished` (the reply ended with EOS) and
`response_ids` (the exact tokens generated, so segmentation needs no re-tokenisation).
Rows are appended as replies end, a finished group at a time, so an interrupted run resumes where it stopped (a kill
loses only the replies in flight; a torn last line is cut off on resume), and once every prompt has its row the file
is put in the prompts' order, so a run killed and resumed ends with the same file as one never stopped.

The replies come from the fast engine's continuous-batching scheduler where the base is supported (static
batches on the transformers reference path otherwise, or with `--engine reference`), in the order they end.
`--quantize fp16` speeds a CPU up (docs/training.md); its greedy replies are the fp16 base's,
which can part from the float32 base's where two tokens are nearly tied.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from hamburger.inference.engine import ReferenceEngine, make_engine
from hamburger.inference.reference import eos_ids
from hamburger.inference.sampling import SamplingParams
from hamburger.inference.scheduler import Scheduler
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import HamburgerModel
from hamburger.training.atomic import append_jsonl, read_lines, write_text
from hamburger.training.sources import Prompt


def done_ids(path: Path) -> set[str]:
    """Ids already written by an earlier (possibly interrupted) run; a torn last line is cut off (`read_lines`)."""
    return {row["id"] for row in map(json.loads, read_lines(path)) if "id" in row}


def put_in_prompt_order(path: Path, prompts: list[Prompt]) -> None:
    """Rewrite `path` (atomically) with the rows of `prompts` in their order, after any rows of other prompts: the
    rows were appended as replies ended, an order that depends on where an interrupted run stopped."""
    lines = read_lines(path)
    rank = {p.id: i for i, p in reversed(list(enumerate(prompts)))}
    ordered = sorted(lines, key=lambda line: rank.get(json.loads(line).get("id"), -1))
    if ordered != lines:
        write_text(path, b"".join(ordered).decode("utf-8"))


def replies(model: HamburgerModel, prompts: list[list[int]], batch_size: int, max_new_tokens: int,
            sampling: SamplingParams, engine: str = "auto") -> Iterator[list[tuple[int, list[int]]]]:
    """The plain base's replies to `prompts`, as groups of (prompt index, reply tokens) in the order they finish.

    On the fast engine the prompts go through the continuous-batching scheduler: `batch_size` rows, a finished
    row takes the next prompt at once, so no pass computes a row that is done (a static batch runs every row to
    its longest reply). The reference path decodes static batches of `batch_size`."""
    base = HamburgerModel.plain(model.base, model.tokenizer)
    runner = make_engine(base, engine)
    if isinstance(runner, ReferenceEngine):
        for start in range(0, len(prompts), batch_size):
            res = runner.generate(prompts[start : start + batch_size], max_new_tokens=max_new_tokens, confidence=1.0,
                                  sampling=sampling, mode="trust")
            yield list(enumerate(res.tokens, start))
        return
    longest = max(map(len, prompts), default=1)
    sched = Scheduler(base, max_batch_size=batch_size, max_len=longest + max_new_tokens)
    index = {sched.submit(ids, max_new_tokens, confidence=1.0, sampling=sampling): i for i, ids in enumerate(prompts)}
    tokens: dict[int, list[int]] = {}
    while sched.has_work():
        done = []
        for ev in sched.step():
            tokens.setdefault(ev.id, []).extend(ev.tokens)
            if ev.finished:
                done.append((index[ev.id], tokens.pop(ev.id)))
        if done:
            yield done


def reply_row(p: Prompt, reply_ids: list[int], tokenizer, eos: set[int]) -> dict:
    """The output row of prompt `p` answered with `reply_ids`."""
    reply = tokenizer.decode(reply_ids, skip_special_tokens=True).strip()
    return {"id": p.id, "source": p.source, "messages": p.messages + [{"role": "assistant", "content": reply}],
            "answer": p.answer, "finished": bool(reply_ids) and reply_ids[-1] in eos, "response_ids": reply_ids}


def distill(
    model: HamburgerModel, prompts: list[Prompt], out: Path, batch_size: int = 32, max_new_tokens: int = 256,
    sampling: SamplingParams | None = None, progress: bool = True, engine: str = "auto",
) -> dict[str, int]:
    """Generate the base model's replies for `prompts` not yet in `out`, appending a row per reply as it finishes,
    then put the file in the prompts' order. `engine`: as `make_engine`'s kind (auto: the fast engine where the base
    is supported)."""
    tok, eos = model.tokenizer, eos_ids(model)
    skip = done_ids(out)
    todo = [p for p in prompts if p.id not in skip]
    encoded = [(p, encode_chat(tok, p.messages)) for p in todo]
    encoded.sort(key=lambda pair: len(pair[1]))  # similar lengths side by side: less padding
    counts = {"prompts": len(prompts), "already_done": len(prompts) - len(todo), "written": 0, "unfinished": 0,
              "tokens": 0}
    out.parent.mkdir(parents=True, exist_ok=True)
    columns = (TextColumn("distill"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[tps]} tok/s"),
               TimeRemainingColumn())
    with Progress(*columns, disable=not progress, console=Console(stderr=True)) as bar:
        task = bar.add_task("distill", total=len(encoded), tps="-")
        t0 = said = time.perf_counter()
        for group in replies(model, [ids for _, ids in encoded], batch_size, max_new_tokens,
                             sampling or SamplingParams(), engine):
            rows = [reply_row(encoded[i][0], reply_ids, tok, eos) for i, reply_ids in group]
            append_jsonl(out, rows)
            counts["written"] += len(rows)
            counts["unfinished"] += sum(not row["finished"] for row in rows)
            counts["tokens"] += sum(len(row["response_ids"]) for row in rows)
            now = time.perf_counter()
            bar.update(task, advance=len(group), tps=f"{counts['tokens'] / max(now - t0, 1e-9):.0f}")
            if progress and not bar.console.is_terminal and (now - said > 60 or counts["written"] == len(encoded)):
                said = now  # a log file gets a plain line a minute instead of a live bar
                print(f"distill {counts['written']}/{len(encoded)} prompts, {counts['tokens']} tokens, "
                      f"{counts['tokens'] / (now - t0):.0f} tok/s, elapsed {now - t0:.0f}s", file=sys.stderr, flush=True)
    put_in_prompt_order(out, prompts)
    return counts
