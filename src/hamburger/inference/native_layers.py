"""The base's decoder layers in one native call a pass (`kernels/native.c`'s `hb_layers`): the engine's decode
steps and verify passes without PyTorch's per-operator cost.

A base step of the default is ~1,300 PyTorch operators even with the fast layers (`fast_layer.py`), and at
batch 1 they cost about as much as the matrix products themselves (`benchmarks/step_profile.py`). Here one C call
runs every layer of a pass over the engine's own caches, in one OpenMP region: the norms, the products (the
layers' native float16 or 4-bit weights), the rotary embedding, the cache writes, attention and the MLP.

It is the fast layers' computation, not their bits: sums run in another order, and the 4-bit products quantize
their inputs to int16 (`native.INT4_Q16`). The engine checks the first layer against the module-by-module layer
(`kv.layer_forward`) before using it (`_close_to`), and uses it for every pass of at most `NATIVE_ROWS` rows;
longer passes (a prompt's prefill) take the fast layers. Each row's result is the same whatever the pass's other
rows and however many slots lie beyond its mask, so verify mode's check passes give each position the
one-position step's result.
"""

from __future__ import annotations

import ctypes
import operator

import torch

from hamburger.inference.fast_layer import FastLayer, fast_layers_of, probe_first_layer, rope_tables
from hamburger.inference.kv import KVCache, RowSlots
from hamburger.kernels import native
from hamburger.kernels.qlinear import Fp16Linear, Int4Linear, Int8Linear

NATIVE_ROWS = 64  # passes of at most this many rows (batch x positions) run natively; longer ones (prefill) do not


class NativeLayers:
    """The C description of a base's decoder layers (from its `FastLayer`s) and the call that runs them."""

    def __init__(self, fast: list[FastLayer], gates: torch.Tensor | None = None,
                 sources: list[int] | None = None) -> None:
        """`gates` (layers, heads) and `sources`: the micro-step decoder's layers, which also attend to the base's
        entries of base layer sources[i], weighted per head by gates[i] (tanh of its context gate)."""
        first = fast[0]
        self.gates = None if gates is None else gates.detach().float().contiguous()
        self.heads, self.kv_heads, self.head_dim = first.heads, first.kv_heads, first.head_dim
        self.d, self.inner, self.eps, self.scaling = first.qkv.in_features, first.inner, first.eps, first.scaling
        self.fast = fast
        self.layers = (native.Layer * len(fast))()
        self._held = []  # (dict, key, tensor): what the descriptions point into, checked at each pass
        for i, f in enumerate(fast):
            weights = {}
            for name in ("qkv", "o", "gate_up", "down"):
                module = getattr(f, name)
                weights[name] = module.native_desc()
                self._held += [(module._buffers, key, t) for key, t in module._buffers.items()]
                if module.bias is not None:
                    self._held.append((module._parameters, "bias", module.bias))
            norms = (f.layer.input_layernorm, f.layer.post_attention_layernorm)
            self._held += [(norm._parameters, "weight", norm.weight) for norm in norms]
            gate = (self.gates[i].data_ptr(), sources[i]) if self.gates is not None else (None, 0)
            self.layers[i] = native.Layer(f.norm1.data_ptr(), f.norm2.data_ptr(), index=i, ctx_gate=gate[0],
                                          ctx_index=gate[1], **weights)
        self._owners, self._keys, self._tensors = (list(column) for column in zip(*self._held))

    def usable(self) -> bool:
        """The modules still hold the tensors the descriptions point into (at C speed: it runs at every pass)."""
        return all(map(operator.is_, map(dict.get, self._owners, self._keys), self._tensors))

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
                 start: int | RowSlots, mask: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """Layers first..last-1 over x (B, T, d) float32 contiguous, in place (the caller's own copy); `rope`: the
        base's (cos, sin), `mask`: bool (B or 1, 1, T, slots)."""
        return self.run(x, rope, cache, start, mask, [last], first)[last]

    def run(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache, start: int | RowSlots,
            mask: torch.Tensor, stops: list[int], first: int = 0,
            context: tuple[KVCache, torch.Tensor] | None = None,
            bias: tuple[torch.Tensor, ...] | None = None) -> dict[int, torch.Tensor]:
        """Layers first.. up to each of `stops` in turn (ascending) over x, in place: {stop: x after layer stop-1}
        (x itself for the last stop, a copy for the others, made inside the one native call). `context`: the
        base's cache and the entries (B, end) bool each row may read, for layers with a context gate. `bias`:
        compress mode's merged entries, (log k (B, end), merged (B, end), a, c (layers, heads)): a score on an entry
        that merges k tokens gains a * log k + c (`merge.MergedMask`)."""
        b, t, d = x.shape
        cos, sin = (table.reshape(b * t, self.head_dim).contiguous() for table in rope_tables(rope))
        k, v = cache.k, cache.v
        if isinstance(start, RowSlots):
            slots, end = start.slots.reshape(b * t).to(torch.int64).contiguous(), start.end
            low, high = int(slots.min()), int(slots.max())
        else:
            slots, end = torch.arange(start, start + t).repeat(b), start + t
            low, high = start, start + t - 1
        if end > k.shape[3] or low < 0 or high >= k.shape[3]:  # C would write out of bounds
            raise IndexError(f"cache slots {low}..{high} (attending to {end}) outside the cache's {k.shape[3]}")
        allowed = mask.expand(b, 1, t, end).contiguous()
        lib = native.library()
        scratch = torch.empty(lib.hb_scratch_floats(b * t, d, self.heads, self.kv_heads, self.head_dim, self.inner))
        if any(later <= earlier for earlier, later in zip([first, *stops], stops)):
            raise ValueError(f"stops must ascend past layer {first}, got {stops}")
        out = {stop: torch.empty_like(x) for stop in stops[:-1]}  # copies of x after the earlier stops, in the call
        after = torch.tensor([stop - first for stop in out], dtype=torch.int64)
        to = (ctypes.c_void_p * max(1, len(out)))(*[copy.data_ptr() for copy in out.values()])
        p = native.Pass(b, t, d, self.heads, self.kv_heads, self.head_dim, self.inner, end, self.eps, self.scaling,
                        cos.data_ptr(), sin.data_ptr(), k.data_ptr(), v.data_ptr(), *k.stride()[:4],
                        slots.data_ptr(), allowed.data_ptr(), scratch.data_ptr(), len(out), after.data_ptr(),
                        ctypes.addressof(to))
        if bias is not None:
            parts = [t.detach().float().expand(b, -1).contiguous() for t in bias[:2]]  # alive until the call returns
            parts += [t.detach().float().contiguous() for t in bias[2:]]
            if parts[0].shape[1] != end or parts[2].shape[0] < len(self.layers) or parts[2].shape[1] != self.heads:
                raise ValueError(f"merged-entry bias of shape {tuple(parts[0].shape)} / {tuple(parts[2].shape)} for a "
                                 f"pass attending to {end} slots over {len(self.layers)} layers of {self.heads} heads")
            p.log_k, p.merged, p.bias_a, p.bias_c = (t.data_ptr() for t in parts)
        if context is not None and self.gates is not None:
            base_cache, visible = context
            seen = visible.to(torch.uint8).expand(b, -1).contiguous()  # kept alive until the call returns
            p.ctx_k, p.ctx_v, p.ctx_len, p.ctx_mask = (base_cache.k.data_ptr(), base_cache.v.data_ptr(),
                                                       seen.shape[1], seen.data_ptr())
            p.c_s_layer, p.c_s_row, p.c_s_head, p.c_s_slot = base_cache.k.stride()[:4]
        if lib.hb_layers(ctypes.byref(self.layers, first * ctypes.sizeof(native.Layer)), stops[-1] - first,
                         ctypes.byref(p), x.data_ptr()):
            raise MemoryError("the native layers could not allocate their attention scores")
        out[stops[-1]] = x
        return out

    def takes(self, x: torch.Tensor, cache: KVCache, start, mask) -> bool:
        """Whether this pass can run natively: few rows, float32 everywhere, a bool mask over the pass's slots."""
        end = start.end if isinstance(start, RowSlots) else start + x.shape[1]
        return (x.shape[0] * x.shape[1] <= NATIVE_ROWS and x.dtype == torch.float32 and not callable(mask)
                and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[-1] == end
                and cache.k.dtype == torch.float32 and cache.k.stride(-1) == 1 and cache.v.stride() == cache.k.stride()
                and self.usable())


