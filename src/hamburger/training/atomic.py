"""Outputs that survive a kill: nothing appears under its final name until it is complete.

A training or data command can be killed at any instant (SIGKILL, a preempted machine). A file is therefore written
under a temporary name beside its final one and renamed over it (`os.replace`, atomic within a filesystem), and a
folder (a training state, a checkpoint) is written whole as `NAME.new/` and swapped in (`replace_dir`); a kill then
leaves the previous complete version or the new one, never a torn one. A folder cannot be renamed over a non-empty
one, so the swap takes two renames; `settle_dir`, run before a resume reads the folder, finishes a swap that a kill
cut between them. Files that grow by appends (JSONL records) take a batch of records in one write (`append_jsonl`)
and are read back with `read_lines`, which cuts off a torn last line.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: readers see the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def staging(final: Path) -> Path:
    """Where a folder is written before `replace_dir` swaps it in: `NAME.new` beside it."""
    return final.with_name(final.name + ".new")


def _aside(final: Path) -> Path:
    return final.with_name(final.name + ".old")


def replace_dir(final: Path) -> None:
    """Swap the complete folder `staging(final)` in as `final`: the old one is renamed aside, the new one renamed in,
    the old one removed. A kill between the renames leaves `NAME.old` and `NAME.new`, both complete (`settle_dir`)."""
    old = _aside(final)
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    staging(final).rename(final)
    shutil.rmtree(old, ignore_errors=True)


def settle_dir(final: Path) -> None:
    """The folder `final` as the last complete write left it, after a kill anywhere in a write or a `replace_dir`.

    No `final` but `NAME.old`: the kill fell between the swap's renames, so `NAME.new` is complete and goes in.
    Otherwise a `NAME.new` is a write the kill cut short and `NAME.old` a removal it cut short: both go."""
    old, new = _aside(final), staging(final)
    if not final.exists() and old.exists():
        (new if new.exists() else old).rename(final)
    for leftover in (new, old):
        if leftover.exists():
            shutil.rmtree(leftover)


def read_lines(path: Path) -> list[bytes]:
    """The complete records of a JSONL file that grows by appends, each with its newline; a torn tail is cut off.

    A kill can cut an append anywhere: a last line with no newline is torn even where it parses (the next append
    would join it), and so is one that does not parse. The file is truncated to its complete lines (one call: a kill
    during it loses nothing complete), so the next append starts a fresh line. Lines are split on newlines only: the
    records are written with ensure_ascii=False, which leaves U+2028 and NEL in a string raw."""
    if not path.exists():
        return []
    data = path.read_bytes()
    lines, size = [], 0
    for line in data.split(b"\n")[:-1]:
        try:
            if not isinstance(json.loads(line), dict):
                break
        except ValueError:
            break
        lines.append(line + b"\n")
        size += len(line) + 1
    if size != len(data):
        os.truncate(path, size)
    return lines


def append_jsonl(path: Path, rows: list[dict]) -> None:
    """Append `rows` to `path` as JSON lines in a single write, so a kill between two appends never leaves a torn
    line (only the kernel cutting one large write short can, which `read_lines` then cuts off)."""
    data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)
