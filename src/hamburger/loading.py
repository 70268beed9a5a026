"""Loading a model to decode with: the device, the weights' quantization, and the line that says what runs.

Every command that loads a model goes through `load`, and so can a program: names in, a ready `HamburgerModel`
out. "auto" picks what delivers on the machine at hand (a GPU if there is one; fp16 weights on an x86 CPU), so
that the defaults are the fast configuration, and `describe_run` says in one line what that choice means for
the output. Light to import: torch and transformers load inside the functions.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from hamburger.errors import HamburgerError

if TYPE_CHECKING:
    import torch

    from hamburger.model.hamburger_model import HamburgerModel

AUTO = "auto"
DTYPES = ("float32", "bfloat16", "float16")
WIDE_SUFFIX = "+bf16"
# the 4-bit layers' native products with their inputs in 8 bits (`native.INT4_Q8`): llama.cpp's precision, faster
# checks of several positions where the CPU multiplies bytes (docs/quantize.md); last in a spec ("int4/int8+a8")
A8_SUFFIX = "+a8"


def resolve_device(device: str = AUTO) -> torch.device:
    """"auto": cuda where torch sees a GPU, else cpu. Any device is checked usable here before seconds of loading."""
    import torch

    name = ("cuda" if torch.cuda.is_available() else "cpu") if device == AUTO else device
    try:
        resolved = torch.device(name)
        torch.empty(0, device=resolved)
    except (RuntimeError, AssertionError) as exc:
        raise HamburgerError(f"device {device!r} is not usable here: {exc}") from exc
    return resolved


GGUF_BLOCKS = "int4/int8"  # the embedded default's GGUF: Q4_1 projections, a Q8_0 embedding (the tied LM head)


def resolve_quantize(spec: str, device: torch.device | str, dtype: str = "float32", model: str | None = None,
                     base: str | None = None) -> str:
    """"auto": for the embedded default (`model` one of its names, or a checkpoint folder on its base that holds no
    base weights of its own and no LoRA: `on_default_base`; no other `base`) on a CPU where the native kernels run,
    int4/int8: its GGUF's own Q4_1 and Q8_0 blocks, so its weights exactly, and faster than the fp16 base there (`hamburger bench --quantize`; docs/quantize.md). Else fp16 where FBGEMM's packed float16 GEMM runs float32 models (x86 CPUs:
    faster than float32 at decoding, the weights with which verify mode's drafts pay on a CPU), else none (a GPU
    decodes fast in --dtype). Any other spec is returned as it is."""
    if spec != AUTO:
        return spec
    from hamburger.kernels import native
    from hamburger.kernels.qlinear import fp16_unavailable
    from hamburger.model.base import DEFAULT_ALIASES

    cpu = getattr(device, "type", str(device)) == "cpu"
    default = model is not None and (model.lower() in DEFAULT_ALIASES or on_default_base(model))
    if default and base is None and cpu and dtype == "float32" and native.available():
        return GGUF_BLOCKS
    return "fp16" if dtype == "float32" and fp16_unavailable(device) is None else "none"


def on_default_base(model: str) -> bool:
    """Whether `model` is a checkpoint folder (one trained from the shipped checkpoint, say) whose base is the embedded
    default's, untouched: the base's weights are not in the checkpoint (no `--base-training full`) and no LoRA rides
    on it, so the base it loads is the default's GGUF, as for the shipped checkpoint."""
    from hamburger.model.base import DEFAULT_ALIASES
    from hamburger.model.config import HamburgerConfig

    if not HamburgerConfig.is_checkpoint(model):
        return False
    try:
        config = HamburgerConfig.load(model)
    except HamburgerError:
        return False
    return (str(config.base_model).lower() in DEFAULT_ALIASES and not config.base_in_checkpoint
            and not config.lora_rank)


def split_scheme(spec: str) -> tuple[str, str | None]:
    """"int4" -> ("int4", None); "int4/int8" -> ("int4", "int8"): the layers' scheme and the LM head's (None: the
    same). A +bf16 suffix (`split_wide`) is not part of either."""
    scheme, _, head = split_wide(spec)[0].partition("/")
    return scheme, (head or None)


def split_wide(spec: str) -> tuple[str, bool]:
    """"fp16+bf16" -> ("fp16", True): the spec without the suffix (nor +a8), and whether wide passes use a bfloat16
    copy."""
    spec = split_a8(spec)[0]
    return (spec.removesuffix(WIDE_SUFFIX), True) if spec.endswith(WIDE_SUFFIX) else (spec, False)


def split_a8(spec: str) -> tuple[str, bool]:
    """"int4/int8+a8" -> ("int4/int8", True): the spec without the suffix, and whether the 4-bit layers' native
    products take 8-bit inputs."""
    return (spec.removesuffix(A8_SUFFIX), True) if spec.endswith(A8_SUFFIX) else (spec, False)


