"""Segmented training data as the trainers read it: examples from JSONL (with the teacher cache when present), the
held-out split, length-bucketed epoch batches, and set-wide held-out metrics."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import torch

from hamburger.errors import HamburgerError
from hamburger.model.base import encode_chat, fingerprint
from hamburger.model.hamburger_model import HamburgerModel
from hamburger.model.outputs import metrics_from_counts
from hamburger.training.data import SegmentedExample, collate
from hamburger.training.loss import hamburger_loss
from hamburger.training.teacher import read_teacher, teacher_dir


def read_examples(path: Path, tokenizer=None, distilled: bool = False) -> list[tuple[str, SegmentedExample]]:
    """The (id, example) rows of segmented JSONL (`hamburger segment`). With `distilled`, rows of distilled JSONL
    (`hamburger distill`: `messages` and `response_ids`) are read too, as unsegmented examples (one token per
    step): for the drafter, which learns at every response position and never reads the steps. Their prompts
    are tokenized with `tokenizer`; without one they are left out (prompt_len 0): enough to check a file."""
    if not path.is_file():
        raise HamburgerError(f"segmented data {path} does not exist (make it with `hamburger segment`)")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
                if distilled and "input_ids" not in row and isinstance(row.get("response_ids"), list):
                    if not row["response_ids"]:
                        continue  # an empty reply teaches nothing
                    if not isinstance(row["messages"], list) or not all(isinstance(t, int) for t in row["response_ids"]):
                        raise TypeError("messages must be a list and response_ids token ids")
                    prompt = encode_chat(tokenizer, row["messages"][:-1]) if tokenizer is not None else []
                    ex = SegmentedExample(prompt + row["response_ids"], len(prompt), [1] * len(row["response_ids"]))
                else:
                    ex = SegmentedExample(row["input_ids"], row["prompt_len"], row["steps"])
                out.append((str(row.get("id", n)), ex))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                what = "a segmented or distilled example" if distilled else "a segmented example"
                raise HamburgerError(f"{path}:{n}: not {what} ({exc!r})") from exc
    if not out:
        raise HamburgerError(f"{path} holds no examples")
    return out


def attach_teacher(rows: list[tuple[str, SegmentedExample]], data: Path, model: HamburgerModel) -> int:
    """Give every example its cached teacher (`segment --teacher-top-k`, in DATA.teacher/) when there is one;
    returns its top-k, or 0 when there is none (KD then runs the base a second time per batch)."""
    folder = teacher_dir(data)
    if not folder.is_dir():
        return 0
    cached, meta = read_teacher(folder)
    mine = fingerprint(model.base)
    if meta.get("base_fingerprint") != mine:
        raise HamburgerError(f"{folder} was cached from another base (fingerprint {meta.get('base_fingerprint')}, "
                             f"this one {mine}): re-run `hamburger segment --teacher-top-k` with this base, "
                             "or pass --no-teacher-cache")
    missing = [rid for rid, _ in rows if rid not in cached]
    if missing:
        raise HamburgerError(f"{folder} has no teacher for {len(missing)} of the {len(rows)} examples "
                             f"(e.g. {missing[0]!r}): it was cached for other data (re-run `hamburger segment`)")
    for rid, ex in rows:
        ex.teacher_ids, ex.teacher_logprobs = cached[rid]
    return int(meta.get("top_k", 0))


def split_eval(rows: list[tuple[str, SegmentedExample]], fraction: float) -> tuple[list, list]:
    """A stable split by id hash, so a resumed or re-launched run evaluates on the same examples."""
    def held(rid: str) -> bool:
        return int(hashlib.sha256(rid.encode()).hexdigest(), 16) % 10_000 < fraction * 10_000
    return [r for r in rows if not held(r[0])], [r for r in rows if held(r[0])]


def epoch_batches(n: int, batch_size: int, epoch: int, seed: int, lengths: list[int] | None = None,
                  pool: int = 0) -> list[list[int]]:
    """One epoch's global batches: a seeded permutation of the n examples cut into batches, the ragged tail dropped.

    With `lengths` and `pool` > 0 the batches are length-bucketed: the permutation is cut into pools of
    `pool` batches, each pool is sorted by length (ties keep the random order) and cut into batches, and
    then the order of the epoch's batches is shuffled. A batch then holds examples of similar length (little
    padding) while which examples share a batch, and the order of the batches, still change every epoch.
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(n))
    rng.shuffle(order)
    order = order[: n - n % batch_size]  # drop the ragged tail
    if lengths is None or pool <= 0:
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    batches = []
    for start in range(0, len(order), pool * batch_size):
        chunk = sorted(order[start : start + pool * batch_size], key=lambda i: lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches



@torch.no_grad()
def evaluate(model, examples: list[SegmentedExample], k: int, pad: int, batch_size: int, device,
             dense: bool = False) -> dict[str, float]:
    """Loss, token accuracy by position in the step and stop accuracy over held-out examples; with `dense`
    also the dense losses (KL to the unmerged base, state distance), whatever the run trains on.

    Each metric is a mean over the whole set's items it counts (tokens; tokens at in-step index k for
    acc@k; the stop labels that count for the stop loss and accuracy), not a mean of batch means.
    Examples are batched in length order (less padding; the results do not depend on the batching).
    """
    examples = sorted(examples, key=lambda ex: ex.num_slots)
    counts: dict[str, tuple[float, int]] = {}
    for i in range(0, len(examples), batch_size):
        out = hamburger_loss(model, collate(examples[i : i + batch_size], k, pad).to(device), dense_metrics=dense)
        for key, (total, n) in out.metric_counts(k).items():
            before = counts.get(key, (0.0, 0))
            counts[key] = (before[0] + total, before[1] + n)
    return metrics_from_counts(counts)
