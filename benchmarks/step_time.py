"""Where a decode step's time goes in real decoding, base against verify mode: the native calls, and the Python
around them function by function.

`hamburger bench`'s prompts (`--sets`, `--prompts-per-set`) are decoded greedily at batch 1 by the engine's base
(the same weights, one token per forward) and by verify mode, one after the other; every step's time is split by
wrapping the native calls (`hb_layers`: the decoder layers, and for a request alone the final norm and the LM
head's argmax too; `hb_linear_argmax` / `hb_linear`: the LM head in a call of its own) and the
decode loop's functions (scheduler, runner, verify step, macro-step, proposers), each charged its own time less
its callees'. The clock is the main thread's CPU time (`time.thread_time`), which a shared machine's other jobs
disturb less than the wall clock; the main thread runs Python and takes its share of every native call, so the
native calls' entries are their wall time on it. The Python entries are what issue 51 calls "Python per step".

It also counts the verify passes' widths (1 + the drafts checked), the tokens each step emits and, in an untimed
decode of the first prompt, the PyTorch operators a step runs. The wrappers cost a few microseconds a call; compare
entries within one run. A request decoding alone takes `solo.py`'s step; `--batched-step` the batched one.

    python benchmarks/step_time.py --json results/step-time-2026-11-27.json       # about a minute on 2 cores
    python benchmarks/step_time.py --batched-step
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hamburger.inference.core as core
import hamburger.inference.native_layers as native_layers
import hamburger.inference.rows as rows_mod
import hamburger.inference.runner as runner_mod
import hamburger.inference.scheduler as scheduler
import hamburger.inference.solo as solo
import hamburger.inference.verify as verify
from hamburger.evaluation.bench_systems import SETS, bench_messages
from hamburger.inference.engine import Engine
from hamburger.kernels import native
from hamburger.loading import load
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import HamburgerModel


class Operators(TorchDispatchMode):
    """Counts the PyTorch operators run under it (views and scalar reads included)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class Ledger:
    """Exclusive CPU time per wrapped function: its own time less the time of the wrapped calls inside it."""

    def __init__(self) -> None:
        self.own: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self._stack: list[float] = []

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.thread_time()
            self._stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                spent, inner = time.thread_time() - start, self._stack.pop()
                self.own[name] += spent - inner
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1] += spent
        return timed

    def clear(self) -> None:
        self.own.clear()
        self.calls.clear()


