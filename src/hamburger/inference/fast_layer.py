"""A Llama-style decoder layer over the engine's caches in few operators: the base's own weights and math, the
same outputs bit for bit, about half the operators of the module-by-module path (`kv.layer_forward`).

At batch 1 a base step of the 135M default is ~2,400 PyTorch operators, and more of its time goes to them than to
its matrix products (`benchmarks/step_profile.py`). This layer keeps the rows as one (B*T, d) matrix from norm to
residual, calls the quantized kernels directly (`QuantizedLinear.linear2d`: no module call, no reshapes), serves
q/k/v and gate/up from their fused layer's one output, and rotates queries and keys together with one `roll`
against a sine whose first half is negated (exactly `x * cos + rotate_half(x) * sin`, the same products and sum).

It is used only where it is the same computation: a float32 model (`torch.rms_norm` is transformers' RMSNorm
there), quantized layers with q/k/v and gate/up fused (`quantize_model`'s default), Llama, Mistral or Qwen2 layers
(no per-head norms), no slot adapters in the pass, and no hook on any module it bypasses (a LoRA, the transformers
path's adapter hooks). `decode_layers` checks the first layer against `kv.layer_forward` bit for bit before it
says yes; `usable` checks the modules again at each pass (a LoRA attached later, a hook added).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

from hamburger.inference.kv import KVCache, layer_forward
from hamburger.kernels.fused import FusedPart
from hamburger.kernels.qlinear import QuantizedLinear

FAST_TYPES = ("llama", "mistral", "qwen2")
_HOOKS = operator.attrgetter("_forward_hooks", "_forward_pre_hooks")


class FastLayer:
    """One decoder layer's modules, read once, and its forward over a cache (`KVCache.update`)."""

    def __init__(self, layer: nn.Module, config) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        # (parent, attribute, module) of every module the layer's forward here stands in for
        self.slots = [(layer, n, getattr(layer, n)) for n in ("self_attn", "mlp", "input_layernorm",
                                                              "post_attention_layernorm")]
        self.slots += [(attn, n, getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        self.slots += [(mlp, n, getattr(mlp, n)) for n in ("gate_proj", "up_proj", "down_proj")]
        self.layer = layer
        # what `usable` reads, flat, so that it runs at C speed (it runs for every layer of every pass)
        self._watched = [layer] + [module for _, _, module in self.slots]
        self._owners = [parent._modules for parent, _, _ in self.slots]
        self._names = [name for _, name, _ in self.slots]
        self._held = [module for _, _, module in self.slots]
        self.qkv, self.gate_up = attn.q_proj.group.linear, mlp.gate_proj.group.linear
        self.o, self.down = attn.o_proj, mlp.down_proj
        self.norm1, self.norm2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.variance_epsilon
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
        self.scaling = attn.scaling
        self.inner = self.gate_up.out_features // 2

    def usable(self) -> bool:
        """The layer still holds the modules this was made from, none with a hook (read from the modules' own
        dicts, through `map` over flat lists: this runs for every layer of every pass)."""
        return (not any(map(any, map(_HOOKS, self._watched)))
                and all(map(operator.is_, map(dict.get, self._owners, self._names), self._held)))

    def __call__(self, x3: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, cache, index: int, start,
                 mask) -> torch.Tensor:
        """(B, T, d) -> (B, T, d); `cos`, `sin_signed`: (B, T, 1, head_dim) from `rope_tables`."""
        b, t, d = x3.shape
        heads, kv = self.heads, self.kv_heads
        x = x3.reshape(b * t, d)
        qkv = self.qkv.linear2d(torch.rms_norm(x, (d,), self.norm1, self.eps)).view(b, t, heads + 2 * kv, -1)
        qk = qkv[:, :, :heads + kv]
        qk = qk * cos + torch.roll(qk, self.head_dim // 2, -1) * sin_signed
        keys, values = cache.update(index, start, qk[:, :, heads:].transpose(1, 2), qkv[:, :, heads + kv:].transpose(1, 2))
        o = F.scaled_dot_product_attention(qk[:, :, :heads].transpose(1, 2), keys, values, attn_mask=mask,
                                           scale=self.scaling, enable_gqa=heads != kv)
        x = x + self.o.linear2d(o.transpose(1, 2).reshape(b * t, -1))
        gu = self.gate_up.linear2d(torch.rms_norm(x, (d,), self.norm2, self.eps))
        x = x + self.down.linear2d(F.silu(gu[:, :self.inner]) * gu[:, self.inner:])
        return x.view(b, t, d)


class FastUsable:
    """Whether every one of `layers` is still `usable` and no global module hook is set (it would see none of their
    modules), with all their modules read once into flat lists: one pass at C speed however many layers (it runs
    at every pass, where one call per layer showed in a step's profile: benchmarks/step_profile.py)."""

    def __init__(self, layers: list[FastLayer]) -> None:
        self.watched = [m for f in layers for m in f._watched]
        self.owners = [o for f in layers for o in f._owners]
        self.names = [n for f in layers for n in f._names]
        self.held = [m for f in layers for m in f._held]
        # the modules' hook dicts themselves (a hook is registered into them in place): `any` of them is one C loop
        self.hooks = [d for m in self.watched for d in _HOOKS(m)]

    def __call__(self) -> bool:
        hooks = torch.nn.modules.module
        if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
            return False
        return not any(self.hooks) and list(map(dict.get, self.owners, self.names)) == self.held  # modules in place


def rope_tables(rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The base's rotary (cos, sin), each (B, T, head_dim), as `FastLayer` takes them: (B, T, 1, head_dim), the
    sine's first half negated (rotate_half(x) * sin == roll(x, half) * that, exactly: only signs move)."""
    cos, sin = rope
    half = sin.shape[-1] // 2
    return cos.unsqueeze(2), torch.cat((-sin[..., :half], sin[..., half:]), -1).unsqueeze(2)


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
            and hasattr(layer.input_layernorm, "variance_epsilon")
            and all(getattr(norm, "weight", None) is not None and norm.weight.dtype == torch.float32
                    for norm in (layer.input_layernorm, layer.post_attention_layernorm)))


def decode_layers(base: nn.Module) -> list[FastLayer] | None:
    """`FastLayer`s for the base's decoder layers (`base`: the inner model, with `layers` and `rotary_emb`), or None
    where they would not be the same computation. The first is checked against the module-by-module layer
    (`kv.layer_forward`), bit for bit, on a two-position pass."""
    config = base.config
    if (getattr(config, "model_type", "") not in FAST_TYPES or getattr(config, "hidden_act", "") != "silu"
            or not all(_fits(layer) for layer in base.layers)):
        return None
    layers = [FastLayer(layer, config) for layer in base.layers]
    if not all(f.usable() for f in layers) or not _same_as(layers[0], base):
        return None
    return layers


def fast_layers_of(layers, config) -> list[FastLayer] | None:
    """`FastLayer`s for decoder layers of the base's kind that fit them (fused quantized projections), without the
    bit-for-bit probe `decode_layers` makes (the micro-step decoder's layers: their user checks its own path)."""
    if getattr(config, "model_type", "") not in FAST_TYPES or not all(_fits(layer) for layer in layers):
        return None
    fast = [FastLayer(layer, config) for layer in layers]
    return fast if all(f.usable() for f in fast) else None


def probe_first_layer(base: nn.Module, run) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The base's first layer module by module (`kv.layer_forward`) and through `run(x, rope, cache, start, mask)`,
    on a random two-position pass at slots 3..4 over caches holding the same random earlier entries: [(module path,
    run)] for the output, the keys and the values (what a faster path is checked against before it is used)."""
    device = base.layers[0].input_layernorm.weight.device
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, 2, base.config.hidden_size, generator=gen).to(device)
    positions = torch.arange(3, 5, device=device)[None]
    mask = torch.ones(1, 1, 2, 5, dtype=torch.bool, device=device).tril(3)
    caches = [KVCache.for_layers(base.layers[:1], base.config, 1, 8, torch.float32, device) for _ in range(2)]
    earlier = torch.randn(caches[0].k.shape, generator=gen).to(device)
    for cache in caches:
        cache.k.copy_(earlier)
        cache.v.copy_(earlier.flip(-1))
    with torch.inference_mode():
        rope = base.rotary_emb(x, positions)
        slow = layer_forward(base.layers[0], x, rope, caches[0], 0, 3, mask)
        quick = run(x.clone(), rope, caches[1], 3, mask)
    return [(slow, quick), (caches[0].k, caches[1].k), (caches[0].v, caches[1].v)]


def _same_as(fast: FastLayer, base: nn.Module) -> bool:
    """The fast layer and `layer_forward` give the same output and cache, bit for bit (`probe_first_layer`)."""
    pairs = probe_first_layer(base, lambda x, rope, cache, start, mask: fast(x, *rope_tables(rope), cache, 0,
                                                                            start, mask))
    return all(torch.equal(a, b) for a, b in pairs)
