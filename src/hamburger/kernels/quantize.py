"""Weight-only fp16 / int8 / int4 quantization of a model's linear layers, in the style of gpt-fast's quantize.py.

Every `nn.Linear` the plan takes (the base's projections and MLPs, the micro-step decoder's, and the LM
head) is swapped for a module with the same forward signature that multiplies with weight-only kernels:

* ``fp16``: weights rounded to float16, float32 activations. At batch 1 a decode step reads every weight once, so
  halving their bytes with a kernel that streams them well is the CPU's largest lever (docs/quantize.md has the
  figures). On x86-64 CPUs with AVX2 or AVX-512 and on aarch64 the native kernels multiply (`native.py`, built at
  first use), else FBGEMM's float16 GEMM (`quantized::linear_prepack_fp16` + `quantized::linear_dynamic_fp16`).
  Then each decoder layer's q/k/v and gate/up share one call (`fused.fuse_projections`, for int8 and int4 too):
  fewer calls, the same outputs.
* ``int8``: symmetric int8. The native kernels where they run: GGUF's Q8_0 (a float16 scale per block of 32
  inputs, int16 activations); else per output channel, `aten._weight_int8pack_mm` (CPU and CUDA).
* ``int4``: asymmetric group-wise 4-bit (groups of `group_size` input weights sharing a scale and a
  minimum): the native kernels where they run (int16 activations), else `aten._convert_weight_to_int4pack_for_cpu`
  + `aten._weight_int4pack_mm_for_cpu` on CPU (bfloat16 activations), and `aten._convert_weight_to_int4pack` +
  `aten._weight_int4pack_mm` on CUDA (bfloat16 only there).

The int4 layout is GGUF's Q4_1 (w = q·scale + min, q in 0..15, 32 weights a block): min/max over a block
give back a Q4_1 block's min and 15·scale. Natively the scale and the min are float16, as in Q4_1, so a base
whose float weights were dequantised from Q4_1 blocks (the embedded SmolLM2 default: its 210 Q4_1 tensors) gets
its own codes back exactly, and its Q8_0 embedding (the tied LM head) likewise under int8: `int4/int8` is the
GGUF's own weights. PyTorch's kernels take (scale, zero) with w = (q - 8)·scale + zero, zero = min + 8·scale, in
bfloat16 on CPU (the scale's rounding moves the codes a little).

The tied LM head (SmolLM2 ties it to the input embedding) is swapped as a module: the embedding keeps its
float Parameter, so the lookup stays float. Quantized modules expose `.weight` as a dequantised float
copy (computed on each access) for code that reads it, e.g. the engine's shortlist head.

`quantize_cached` keeps the quantized tensors in a safetensors file keyed by the model's fingerprint,
scheme, group size and dtype, so a second start loads them instead of quantizing again.

This is for inference: a quantized model's state dict holds packed buffers, not checkpoint weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from hamburger.kernels.fused import fuse_projections, fused_layer, install, sibling_sets
from hamburger.kernels.qlinear import (
    MODULES,
    WIDE_ROWS,
    QuantizedLinear,
    carry_hooks,
    fp16_unavailable,
    int8_unfit,
    int_kernel_dtype,
    wide_unavailable,
)

SCHEMES = ("none", "fp16", "int8", "int4")
GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernels accept
# Parts of a HamburgerModel left in float by default: small, and the stop head's decisions are thresholded.
DEFAULT_SKIP = ("embedder", "stop_head", "draft_stop_head", "slot_adapters")
CACHE_FORMAT = "hamburger-quantized"
CACHE_VERSION = 3  # 2: int8/int4 scales in bfloat16 on CPU; 3: GGUF's Q8_0 / Q4_1 blocks where the native kernels run

# --- planning and swapping ----------------------------------------------------------------------------------


def check_args(scheme: str, group_size: int, head: str | None = None) -> None:
    for name, value in (("scheme", scheme), ("head scheme", head)):
        if value is not None and value not in SCHEMES:
            raise ValueError(f"{name} must be one of {SCHEMES}, got {value!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES} (what the int4 kernels accept), got {group_size!r}")


def _head_ids(model: nn.Module) -> set[int]:
    """ids of the output-embedding (LM head) modules of every transformers model inside `model`."""
    ids = set()
    for m in model.modules():
        get = getattr(m, "get_output_embeddings", None)
        if callable(get):
            try:
                head = get()
            except (AttributeError, NotImplementedError):
                continue
            if head is not None:
                ids.add(id(head))
    return ids


def _why_not(linear: nn.Linear, scheme: str, group_size: int) -> str | None:
    """Why the kernels cannot take this layer (None if they can)."""
    n, k = linear.out_features, linear.in_features
    device = linear.weight.device
    if device.type not in ("cpu", "cuda"):
        return f"no packed kernel on {device.type}"
    if scheme == "fp16":
        return fp16_unavailable(device)
    if scheme == "int8":
        return int8_unfit(k, device, int_kernel_dtype(device, linear.weight.dtype))
    if scheme == "int4":
        if k % group_size:
            return f"in_features {k} is not a multiple of the group size {group_size}"
        if device.type == "cpu" and n % 16:
            return f"out_features {n} is not a multiple of 16 (CPU int4 packing)"
        if device.type == "cuda":
            if n % 8 or k % 32:
                return f"shape ({n}, {k}) does not fit the CUDA int4 packing (out % 8, in % 32)"
            if linear.weight.dtype != torch.bfloat16:
                return f"the CUDA int4 kernel runs in bfloat16 only, not {linear.weight.dtype}"
    return None


def _plan(model: nn.Module, scheme: str, group_size: int, head: str | None, skip: tuple[str, ...]) -> dict:
    """Which layers get which scheme, which are skipped (and why), excluded, or already quantized."""
    heads = _head_ids(model)
    todo, skipped, excluded, already = {}, {}, [], {}
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Linear, QuantizedLinear)):
            continue
        if any(name == s or name.startswith(s + ".") for s in skip) or ".lora_" in name:
            excluded.append(name)
            continue
        want = (head or scheme) if id(m) in heads else scheme
        if isinstance(m, QuantizedLinear):
            if scheme == "none" and head in (None, "none"):  # "none" never changes anything
                already[name] = m
                continue
            if want != m.scheme or (m.scheme == "int4" and m.group_size != group_size):
                got = m.scheme + (f" (group {m.group_size})" if m.group_size else "")
                raise ValueError(f"{name or 'the model'} is already quantized as {got}: quantizing again as {want} "
                                 f"(group {group_size}) is refused; reload the float model to change the scheme")
            already[name] = m
            continue
        if want == "none":
            excluded.append(name)
            continue
        if name.endswith(".base_layer"):
            raise ValueError(f"{name} sits under a LoRA adapter: merge the adapters first (HamburgerModel.merge_lora)")
        if (why := _why_not(m, want, group_size)) is not None:
            skipped[name] = why
            continue
        todo[name] = want
    return {"todo": todo, "skipped": skipped, "excluded": excluded, "already": already}


def _packed_bytes(model: nn.Module) -> int:
    """Bytes of packed weights held as opaque objects (fp16), which are neither parameters nor buffers."""
    return sum(getattr(m, "packed_nbytes", 0) for m in model.modules())


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters, buffers, packed weights and the bfloat16 copies of wide passes
    (`quantize_model(wide=True)`), each storage counted once (tied weights once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total + _packed_bytes(model) + wide_bytes(model)


def _linear_bytes(model: nn.Module, names) -> int:
    total = 0
    for name in names:
        m = model.get_submodule(name)
        total += sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
        total += _packed_bytes(m)
    return total


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` in place of the module at `name`, carrying its hooks over (e.g. slot adapters' forward hooks)."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, carry_hooks(model.get_submodule(name), new))


def _summary(scheme: str, group_size: int, head: str | None, plan: dict, before: int, after: int,
             linear_before: int, linear_after: int) -> dict:
    return {
        "scheme": scheme, "group_size": group_size, "head": head or scheme,
        "quantized": len(plan["todo"]), "already_quantized": len(plan["already"]),
        "skipped": len(plan["skipped"]), "skipped_layers": dict(plan["skipped"]),
        "excluded": len(plan["excluded"]),
        "bytes_before": before, "bytes_after": after,
        "linear_bytes_before": linear_before, "linear_bytes_after": linear_after,
    }


@torch.no_grad()
def quantize_model(model: nn.Module, scheme: str, group_size: int = 32, *, head: str | None = None,
                   skip: tuple[str, ...] = DEFAULT_SKIP, fuse: bool = True,
                   act_dtype: torch.dtype | None = None, wide: bool = False) -> dict:
    """Swap the model's nn.Linear layers for weight-only quantized ones, in place.

    scheme: "none" (nothing changes), "fp16", "int8" or "int4"; group_size: int4 group (32, 64, 128 or 256; checked
    for every scheme). head: the LM head's scheme if it should differ (e.g. "int8" for a head that came
    from Q8_0), None for the same. skip: module-name prefixes left in float (default: the HAMburger
    embedder, stop head and slot adapters). Layers the kernels cannot take (in_features not a multiple of
    the group, out_features not a multiple of 16 for CPU int4) stay float and are counted as skipped.
    fuse: quantized layers that read one input (q/k/v, gate/up) share one call (`fused.fuse_projections`; False
    keeps them apart, for measuring what fusing gives). act_dtype: the activations' (and scales') dtype of
    int8/int4 layers; None = `qlinear.int_kernel_dtype` (bfloat16 on CPU, the kernels' fast path; torch.float32
    there is exact for Q4_1 weights but much slower: docs/quantize.md). wide: passes of at least `qlinear.WIDE_ROWS` rows (prefill,
    batches of 8 or more) multiply by a bfloat16 copy of each quantized layer's weights (CPUs with native bfloat16:
    `qlinear.wide_unavailable`), one more copy of the weights in memory. Quantizing again with the same settings changes nothing;
    with other settings it raises ValueError.

    Returns a summary: layers quantized / already_quantized / skipped (with reasons) / excluded, and the
    bytes of the whole model and of the quantized layers before and after.
    """
    check_args(scheme, group_size, head)
    plan = _plan(model, scheme, group_size, head, tuple(skip))
    before = model_bytes(model)
    linear_before = _linear_bytes(model, plan["todo"])
    def dtype(want: str) -> torch.dtype | None:  # the int kernels' activations; fp16 computes in float32
        return act_dtype if want in ("int8", "int4") else None

    groups = sibling_sets(model, plan["todo"]) if fuse else []  # one packing per group
    fused = {name for _, _, full, _ in groups for name in full}
    singles = [(name, want) for name, want in plan["todo"].items() if name not in fused]
    # Made in threads (the packing kernels release the GIL), installed in order
    layers = in_threads([lambda g=g: fused_layer(g[0], g[1], MODULES[g[3]], group_size, dtype(g[3])) for g in groups]
                        + [lambda n=n, w=w: MODULES[w].from_linear(model.get_submodule(n), group_size, dtype(w))
                           for n, w in singles])
    for (module, names, _, _), layer in zip(groups, layers):
        install(module, names, [getattr(module, n) for n in names], layer)
    for (name, _), layer in zip(singles, layers[len(groups):]):
        _swap(model, name, layer)
    if fuse:
        fuse_projections(model)  # siblings quantized before this call
    if wide:
        if (why := wide_unavailable(next(model.parameters()).device)) is not None:
            raise ValueError(why)
        for module in model.modules():
            if isinstance(module, QuantizedLinear) and module.wide_rows != WIDE_ROWS:
                module.set_wide(WIDE_ROWS)
    summary = _summary(scheme, group_size, head, plan, before, model_bytes(model), linear_before,
                       _linear_bytes(model, plan["todo"]))
    return {**summary, "wide_bytes": wide_bytes(model)}


def in_threads(jobs: list) -> list:
    """The jobs' results in order, made on as many threads as torch computes with (the packing kernels release the
    GIL, so layers pack side by side; benchmarks/startup.py times the packing)."""
    workers = min(len(jobs), torch.get_num_threads())
    if workers <= 1:
        return [job() for job in jobs]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda job: job(), jobs))


def wide_bytes(model: nn.Module) -> int:
    """Bytes of the bfloat16 copies that wide passes multiply by (`quantize_model(wide=True)`), each counted once."""
    layers = {}
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            layer = m.group.linear if hasattr(m, "group") else m
            layers[id(layer)] = layer
    return sum(layer.wide.numel() * layer.wide.element_size() for layer in layers.values() if layer.wide is not None)


def inputs_in_8_bits(model: nn.Module) -> int:
    """`--quantize ...+a8`: every native 4-bit layer of `model` takes its inputs in 8 bits (`native.INT4_Q8`), the
    fused groups' layers (q/k/v, gate/up) included. Returns how many layers, each counted once."""
    from hamburger.kernels.qlinear import Int4Linear

    layers = {}
    for m in model.modules():
        layer = m.group.linear if isinstance(m, QuantizedLinear) and hasattr(m, "group") else m
        if isinstance(layer, Int4Linear) and layer.native:
            layers[id(layer)] = layer
    for layer in layers.values():
        layer.activations8 = True
    return len(layers)


