"""Time to the first token of a fresh process, warm: `hamburger generate` against llama.cpp on the same GGUF.

Each system is a new process started `--rounds` times, the systems taking turns; a time runs from starting the process
to the first byte of the reply on its stdout (the model converted and cached, the page cache warm: the first round
is not counted). `hamburger generate "hi" --max-new-tokens 1` with no other flags (fp16 weights, verify mode) and
with each `--flags` variant; llama.cpp (llama-cpp-python, when installed) loads the embedded default's GGUF with
`n_batch` 512 and 2 threads, tokenizes the same chat turn and prints its first token.

    python benchmarks/startup.py                                      # about 30 s on 2 cores
    python benchmarks/startup.py --flags "--quantize int4/int8"
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hamburger.model.base import DEFAULT_GGUF, default_model_dir

LLAMA = """
import sys
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=1024, n_batch=512, n_threads=2, verbose=False)
turn = ("<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n"
        "<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n")
for token in llm.generate(llm.tokenize(turn.encode(), special=True), temp=0.0):
    sys.stdout.write(llm.detokenize([token]).decode(errors="ignore") or " ")
    sys.stdout.flush()
    break
"""


def first_byte(cmd: list[str]) -> float:
    """Seconds from starting `cmd` to the first byte on its stdout."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    proc.stdout.read(1)
    took = time.perf_counter() - start
    proc.communicate()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="starts of each system (the first is not counted)")
    parser.add_argument("--flags", action="append", default=[], help="another `hamburger generate` variant")
    args = parser.parse_args()
    hamburger = str(Path(sys.executable).with_name("hamburger"))
    systems = {"hamburger generate": [hamburger, "generate", "hi", "--max-new-tokens", "1"]}
    for flags in args.flags:
        systems[f"hamburger generate {flags}"] = systems["hamburger generate"] + shlex.split(flags)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama.cpp: skipped (pip install llama-cpp-python)")
    else:
        systems["llama.cpp"] = [sys.executable, "-c", LLAMA, str(default_model_dir() / DEFAULT_GGUF)]
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.rounds):
        for name, cmd in systems.items():
            times[name].append(first_byte(cmd))
    print("| system | time to first token (median) | every round |\n| --- | ---: | --- |")
    for name, taken in times.items():
        print(f"| {name} | {statistics.median(taken[1:]):.2f} s | {' '.join(f'{t:.2f}' for t in taken)} |")


if __name__ == "__main__":
    main()
