"""`hamburger` command line: a thin layer over the library."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from hamburger.errors import HamburgerError
from hamburger.model.base import DEFAULT_MODEL, encode_chat

DTYPES = ("float32", "bfloat16", "float16")
# Commands that decode with the loaded model take --quantize (bench its own comma list); training commands do not.
QUANTIZE_COMMANDS = ("generate", "info", "demo", "serve", "eval", "bench-serve")
COMMAND_MODULES: tuple[str, ...] = ("hamburger.training.distill", "hamburger.training.segment", "hamburger.training.train", "hamburger.training.drafter",
                                    "hamburger.evaluation.evaluate",
                                    "hamburger.training.train_merger",
                                    "hamburger.evaluation.bench", "hamburger.serving.server", "hamburger.evaluation.bench_serve", "hamburger.evaluation.demo")


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
    parser.add_argument("--compile", action="store_true", help="torch.compile the fast engine's passes (base and micro-steps): 1.2-1.3x faster "
                        "steps on a CPU after minutes of compiling at first use (docs/engine.md)")
    parser.add_argument("--mode", choices=("trust", "verify", "compress"), default=None,
                        help="trust: HAMburger (drafts kept, one KV entry per step); verify: the base checks every "
                        "draft, exactly the base's output; compress: verify against a base that keeps one merged KV "
                        "entry per step (needs a KV merger in the checkpoint); verify and compress run on the fast "
                        "engine only; default: the checkpoint's")
    add_lookup_arg(parser)


def add_lookup_arg(parser: argparse.ArgumentParser) -> None:
    """--lookup: verify and compress mode's lookup drafts (the checkpoint's `lookup` unless given)."""
    parser.add_argument("--lookup", type=int, default=None, metavar="N",
                        help="verify and compress mode: where the last N..3 tokens occurred before in the prompt or "
                        "the reply, draft what followed them there instead of running the micro-step decoder "
                        "(the base checks them like any draft); 0: micro-step drafts only; default: the checkpoint's")


def add_quantize_args(parser: argparse.ArgumentParser, many: bool = False) -> None:
    """--quantize and --group-size, for the commands that decode (never those that train)."""
    from hamburger.inference.quantize import GROUP_SIZES, SCHEMES

    what = "a comma list from {" + ",".join(SCHEMES) + "}: every system under each scheme, side by side" if many \
        else "{" + ",".join(SCHEMES) + "}"
    parser.add_argument("--quantize", default="none", metavar="SCHEME" + ("S" if many else ""),
                        help=f"{what}; weight-only quantization of the linear layers of the base, the micro-step "
                        "decoder and the LM head (fp16: float16 weights packed for FBGEMM, x86 CPUs; "
                        "int8: per output channel; int4: groups of --group-size; int8 and int4 compute in bfloat16 "
                        "on CPU, the fastest there; SCHEME/HEAD, e.g. int4/int8, puts another scheme on the LM "
                        "head; a +bf16 suffix, e.g. fp16+bf16, also gives passes of 8 or more rows (prefill, batches) a bfloat16 "
                        "copy of the weights, faster there on CPUs with AMX/AVX512-BF16, at bfloat16's rounding and "
                        "one more copy of the weights in memory), applied after loading; the embedder, stop head and "
                        "slot adapters stay float")
    parser.add_argument("--group-size", type=int, default=32, metavar="N",
                        help=f"int4: input weights per scale and zero, one of {', '.join(map(str, GROUP_SIZES))} "
                        "(32 = GGUF Q4_1's blocks)")


WIDE_SUFFIX = "+bf16"


def split_scheme(spec: str) -> tuple[str, str | None]:
    """"int4" -> ("int4", None); "int4/int8" -> ("int4", "int8"): the layers' scheme and the LM head's (None: the
    same). A +bf16 suffix (`split_wide`) is not part of either."""
    scheme, _, head = split_wide(spec)[0].partition("/")
    return scheme, (head or None)


def split_wide(spec: str) -> tuple[str, bool]:
    """"fp16+bf16" -> ("fp16", True): the spec without the suffix, and whether wide passes use a bfloat16 copy."""
    return (spec.removesuffix(WIDE_SUFFIX), True) if spec.endswith(WIDE_SUFFIX) else (spec, False)


def parse_schemes(text: str, many: bool = False) -> list[str]:
    """--quantize's value: one scheme spec (or, with `many`, a comma list without repeats), checked. A spec is a
    scheme, or SCHEME/HEAD for another scheme on the LM head (e.g. int4/int8)."""
    from hamburger.inference.quantize import SCHEMES

    specs = [s.strip() for s in str(text).split(",")] if many else [str(text).strip()]
    bare = [split_wide(spec)[0] for spec in specs]
    parts = [p for spec in bare for p in ([spec] if spec.count("/") != 1 else spec.split("/"))]
    if not specs or any(p not in SCHEMES for p in parts):
        kind = "a comma list from" if many else "one of"
        raise HamburgerError(f"--quantize must be {kind} {', '.join(SCHEMES)} (or SCHEME/HEAD, e.g. int4/int8: "
                             f"another scheme for the LM head; either with {WIDE_SUFFIX}), got {text!r}")
    if any(wide and b == "none" for b, (_, wide) in zip(bare, map(split_wide, specs))):
        raise HamburgerError(f"--quantize none{WIDE_SUFFIX}: {WIDE_SUFFIX} gives a quantized model's wide passes a "
                             "bfloat16 copy of its weights; with float weights use --dtype bfloat16")
    return list(dict.fromkeys(specs))


def check_quantize(spec: str, group_size: int, device, dtype) -> None:
    """Refuse, before any loading, what the packed kernels cannot run: a HamburgerError naming the fix."""
    spec, wide = split_wide(spec)
    if wide:
        from hamburger.inference.qlinear import wide_unavailable

        if (why := wide_unavailable(device)) is not None:
            raise HamburgerError(f"--quantize {spec}{WIDE_SUFFIX}: {why}")
    scheme, head = split_scheme(spec)
    if head is not None:
        check_quantize(head, group_size, device, dtype)
    from hamburger.inference.quantize import check_args

    try:
        check_args(scheme, group_size)
    except ValueError as exc:
        raise HamburgerError(f"--group-size: {exc}") from None
    if scheme == "none":
        return
    if device.type not in ("cpu", "cuda"):
        raise HamburgerError(f"--quantize {scheme}: the packed int8/int4 kernels run on cpu and cuda only, "
                             f"not {device.type}")
    import torch

    if scheme == "fp16":
        from hamburger.inference.qlinear import fp16_unavailable

        if (why := fp16_unavailable(device)) is not None:
            raise HamburgerError(f"--quantize fp16: {why}")
    if scheme == "int4" and device.type == "cuda" and dtype != torch.bfloat16:
        raise HamburgerError(f"--quantize int4 on CUDA runs in bfloat16 only (the kernel's one dtype), not "
                             f"{str(dtype).removeprefix('torch.')}: add --dtype bfloat16, or use --quantize int8")


def quantize_loaded(model, spec: str, group_size: int = 32, quiet: bool = False) -> dict | None:
    """Quantize a loaded HamburgerModel in place (base, micro-step decoder, LM head); one line on stderr.

    Quantizes afresh every time (about a second for the 135M default): the disk cache of
    `quantize.quantize_cached` would save little here. `spec`: a scheme, or SCHEME/HEAD (`split_scheme`). Returns
    the summary of `quantize.quantize_model` (None when nothing is quantized) with `layers` (quantized layers per
    top module: base, micro) added.
    """
    import torch

    from hamburger.inference.qlinear import WIDE_ROWS
    from hamburger.inference.quantize import (
        DEFAULT_SKIP,
        QuantizedLinear,
        quantize_model,
    )

    scheme, head = split_scheme(spec)
    wide = split_wide(spec)[1]
    if scheme == "none" and head in (None, "none"):
        return None
    param = next(model.parameters())
    check_quantize(spec, group_size, param.device, param.dtype)
    if model.config.lora_rank:
        model.merge_lora()  # the LoRA deltas go into the base weights first: the kernels take plain weights
    # A plain base (one token per step) never runs its placeholder micro-step decoder: it stays as it is.
    skip = DEFAULT_SKIP + (("micro",) if model.config.max_step_tokens == 1 else ())
    try:
        summary = quantize_model(model, scheme, group_size, head=head, skip=skip, wide=wide)
    except ValueError as exc:
        raise HamburgerError(f"--quantize {spec}: {exc}") from None
    if not summary["quantized"]:
        reasons = sorted(set(summary["skipped_layers"].values()))
        raise HamburgerError(f"--quantize {spec}" + (f" --group-size {group_size}" if "int4" in spec else "")
                             + ": no linear layer of this model fits the kernels"
                             + (f" ({reasons[0]})" if reasons else ""))
    layers: dict[str, int] = {}
    kernels = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            top = name.split(".")[0]
            layers[top] = layers.get(top, 0) + 1
            kernels.setdefault(type(module), module)
    for module in kernels.values():  # the kernels must run here: an error now, not mid-generation
        try:
            with torch.inference_mode():
                for rows in (1, WIDE_ROWS) if wide else (1,):  # wide passes run another kernel
                    module(torch.zeros(rows, module.in_features, dtype=param.dtype, device=param.device))
        except (RuntimeError, NotImplementedError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise HamburgerError(f"--quantize {module.scheme} does not run on {param.device.type} in "
                                 f"{str(param.dtype).removeprefix('torch.')}: {first}") from None
    summary["layers"] = layers
    if not quiet:
        print("quantize: " + describe_quantization(summary), file=sys.stderr, flush=True)
    return summary


def describe_quantization(summary: dict) -> str:
    """One line: scheme, layers (per module), skipped layers, weight MB before -> after."""
    mb = 2**20
    group = f" (groups of {summary['group_size']})" if "int4" in (summary["scheme"], summary["head"]) else ""
    head = f", LM head {summary['head']}" if summary["head"] != summary["scheme"] else ""
    parts = ", ".join(f"{name} {count}" for name, count in summary.get("layers", {}).items())
    line = f"{summary['scheme']}{group}{head}: {summary['quantized']} linear layers ({parts})"
    if summary["skipped"]:
        line += f", {summary['skipped']} left float ({next(iter(summary['skipped_layers'].values()))})"
    before, after = summary["linear_bytes_before"] / mb, summary["linear_bytes_after"] / mb
    line += (f"; weights {summary['bytes_before'] / mb:.1f} MB -> {summary['bytes_after'] / mb:.1f} MB "
             f"(quantized layers {before:.1f} MB -> {after:.1f} MB)")
    if summary.get("wide_bytes"):
        line += f"; wide passes in bfloat16: {summary['wide_bytes'] / mb:.1f} MB more"
    return line


def load_from_args(args: argparse.Namespace, quantize: bool = True):
    """The model named by --model/--base/--dtype/--device: (HamburgerModel, is_trained_checkpoint).

    Where the command has --quantize (decoding commands only), its schemes and --group-size are checked
    against the device and dtype before loading; with `quantize`, the loaded model's linear layers are
    then quantized in place (`quantize_loaded`). Callers that quantize themselves (info, bench's comma
    list) pass quantize=False.
    """
    import torch

    from hamburger.model.hamburger_model import load_model

    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as exc:
        raise HamburgerError(f"device {args.device!r} is not usable here: {exc}") from exc
    scheme, group_size = "none", 32
    if hasattr(args, "quantize"):
        for name in parse_schemes(args.quantize, many=not quantize):
            check_quantize(name, args.group_size, device, getattr(torch, args.dtype))
        if quantize:
            scheme, group_size = parse_schemes(args.quantize)[0], args.group_size
    lookup = getattr(args, "lookup", None)
    if lookup is not None:
        from hamburger.model.config import check_lookup

        check_lookup(lookup)
    model, trained = load_model(args.model, args.base, dtype=getattr(torch, args.dtype), device=str(device))
    if lookup is not None:
        model.config.lookup = lookup
    quantize_loaded(model, scheme, group_size)
    return model, trained


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
    for name in QUANTIZE_COMMANDS:
        add_quantize_args(sub.choices[name])
    return parser


def _prompt_ids(tokenizer, text: str, raw: bool, system: str | None) -> list[int]:
    if not text.strip():
        raise HamburgerError("the prompt is empty")
    if raw or not tokenizer.chat_template:
        return tokenizer(text, add_special_tokens=True)["input_ids"]
    return encode_chat(tokenizer, ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}])


def cmd_generate(args: argparse.Namespace) -> int:
    # Validate what needs no model before spending seconds loading one.
    from hamburger.inference.engine import make_engine
    from hamburger.inference.sampling import SamplingParams
    from hamburger.model.config import check_confidence

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
        print(json.dumps({"model": args.model, "hamburger": trained, "mode": gen.mode, "quantize": args.quantize,
                          "text": text, "steps": out.steps[0], **stats.to_dict()}))
    else:
        print()
        print(f"[{gen.mode}: {stats.generated_tokens} tokens in {stats.base_forwards} base forwards "
              f"({stats.tokens_per_forward:.2f} tokens/forward), {stats.macro_steps} steps, "
              f"{stats.kv_entries} KV entries (base: {stats.kv_entries_base}), "
              f"{stats.decode_tokens_per_s:.1f} decode tokens/s]", file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from hamburger.inference.quantize import model_bytes

    scheme = parse_schemes(args.quantize)[0]
    model, trained = load_from_args(args, quantize=False)  # the parameter counts are those of the float model
    counts = model.parameter_counts() if trained else {"base": model.parameter_counts()["base"]}
    weights = model_bytes(model) if trained else model_bytes(model.base)
    summary = quantize_loaded(model, scheme, args.group_size, quiet=args.json)
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