def native_weights(fast: list[FastLayer] | None) -> bool:
    """Whether the native call can run these layers: head sizes it takes, every product on the native kernels'
    weights (fp16, int8, int4), biases only on q/k/v (Qwen2), as the fast layers assume."""
    if fast is None or not native.available() or fast[0].head_dim % 16 or fast[0].head_dim > native.MAX_HEAD_DIM:
        return False
    modules = [m for f in fast for m in (f.qkv, f.o, f.gate_up, f.down)]
    return (all(isinstance(m, (Fp16Linear, Int4Linear, Int8Linear)) and m.native for m in modules)
            and not any(m.bias is not None for f in fast for m in (f.o, f.gate_up, f.down)))


def micro_native_layers(micro, config, base_native: NativeLayers | None) -> NativeLayers | None:
    """`NativeLayers` for the micro-step decoder's layers (their attention to the base's entries included), or None
    (the base's layers not native, or `native_weights` says no). Its user checks the result against the
    module-by-module micro pass before using it. The context gates are read now (an engine is made after its model
    is loaded)."""
    fast = fast_layers_of(micro.layers, config) if base_native is not None else None
    if not native_weights(fast):
        return None
    gates = torch.tanh(micro.context_gate) if micro.context_gate is not None else None
    return NativeLayers(fast, gates, list(micro.context_layers))


def native_layers(base, fast: list[FastLayer] | None) -> NativeLayers | None:
    """`NativeLayers` for the base's decoder layers, or None: `native_weights` says no, or the first layer is not
    close to the module-by-module layer."""
    if not native_weights(fast):
        return None
    layers = NativeLayers(fast)
    return layers if _close_to(layers, base) else None


def _close_to(layers: NativeLayers, base) -> bool:
    """Layer 0 natively against `layer_forward` (`fast_layer.probe_first_layer`): outputs and cache within 1e-3 of
    their norm (sums in another order, the 4-bit products' inputs rounded to int16: 1e-7 to 1e-4 measured). A
    wrong layout, sign or weight is far outside it."""
    pairs = probe_first_layer(base, lambda x, rope, cache, start, mask: layers(x, rope, cache, start, mask, 0, 1))
    return all(bool((a - b).norm() <= 1e-3 * a.norm()) for a, b in pairs)