def parse_schemes(text: str, many: bool = False) -> list[str]:
    """--quantize's value: one scheme spec (or, with `many`, a comma list without repeats), checked. A spec is
    "auto" (`resolve_quantize`), a scheme, or SCHEME/HEAD for another scheme on the LM head (e.g. int4/int8)."""
    from hamburger.kernels.quantize import SCHEMES

    specs = [s.strip() for s in str(text).split(",")] if many else [str(text).strip()]
    bare = [split_wide(spec)[0] for spec in specs if spec != AUTO]
    parts = [p for spec in bare for p in ([spec] if spec.count("/") != 1 else spec.split("/"))]
    if not specs or any(p not in SCHEMES for p in parts):
        kind = "a comma list from" if many else "one of"
        raise HamburgerError(f"--quantize must be {kind} {AUTO}, {', '.join(SCHEMES)} (or SCHEME/HEAD, e.g. int4/int8: "
                             f"another scheme for the LM head; either with {WIDE_SUFFIX}; int4 layers with {A8_SUFFIX}), got {text!r}")
    if any(split_a8(spec)[1] and split_scheme(spec)[0] != "int4" for spec in specs):
        raise HamburgerError(f"--quantize {text}: {A8_SUFFIX} gives the 4-bit layers' products 8-bit inputs: the "
                             f"layers' scheme must be int4 (e.g. int4/int8{A8_SUFFIX})")
    if any(wide and b == "none" for b, (_, wide) in zip(bare, map(split_wide, specs))):
        raise HamburgerError(f"--quantize none{WIDE_SUFFIX}: {WIDE_SUFFIX} gives a quantized model's wide passes a "
                             "bfloat16 copy of its weights; with float weights use --dtype bfloat16")
    return list(dict.fromkeys(specs))


