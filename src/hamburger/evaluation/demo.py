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
                 max_new_tokens: int, mode: str = "trust") -> tuple[Lane, Lane]:
    from hamburger.model.base import encode_chat

    base_engine, ham_engine = engines["base"], engines["hamburger"]
    tokenizer = ham_engine.model.tokenizer
    ids = encode_chat(tokenizer, messages)
    base = Lane("base model", iter(base_engine.stream([ids], max_new_tokens=max_new_tokens,
                                                                            confidence=1.0)),
                tokenizer, len(ids), colour_steps=False)
    title = f"HAMburger{'' if mode == 'trust' else ' ' + mode} @ {confidence:g}"
    lookup = getattr(ham_engine, "lookup", 0) if mode != "trust" else 0
    if lookup:
        title += " + lookup"
    legend = ("base: one token per forward. " + title + {
        "verify": " (exactly the base's text)", "compress": " (checked against a base whose past steps are merged)",
    }.get(mode, "") + ": coloured runs of text came from one forward."
        + (" Drafts come from the micro-step decoder, or, where the last tokens occurred before, from what "
           "followed them there." if lookup else ""))
    ham = Lane(title, iter(ham_engine.stream([ids], max_new_tokens=max_new_tokens, confidence=confidence, mode=mode)),
               tokenizer, len(ids), colour_steps=True, unmerged=mode == "verify")
    with Live(render(prompt, [base, ham], legend=legend), console=console, refresh_per_second=8) as live:
        while not (base.done and ham.done):
            for lane in (base, ham):
                if not lane.done:
                    lane.advance()
            live.update(render(prompt, [base, ham], legend=legend))
        ham_s, base_s = ham.stats, base.stats
        ratio = ham_s.decode_tokens_per_s / base_s.decode_tokens_per_s if base_s.decode_tokens_per_s else 0.0
        kv = ham_s.kv_entries / max(1, base_s.kv_entries)
        live.update(render(prompt, [base, ham], f"HAMburger: {ratio:.2f}× the base's decode tokens/s, "
                                               f"{kv:.2f}× its KV entries", legend))
    return base, ham