def instrument(ledger: Ledger, widths: collections.Counter) -> None:
    lib = native.library()
    for name in ("hb_layers", "hb_linear", "hb_linear_argmax"):
        if hasattr(lib, name):  # (hb_linear_argmax: since 2026-11-27; an older tree has hb_linear alone)
            setattr(lib, name, ledger.wrap(f"native {name}", getattr(lib, name)))
    methods = {scheduler.Scheduler: ["step", "_feed_steps", "_feed_trust", "_macro_step", "_admit", "_apply_cancels"],
               runner_mod.ModelRunner: ["trust_pass", "base_pass", "_layers", "_micro_native_pass", "head_argmax"],
               native_layers.NativeLayers: ["run", "usable", "takes"], rows_mod.RowBatch: ["compact", "report", "span"],
               core.RowPicker: ["__call__"], core.MicroRun: ["__call__"]}
    for cls, names in methods.items():
        for name in names:
            if hasattr(cls, name):
                setattr(cls, name, ledger.wrap(f"{cls.__name__}.{name}", getattr(cls, name)))
    pass_fn = verify.check_pass

    def counted(runner, embeds, *args, **kwargs):
        widths[embeds.shape[1]] += 1
        return pass_fn(runner, embeds, *args, **kwargs)

    verify.check_pass = counted
    for name in ("check", "check_pass", "accept", "settle", "record_kept"):
        setattr(verify, name, ledger.wrap(f"verify.{name}", getattr(verify, name)))
    for name in ("macro_step", "drafts_wanted", "proposer_for", "micro_context"):
        setattr(scheduler, name, ledger.wrap(name, getattr(scheduler, name)))
    for name in ("check", "macro_step"):  # a request alone (`solo.py`)
        setattr(solo, name, ledger.wrap(f"solo.{name}", getattr(solo, name)))
    verify.record_row = ledger.wrap("verify.record_row", verify.record_row)
    core._propose = ledger.wrap("core._propose (proposers)", core._propose)
    core._goes_on = ledger.wrap("core._goes_on", core._goes_on)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sets", default="code,math,chat", help=f"prompt sets, from {', '.join(SETS)}")
    p.add_argument("--prompts-per-set", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--top", type=int, default=14, help="Python entries listed per mode")
    p.add_argument("--json", help="write every entry (seconds per step) here")
    p.add_argument("--batched-step", action="store_true",
                   help="the lone request on the batched step (Engine(alone=False)), not on host integers (solo.py)")
    a = p.parse_args()
    torch.manual_seed(0)
    model, _ = load("default", quantize="auto", decode_only=True)
    prompts = [encode_chat(model.tokenizer, m) for s in a.sets.split(",") for m in bench_messages(s, a.prompts_per_set)]
    ledger, widths = Ledger(), collections.Counter()
    instrument(ledger, widths)
    alone = False if a.batched_step else None
    engines = {"base": (Engine(HamburgerModel.plain(model.base, model.tokenizer), alone=alone), None),
               "verify": (Engine(model, alone=alone), "verify")}
    report = {}
    with torch.inference_mode():
        for name, (engine, mode) in engines.items():
            engine.generate([prompts[0]], max_new_tokens=16, mode=mode)  # warm up
            own, calls, seen = collections.Counter(), collections.Counter(), collections.Counter()
            steps = tokens = 0
            for prompt in prompts:
                gen = engine.stream([prompt], max_new_tokens=a.max_new_tokens, mode=mode)
                events = iter(gen)
                first = next(events)  # the prefill's step: not a decode step
                ledger.clear()
                widths.clear()
                steps += sum(1 for _ in events)
                tokens += len(gen.output().tokens[0]) - len(first.tokens[0])
                own.update(ledger.own)
                calls.update(ledger.calls)
                seen.update(widths)
            # PyTorch operators per decode step, in an untimed decode of the first prompt
            gen = engine.stream([prompts[0]], max_new_tokens=a.max_new_tokens, mode=mode)
            events, counter, op_steps = iter(gen), Operators(), 0
            next(events)
            with counter:
                op_steps = sum(1 for _ in events)
            report[name] = (dict(own), dict(calls), steps, tokens, dict(seen), counter.count / max(op_steps, 1))
    print(f"{len(prompts)} prompts ({a.sets}), {a.max_new_tokens} new tokens, batch 1, the default (int4/int8), "
          f"{'the batched step, ' if a.batched_step else ''}main-thread CPU time per decode step (the prefill's "
          "step left out):\n")
    print("| | base | verify |\n| --- | ---: | ---: |")
    rows = {}
    for name, (own, calls, steps, tokens, *_) in report.items():
        nat = sum(v for k, v in own.items() if k.startswith("native hb_layers"))
        head = sum(v for k, v in own.items() if k.startswith("native hb_linear"))
        py = sum(v for k, v in own.items() if not k.startswith("native"))
        rows[name] = (steps, tokens, nat, head, py, report[name][5])
    fmt = {"tokens per step": lambda r: f"{r[1] / r[0]:.2f}",
           "step, ms": lambda r: f"{(r[2] + r[3] + r[4]) / r[0] * 1e3:.2f}",
           "native layers (hb_layers: with the LM head where it runs there), ms": lambda r: f"{r[2] / r[0] * 1e3:.2f}",
           "LM head in its own call (hb_linear_argmax or hb_linear), ms": lambda r: f"{r[3] / r[0] * 1e3:.2f}",
           "Python and PyTorch around them, ms": lambda r: f"{r[4] / r[0] * 1e3:.2f}",
           "ms per token": lambda r: f"{(r[2] + r[3] + r[4]) / r[1] * 1e3:.2f}",
           "PyTorch operators per step (the first prompt, untimed)": lambda r: f"{r[5]:.0f}"}
    for label, f in fmt.items():
        print(f"| {label} | {f(rows['base'])} | {f(rows['verify'])} |")
    for name, (own, calls, steps, _, w, _) in report.items():
        print(f"\n{name}: the Python entries, microseconds per step (calls per step)")
        py = sorted(((v, k) for k, v in own.items() if not k.startswith("native")), reverse=True)[: a.top]
        print(", ".join(f"{k} {v / steps * 1e6:.0f} ({calls[k] / steps:.2f})" for v, k in py))
        if w:
            total = sum(w.values())
            print(f"verify pass widths (positions: passes): {dict(sorted(w.items()))}, mean "
                  f"{sum(k * v for k, v in w.items()) / total:.2f}")
    if a.json:
        out = {name: {"steps": steps, "tokens": tokens, "pass_widths": w,
                      "seconds_per_step": {k: v / steps for k, v in own.items()},
                      "calls_per_step": {k: c / steps for k, c in calls.items()}, "operators_per_step": ops}
               for name, (own, calls, steps, tokens, w, ops) in report.items()}
        with open(a.json, "w") as f:
            json.dump({"command": "python benchmarks/step_time.py", "sets": a.sets, "prompts_per_set": a.prompts_per_set,
                       "max_new_tokens": a.max_new_tokens, "modes": out}, f, indent=1)


if __name__ == "__main__":
    main()
