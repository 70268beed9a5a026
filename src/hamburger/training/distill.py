"""Self-distillation: the base model answers offline prompts; the answers become training data.

Output: JSONL, one row per prompt: `id`, `source`, `messages` (the prompt turns plus the assistant's
reply), `answer` (reference, where the source has one), `finished` (the reply ended with EOS) and
`response_ids` (the exact tokens generated, so segmentation needs no re-tokenisation).
Rows are appended batch by batch, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from hamburger.errors import HamburgerError
from hamburger.inference.reference import eos_ids, generate
from hamburger.inference.sampling import SamplingParams
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import HamburgerModel
from hamburger.training.sources import BUILTIN, Prompt, load_prompts


def done_ids(path: Path) -> set[str]:
    """Ids already written by an earlier (possibly interrupted) run; a torn last line is dropped."""
    if not path.exists():
        return set()
    ids, lines = set(), path.read_text(encoding="utf-8").splitlines(keepends=True)
    good = []
    for line in lines:
        try:
            ids.add(json.loads(line)["id"])
            good.append(line)
        except (ValueError, KeyError):
            break
    if len(good) != len(lines):  # cut a partial line left by a crash, keep everything before it
        path.write_text("".join(good), encoding="utf-8")
    return ids


def distill(
    model: HamburgerModel, prompts: list[Prompt], out: Path, batch_size: int = 16, max_new_tokens: int = 256,
    sampling: SamplingParams | None = None, progress: bool = True,
) -> dict[str, int]:
    """Generate the base model's replies for `prompts` not yet in `out`, appending rows to `out`."""
    base = HamburgerModel.plain(model.base, model.tokenizer)
    tok, eos = model.tokenizer, eos_ids(model)
    skip = done_ids(out)
    todo = [p for p in prompts if p.id not in skip]
    encoded = [(p, encode_chat(tok, p.messages)) for p in todo]
    encoded.sort(key=lambda pair: len(pair[1]))  # similar lengths per batch: less padding
    counts = {"prompts": len(prompts), "already_done": len(prompts) - len(todo), "written": 0, "unfinished": 0}
    out.parent.mkdir(parents=True, exist_ok=True)
    columns = (TextColumn("distill"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[tps]} tok/s"),
               TimeRemainingColumn())
    with Progress(*columns, disable=not progress, console=Console(stderr=True)) as bar, out.open("a", encoding="utf-8") as f:
        task = bar.add_task("distill", total=len(encoded), tps="-")
        for start in range(0, len(encoded), batch_size):
            batch = encoded[start : start + batch_size]
            res = generate(base, [ids for _, ids in batch], max_new_tokens=max_new_tokens, confidence=1.0,
                           sampling=sampling or SamplingParams())
            for (p, _), tokens in zip(batch, res.tokens):
                finished = bool(tokens) and tokens[-1] in eos
                reply = tok.decode(tokens, skip_special_tokens=True).strip()
                row = {"id": p.id, "source": p.source, "messages": p.messages + [{"role": "assistant", "content": reply}],
                       "answer": p.answer, "finished": finished, "response_ids": tokens}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                counts["written"] += 1
                counts["unfinished"] += not finished
            f.flush()
            st = res.stats
            bar.update(task, advance=len(batch), tps=f"{st.generated_tokens / max(st.prefill_s + st.decode_s, 1e-9):.0f}")
    return counts


def cmd_distill(args: argparse.Namespace) -> int:
    from hamburger.cli import load_from_args  # noqa: PLC0415 - the CLI depends on us, not the reverse at import

    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise HamburgerError("--batch-size and --max-new-tokens must be >= 1")
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    for s in sources:
        if s not in BUILTIN and not Path(s).exists():
            raise HamburgerError(f"unknown source {s!r}: use {', '.join(BUILTIN)} or a JSONL file / datasets folder")
    prompts = load_prompts(sources, split=args.split, per_template=args.per_template, seed=args.seed, limit=args.limit)
    model, _ = load_from_args(args)
    sampling = SamplingParams(temperature=args.temperature, seed=args.seed)
    counts = distill(model, prompts, Path(args.out), args.batch_size, args.max_new_tokens, sampling)
    print(json.dumps(counts), file=sys.stderr)
    return 0


def register(sub, add_model_args) -> None:
    p = sub.add_parser("distill", help="generate the base model's replies to offline prompts (resumable JSONL)")
    p.add_argument("--sources", default="gsm,chat,code", help=f"comma list of {', '.join(BUILTIN)} and/or JSONL files")
    p.add_argument("--split", default="train", choices=("train", "heldout"))
    p.add_argument("--out", required=True, help="JSONL to append to (an existing file is resumed, never truncated)")
    add_model_args(p)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--per-template", type=int, default=10, help="GSM variants generated per template")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts per source")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_distill)
