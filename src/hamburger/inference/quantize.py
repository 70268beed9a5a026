"""Weight-only int8 / int4 quantization of a model's linear layers, in the style of gpt-fast's quantize.py.

Every `nn.Linear` the plan takes (the base's projections and MLPs, the micro-step decoder's, and the LM
head) is swapped for a module with the same forward signature that multiplies with PyTorch's packed kernels:

* ``int8``: per-output-channel symmetric int8, `aten._weight_int8pack_mm` (CPU and CUDA).
* ``int4``: asymmetric group-wise 4-bit (groups of `group_size` input weights sharing a scale and a
  minimum), `aten._convert_weight_to_int4pack_for_cpu` + `aten._weight_int4pack_mm_for_cpu` on CPU, and
  `aten._convert_weight_to_int4pack` + `aten._weight_int4pack_mm` on CUDA (bfloat16 only there).

The int4 layout is GGUF's Q4_1 (w = q·scale + min, q in 0..15, 32 weights a block): a base whose float
weights were dequantised from Q4_1 blocks (the embedded SmolLM2 default: every block of its 210 Q4_1
tensors spans q = 0..15) is represented exactly, up to the rounding of the scale (min/max over a block
give back the block's min and 15·scale). The kernels take (scale, zero) with w = (q - 8)·scale + zero,
so zero = min + 8·scale; both are kept in the model's dtype (float32 for the default: no rounding).

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
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

SCHEMES = ("none", "int8", "int4")
GROUP_SIZES = (32, 64, 128, 256)  # what the int4 kernels accept
# Parts of a HamburgerModel left in float by default: small, and the stop head's decisions are thresholded.
DEFAULT_SKIP = ("embedder", "stop_head", "slot_adapters")
CACHE_FORMAT = "hamburger-quantized"
CACHE_VERSION = 1
_PROBE = {"cpu": torch.float32, "cuda": torch.bfloat16}  # dtype of the identity used to read int4 codes back


# --- the quantization arithmetic (pure functions) ------------------------------------------------------------


def int8_weights(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (int8 codes in -127..127, per-row scales in `dtype`) with w ≈ q · scale."""
    w32 = w.detach().float()
    amax = w32.abs().amax(1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).to(dtype)
    q = (w32 / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def int4_weights(w: torch.Tensor, group_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float -> (uint8 codes in 0..15 (N, K), scales (N, K/g), mins (N, K/g)) with w ≈ q · scale + min.

    Min/max per group (Q4_1's rule): a group's smallest weight gets q = 0, its largest q = 15. The scale
    and the kernels' zero (min + 8·scale) are rounded to `dtype` first and the codes are computed
    against the rounded values; the returned mins are those the kernel reproduces (zero - 8·scale).
    """
    n, k = w.shape
    groups = w.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    tiny = torch.finfo(dtype).tiny  # constant groups: any scale works; a tiny one keeps zero == min
    scale = torch.where(hi > lo, (hi - lo) / 15, torch.full_like(lo, tiny)).to(dtype).float()
    zero = (lo + 8 * scale).to(dtype).float()
    low = zero - 8 * scale
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale.to(dtype), low.to(dtype)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K/2) uint8, even columns in the low nibble (the cache's portable layout)."""
    q = q.to(torch.uint8)
    return q[:, ::2] | (q[:, 1::2] << 4)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p & 15, p >> 4], -1).reshape(p.shape[0], -1)


# --- the modules ---------------------------------------------------------------------------------------------


def _check_device(device: torch.device) -> None:
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"weight-only quantization has packed kernels for cpu and cuda only, not {device.type!r}")


