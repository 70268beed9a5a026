"""`hamburger` command line: a thin layer over the library."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from hamburger.base import DEFAULT_MODEL, encode_chat
from hamburger.errors import HamburgerError

DTYPES = ("float32", "bfloat16", "float16")
COMMAND_MODULES: tuple[str, ...] = ("hamburger.distill", "hamburger.segment", "hamburger.train", "hamburger.drafter",
                                    "hamburger.evaluate",
                                    "hamburger.merger",
                                    "hamburger.bench", "hamburger.server", "hamburger.bench_serve", "hamburger.demo")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help=f"HAMburger checkpoint folder, or a base model (hub id, folder, .gguf); default: {DEFAULT_MODEL}")
    parser.add_argument("--base", default=None, help="load a checkpoint's base from here instead of the reference it records")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and compute dtype")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=("auto", "fast", "reference"), default="auto",
                        help="fast: static KV caches (Llama, Mistral, Qwen2, Qwen3); reference: transformers, any "
                        "model; auto: fast where supported")
    parser.add_argument("--compile", action="store_true", help="torch.compile the fast engine's base step")
    parser.add_argument("--mode", choices=("trust", "verify"), default=None,
                        help="trust: HAMburger (drafts kept, one KV entry per step); verify: the base checks every "
                        "draft, exactly the base's output (fast engine only); default: the checkpoint's")


def load_from_args(args: argparse.Namespace):
    """The model named by --model/--base/--dtype/--device: (HamburgerModel, is_trained_checkpoint)."""
    import torch

    from hamburger.model import load_model

    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:
        raise HamburgerError(f"device {args.device!r} is not usable here: {exc}") from exc
    return load_model(args.model, args.base, dtype=getattr(torch, args.dtype), device=str(device))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hamburger", description="HAMburger: several tokens per base forward, one KV entry per step.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a reply to a chat message (or continue a raw prompt)")
    gen.add_argument("text", help="the user's chat message (with --raw: the prompt text to continue); - reads stdin")
    add_model_args(gen)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--system", default=None, help="system message for the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--confidence", type=float, default=None, help="P(continue) a step needs to take another token, in (0, 1]")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    add_engine_args(gen)

    gen.set_defaults(func=cmd_generate)

    info = sub.add_parser("info", help="what a model is: architecture, sizes, parameters of each module")
    add_model_args(info)
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)

    for module in COMMAND_MODULES:  # each registers its own subcommand(s) with set_defaults(func=...)
        importlib.import_module(module).register(sub, add_model_args)
    return parser


def _prompt_ids(tokenizer, text: str, raw: bool, system: str | None) -> list[int]:
    if not text.strip():
        raise HamburgerError("the prompt is empty")
    if raw or not tokenizer.chat_template:
        return tokenizer(text, add_special_tokens=True)["input_ids"]
    return encode_chat(tokenizer, ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}])


def cmd_generate(args: argparse.Namespace) -> int:
    # Validate what needs no model before spending seconds loading one.
    from hamburger.config import check_confidence
    from hamburger.engine import make_engine
    from hamburger.sampling import SamplingParams

    if args.text == "-":
        args.text = sys.stdin.read()

    if args.max_new_tokens <= 0:
        raise HamburgerError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.confidence is not None:
        check_confidence(args.confidence)
    if not args.text.strip():
        raise HamburgerError("the prompt is empty")
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)

    model, trained = load_from_args(args)
    if not trained:
        print(f"note: {args.model} is a base model, not a HAMburger checkpoint: decoding one token per step "
              "(exactly the base model's output)", file=sys.stderr)
    tokenizer = model.tokenizer
    prompt = _prompt_ids(tokenizer, args.text, args.raw, args.system)
    engine = make_engine(model, args.engine, args.compile)
    gen = engine.stream([prompt], max_new_tokens=args.max_new_tokens, confidence=args.confidence, sampling=sampling,
                        mode=args.mode)
    shown = ""
    for _ in gen:
        if not args.json:
            text = tokenizer.decode(gen.tokens[0], skip_special_tokens=True)
            print(text[len(shown):], end="", flush=True)
            shown = text
    out = gen.output()
    stats = out.stats
    text = tokenizer.decode(out.tokens[0], skip_special_tokens=True)
    if args.json:
        print(json.dumps({"model": args.model, "hamburger": trained, "mode": gen.mode, "text": text,
                          "steps": out.steps[0], **stats.to_dict()}))
    else:
        print()
        print(f"[{gen.mode}: {stats.generated_tokens} tokens in {stats.base_forwards} base forwards "
              f"({stats.tokens_per_forward:.2f} tokens/forward), {stats.macro_steps} steps, "
              f"{stats.kv_entries} KV entries (base: {stats.kv_entries_base}), "
              f"{stats.decode_tokens_per_s:.1f} decode tokens/s]", file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    model, trained = load_from_args(args)
    bcfg, cfg = model.base.config, model.config
    info = {
        "model": args.model,
        "hamburger_checkpoint": trained,
        "base_model": cfg.base_model,
        "base_fingerprint": cfg.base_fingerprint,
        "architecture": (bcfg.architectures or [type(model.base).__name__])[0],
        "layers": bcfg.num_hidden_layers,
        "hidden_size": bcfg.hidden_size,
        "vocab_size": bcfg.vocab_size,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "max_step_tokens": cfg.max_step_tokens,
        "default_confidence": cfg.default_confidence,
        "parameters": model.parameter_counts() if trained else {"base": model.parameter_counts()["base"]},
    }
    if trained:
        info.update(micro_layers=cfg.micro_layers, feature_layers=cfg.feature_layers,
                    slot_adapter_rank=cfg.slot_adapter_rank)
    if args.json:
        print(json.dumps(info))
        return 0
    for key, value in info.items():
        if key == "parameters":
            for name, count in value.items():
                print(f"  params.{name:<14} {count:>14,}")
        else:
            print(f"{key:<22} {value}")
    if not trained:
        print("(a base model: generation runs it one token per step; pass a HAMburger checkpoint for the speed-up)")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except HamburgerError as exc:
        print(f"hamburger: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
