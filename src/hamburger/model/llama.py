"""Llama-style decoders (Llama, Mistral, Qwen2, Qwen3) in plain PyTorch: the base for decoding without transformers.

`hamburger generate` spends most of its start-up importing transformers (about 2.4 s of 4 on two CPU cores) to
build a model whose layers the engine then drives module by module. `load_light` builds the same module tree
(the same names, parameters and arithmetic as transformers' classes: `model.layers[i].self_attn.q_proj`, ...,
`model.rotary_emb`, `lm_head`) from a local folder's config.json and safetensors, without importing transformers.
It takes only what it reproduces exactly (no RoPE scaling, no sliding window, every size given in config.json),
and returns None otherwise: the caller then loads transformers' own classes. The decoding engine runs these
modules as it runs transformers'; training and the reference engine need transformers' (a cache, its kwargs).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from hamburger.model.files import read_json, read_safetensors

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "hidden_act")
# transformers' defaults of the settings config.json may leave out (per architecture where they differ)
DEFAULTS = {"attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "pad_token_id": None,
            "bos_token_id": None, "eos_token_id": None, "max_position_embeddings": 2048}


class DecoderConfig(SimpleNamespace):
    """config.json's settings as attributes (what the engine reads of transformers' config), defaults filled."""


def rope_theta(data: dict) -> float | None:
    """The RoPE base of a config without scaling (transformers 5's `rope_parameters` or the older `rope_theta`), or
    None where some scaling applies."""
    params = data.get("rope_parameters")
    if params is not None:
        return float(params["rope_theta"]) if params.get("rope_type", "default") == "default" else None
    if data.get("rope_scaling") is not None:
        return None
    return float(data.get("rope_theta", 10000.0))


def config_from(data: dict) -> DecoderConfig | None:
    """The config of a folder's config.json, or None where this module would not compute what transformers does."""
    kind = data.get("model_type")
    if kind not in SUPPORTED or any(k not in data for k in REQUIRED) or data["hidden_act"] != "silu":
        return None
    if kind == "qwen3" and "head_dim" not in data:
        return None
    sliding = data.get("use_sliding_window", False) if kind in ("qwen2", "qwen3") else data.get("sliding_window")
    theta = rope_theta(data)
    if sliding or theta is None or data.get("quantization_config") is not None:
        return None
    values = {**DEFAULTS, **data, "rope_theta": theta}
    values["head_dim"] = data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"]
    values["attention_bias"] = True if kind == "qwen2" else values["attention_bias"]
    values.setdefault("name_or_path", "")
    return DecoderConfig(**values)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)), normalised in float32 and cast back to x's dtype before the weight, as
    transformers' Llama norm. Where x and the weight are float32 (decoding), PyTorch's one fused operator, which gives
    the formula's bits (a test) for a fraction of a decode step's per-operator cost."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)


class RotaryEmbedding(nn.Module):
    """(x, position_ids (B, T)) -> cos, sin (B, T, head_dim) in x's dtype, as transformers' default RoPE."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        dim = config.head_dim
        # on the CPU even under a meta-device build (arange on meta goes through torch's compiler: a second)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Rotate queries and keys (B, heads, T, hd) by cos, sin (B, T, hd): what the engine's `layers.project` calls."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx, self.head_dim = config, layer_idx, config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        d, q_out, kv_out = config.hidden_size, config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj, self.k_proj = nn.Linear(d, q_out, bias=bias), nn.Linear(d, kv_out, bias=bias)
        self.v_proj = nn.Linear(d, kv_out, bias=bias)
        self.o_proj = nn.Linear(q_out, d, bias=bias and config.model_type != "qwen2")
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim)
        k = self.k_proj(x).view(b, t, -1, self.head_dim)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *rope)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                           enable_gqa=self.num_key_value_groups != 1)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        d, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj, self.up_proj = nn.Linear(d, inner, bias=bias), nn.Linear(d, inner, bias=bias)
        self.down_proj = nn.Linear(inner, d, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The inner model (`base.base_model`): embeddings, layers, final norm, RoPE tables."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        # An empty weight: no random initialisation to overwrite (and on the meta device, normal_ would import
        # torch's compiler, a second of start-up)
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                output_hidden_states: bool = False) -> SimpleNamespace:
        """A whole sequence at once (no KV cache): `last_hidden_state` and, if asked, `hidden_states` (the
        embeddings, each layer's output, the last one normed), as transformers' model returns them."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, t, _ = x.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=x.device)[None].expand(b, -1)
        allowed = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill(~allowed, torch.finfo(x.dtype).min)
        rope = self.rotary_emb(x, position_ids)
        states = [x]
        for layer in self.layers:
            x = layer(x, rope, mask)
            states.append(x)
        x = self.norm(x)
        states[-1] = x
        return SimpleNamespace(last_hidden_state=x, hidden_states=tuple(states) if output_hidden_states else None)


class CausalLM(nn.Module):
    """A decoder and its LM head, named as transformers names them (`model`, `lm_head`; tied to the embeddings
    where the config says so)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.generation_config = SimpleNamespace(eos_token_id=config.eos_token_id)
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def base_model(self) -> Decoder:
        return self.model

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> SimpleNamespace:
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids, attention_mask).last_hidden_state))


def weight_files(folder: Path) -> list[Path] | None:
    """The folder's safetensors (one file, or the shards its index lists), or None."""
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return None
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [folder / s for s in shards] if all((folder / s).is_file() for s in shards) else None


def load_light(folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               name: str | None = None) -> CausalLM | None:
    """The base in `folder` (config.json + safetensors) as a `CausalLM`, in `dtype` on `device`; None where this
    module does not reproduce it (then load it with transformers). Weights whose names do not match are None too."""
    folder = Path(folder)
    files = weight_files(folder)
    if files is None or not (folder / "config.json").is_file():
        return None
    config = config_from(read_json(folder / "config.json"))
    if config is None:
        return None
    config.name_or_path = name or str(folder)
    state = {}
    for f in files:
        state.update(read_safetensors(f, device))
    with torch.device("meta"):
        model = CausalLM(config)
    want = set(model.state_dict())
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        want.discard("lm_head.weight")
    if set(state) != want:
        return None
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = RotaryEmbedding(config).to(device)
    generation = folder / "generation_config.json"
    if generation.is_file() and "eos_token_id" in (extra := json.loads(generation.read_text())):
        model.generation_config.eos_token_id = extra["eos_token_id"]
    return model.eval()