# --- the disk cache -----------------------------------------------------------------------------------------


def save_quantized(model: nn.Module, path: str | Path) -> int:
    """Write every quantized layer's portable tensors to one safetensors file (atomically). Returns the count."""
    path = Path(path)
    tensors, layers = {}, {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            layers[name] = [m.scheme, m.group_size if m.scheme == "int4" else 0]  # int8's blocks of 32 are fixed
            for key, t in m.portable().items():
                tensors[f"{name}.{key}"] = t.contiguous()
    meta = {"format": CACHE_FORMAT, "version": str(CACHE_VERSION), "layers": json.dumps(layers)}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".quantizing-", suffix=".safetensors", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return len(layers)


@torch.no_grad()
def load_quantized(model: nn.Module, path: str | Path, scheme: str, group_size: int = 32, *,
                   head: str | None = None, skip: tuple[str, ...] = DEFAULT_SKIP) -> dict:
    """Swap in the quantized layers stored by `save_quantized`, after checking they are the ones
    `quantize_model(model, scheme, group_size, head=head, skip=skip)` would make; ValueError (and the model
    untouched) if not."""
    check_args(scheme, group_size, head)
    plan = _plan(model, scheme, group_size, head, tuple(skip))
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != CACHE_FORMAT or meta.get("version") != str(CACHE_VERSION):
            raise ValueError(f"{path} is not a version-{CACHE_VERSION} quantized-layer file")
        layers = json.loads(meta["layers"])
        expected = {name: [want, group_size if want == "int4" else 0] for name, want in plan["todo"].items()}
        if layers != expected:
            raise ValueError(f"{path} holds other layers or schemes than this model's plan")
        by_layer: dict[str, dict[str, torch.Tensor]] = {name: {} for name in layers}
        for key in f.keys():
            name, _, field = key.rpartition(".")
            if name not in by_layer:
                raise ValueError(f"{path} has an unexpected tensor {key}")
            by_layer[name][field] = f.get_tensor(key)
    made = {}
    for name, (want, group) in layers.items():
        linear = model.get_submodule(name)
        t = by_layer[name]
        shape = {"fp16": lambda: tuple(t["w16"].shape), "int8": lambda: tuple(t["q"].shape),
                 "int4": lambda: (t["q4"].shape[0], t["q4"].shape[1] * 2)}[want]()
        # fp16 stores its float16 weights for a model of any dtype; int8/int4 keep scales in the kernels' dtype, or
        # in float16 where the native kernels made them (GGUF's blocks)
        want_dtype = int_kernel_dtype(linear.weight.device, linear.weight.dtype)
        scales = next((t[key] for key in ("scales", "scales_and_zeros") if key in t), None)
        if want != "fp16" and scales is None:
            want_dtype, scales = torch.float16, t["block_scales" if want == "int8" else "scales_and_mins"]
        dtype = want_dtype if want == "fp16" else scales.dtype
        if shape != (linear.out_features, linear.in_features) or dtype != want_dtype:
            raise ValueError(f"{path}: layer {name} is stored as {shape} {dtype}, the model wants "
                             f"({linear.out_features}, {linear.in_features}) {want_dtype}")
        made[name] = lambda t=t, want=want, group=group, dev=linear.weight.device: MODULES[want].from_portable(
            t, dev, group)
    new = dict(zip(made, in_threads(list(made.values()))))
    before = model_bytes(model)
    linear_before = _linear_bytes(model, plan["todo"])
    for name, m in new.items():
        _swap(model, name, m)
    fuse_projections(model)
    return _summary(scheme, group_size, head, plan, before, model_bytes(model), linear_before,
                    _linear_bytes(model, plan["todo"]))


def cache_path(model: nn.Module, scheme: str, group_size: int = 32, *, head: str | None = None,
               skip: tuple[str, ...] = DEFAULT_SKIP, root: str | Path | None = None) -> Path | None:
    """<root>/<fingerprint>-<scheme>[-head<h>]-g<group>-<dtype>[-skip<hash>]-v<N>.safetensors; None if caching is off.

    root defaults to hamburger.model.base.cache_dir()/quantized ($HAMBURGER_CACHE=off turns it off). Call it on
    the float model: the fingerprint is that of the weights being quantized.
    """
    from hamburger.model.base import cache_dir, fingerprint  # noqa: PLC0415 - keeps this module light to import

    if root is None:
        base = cache_dir()
        if base is None:
            return None
        root = base / "quantized"
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    key = f"{fingerprint(model)}-{scheme}"
    if head is not None and head != scheme:
        key += f"-head{head}"
    key += f"-g{group_size}-{dtype}"
    if tuple(skip) != DEFAULT_SKIP:
        key += "-skip" + hashlib.sha256("\0".join(skip).encode()).hexdigest()[:8]
    return Path(root) / f"{key}-v{CACHE_VERSION}.safetensors"


def quantize_cached(model: nn.Module, scheme: str, group_size: int = 32, *, head: str | None = None,
                    skip: tuple[str, ...] = DEFAULT_SKIP, root: str | Path | None = None) -> dict:
    """`quantize_model`, reading the quantized layers from the disk cache when they are there and writing them
    there when not. The summary says `cache`: "hit", "miss" (written), or "off"; and `cache_path`."""
    check_args(scheme, group_size, head)
    if scheme == "none" and head in (None, "none"):
        return {**quantize_model(model, scheme, group_size, head=head, skip=skip), "cache": "off", "cache_path": None}
    path = cache_path(model, scheme, group_size, head=head, skip=skip, root=root)
    if path is not None and path.is_file():
        try:
            summary = load_quantized(model, path, scheme, group_size, head=head, skip=skip)
            return {**summary, "cache": "hit", "cache_path": str(path)}
        except Exception as exc:  # noqa: BLE001 - a stale or broken cache file is rebuilt, never fatal
            warnings.warn(f"ignoring the quantized cache {path}: {type(exc).__name__}: {exc}", stacklevel=2)
    summary = quantize_model(model, scheme, group_size, head=head, skip=skip)
    if path is None:
        return {**summary, "cache": "off", "cache_path": None}
    try:
        save_quantized(model, path)
    except OSError as exc:
        warnings.warn(f"could not write the quantized cache {path}: {exc}", stacklevel=2)
        return {**summary, "cache": "off", "cache_path": None}
    return {**summary, "cache": "miss", "cache_path": str(path)}