class QuantizedLinear(nn.Module):
    """Common part: same forward as nn.Linear (any leading dims), float bias, `.weight` as a dequantised copy."""

    scheme = ""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, group_size: int = 0) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None

    @property
    def compute_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous()
        y = self._mm(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The (out, in) float weights the kernel multiplies with, in the compute dtype."""
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:  # a fresh dequantised copy: read-only use (e.g. rows of the LM head)
        return self.dequantize()

    def portable(self) -> dict[str, torch.Tensor]:
        """Device-independent CPU tensors that `from_portable` turns back into this module bit for bit."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{group}"


class Int8Linear(QuantizedLinear):
    """Per-channel symmetric int8 weights, `aten._weight_int8pack_mm` (CPU and CUDA)."""

    scheme = "int8"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(q.shape[1], q.shape[0], bias)
        self.register_buffer("weight_int8", q.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        w = linear.weight
        _check_device(w.device)
        q, scales = int8_weights(w, w.dtype)
        return cls(q, scales, linear.bias)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales.dtype

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scales)

    def dequantize(self) -> torch.Tensor:
        return self.weight_int8.to(self.scales.dtype) * self.scales[:, None]

    def portable(self) -> dict[str, torch.Tensor]:
        out = {"q": self.weight_int8.cpu(), "scales": self.scales.cpu()}
        if self.bias is not None:
            out["bias"] = self.bias.detach().cpu()
        return out

    @classmethod
    def from_portable(cls, t: dict[str, torch.Tensor], device: torch.device, group_size: int = 0) -> Int8Linear:
        return cls(t["q"].to(device), t["scales"].to(device), t["bias"].to(device) if "bias" in t else None)


def _inner_k_tiles(k: int) -> int:
    """The CUDA packing's innerKTiles: the largest of 8, 4, 2 with K a multiple of innerKTiles·16."""
    return next(t for t in (8, 4, 2) if k % (t * 16) == 0)


class Int4Linear(QuantizedLinear):
    """Asymmetric group-wise 4-bit weights (Q4_1 layout), the packed int4 kernels of CPU or CUDA."""

    scheme = "int4"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None) -> None:
        """q: (N, K) codes 0..15 (any int dtype), scales and mins: (N, K/g) with w = q · scale + min."""
        n, k = q.shape
        super().__init__(k, n, bias, group_size)
        device = q.device
        _check_device(device)
        self.packed_for = device.type
        if device.type == "cuda":
            if scales.dtype != torch.bfloat16:
                raise ValueError(f"the CUDA int4 kernel runs in bfloat16 only, not {scales.dtype}: load the model "
                                 "in bfloat16 or use int8")
            q8 = q.to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack((q8[:, ::2] << 4 | q8[:, 1::2]).contiguous(),
                                                               _inner_k_tiles(k))
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
        zeros = mins + 8 * scales  # in the stored dtype, as quantized against
        self.register_buffer("weight_int4pack", packed)
        self.register_buffer("scales_and_zeros", torch.stack([scales.t(), zeros.t()], -1).contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> Int4Linear:
        w = linear.weight
        q, scales, mins = int4_weights(w, group_size, w.dtype)
        return cls(q, scales, mins, group_size, linear.bias)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    def _kernel(self, x: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
        if x.device.type != self.packed_for:
            raise ValueError(f"int4 weights packed for {self.packed_for} cannot run on {x.device.type}: quantize "
                             "the model on the device it runs on")
        if self.packed_for == "cuda":
            return torch.ops.aten._weight_int4pack_mm(x, self.weight_int4pack, self.group_size, scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight_int4pack, self.group_size, scales_and_zeros)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, self.scales_and_zeros)

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes (N, K) uint8, scales (N, K/g), mins (N, K/g)), read back from the packed weights.

        Layout-agnostic: the kernel itself multiplies an identity with scale 1 and zero 8, so it returns
        (q - 8) + 8 = q for every weight, exactly.
        """
        dtype = _PROBE[self.packed_for]
        sz = self.scales_and_zeros
        probe = torch.stack([torch.ones_like(sz[..., 0]), torch.full_like(sz[..., 0], 8)], -1).to(dtype)
        eye = torch.eye(self.in_features, dtype=dtype, device=sz.device)
        q = self._kernel(eye, probe).t().round().to(torch.uint8)
        scales, zeros = sz[..., 0].t(), sz[..., 1].t()
        return q, scales.contiguous(), (zeros - 8 * scales).contiguous()

    def dequantize(self) -> torch.Tensor:
        """The kernel's own weights: an identity through the kernel (exactly what any input is multiplied with)."""
        eye = torch.eye(self.in_features, dtype=self.compute_dtype, device=self.scales_and_zeros.device)
        return self._mm(eye).t().contiguous()

    def portable(self) -> dict[str, torch.Tensor]:
        q = self.unpack()[0]
        out = {"q4": pack_nibbles(q).cpu(), "scales_and_zeros": self.scales_and_zeros.cpu()}
        if self.bias is not None:
            out["bias"] = self.bias.detach().cpu()
        return out

    @classmethod
    def from_portable(cls, t: dict[str, torch.Tensor], device: torch.device, group_size: int = 32) -> Int4Linear:
        sz = t["scales_and_zeros"].to(device)
        scales, zeros = sz[..., 0].t(), sz[..., 1].t()
        q = unpack_nibbles(t["q4"]).to(device)
        module = cls(q, scales, zeros - 8 * scales, group_size, t["bias"].to(device) if "bias" in t else None)
        module.scales_and_zeros.copy_(sz)  # exactly the stored (scale, zero), not re-derived through the min
        return module


