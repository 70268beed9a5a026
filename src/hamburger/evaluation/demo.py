"""`hamburger demo`: the same prompt streamed side by side by the base model and by HAMburger.

HAMburger's macro-steps are shown in alternating colours (each colour run is one base forward and one KV
entry), with live decode tokens/s, tokens per step and KV entries for both, and the speed-up at the end.
The two decoders take turns one macro-step at a time in one thread, and each one's clock runs only
while it works, so neither is slowed by the other or by the drawing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from hamburger.inference.modes import TRUST, Mode, parse_mode
from hamburger.inference.stats import GenerationStats

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, with a short explanation.",
    "A baker makes 12 loaves every hour for 7 hours and sells 5 dozen. How many loaves are left? Think step by step.",
    "What are three good habits for staying healthy? Answer in a short list.",
)
STEP_STYLES = ("black on bright_cyan", "black on bright_yellow")


@dataclass
class Lane:
    """One decoder's side of the demo: its stream, the text so far as styled steps, and its own clock."""

    name: str
    events: Iterator
    tokenizer: object
    prompt_tokens: int
    colour_steps: bool
    unmerged: bool = False  # verify mode: every token keeps its own KV entry
    tokens: list[int] = field(default_factory=list)
    text: Text = field(default_factory=Text)
    steps: int = 0
    busy: float = 0.0
    first: float | None = None
    done: bool = False

    def advance(self) -> None:
        start = time.perf_counter()
        event = next(self.events, None)
        self.busy += time.perf_counter() - start
        if event is None:
            self.done = True
            return
        if self.first is None:
            self.first = self.busy  # time to first token: prefill and the first step
        new = event.tokens[0]
        if new:
            before = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            self.tokens += new
            piece = self.tokenizer.decode(self.tokens, skip_special_tokens=True)[len(before):]
            style = STEP_STYLES[self.steps % 2] if self.colour_steps and len(new) > 1 else ""
            self.text.append(piece, style=style)
            self.steps += 1

    @property
    def stats(self) -> GenerationStats:
        """The figures so far, measured as everywhere else (`stats.GenerationStats`)."""
        first = self.first or 0.0
        return GenerationStats(sequences=1, prompt_tokens=self.prompt_tokens, generated_tokens=len(self.tokens),
                               macro_steps=self.steps, base_forwards=self.steps, row_forwards=self.steps,
                               prefill_s=first,
                               decode_s=self.busy - first, unmerged=self.unmerged)

    def figures(self) -> str:
        s = self.stats
        return (f"{s.generated_tokens} tokens in {s.base_forwards} forwards, {s.kv_entries} KV entries, "
                f"{s.decode_tokens_per_s:.1f} tokens/s")


def render(prompt: str, lanes: list[Lane], speedup: str = "", legend: str = "") -> Group:
    """The prompt, a legend line, one panel per lane with its figures underneath (wrapped, never cut off at a
    narrow terminal or in a log file), and the closing comparison."""
    table = Table.grid(expand=True, padding=(0, 1))
    for _ in lanes:
        table.add_column(ratio=1)
    table.add_row(*(Panel(lane.text, title=lane.name, border_style="dim") for lane in lanes))
    table.add_row(*(Text(lane.figures(), style="dim") for lane in lanes))
    parts = [Text(f"> {prompt}", style="bold")] + ([Text(legend, style="dim")] if legend else []) + [table]
    if speedup:
        parts.append(Text(speedup, style="bold green"))
    return Group(*parts)


def side_by_side(console: Console, prompt: str, messages: list[dict], engines: dict, confidence: float,
                 max_new_tokens: int, mode: Mode | str = TRUST) -> tuple[Lane, Lane]:
    from hamburger.model.base import encode_chat

    mode = parse_mode(mode)

    base_engine, ham_engine = engines["base"], engines["hamburger"]
    tokenizer = ham_engine.model.tokenizer
    ids = encode_chat(tokenizer, messages)
    base = Lane("base model", iter(base_engine.stream([ids], max_new_tokens=max_new_tokens,
                                                                            confidence=1.0)),
                tokenizer, len(ids), colour_steps=False)
    title = f"HAMburger{' ' + mode.name if mode.checked else ''} @ {confidence:g}"
    lookup = getattr(getattr(ham_engine, "runner", None), "lookup", 0) if mode.lookup else 0
    if lookup:
        title += " + lookup"
    legend = ("base: one token per forward. " + title + {
        "verify": " (exactly the base's text)", "compress": " (checked against a base whose past steps are merged)",
    }.get(mode.name, "") + ": coloured runs of text came from one forward."
        + (" Drafts come from the micro-step decoder, or, where the last tokens occurred before (in the prompt, "
           "the reply or the base's stored replies), from what followed them there." if lookup else ""))
    ham = Lane(title, iter(ham_engine.stream([ids], max_new_tokens=max_new_tokens, confidence=confidence, mode=mode)),
               tokenizer, len(ids), colour_steps=True, unmerged=mode.per_token)
    with Live(render(prompt, [base, ham], legend=legend), console=console, refresh_per_second=8) as live:
        while not (base.done and ham.done):
            for lane in (base, ham):
                if not lane.done:
                    lane.advance()
            live.update(render(prompt, [base, ham], legend=legend))
        ham_s, base_s = ham.stats, base.stats
        ratio = ham_s.decode_tokens_per_s / base_s.decode_tokens_per_s if base_s.decode_tokens_per_s else 0.0
        live.update(render(prompt, [base, ham], f"HAMburger: {ratio:.2f}× the base's decode tokens/s, "
                                               f"{ham_s.kv_ratio:.2f}× its KV entries for this text", legend))
    return base, ham


