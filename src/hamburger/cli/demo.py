"""`hamburger demo`: the same prompt streamed side by side by the base model and by HAMburger
(`evaluation/demo.py`)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from hamburger.cli.common import (
    add_engine_args,
    add_model_args,
    add_output_args,
    add_quantize_args,
    command,
    load_model,
    say_start,
)
from hamburger.errors import HamburgerError

if TYPE_CHECKING:
    from hamburger.inference.modes import Mode


def register(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "demo", "stream a prompt side by side: the base model and HAMburger, with live figures")
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable); default: three built-in")
    p.add_argument("--chat", action="store_true", help="type your own prompts")
    p.add_argument("--confidence", type=float, default=None, help="default: the checkpoint's")
    p.add_argument("--max-new-tokens", type=int, default=160, help="the most tokens of each reply")
    p.add_argument("--no-table", action="store_true",
                   help="skip the closing table (every mode on the prompts: base, verify, compress, trust)")
    add_model_args(p)
    add_quantize_args(p)
    add_engine_args(p)
    add_output_args(p)
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from hamburger.inference.engine import make_engine, resolve_mode
    from hamburger.model.config import check_confidence
    from hamburger.model.hamburger_model import HamburgerModel

    if args.max_new_tokens <= 0:
        raise HamburgerError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.confidence is not None:
        check_confidence(args.confidence)
    model, trained, scheme = load_model(args, decode_only=args.engine != "reference")
    if not trained:
        raise HamburgerError(f"{args.model} is a base model: the demo compares a HAMburger checkpoint with its base "
                             "(leave --model out for the shipped default)")
    engines = {"base": make_engine(HamburgerModel.plain(model.base, model.tokenizer), args.engine,
                                   kv_dtype=args.kv_cache_dtype),
               "hamburger": make_engine(model, args.engine, lookup=args.lookup, kv_dtype=args.kv_cache_dtype)}
    mode, confidence = resolve_mode(model, args.mode, args.confidence, engines["hamburger"])
    say_start(args, model, trained, scheme, mode.name)
    console = Console()
    if args.chat:
        return _chat(console, engines, confidence, args.max_new_tokens, mode)
    _prompts(console, args, model, engines, confidence, mode)
    _hints(console, args, model, engines["hamburger"], scheme, mode)
    return 0


def _prompts(console, args: argparse.Namespace, model, engines: dict, confidence: float, mode: Mode) -> None:
    """The prompts side by side, then (unless --no-table) the closing table of every mode on them."""
    from hamburger.evaluation.demo import PROMPTS, mode_table, run_modes, side_by_side
    from hamburger.model.base import encode_chat

    prompts = args.prompt or list(PROMPTS)
    for prompt in prompts:
        side_by_side(console, prompt, [{"role": "user", "content": prompt}], engines, confidence,
                     args.max_new_tokens, mode)
        console.print()
    if not args.no_table:
        with console.status("Running every mode on these prompts for the closing table..."):
            runs = [run_modes(engines, encode_chat(model.tokenizer, [{"role": "user", "content": p}]),
                              args.max_new_tokens) for p in prompts]
        console.print(mode_table(prompts, runs))
        console.print("[dim]verify: the base checks every draft, so the text is exactly the base's. compress: "
                      "drafts checked by a base that keeps one merged KV entry per step (fewer KV entries, text "
                      "close to the base's). trust: the paper's method, drafts kept unchecked, one KV entry per "
                      "step. tok/fwd: tokens per base forward. KV entries: prompt and reply, × what the base "
                      "holds for the same text.[/dim]")


def _hints(console, args: argparse.Namespace, model, ham, scheme: str, mode: Mode) -> None:
    """The closing hints: a faster scheme where one applies, the other modes."""
    from hamburger.inference.modes import TRUST, VERIFY
    from hamburger.kernels.qlinear import fp16_unavailable

    device = next(model.parameters()).device
    if mode is VERIFY and getattr(getattr(ham, "runner", None), "draft_rows", 1) == 0:
        console.print("[dim]Verify mode drafted nothing here: with float32 weights on a CPU a base pass over a few "
                      "positions costs about as much as that many passes, so drafts cannot pay. --quantize fp16 "
                      "decodes both lanes about 2.3x faster and lets verify mode draft (make demo "
                      "ARGS=\"--quantize fp16\").[/dim]")
    elif scheme == "none" and device.type == "cpu" and fp16_unavailable(device) is None:
        console.print("[dim]On a CPU, --quantize fp16 decodes both lanes about 2.3x faster (float16 weights, "
                      "float32 compute; see the README).[/dim]")
    if mode is TRUST:
        console.print("[dim]--mode verify gives exactly the base's text: the base checks the micro-step "
                      "decoder's drafts (make demo ARGS=\"--mode verify\").[/dim]")
    elif mode is VERIFY and args.no_table:
        console.print("[dim]--mode trust is HAMburger as in the paper: drafts kept unchecked and each step smashed "
                      "into one KV entry (on this checkpoint about one token per step, close to the base's text "
                      "but not equal).[/dim]")


def _chat(console, engines: dict, confidence: float, max_new_tokens: int, mode: Mode) -> int:
    """Typed prompts side by side until an empty line or the end of input."""
    from hamburger.evaluation.demo import side_by_side

    console.print("[bold]Chat with both models (an empty line or Ctrl-D ends).[/bold]")
    while True:
        try:
            prompt = input("you> ") if sys.stdin.isatty() else sys.stdin.readline()
        except EOFError:
            return 0
        if not prompt.strip():
            return 0
        side_by_side(console, prompt.strip(), [{"role": "user", "content": prompt.strip()}], engines, confidence,
                     max_new_tokens, mode)
        console.print()
