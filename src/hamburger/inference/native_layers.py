"""The decoder layers in one native call a pass (`kernels/native.c`'s `hb_layers`): the engine's fast path.

The model's own modules are the reference: a pass runs them one by one over the engine's caches
(`kv.layer_forward`), which any model the engine supports can do. Where the native kernels run and the layers are
of a kind they take (Llama, Mistral or Qwen2 layers in float32 with q/k/v and gate/up fused and their weights
packed as fp16, int8 or int4: `quantize_model`'s default), one C call runs every layer of a pass over the same
caches, in one OpenMP region: the norms, the products, the rotary embedding, the cache writes, attention and the
MLP, without PyTorch's per-operator cost, which at batch 1 is about as much as the products themselves
(`benchmarks/step_profile.py`).

It is the modules' computation, not their bits: sums run in another order, and the 4-bit products quantize their
inputs to int16 (`native.INT4_Q16`); tests/inference/test_native_layers.py holds every variant to the module path
and verify mode to its base exactly. Passes of at most `NATIVE_ROWS` rows run natively; longer ones (a long
prompt's prefill) and any pass where a module it would bypass has a hook or was replaced (a LoRA attached later)
run module by module. Each row's result is the same whatever the pass's other rows and however many slots lie
beyond its mask, so verify mode's check passes give each position the one-position step's result.
"""

from __future__ import annotations

import ctypes
import operator

import torch
from torch import nn

from hamburger.inference.kv import KVCache, RowSlots
from hamburger.kernels import native
from hamburger.kernels.fused import FusedPart
from hamburger.kernels.qlinear import Fp16Linear, Int4Linear, Int8Linear, QuantizedLinear

# Passes of at most this many rows (batch x positions) run natively: a decode step or a check pass of up to 32
# rows of 4 positions; a longer prefill runs module by module (benchmarks/pass_paths.py measures both).
NATIVE_ROWS = 128
KV_DTYPES = (torch.float32, torch.float16)  # the caches the native call reads and writes (`hb_pass.kv_half`)
NATIVE_TYPES = ("llama", "mistral", "qwen2")
NORMED, ARGMAX = "normed", "argmax"  # `NativeLayers.run`'s entries: the final norm's output, the head's tokens
_HOOKS = operator.attrgetter("_forward_hooks", "_forward_pre_hooks")


