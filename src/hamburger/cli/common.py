"""What the commands share: their options (defined once, as argument groups), the help formatter, loading the model
the options name, and the start line.

Building the parser must stay fast (`hamburger --help` well under a second): nothing here imports torch,
transformers or the library's heavy modules at import time. The few library names the help shows are repeated
below as literals; tests/test_cli.py checks each against its source.
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import TYPE_CHECKING

from hamburger.model.config import MODES, check_lookup

if TYPE_CHECKING:
    from hamburger.model.hamburger_model import HamburgerModel

# --- the library's names, repeated so that building the parser imports no torch (checked by tests/test_cli.py) ----
DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # hamburger.model.base.DEFAULT_MODEL
DTYPES = ("float32", "bfloat16", "float16")  # hamburger.loading.DTYPES
SCHEMES = ("none", "fp16", "int8", "int4")  # hamburger.kernels.quantize.SCHEMES
GROUP_SIZES = (32, 64, 128, 256)  # hamburger.kernels.quantize.GROUP_SIZES
ENGINES = ("auto", "fast", "reference")  # hamburger.inference.engine.ENGINES
KV_CACHE_DTYPES = ("float16", "bfloat16", "float32")  # hamburger.inference.runner.KV_CACHE_DTYPES
PREFILL_TOKENS = 256  # hamburger.inference.admission.PREFILL_TOKENS
BUILTIN_SOURCES = ("gsm", "chat", "code", "stdlib")  # hamburger.training.sources.BUILTIN
MERGER_WEIGHTS = "merger.safetensors"  # hamburger.model.merger.WEIGHTS
TASKS = ("humaneval", "gsm", "chat", "prompts", "needle", "summary")  # hamburger.evaluation.evaluate.TASKS
DEFAULT_TASKS = ("humaneval", "gsm", "chat")  # hamburger.evaluation.evaluate.DEFAULT_TASKS
MAX_NEW_TOKENS = {"humaneval": 384, "gsm": 320, "chat": 256, "prompts": 256, "needle": 16, "summary": 192}  # ...evaluate.MAX_NEW_TOKENS
BENCH_SETS = ("code", "math", "chat", "long")  # hamburger.evaluation.bench_systems.SETS
BENCH_SYSTEMS = ("hf_generate", "engine_base", "prompt_lookup", "spec_int8_k2", "spec_int8_k4", "hamburger_ref",
                 "hamburger_engine", "hamburger_forced", "hamburger_verify", "hamburger_compress",
                 "llama_cpp", "llama_cpp_lookup")  # hamburger.evaluation.bench_systems.SYSTEMS


Options = argparse.ArgumentParser | argparse._ArgumentGroup  # where an option can be added


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help: appended unless the help already says it or there is none to show (None;
    a flag, whose default is not to be given); an option without help gets "default: ..." alone."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and _shows_default(action):
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not _shows_default(action):
            return text
        return text + " (default: %(default)s)"


def _shows_default(action: argparse.Action) -> bool:
    return bool(action.option_strings) and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS)


def command(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand whose help shows each option's default."""
    return sub.add_parser(name, help=help, description=help, formatter_class=DefaultsFormatter)


