"""Entropy-based segmentation: cut each response into steps of 1..K tokens by the base's own uncertainty.

A token joins the current step if the step has fewer than K tokens and its next-token entropy H_t is
below `abs_threshold`, or below `rel_threshold` times the largest entropy already in the step; otherwise
it starts a new step. Runs data-parallel under `accelerate launch` (each process takes every n-th row).

Each process appends its records a batch at a time to `OUT.partN` (a header line first: the data's hash, the
thresholds, the base, the batch size), so a killed run, run again with the same settings, computes only the batches
it had not written, in the same batches as before (the same numbers); `OUT` appears, whole, only at the end.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from hamburger.errors import HamburgerError
from hamburger.model.base import encode_chat, eos_ids, fingerprint
from hamburger.model.hamburger_model import HamburgerModel
from hamburger.training.atomic import append_jsonl, read_lines, write_text
from hamburger.training.teacher import TeacherWriter, teacher_dir, top_k


@dataclass(frozen=True)
class Thresholds:
    max_step_tokens: int = 4
    abs_threshold: float = 0.05
    rel_threshold: float = 0.3


def segment(entropies: list[float], th: Thresholds) -> list[int]:
    """Step lengths for one response from the entropy of each of its tokens."""
    steps: list[int] = []
    size, top = 0, 0.0
    for h in entropies:
        if 0 < size < th.max_step_tokens and (h < th.abs_threshold or h < th.rel_threshold * top):
            size, top = size + 1, max(top, h)
        else:
            if size:
                steps.append(size)
            size, top = 1, h
    if size:
        steps.append(size)
    return steps


def chat_example(tokenizer, messages: list[dict], eos: set[int]) -> tuple[list[int], int] | None:
    """(input_ids, prompt_len) of a chat whose last message is the assistant's reply, ending at its EOS."""
    if not messages or messages[-1].get("role") != "assistant":
        return None
    prompt = encode_chat(tokenizer, messages[:-1])
    full = encode_chat(tokenizer, messages[:-1], reply=messages[-1]["content"])
    if full[: len(prompt)] != prompt:
        raise HamburgerError("the chat template does not extend the prompt when a reply is added; cannot segment")
    response = full[len(prompt) :]
    ends = [i for i, t in enumerate(response) if t in eos]
    response = response[: ends[0] + 1] if ends else response
    return (prompt + response, len(prompt)) if response else None


@torch.no_grad()
def response_entropies(model: HamburgerModel, batch: list[tuple[list[int], int]], teacher_k: int = 0) -> list[tuple]:
    """For each example: the entropy (nats) of the base's next-token distribution at every response token,
    teacher-forced, and with `teacher_k` > 0 the base's top-k ids and log-probabilities there (`teacher.top_k`),
    else None for both."""
    device = next(model.parameters()).device
    width = max(len(ids) for ids, _ in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for b, (row, _) in enumerate(batch):
        ids[b, : len(row)] = torch.tensor(row, device=device)
        mask[b, : len(row)] = 1
    logits = model.base(input_ids=ids, attention_mask=mask).logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)  # (B, T): entropy at t predicts token t+1
    out = []
    for b, (row, p) in enumerate(batch):
        at = slice(p - 1, len(row) - 1)  # the positions that predict the response tokens
        teacher = top_k(logits[b, at], teacher_k) if teacher_k else (None, None)
        out.append((entropy[b, at].tolist(), *teacher))
    return out


def summarize(examples: list[dict], max_step_tokens: int) -> dict:
    hist = Counter(s for ex in examples for s in ex["steps"])
    tokens = sum(hist[k] * k for k in hist)
    steps = sum(hist.values())
    return {
        "examples": len(examples),
        "response_tokens": tokens,
        "steps": steps,
        "mean_tokens_per_step": tokens / steps if steps else 0.0,
        "step_length_histogram": {str(k): hist.get(k, 0) for k in range(1, max_step_tokens + 1)},
    }


def read_chats(path: Path) -> list[dict]:
    if not path.is_file():
        raise HamburgerError(f"data file {path} does not exist")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):  # (U+2028 in a reply is no newline)
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise HamburgerError(f"{path}:{n}: not valid JSON: {exc}") from exc
            if "messages" not in row and {"prompt", "response"} <= row.keys():
                row["messages"] = [{"role": "user", "content": row["prompt"]},
                                   {"role": "assistant", "content": row["response"]}]
            if not isinstance(row.get("messages"), list):
                raise HamburgerError(f"{path}:{n}: needs `messages` or `prompt` and `response`")
            rows.append(row)
    return rows


def encode_rows(model: HamburgerModel, rows: list[dict], include_unfinished: bool) -> list[tuple]:
    """(row number, id, input_ids, prompt_len) of each usable row: replies cut off at max_new_tokens only with
    `include_unfinished`; distilled rows by their exact `response_ids`."""
    eos = eos_ids(model)
    encoded = []
    for i, row in enumerate(rows):
        if not include_unfinished and row.get("finished") is False:
            continue
        if isinstance(row.get("response_ids"), list) and row["response_ids"]:  # exact tokens from `distill`
            prompt = encode_chat(model.tokenizer, row["messages"][:-1])
            ex = (prompt + row["response_ids"], len(prompt))
        else:
            ex = chat_example(model.tokenizer, row["messages"], eos)
        if ex is not None:
            encoded.append((i, row.get("id", str(i)), *ex))
    return encoded


