"""`hamburger generate` (one reply, streamed) and `hamburger info` (what a model is)."""

from __future__ import annotations

import argparse
import json
import sys

from hamburger.cli.common import (
    add_engine_args,
    add_model_args,
    add_output_args,
    add_quantize_args,
    add_sampling_args,
    command,
    load_model,
    say_start,
)
from hamburger.errors import HamburgerError


def register(sub: argparse._SubParsersAction) -> None:
    gen = command(sub, "generate", "generate a reply to a chat message (or continue a raw prompt)")
    gen.add_argument("text", help="the user's chat message (with --raw: the prompt text to continue); - reads stdin")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--system", default=None, help="system message for the chat template (default: none)")
    gen.add_argument("--max-new-tokens", type=int, default=256, help="the reply's most tokens")
    gen.add_argument("--stop", action="append", default=None, metavar="TEXT",
                     help="end the reply before this text (repeatable; the server's `stop`); default: none")
    gen.add_argument("--confidence", type=float, default=None,
                     help="P(continue) a step needs to take another token, in (0, 1]; default: the checkpoint's")
    gen.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    add_model_args(gen)
    add_quantize_args(gen)
    add_engine_args(gen)
    add_sampling_args(gen)
    add_output_args(gen)
    gen.set_defaults(func=cmd_generate)

    info = command(sub, "info", "what a model is: architecture, sizes, parameters of each module")
    info.add_argument("--json", action="store_true", help="one JSON object")
    add_model_args(info)
    add_quantize_args(info)
    info.add_argument("--verbose", action="store_true", help="also the quantization's details on stderr")
    info.set_defaults(func=cmd_info)


def _prompt_ids(tokenizer, text: str, raw: bool, system: str | None) -> list[int]:
    from hamburger.model.base import encode_chat

    if raw or not tokenizer.chat_template:
        return tokenizer(text, add_special_tokens=True)["input_ids"]
    turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return encode_chat(tokenizer, turns)


def cmd_generate(args: argparse.Namespace) -> int:
    # Validate what needs no model before spending seconds loading one.
    from hamburger.inference.engine import make_engine, resolve_mode
    from hamburger.inference.sampling import SamplingParams
    from hamburger.inference.stops import TextStream
    from hamburger.model.config import check_confidence

    if args.text == "-":
        args.text = sys.stdin.read()
    if args.max_new_tokens <= 0:
        raise HamburgerError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.confidence is not None:
        check_confidence(args.confidence)
    if not args.text.strip():
        raise HamburgerError("the prompt is empty")
    if any(not stop for stop in args.stop or []):
        raise HamburgerError("--stop needs a text")
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)

    model, trained, scheme = load_model(args, decode_only=args.engine != "reference")
    tokenizer = model.tokenizer
    prompt = _prompt_ids(tokenizer, args.text, args.raw, args.system)
    engine = make_engine(model, args.engine, lookup=args.lookup, kv_dtype=args.kv_cache_dtype)
    mode = resolve_mode(model, args.mode, args.confidence, engine)[0]
    say_start(args, model, trained, scheme, mode.name)
    gen = engine.stream([prompt], max_new_tokens=args.max_new_tokens, confidence=args.confidence, sampling=sampling,
                        mode=mode)
    text = TextStream(tokenizer, args.stop or [])
    steps = iter(gen)
    for event in steps:
        delta = text.feed(event.tokens[0], final=event.finished[0])
        if not args.json:
            print(delta, end="", flush=True)
        if text.stopped:
            steps.close()  # decoding ends at the stop text
            break
    else:
        tail = text.feed([], final=True)  # what was held back as a possible start of a stop text
        if not args.json:
            print(tail, end="")
    out = gen.output()
    stats = out.stats
    if args.json:
        print(json.dumps({"model": args.model, "hamburger": trained, "mode": mode.name, "quantize": scheme,
                          "text": text.text, "stopped": text.stopped, "steps": out.steps[0], **stats.to_dict()}))
    else:
        print()
        print(f"[{mode}: {stats.generated_tokens} tokens in {stats.base_forwards} base forwards "
              f"({stats.tokens_per_forward:.2f} tokens/forward), {stats.macro_steps} steps, "
              f"{stats.kv_entries} KV entries (base: {stats.kv_entries_base}), "
              f"{stats.decode_tokens_per_s:.1f} decode tokens/s]", file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from hamburger.kernels.quantize import model_bytes
    from hamburger.loading import quantize_loaded

    # the parameter counts are those of the float model
    model, trained, scheme = load_model(args, quantize=False, decode_only=True)
    counts = model.parameter_counts() if trained else {"base": model.parameter_counts()["base"]}
    weights = model_bytes(model) if trained else model_bytes(model.base)
    summary = quantize_loaded(model, scheme, args.group_size, quiet=not args.verbose)
    bcfg, cfg = model.base.config, model.config
    info = {
        "model": args.model,
        "hamburger_checkpoint": trained,
        "base_model": cfg.base_model,
        "base_fingerprint": cfg.base_fingerprint,
        "architecture": (getattr(bcfg, "architectures", None) or [type(model.base).__name__])[0],
        "layers": bcfg.num_hidden_layers,
        "hidden_size": bcfg.hidden_size,
        "vocab_size": bcfg.vocab_size,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "max_step_tokens": cfg.max_step_tokens,
        "default_mode": cfg.default_mode,
        "default_confidence": cfg.default_confidence,
        "verify_confidence": cfg.verify_confidence,
        "lookup": cfg.lookup,
        "kv_merger": model.merger is not None,
        "parameters": counts,
        "weights_mb": round(weights / 2**20, 1),
    }
    if summary is not None:
        after = model_bytes(model) if trained else model_bytes(model.base)
        info.update(quantize=scheme, group_size=args.group_size if "int4" in scheme else None,
                    quantized_layers=summary["layers"], quantized_weights_mb=round(after / 2**20, 1))
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
        elif key == "quantized_layers":
            print(f"{key:<22} " + ", ".join(f"{name} {count}" for name, count in value.items()))
        else:
            print(f"{key:<22} {value}")
    if not trained:
        print("(a base model: generation runs it one token per step; pass a HAMburger checkpoint for the speed-up)")
    return 0