# --- the closing table: every mode on the demo's prompts ------------------------------------------------------

MODE_ROWS = (("base", None), ("verify", "verify"), ("compress", "compress"), ("trust", "trust"))


@dataclass
class ModeRun:
    """One mode's reply to one prompt: its tokens and figures (`GenerationStats`)."""

    system: str
    tokens: list[int]
    stats: GenerationStats


def run_modes(engines: dict, ids: list[int], max_new_tokens: int) -> list[ModeRun]:
    """The base and each mode the checkpoint can run (compress needs a KV merger), one after the other on the
    same prompt, each at its own default confidence: what the closing table shows."""
    model = engines["hamburger"].model
    runs = []
    for system, mode in MODE_ROWS:
        if mode is not None and parse_mode(mode).merged and model.merger is None:
            continue
        engine = engines["base"] if mode is None else engines["hamburger"]
        out = engine.generate([ids], max_new_tokens=max_new_tokens, **({} if mode is None else {"mode": mode}))
        runs.append(ModeRun(system, out.tokens[0], out.stats))
    return runs


def mode_table(prompts: list[str], runs: list[list[ModeRun]]) -> Table:
    """Per prompt and in total, for each mode: decode tokens/s and its ratio to the base's, tokens per base forward
    (tok/fwd), KV entries (prompt + reply) against what the base holds for the same text (a reply of another length
    compared fairly), and whether the text is the base's (= base)."""
    table = Table(title="Every mode on these prompts (each run alone, one after the other)", title_justify="left")
    for name, justify in (("prompt", "left"), ("mode", "left"), ("tok/s", "right"), ("× base", "right"),
                          ("tok/fwd", "right"), ("KV entries", "right"), ("= base", "center")):
        table.add_column(name, justify=justify)
    totals: dict[str, GenerationStats] = {}
    equal: dict[str, int] = {}
    for i, (prompt, prompt_runs) in enumerate(zip(prompts, runs)):
        base = prompt_runs[0]
        for j, run in enumerate(prompt_runs):
            table.add_row(f"{i + 1}. {prompt[:12]}…" if j == 0 else "", *_figures(run.system, run.stats, base.stats,
                                                                                run.tokens == base.tokens),
                          end_section=j == len(prompt_runs) - 1)
            total = totals.setdefault(run.system, GenerationStats())
            for f in ("sequences", "prompt_tokens", "generated_tokens", "macro_steps", "base_forwards",
                      "row_forwards", "window_entries"):
                setattr(total, f, getattr(total, f) + getattr(run.stats, f))
            total.decode_s += run.stats.decode_s
            total.unmerged = run.stats.unmerged
            equal[run.system] = equal.get(run.system, 0) + (run.tokens == base.tokens)
    base_total = totals[runs[0][0].system]
    for j, (system, total) in enumerate(totals.items()):
        table.add_row("all" if j == 0 else "", *_figures(system, total, base_total, f"{equal[system]}/{len(prompts)}"),
                      style="bold")
    return table


def _figures(system: str, stats: GenerationStats, base: GenerationStats, same) -> list[str]:
    ratio = stats.decode_tokens_per_s / base.decode_tokens_per_s if base.decode_tokens_per_s else 0.0
    kv = f"{stats.kv_entries} ({stats.kv_ratio:.2f}×)"
    return [system, f"{stats.decode_tokens_per_s:.1f}", f"{ratio:.2f}×", f"{stats.tokens_per_forward:.2f}", kv,
            same if isinstance(same, str) else ("yes" if same else "no")]