def segment_rows(model: HamburgerModel, rows: list[dict], th: Thresholds, batch_size: int = 8,
                 progress: bool = True, include_unfinished: bool = False, teacher: TeacherWriter | None = None,
                 teacher_k: int = 0, done: dict[int, dict] | None = None,
                 write: Callable[[list[tuple[int, dict]]], None] | None = None) -> list[dict]:
    """Each usable row as {id, input_ids, prompt_len, steps}, in the rows' order; with `teacher` and `teacher_k`
    the base's top-k at every response token also goes to the writer, keyed by the example's id.

    Rows are batched by length. `done` (row number -> record, from a killed run) skips every batch whose records are
    all there; `write` gets the (row number, record) pairs of each batch computed, less those in `done`."""
    done = done or {}
    encoded = encode_rows(model, rows, include_unfinished)
    order = sorted(range(len(encoded)), key=lambda j: len(encoded[j][2]))
    out: dict[int, dict] = {}
    columns = (TextColumn("segment"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, disable=not progress, console=Console(stderr=True)) as bar:
        task = bar.add_task("segment", total=len(order))
        t0 = said = time.perf_counter()
        for start in range(0, len(order), batch_size):
            chunk = [encoded[j] for j in order[start : start + batch_size]]
            if all(i in done for i, *_ in chunk):
                out.update((i, done[i]) for i, *_ in chunk)
            else:
                found = response_entropies(model, [(ids, p) for _, _, ids, p in chunk], teacher_k if teacher else 0)
                for (i, rid, ids, p), (ent, top_ids, top_logp) in zip(chunk, found):
                    out[i] = {"id": rid, "input_ids": ids, "prompt_len": p, "steps": segment(ent, th)}
                    if teacher is not None:
                        teacher.add(rid, top_ids, top_logp)
                if write is not None:
                    write([(i, out[i]) for i, *_ in chunk if i not in done])
            bar.update(task, advance=len(chunk))
            n = min(start + batch_size, len(order))
            if progress and not bar.console.is_terminal and (time.perf_counter() - said > 60 or n == len(order)):
                said = time.perf_counter()  # a log file gets a plain line a minute instead of a live bar
                print(f"segment {n}/{len(order)} examples, elapsed {said - t0:.0f}s", file=sys.stderr, flush=True)
    return [out[i] for i in sorted(out)]


def part_header(data: Path, th: Thresholds, model: HamburgerModel, **settings) -> dict:
    """What a part's records depend on: the data (its bytes' hash), the thresholds, the base, and `settings` (the
    batch size, which pads the base's passes; the number of processes, which shares out the rows)."""
    return {"data_sha256": hashlib.sha256(data.read_bytes()).hexdigest(), "thresholds": asdict(th),
            "base": fingerprint(model.base), **settings}


def open_part(part: Path, header: dict, resume: bool = True) -> dict[int, dict]:
    """The records (row number -> record) a killed run left in `part`, if it ran with the same `header` (and
    `resume`); otherwise `part` starts afresh with the header. A torn last line is cut off."""
    lines = read_lines(part)
    if resume and lines and json.loads(lines[0]) == {"header": header}:
        return {row.pop("row"): row for row in map(json.loads, lines[1:])}
    part.write_text(json.dumps({"header": header}) + "\n", encoding="utf-8")
    return {}


def part_writer(part: Path) -> Callable[[list[tuple[int, dict]]], None]:
    """`segment_rows`'s `write`: a batch's records appended to `part` in one write, each with its row number."""
    return lambda pairs: append_jsonl(part, [{"row": i, **record} for i, record in pairs])


def part_records(part: Path) -> list[dict]:
    """A part's records in their rows' order, without the header and row numbers."""
    rows = [json.loads(line) for line in read_lines(part)[1:]]
    return [{k: v for k, v in row.items() if k != "row"} for row in sorted(rows, key=lambda row: row["row"])]


def check_unique_ids(rows: list[dict], data: str) -> None:
    """`segment --teacher-top-k` keys its cache by example id: the ids must not repeat."""
    seen = Counter(str(row.get("id", i)) for i, row in enumerate(rows))
    twice = [rid for rid, n in seen.items() if n > 1]
    if twice:
        raise HamburgerError(f"--teacher-top-k keys the cache by example id, and {len(twice)} ids repeat in "
                             f"{data} (e.g. {twice[0]!r})")


def join_segment_parts(out: Path, processes: int, th: Thresholds, building: Path | None, meta: dict) -> dict:
    """The main process of `segment`: the processes' parts (`out`.partN) joined into `out`, the teacher cache built in
    `building` (None: no cache) moved beside it, and the summary (with `meta`) written beside; returns the summary.
    Every file goes in by a rename, `out` last: where `out` exists, it, its summary and cache are complete."""

    cache = teacher_dir(out)
    parts = [out.with_name(f"{out.name}.part{i}") for i in range(processes)]
    examples = [ex for p in parts for ex in part_records(p)]
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(ex) + "\n" for ex in examples))
    summary = summarize(examples, th.max_step_tokens) | {"thresholds": asdict(th), **meta}
    write_text(out.with_name(out.name + ".summary.json"), json.dumps(summary, indent=2) + "\n")
    if cache.exists():  # --force: an old cache would not match the new data
        shutil.rmtree(cache)
    if building is not None:
        building.replace(cache)
    tmp.replace(out)
    for p in parts:
        p.unlink()
    return summary