def check_quantize(spec: str, group_size: int, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, before any loading, what the packed kernels cannot run: a HamburgerError naming the fix."""
    if split_a8(spec)[1]:
        from hamburger.kernels import native

        if getattr(device, "type", str(device)) != "cpu" or not native.available():
            why = native.why_unavailable() or "the native kernels run on a CPU"
            raise HamburgerError(f"--quantize {spec}: 8-bit inputs are the native kernels' ({why})")
    spec, wide = split_wide(spec)
    if wide:
        from hamburger.kernels.qlinear import wide_unavailable

        if (why := wide_unavailable(device)) is not None:
            raise HamburgerError(f"--quantize {spec}{WIDE_SUFFIX}: {why}")
    scheme, head = split_scheme(spec)
    if head is not None:
        check_quantize(head, group_size, device, dtype)
    from hamburger.kernels.quantize import check_args

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
        from hamburger.kernels.qlinear import fp16_unavailable

        if (why := fp16_unavailable(device)) is not None:
            raise HamburgerError(f"--quantize fp16: {why}")
    if scheme == "int4" and device.type == "cuda" and dtype != torch.bfloat16:
        raise HamburgerError(f"--quantize int4 on CUDA runs in bfloat16 only (the kernel's one dtype), not "
                             f"{str(dtype).removeprefix('torch.')}: add --dtype bfloat16, or use --quantize int8")


def quantize_loaded(model: HamburgerModel, spec: str, group_size: int = 32, quiet: bool = False) -> dict | None:
    """Quantize a loaded HamburgerModel in place (base, micro-step decoder, LM head); one line on stderr unless
    `quiet`.

    Quantizes afresh every time (about a second for the 135M default): the disk cache of
    `quantize.quantize_cached` would save little here. `spec`: a scheme, or SCHEME/HEAD (`split_scheme`). Returns
    the summary of `quantize.quantize_model` (None when nothing is quantized) with `layers` (quantized layers per
    top module: base, micro) added.
    """
    import torch

    from hamburger.kernels.qlinear import WIDE_ROWS
    from hamburger.kernels.quantize import DEFAULT_SKIP, QuantizedLinear, quantize_model

    scheme, head = split_scheme(spec)
    wide = split_wide(spec)[1]
    if scheme == "none" and head in (None, "none"):
        return None
    param = next(model.parameters())
    check_quantize(spec, group_size, param.device, param.dtype)
    if model.config.lora_rank:
        # The kernels take plain weights: the LoRA deltas go into the base first, and can no longer be switched off
        print("quantize: this checkpoint's LoRA is merged into the base to quantize it: verify and compress mode then "
              "check drafts against the adapted base, not the untouched one (--quantize none keeps them exact)",
              file=sys.stderr, flush=True)
        model.merge_lora()
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
    if split_a8(spec)[1]:  # before the kernels are tried below: the 8-bit kind is one of them
        summary["activations8"] = _a8_inputs(model, spec)
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


def _a8_inputs(model: HamburgerModel, spec: str) -> int:
    """`+a8`: the quantized model's 4-bit layers' native products take 8-bit inputs (`native.INT4_Q8`); how many."""
    from hamburger.kernels.quantize import inputs_in_8_bits

    count = inputs_in_8_bits(model)
    if not count:
        raise HamburgerError(f"--quantize {spec}: no 4-bit layer runs on the native kernels here")
    return count


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
    if summary.get("activations8"):
        line += f"; 8-bit inputs to {summary['activations8']} 4-bit layers"
    if summary.get("wide_bytes"):
        line += f"; wide passes in bfloat16: {summary['wide_bytes'] / mb:.1f} MB more"
    return line


def resolve(device: str = AUTO, quantize: str = AUTO, dtype: str = "float32", group_size: int = 32,
            model: str | None = None, base: str | None = None) -> tuple[torch.device, str]:
    """The device and the quantization scheme a load of `model` (with `base`) will use, "auto" resolved
    (`resolve_device`, `resolve_quantize`), checked against each other before any loading: what `load` runs first,
    and what a command that says what it runs before loading calls itself."""
    import torch

    if dtype not in DTYPES:
        raise HamburgerError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    resolved = resolve_device(device)
    scheme = resolve_quantize(parse_schemes(quantize)[0], resolved, dtype, model, base)
    check_quantize(scheme, group_size, resolved, getattr(torch, dtype))
    return resolved, scheme


def load(model: str = "default", base: str | None = None, dtype: str = "float32", device: str = AUTO,
         quantize: str = AUTO, group_size: int = 32, quiet: bool = True, decode_only: bool = False,
         ) -> tuple[HamburgerModel, bool]:
    """The model named `model` (a HAMburger checkpoint folder, or a base: hub id, folder, .gguf; "default": the
    shipped checkpoint) on `device`, its linear layers quantized by `quantize`: (model, is_trained_checkpoint).

    The device, dtype and scheme are checked before any loading, so a bad one costs no seconds. `base` loads a
    checkpoint's base from there instead of the reference it records. `quiet=False`: a "quantize: ..." line on
    stderr. `decode_only`: the model is for decoding with the fast engine only, so a local Llama-style base loads without
    transformers (`base.load_base`); training and the reference engine need transformers' classes.
    """
    import torch

    from hamburger.model.hamburger_model import load_model

    resolved, scheme = resolve(device, quantize, dtype, group_size, model, base)
    loaded, trained = load_model(model, base, dtype=getattr(torch, dtype), device=str(resolved),
                                 decode_only=decode_only)
    quantize_loaded(loaded, scheme, group_size, quiet=quiet)
    return loaded, trained


def hide_progress_bars() -> None:
    """No progress bars while loading (transformers' and the hub's): for `--quiet`, and where stderr is a log file
    that would fill with their redraws. Neither is imported for it (transformers alone takes seconds): both read
    HF_HUB_DISABLE_PROGRESS_BARS when they are; one already imported is told directly."""
    import os
    import sys

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging

        logging.disable_progress_bar()


def kernels_note(quantize: str, device) -> str | None:
    """Which kernels multiply fp16 / int8 / int4 weights on a CPU: "native kernels (<variant>)", or PyTorch's and
    why; None otherwise."""
    if getattr(device, "type", str(device)) != "cpu" or split_scheme(quantize)[0] not in ("fp16", "int8", "int4"):
        return None
    from hamburger.kernels import native

    why = native.why_unavailable()
    return f"native kernels ({native.variant()})" if why is None else f"PyTorch's kernels: {why}"


def describe_run(model: HamburgerModel, trained: bool, quantize: str = "none", auto: bool = False,
                 mode: str | None = None, lookup: int | None = None) -> str:
    """What a decoding command runs, in one line: where, in which weights, in which mode, and so what the output
    is: trust mode's text is HAMburger's own, verify mode's exactly its base's. `quantize` is the scheme the
    weights got (`auto`: chosen by "auto"); `mode` None is the checkpoint's default, a comma list several modes;
    `lookup` None the checkpoint's. E.g. "cpu (2 threads), fp16 weights (auto), verify mode + lookup drafts: the
    output of the fp16 base"."""
    import torch

    from hamburger.inference.modes import parse_mode

    param = next(model.parameters())
    device = param.device
    if device.type == "cpu":
        where = f"cpu ({torch.get_num_threads()} threads)"
    elif device.type == "cuda":
        where = f"{device} ({torch.cuda.get_device_name(device)})"
    else:
        where = str(device)
    weights = str(param.dtype).removeprefix("torch.") if split_scheme(quantize) == ("none", None) else quantize
    notes = (["auto"] if auto else []) + ([kernels] if (kernels := kernels_note(quantize, device)) else [])
    line = f"{where}, {weights} weights" + (f" ({'; '.join(notes)})" if notes else "")
    if not trained:
        return f"{line}, a base model (one token per step): the output of the {weights} base"
    lookup = model.config.lookup if lookup is None else lookup
    parts = []
    for name in (mode or model.config.default_mode).split(","):
        drafts = " + lookup drafts" if lookup and parse_mode(name.strip()).lookup else ""
        parts.append({
            "trust": f"trust mode: HAMburger's steps, drafts kept unchecked (close to the {weights} base's output, "
                     "not equal)",
            "verify": f"verify mode{drafts}: the output of the {weights} base",
            "compress": f"compress mode{drafts}: drafts checked by the {weights} base over merged KV entries",
        }[name.strip()])
    return f"{line}, " + "; ".join(parts)