class LayerParts:
    """What the native call reads of one decoder layer: its fused products, norms and shapes, and the modules it
    stands in for (a hook on any of them, or one replaced, sends the pass back to the modules)."""

    def __init__(self, layer: nn.Module, config) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        # (parent, attribute, module) of every module the native call stands in for
        self.slots = [(layer, n, getattr(layer, n)) for n in ("self_attn", "mlp", "input_layernorm",
                                                              "post_attention_layernorm")]
        self.slots += [(attn, n, getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        self.slots += [(mlp, n, getattr(mlp, n)) for n in ("gate_proj", "up_proj", "down_proj")]
        self.layer = layer
        self.qkv, self.gate_up = attn.q_proj.group.linear, mlp.gate_proj.group.linear
        self.o, self.down = attn.o_proj, mlp.down_proj
        self.norm1, self.norm2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.variance_epsilon
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
        self.scaling = attn.scaling
        self.inner = self.gate_up.out_features // 2


def _fits(layer: nn.Module) -> bool:
    attn, mlp = layer.self_attn, getattr(layer, "mlp", None)
    parts = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    mlp_parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
    return (not hasattr(attn, "q_norm") and mlp is not None
            and all(isinstance(p, FusedPart) and p.group is parts[0].group and p.index == i for i, p in enumerate(parts))
            and len(parts[0].group.bounds) == 3
            and all(isinstance(p, FusedPart) and p.group is mlp_parts[0].group and p.index == i
                    for i, p in enumerate(mlp_parts)) and len(mlp_parts[0].group.bounds) == 2
            and mlp_parts[0].group.bounds[0][1] * 2 == mlp_parts[0].group.linear.out_features
            and isinstance(attn.o_proj, QuantizedLinear) and not isinstance(attn.o_proj, FusedPart)
            and isinstance(mlp.down_proj, QuantizedLinear) and not isinstance(mlp.down_proj, FusedPart)
            and all(FinalNorm.fits(norm) for norm in (layer.input_layernorm, layer.post_attention_layernorm)))


def layer_parts(layers, config) -> list[LayerParts] | None:
    """`LayerParts` for decoder layers of a kind the native call takes (fused packed products, float32 norms,
    SiLU, no per-head norms), or None."""
    if (getattr(config, "model_type", "") not in NATIVE_TYPES or getattr(config, "hidden_act", "") != "silu"
            or not all(_fits(layer) for layer in layers)):
        return None
    return [LayerParts(layer, config) for layer in layers]


class FinalNorm:
    """A model's final RMSNorm, run at the end of the native call (`hb_pass.out_norm`, the C norm the layers' own
    norms use) while it stays the module it was: in its place, the same weight, float32, no hook. Otherwise the
    caller runs the module on the call's output."""

    def __init__(self, parent: nn.Module, name: str) -> None:
        self.parent, self.name = parent, name
        self.module = getattr(parent, name)
        self.weight = self.module.weight

    @staticmethod
    def fits(norm: nn.Module | None) -> bool:
        """Whether the native call's RMSNorm can stand in for `norm` (the layers' norms too): float32 weights, an eps."""
        weight = getattr(norm, "weight", None)
        return (hasattr(norm, "variance_epsilon") and weight is not None and weight.dtype == torch.float32
                and weight.dim() == 1)

    def here(self) -> bool:
        m, w = self.module, self.weight
        return (self.parent._modules.get(self.name) is m and m._parameters.get("weight") is w and not m._forward_hooks
                and not m._forward_pre_hooks and w.dtype == torch.float32 and w.is_contiguous())


def final_norm(parent: nn.Module, name: str = "norm") -> FinalNorm | None:
    """`FinalNorm` for parent.<name> where the native call can run it (a float32 RMSNorm), else None."""
    return FinalNorm(parent, name) if FinalNorm.fits(getattr(parent, name, None)) else None


def rope_tables(rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary (cos, sin), each (B, T, head_dim), as the native call takes them: the sine's first half negated
    (rotate_half(x) * sin == roll(x, half) * that, exactly: only signs move)."""
    cos, sin = rope
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), -1)


# rotary embeddings whose value at a position does not depend on the other positions of the call (transformers'
# "dynamic" and "longrope" ones rescale by the longest position): what `RopeTable` may compute ahead
STATIC_ROPE = ("default", "linear", "llama3")


class RopeTable:
    """The native call's rotary tables of one rotary embedding (`rope_tables`' form, a row per position). For a
    static embedding (`STATIC_ROPE`) kept over every position up to the highest asked so far and read by index,
    instead of computed again at every pass: the embedding's own computation over those positions, made again
    (twice as long) when a pass goes past them. Another (transformers' "dynamic", "longrope") is computed per pass
    over the pass's own positions, as the modules do."""

    def __init__(self, rotary: nn.Module) -> None:
        self.rotary, self.cos, self.sin, self._freq = rotary, None, None, None
        self.static = getattr(rotary, "rope_type", "default") in STATIC_ROPE

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_tables(self.rotary(torch.empty(0, device=positions.device), positions))
        return cos.reshape(-1, cos.shape[-1]).contiguous(), sin.reshape(-1, sin.shape[-1]).contiguous()

    def __call__(self, positions: torch.Tensor | range) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the signed sine at `positions` (B, T), each (B * T, head_dim) contiguous. A `range` (one row's
        consecutive positions) is read as a slice of the table, without an indexing operator."""
        if isinstance(positions, range):
            if not self.static:
                return self._compute(torch.arange(positions.start, positions.stop, device=self._device())[None])
            self._cover(positions.stop, self._device())
            return self.cos[positions.start : positions.stop], self.sin[positions.start : positions.stop]
        if not self.static:
            return self._compute(positions)
        flat = positions.reshape(-1)
        self._cover(int(flat.max()) + 1, flat.device)
        return self.cos[flat], self.sin[flat]

    def _device(self) -> torch.device:
        freq = getattr(self.rotary, "inv_freq", None)
        return freq.device if isinstance(freq, torch.Tensor) else torch.device("cpu")

    def _cover(self, need: int, device: torch.device) -> None:
        """The table over positions 0..need-1 at least (made again, twice as long, past its end)."""
        freq = getattr(self.rotary, "inv_freq", None)
        if self.cos is None or self.cos.shape[0] < need or freq is not self._freq:
            size = max(need, 512, 2 * self.cos.shape[0] if self.cos is not None else 0)
            self.cos, self.sin = self._compute(torch.arange(size, device=device)[None])
            self._freq = freq


class NativeLayers:
    """The C description of decoder layers (from their `LayerParts`) and the call that runs them."""

    def __init__(self, parts: list[LayerParts], gates: torch.Tensor | None = None,
                 sources: list[int] | None = None) -> None:
        """`gates` (layers, heads) and `sources`: the micro-step decoder's layers, which also attend to the base's
        entries of base layer sources[i], weighted per head by gates[i] (tanh of its context gate)."""
        first = parts[0]
        self.gates = None if gates is None else gates.detach().float().contiguous()
        self.heads, self.kv_heads, self.head_dim = first.heads, first.kv_heads, first.head_dim
        self.d, self.inner, self.eps, self.scaling = first.qkv.in_features, first.inner, first.eps, first.scaling
        self.parts = parts
        self.layers = (native.Layer * len(parts))()
        # (dict, key, value): the modules in their parents and the tensors the descriptions point into, checked at
        # each pass; and the hook dicts of every module the call stands in for (a hook is registered in place)
        held = [(parent._modules, name, module) for f in parts for parent, name, module in f.slots]
        self._hooks = [d for f in parts for m in [f.layer, *(module for _, _, module in f.slots)] for d in _HOOKS(m)]
        for i, f in enumerate(parts):
            weights = {}
            for name in ("qkv", "o", "gate_up", "down"):
                module = getattr(f, name)
                weights[name] = module.native_desc()
                held += [(module._buffers, key, t) for key, t in module._buffers.items()]
                if module.bias is not None:
                    held.append((module._parameters, "bias", module.bias))
            norms = (f.layer.input_layernorm, f.layer.post_attention_layernorm)
            held += [(norm._parameters, "weight", norm.weight) for norm in norms]
            gate = (self.gates[i].data_ptr(), sources[i]) if self.gates is not None else (None, 0)
            self.layers[i] = native.Layer(f.norm1.data_ptr(), f.norm2.data_ptr(), index=i, ctx_gate=gate[0],
                                          ctx_index=gate[1], **weights)
        self._owners, self._keys, self._values = (list(column) for column in zip(*held))
        self._intact: bool | None = None  # the modules and tensors still in place, as `usable` last found them

    def usable(self) -> bool:
        """No hook on any module the call stands in for (nor a global one), and the modules and tensors still in
        place (read from the modules' own dicts through flat lists, at C speed). `takes` asks at every pass, but
        checks the modules and tensors only when `recheck` has asked for it (the runner does at every prefill):
        after a pass has streamed the weights through the caches, walking those 500 dict entries showed in a
        profile of decoding (docs/RESULTS.md, section 13). A hook counts from the next pass; a module or tensor replaced
        while a request decodes, from the next request's prefill."""
        self._intact = all(map(operator.is_, map(dict.get, self._owners, self._keys), self._values))
        return self._intact and not self._hooked()

    def recheck(self) -> None:
        """Have the next pass check that the modules and tensors are still in place (`usable`)."""
        self._intact = None

    def _hooked(self) -> bool:
        hooks = torch.nn.modules.module
        return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks or any(self._hooks))

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
                 start: int | RowSlots, mask: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """Layers first..last-1 over x (B, T, d) float32 contiguous, in place (the caller's own copy); `rope`: the
        base's (cos, sin), `mask`: bool (B or 1, 1, T, slots)."""
        return self.run(x, rope, cache, start, mask, [last], first)[last]

    def run(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache, start: int | RowSlots,
            mask: torch.Tensor, stops: list[int], first: int = 0,
            context: tuple[KVCache, torch.Tensor] | None = None,
            bias: tuple[torch.Tensor, ...] | None = None, norm: FinalNorm | None = None,
            last: bool = False, head: native.Weights | None = None) -> dict[int | str, torch.Tensor]:
        """Layers first.. up to each of `stops` in turn (ascending) over x, in place: {stop: x after layer stop-1}
        (x itself for the last stop, a copy for the others, made inside the one native call). `rope`: the rotary
        embedding's (cos, sin), each (B, T, head_dim), or a `RopeTable`'s rows, each (B * T, head_dim). `context`: the
        base's cache and the entries (B, end) bool each row may read, for layers with a context gate. `bias`:
        compress mode's merged entries, (log k (B, end), merged (B, end), a, c (layers, heads)): a score on an entry
        that merges k tokens gains a * log k + c (`merge.MergedMask`). `norm`: the model's final norm over the last
        stop's x (each row's last position where `last`), computed in the call: {NORMED: (B, d) or (B, T, d)}; and
        with `head` (the LM head's native weights), each normed row's greedy token (`native.linear_argmax`'s, bit for
        bit): {ARGMAX: (B,) or (B, T) int64}."""
        b, t, d = x.shape
        cos, sin = rope if rope[0].dim() == 2 else (table.reshape(b * t, self.head_dim).contiguous()
                                                    for table in rope_tables(rope))
        k, v = cache.k, cache.v
        if isinstance(start, RowSlots):
            slots, end = start.slots.reshape(b * t).to(torch.int64).contiguous(), start.end
            low, high = int(slots.min()), int(slots.max())
        else:
            slots, end = torch.arange(start, start + t), start + t
            slots = slots.repeat(b) if b > 1 else slots
            low, high = start, start + t - 1
        if end > k.shape[3] or low < 0 or high >= k.shape[3]:  # C would write out of bounds
            raise IndexError(f"cache slots {low}..{high} (attending to {end}) outside the cache's {k.shape[3]}")
        same = mask.shape == (b, 1, t, end) and mask.is_contiguous()
        allowed = mask if same else mask.expand(b, 1, t, end).contiguous()
        lib = native.library()
        scratch = torch.empty(lib.hb_scratch_floats(b * t, d, self.heads, self.kv_heads, self.head_dim, self.inner))
        if any(later <= earlier for earlier, later in zip([first, *stops], stops)):
            raise ValueError(f"stops must ascend past layer {first}, got {stops}")
        out = {stop: torch.empty_like(x) for stop in stops[:-1]}  # copies of x after the earlier stops, in the call
        after = (ctypes.c_int64 * max(1, len(out)))(*[stop - first for stop in out])
        to = (ctypes.c_void_p * max(1, len(out)))(*[copy.data_ptr() for copy in out.values()])
        p = native.Pass(b, t, d, self.heads, self.kv_heads, self.head_dim, self.inner, end, self.eps, self.scaling,
                        cos.data_ptr(), sin.data_ptr(), k.data_ptr(), v.data_ptr(), *k.stride()[:4],
                        slots.data_ptr(), allowed.data_ptr(), scratch.data_ptr(), len(out), ctypes.addressof(after),
                        ctypes.addressof(to), kv_half=int(k.dtype == torch.float16))
        alive = self._bias(p, bias, b, end) if bias is not None else None  # kept alive until the call returns
        seen = self._context(p, context, k.dtype, b) if context is not None and self.gates is not None else None
        if head is not None and norm is None:
            raise ValueError("the head's argmax in the native call needs the final norm there too")
        if norm is not None:
            out |= self._ends(p, norm, head, (b, d) if last else (b, t, d), last)
        failed = lib.hb_layers(ctypes.byref(self.layers, first * ctypes.sizeof(native.Layer)), stops[-1] - first,
                               ctypes.byref(p), x.data_ptr())
        del alive, seen
        if failed == -2:
            raise ValueError(f"a head of {head.k} inputs after layers of width {d}")
        if failed:
            raise MemoryError("the native layers could not allocate their attention scores or outputs")
        out[stops[-1]] = x
        return out

    @staticmethod
    def _context(p: native.Pass, context: tuple[KVCache, torch.Tensor], dtype: torch.dtype, b: int) -> torch.Tensor:
        """The base's cache and the entries each row may read into the pass; returns the mask it points into."""
        base_cache, visible = context
        if base_cache.k.dtype != dtype:
            raise ValueError(f"a {dtype} cache attending to a {base_cache.k.dtype} base cache in one native call")
        seen = visible.to(torch.uint8).expand(b, -1).contiguous()
        p.ctx_k, p.ctx_v, p.ctx_len, p.ctx_mask = (base_cache.k.data_ptr(), base_cache.v.data_ptr(), seen.shape[1],
                                                   seen.data_ptr())
        p.c_s_layer, p.c_s_row, p.c_s_head, p.c_s_slot = base_cache.k.stride()[:4]
        return seen

    def _bias(self, p: native.Pass, bias: tuple[torch.Tensor, ...], b: int, end: int) -> list[torch.Tensor]:
        """Compress mode's merged-entry bias into the pass; returns the tensors it points into."""
        parts = [t.detach().float().expand(b, -1).contiguous() for t in bias[:2]]
        parts += [t.detach().float().contiguous() for t in bias[2:]]
        if parts[0].shape[1] != end or parts[2].shape[0] < len(self.layers) or parts[2].shape[1] != self.heads:
            raise ValueError(f"merged-entry bias of shape {tuple(parts[0].shape)} / {tuple(parts[2].shape)} for a "
                             f"pass attending to {end} slots over {len(self.layers)} layers of {self.heads} heads")
        p.log_k, p.merged, p.bias_a, p.bias_c = (t.data_ptr() for t in parts)
        return parts

    @staticmethod
    def _ends(p: native.Pass, norm: FinalNorm, head: native.Weights | None, shape: tuple[int, ...],
              last: bool) -> dict[str, torch.Tensor]:
        """The final norm's output (of `shape`) and the head's tokens, made for the call to fill."""
        out = {NORMED: torch.empty(shape)}
        p.out_norm, p.normed = norm.weight.data_ptr(), out[NORMED].data_ptr()
        p.out_eps, p.out_last = norm.module.variance_epsilon, int(last)
        if head is not None:
            out[ARGMAX] = torch.empty(shape[:-1], dtype=torch.int64)
            p.head, p.head_idx = ctypes.addressof(head), out[ARGMAX].data_ptr()
        return out

    def takes(self, x: torch.Tensor, cache: KVCache, start, mask) -> bool:
        """Whether this pass can run natively: few rows, float32 everywhere, a bool mask over the pass's slots."""
        end = start.end if isinstance(start, RowSlots) else start + x.shape[1]
        return (x.shape[0] * x.shape[1] <= NATIVE_ROWS and x.dtype == torch.float32 and not callable(mask)
                and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[-1] == end
                and cache.k.dtype in KV_DTYPES and cache.k.stride(-1) == 1 and cache.v.stride() == cache.k.stride()
                and (self.usable() if self._intact is None else self._intact and not self._hooked()))


def native_weights(parts: list[LayerParts] | None) -> bool:
    """Whether the native call can run these layers: head sizes it takes, every product on the native kernels'
    weights (fp16, int8, int4), biases only on q/k/v (Qwen2)."""
    if parts is None or not native.available() or parts[0].head_dim % 16 or parts[0].head_dim > native.MAX_HEAD_DIM:
        return False
    modules = [m for f in parts for m in (f.qkv, f.o, f.gate_up, f.down)]
    return (all(isinstance(m, (Fp16Linear, Int4Linear, Int8Linear)) and m.native for m in modules)
            and not any(m.bias is not None for f in parts for m in (f.o, f.gate_up, f.down)))


def native_parts(base) -> list[LayerParts] | None:
    """The base's decoder layers (`base`: the inner model, with `layers`) as the native call takes them, or None."""
    parts = layer_parts(base.layers, base.config)
    return parts if native_weights(parts) else None


def native_layers(base) -> NativeLayers | None:
    """`NativeLayers` for the base's decoder layers, or None where the native call does not take them."""
    parts = native_parts(base)
    return NativeLayers(parts) if parts is not None else None


def micro_native_layers(micro, config, base_native: NativeLayers | None) -> NativeLayers | None:
    """`NativeLayers` for the micro-step decoder's layers (their attention to the base's entries included), or None
    (the base's layers not native, or `native_weights` says no). The context gates are read now (an engine is made
    after its model is loaded)."""
    parts = layer_parts(micro.layers, config) if base_native is not None else None
    if not native_weights(parts):
        return None
    gates = torch.tanh(micro.context_gate) if micro.context_gate is not None else None
    return NativeLayers(parts, gates, list(micro.context_layers))