MODULES = {"int8": Int8Linear, "int4": Int4Linear}


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


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied weights once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _linear_bytes(model: nn.Module, names) -> int:
    total = 0
    for name in names:
        m = model.get_submodule(name)
        total += sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
    return total


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` in place of the module at `name`, carrying its hooks over (e.g. slot adapters' forward hooks).

    The hook dicts are shared, not copied, so the handles that registered them still remove them.
    """
    old = model.get_submodule(name)
    for attr in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"):
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))
    new.train(old.training)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


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
                   skip: tuple[str, ...] = DEFAULT_SKIP) -> dict:
    """Swap the model's nn.Linear layers for weight-only quantized ones, in place.

    scheme: "none" (nothing changes), "int8" or "int4"; group_size: int4 group (32, 64, 128 or 256; checked
    for every scheme). head: the LM head's scheme if it should differ (e.g. "int8" for a head that came
    from Q8_0), None for the same. skip: module-name prefixes left in float (default: the HAMburger
    embedder, stop head and slot adapters). Layers the kernels cannot take (in_features not a multiple of
    the group, out_features not a multiple of 16 for CPU int4) stay float and are counted as skipped.
    Quantizing again with the same settings changes nothing; with other settings it raises ValueError.

    Returns a summary: layers quantized / already_quantized / skipped (with reasons) / excluded, and the
    bytes of the whole model and of the quantized layers before and after.
    """
    check_args(scheme, group_size, head)
    plan = _plan(model, scheme, group_size, head, tuple(skip))
    before = model_bytes(model)
    linear_before = _linear_bytes(model, plan["todo"])
    for name, want in plan["todo"].items():
        linear = model.get_submodule(name)
        new = Int8Linear.from_linear(linear) if want == "int8" else Int4Linear.from_linear(linear, group_size)
        _swap(model, name, new)
    return _summary(scheme, group_size, head, plan, before, model_bytes(model), linear_before,
                    _linear_bytes(model, plan["todo"]))


# --- the disk cache -----------------------------------------------------------------------------------------


def save_quantized(model: nn.Module, path: str | Path) -> int:
    """Write every quantized layer's portable tensors to one safetensors file (atomically). Returns the count."""
    path = Path(path)
    tensors, layers = {}, {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            layers[name] = [m.scheme, m.group_size]
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
    new = {}
    for name, (want, group) in layers.items():
        linear = model.get_submodule(name)
        t = by_layer[name]
        shape = tuple(t["q"].shape) if want == "int8" else (t["q4"].shape[0], t["q4"].shape[1] * 2)
        dtype = (t["scales"] if want == "int8" else t["scales_and_zeros"]).dtype
        if shape != (linear.out_features, linear.in_features) or dtype != linear.weight.dtype:
            raise ValueError(f"{path}: layer {name} is stored as {shape} {dtype}, the model has "
                             f"({linear.out_features}, {linear.in_features}) {linear.weight.dtype}")
        new[name] = MODULES[want].from_portable(t, linear.weight.device, group)
    before = model_bytes(model)
    linear_before = _linear_bytes(model, plan["todo"])
    for name, m in new.items():
        _swap(model, name, m)
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