# --- shared options --------------------------------------------------------------------------------------------


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--model, --base, --dtype, --device: which model, in which dtype, where."""
    group = parser.add_argument_group("model")
    group.add_argument("--model", default="default",
                       help=f"HAMburger checkpoint folder, or a base model (hub id, folder, .gguf); default: the "
                       f"shipped checkpoint for {DEFAULT_MODEL}")
    group.add_argument("--base", default=None,
                       help="load a checkpoint's base from here instead of the reference it records")
    group.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and compute dtype")
    group.add_argument("--device", default="auto", help="torch device, e.g. cpu, cuda, cuda:1; auto: cuda if torch "
                       "sees a GPU, else cpu")


def add_quantize_args(parser: argparse.ArgumentParser, many: bool = False, default: str = "auto") -> None:
    """--quantize and --group-size, for the commands that decode (never those that train)."""
    group = parser.add_argument_group("weights")
    names = ",".join(("auto", *SCHEMES))
    what = f"a comma list from {{{names}}}: every system under each scheme, side by side" if many else f"{{{names}}}"
    group.add_argument("--quantize", default=default, metavar="SCHEME" + ("S" if many else ""),
                       help=f"{what}; weight-only quantization of the linear layers of the base, the micro-step "
                       "decoder and the LM head (auto: int4/int8 for the embedded default on a CPU where the native kernels run, "
                       "its GGUF's own blocks; else fp16 on an x86 CPU with float32 weights, else none; "
                       "fp16: float16 weights packed for FBGEMM, x86 CPUs; "
                       "int8: per output channel; int4: groups of --group-size; int8 and int4 compute in bfloat16 "
                       "on CPU, the fastest there; SCHEME/HEAD, e.g. int4/int8, puts another scheme on the LM "
                       "head; a +bf16 suffix, e.g. fp16+bf16, also gives passes of 8 or more rows (prefill, batches) "
                       "a bfloat16 copy of the weights, faster there on CPUs with AMX/AVX512-BF16, at bfloat16's "
                       "rounding and one more copy of the weights in memory); a last +a8 suffix, e.g. int4/int8+a8, "
                       "gives the 4-bit layers' native products 8-bit inputs (llama.cpp's precision: faster checks "
                       "of several positions on AVX-512, further from the float model), applied after loading; the embedder, "
                       "stop head and slot adapters stay float")
    group.add_argument("--group-size", type=int, default=32, metavar="N",
                       help=f"int4: input weights per scale and zero, one of {', '.join(map(str, GROUP_SIZES))} "
                       "(32 = GGUF Q4_1's blocks)")


def add_engine_arg(parser: Options) -> None:
    parser.add_argument("--engine", choices=ENGINES, default="auto",
                        help="fast: static KV caches (Llama, Mistral, Qwen2, Qwen3); reference: transformers, any "
                        "model (trust mode only); auto: fast where supported")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """--engine, --mode, --lookup, --kv-cache-dtype: how a decoding command decodes."""
    group = parser.add_argument_group("decoding")
    add_engine_arg(group)
    add_mode_arg(group)
    add_lookup_arg(group)
    add_kv_cache_arg(group)


def add_kv_cache_arg(parser: Options) -> None:
    parser.add_argument("--kv-cache-dtype", choices=("auto", *KV_CACHE_DTYPES), default="auto",
                        help="what the fast engine's KV cache holds; auto: float16 where its native layers run (half "
                        "the memory a token takes and the bytes a step reads, as llama.cpp), else the model's dtype; "
                        "float32: a float32 model's keys and values as computed")




def add_mode_arg(parser: Options, what: str = "default: the checkpoint's") -> None:
    parser.add_argument("--mode", choices=MODES, default=None,
                        help="trust: HAMburger (drafts kept, one KV entry per step); verify: the base checks every "
                        "draft, exactly the base's output; compress: verify against a base that keeps one merged KV "
                        "entry per step (needs a KV merger in the checkpoint); verify and compress run on the fast "
                        f"engine only; {what}")


def add_lookup_arg(parser: Options) -> None:
    """--lookup: verify and compress mode's lookup drafts (the checkpoint's `lookup` unless given)."""
    parser.add_argument("--lookup", type=int, default=None, metavar="N",
                        help="verify and compress mode: where the last N..3 tokens occurred before in the prompt or "
                        "the reply, draft what followed them there instead of running the micro-step decoder "
                        "(the base checks them like any draft); 0: micro-step drafts only; default: the checkpoint's")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """--temperature, --top-p, --top-k, --seed."""
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens with "
                       "this much probability")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    group.add_argument("--seed", type=int, default=None, help="seeds the sampling (default: unseeded)")


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """--quiet and --verbose: what a decoding command says on stderr besides its output."""
    group = parser.add_argument_group("messages")
    group.add_argument("--quiet", action="store_true", help="no start line and no progress bars on stderr")
    group.add_argument("--verbose", action="store_true",
                       help="also the quantization's details: layers per module, weights' MB before and after")


def add_decode_threads_arg(parser: Options) -> None:
    parser.add_argument("--decode-threads", type=int, default=None, metavar="N",
                        help="torch threads for decode passes (prefill passes use all); default on a CPU: one fewer "
                        "than torch's, so the HTTP side keeps a core; 0: all")


def add_dataclass_args(parser: argparse.ArgumentParser, settings: type, skip: tuple[str, ...]) -> None:
    """An option per field of a training settings dataclass (`training/args.py`), but those in `skip` (positional,
    or defined by hand with their help)."""
    for name, f in settings.__dataclass_fields__.items():
        if name not in skip:
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(f.default), default=f.default)


# --- running a command ---------------------------------------------------------------------------------------------


def load_model(args: argparse.Namespace, quantize: bool = True,
               decode_only: bool = False) -> tuple[HamburgerModel, bool, str]:
    """The model the options name (`loading.load`): (model, is_trained_checkpoint, the scheme of --quantize with
    "auto" resolved; "none" where the command has no --quantize). What needs no model is checked first (--lookup,
    the scheme against the device), so it costs no loading. `quantize` False: the weights stay float, for the
    caller to quantize. Progress bars only where stderr is a terminal, and never with --quiet. `decode_only`: the
    command only decodes with the fast engine (no training, no transformers generate), so the base may load without
    transformers (`loading.load`)."""
    from hamburger.loading import hide_progress_bars, load, resolve

    if getattr(args, "lookup", None) is not None:
        check_lookup(args.lookup)
    group_size = getattr(args, "group_size", 32)
    device, scheme = resolve(args.device, getattr(args, "quantize", "none"), args.dtype, group_size, args.model,
                             args.base)
    if getattr(args, "quiet", False) or not sys.stderr.isatty():
        hide_progress_bars()
    model, trained = load(args.model, args.base, args.dtype, str(device), scheme if quantize else "none", group_size,
                          quiet=not getattr(args, "verbose", False), decode_only=decode_only)
    return model, trained, scheme


def say_start(args: argparse.Namespace, model: HamburgerModel, trained: bool, scheme: str,
              mode: str | None = None) -> None:
    """The one line a decoding command starts with (`loading.describe_run`), unless --quiet."""
    from hamburger.loading import describe_run

    if not args.quiet:
        line = describe_run(model, trained, scheme, args.quantize == "auto", mode, getattr(args, "lookup", None))
        print(f"hamburger: {line}", file=sys.stderr, flush=True)


UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_kv_memory(text: str) -> tuple[int, str]:
    """`--kv-memory`: bytes ("512MB", "2GiB", "300000000") or KV entries ("40000entries"): (amount, "bytes" or
    "entries")."""
    value = text.strip().lower().replace(" ", "")
    unit = "entries" if value.endswith("entries") else "bytes"
    number = value.removesuffix("entries")
    digits = number.rstrip("kmgib")
    suffix = number[len(digits):]
    try:
        amount = float(digits) * (1 if unit == "entries" else UNITS[suffix])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 512MB, 2GiB, 40000entries)") from None
    if amount < 1:
        raise argparse.ArgumentTypeError(f"--kv-memory must be positive, got {text!r}")
    return int(amount), unit
