"""Process, then compress: a frozen base whose KV cache keeps ONE merged entry per macro-step.

Each macro-step's 1..K tokens go through the frozen base as ordinary positions (causal among themselves,
attending to the compressed past). When the step is done its keys and values are replaced, in every layer
and KV head, by one entry: softmax-weighted sums over the step's tokens, the weights indexed by offset from
the step's *end* (so "the last token" is the same weight whatever the step's length). Later queries add a
bias a*log(k) + c (per layer and query head) to that entry's attention logit: k identical keys would add
exactly log k to the softmax, so a = 1, c = 0 with mean weights is the untrained start. Keys are merged
after rotation, each at its own position, so a merged entry needs no position of its own.

Two forms of the same computation: `parallel_forward` (all positions at once under an explicit float
mask: training and evaluation) and `stepwise_forward` (step by step with a list cache, as a decoder would
run it: the reference the tests hold the parallel form to). `hamburger train-merger` fits the merger by
KL(unmerged base || merged base) on every response position, the base frozen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from hamburger.errors import HamburgerError
from hamburger.model.files import load_state
from hamburger.model.layers import attend, project

WEIGHTS = "merger.safetensors"


class KVMerger(nn.Module):
    """Per layer and KV head: softmax logits over step offsets for K and for V (zeros: the mean), one set per
    head or, with `channels`, one per head and channel; per layer and query head: the merged entry's bias
    a*log k + c; optionally per-channel gates on merged K and V."""

    def __init__(self, layers: int, kv_heads: int, heads: int, max_step_tokens: int, head_dim: int,
                 gates: bool = False, channels: bool = False) -> None:
        super().__init__()
        self.config = dict(layers=layers, kv_heads=kv_heads, heads=heads, max_step_tokens=max_step_tokens,
                           head_dim=head_dim, gates=gates, channels=channels)
        self.max_step_tokens = max_step_tokens
        shape = (layers, kv_heads, max_step_tokens, head_dim if channels else 1)
        self.k_logits = nn.Parameter(torch.zeros(shape))
        self.v_logits = nn.Parameter(torch.zeros(shape))
        self.a = nn.Parameter(torch.ones(layers, heads))
        self.c = nn.Parameter(torch.zeros(layers, heads))
        self.k_gate = nn.Parameter(torch.ones(layers, kv_heads, head_dim)) if gates else None
        self.v_gate = nn.Parameter(torch.ones(layers, kv_heads, head_dim)) if gates else None

    @classmethod
    def for_base(cls, config, max_step_tokens: int, gates: bool = False, channels: bool = False) -> KVMerger:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.num_attention_heads,
                   max_step_tokens, head_dim, gates, channels)

    def weights(self, logits: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """Softmax over each step's own tokens: (kvh, K, c) logits, lengths (*) -> (*, kvh, width, c), c = 1 or
        head_dim."""
        offset = lengths[..., None] - 1 - torch.arange(width, device=lengths.device)  # from the step's end
        w = logits[:, offset.clamp(min=0)].movedim(0, -3)  # (*, kvh, width, c)
        w = w.masked_fill((offset < 0)[..., None, :, None], float("-inf"))  # padding past the step's end
        return torch.softmax(w, -2)

    def merge(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's rotated keys and values (*, kvh, width, hd), its first `lengths` (*) tokens real ->
        one merged key and value each (*, kvh, 1, hd). Works for any leading shape (B or B, S)."""
        width = k.shape[-2]
        mk = (self.weights(self.k_logits[layer], lengths, width).to(k.dtype) * k).sum(-2, keepdim=True)
        mv = (self.weights(self.v_logits[layer], lengths, width).to(v.dtype) * v).sum(-2, keepdim=True)
        if self.k_gate is not None:
            mk, mv = mk * self.k_gate[layer, :, None].to(k.dtype), mv * self.v_gate[layer, :, None].to(v.dtype)
        return mk, mv

    def bias(self, layer: int, lengths: torch.Tensor) -> torch.Tensor:
        """Additive attention bias of merged entries of `lengths` (*) tokens -> (*, heads)."""
        return self.a[layer] * torch.log(lengths.to(self.a.dtype))[..., None] + self.c[layer]

    def merge_all_layers(self, k: torch.Tensor, v: torch.Tensor,
                         lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`merge` for every layer at once (the decoder's form): (L, B, kvh, width, hd), lengths (B,) ->
        (L, B, kvh, hd) each."""
        width = k.shape[-2]
        offset = lengths[:, None] - 1 - torch.arange(width, device=lengths.device)  # (B, width)

        def weights(logits: torch.Tensor) -> torch.Tensor:  # (L, kvh, K, c) -> (L, B, kvh, width, c)
            w = logits[:, :, offset.clamp(min=0)].permute(0, 2, 1, 3, 4)
            return torch.softmax(w.masked_fill((offset < 0)[None, :, None, :, None], float("-inf")), -2)

        mk = (weights(self.k_logits).to(k.dtype) * k).sum(-2)
        mv = (weights(self.v_logits).to(v.dtype) * v).sum(-2)
        if self.k_gate is not None:
            mk, mv = mk * self.k_gate[:, None].to(k.dtype), mv * self.v_gate[:, None].to(v.dtype)
        return mk, mv

    def save(self, path: str | Path, **meta: str) -> None:
        """Float32 safetensors with the config (and `meta`, strings) in the header: a few kB."""
        tensors = {k: v.detach().float().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(path), metadata={"config": json.dumps(self.config), **meta})

    @classmethod
    def load(cls, path: str | Path) -> KVMerger:
        """A saved merger; `.meta` keeps what it was saved with (e.g. the base's fingerprint, to check)."""
        try:
            with safe_open(str(path), "pt") as f:
                meta = dict(f.metadata() or {})
                state = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError) as exc:
            raise HamburgerError(f"{path}: not a readable safetensors file, truncated or corrupted? ({exc})") from exc
        try:
            merger = cls(**json.loads(meta.pop("config")))
        except (KeyError, ValueError, TypeError) as exc:
            raise HamburgerError(f"{path}: not a KV merger (its header has no valid config: {exc})") from exc
        for name in ("k_logits", "v_logits"):  # saved before per-channel weights existed: (L, kvh, K)
            if state.get(name) is not None and state[name].dim() == 3:
                state[name] = state[name][..., None]
        load_state(merger, state, path)
        merger.meta = meta
        return merger


# --- the parallel (training) form -------------------------------------------------------------------------

@dataclass
class Layout:
    """A right-padded batch of sequences (prompt, then a response cut into steps) and where each piece sits."""

    ids: torch.Tensor  # (B, T) token ids, 0 past each row's end
    prompt_len: torch.Tensor  # (B,)
    step_of: torch.Tensor  # (B, T) -1 prompt, j for a token of step j, -2 padding (sees only prompt+padding)
    step_tokens: torch.Tensor  # (B, S, W) positions of each step's tokens (past its end: its last one, masked)
    step_len: torch.Tensor  # (B, S) 1 for padding steps (never visible), so every softmax has a token
    valid: torch.Tensor  # (B, R) response token r exists
    starts: torch.Tensor  # (B, R) response token r begins a step

    @classmethod
    def build(cls, ids: list[list[int]], prompt_len: list[int], steps: list[list[int]], device=None) -> Layout:
        b = len(ids)
        t, s = max(map(len, ids)), max(map(len, steps))
        w = max(max(st) for st in steps)
        r = t - min(prompt_len)
        out = cls(torch.zeros(b, t, dtype=torch.long), torch.tensor(prompt_len), torch.full((b, t), -2),
                  torch.zeros(b, s, w, dtype=torch.long), torch.ones(b, s, dtype=torch.long),
                  torch.zeros(b, r, dtype=torch.bool), torch.zeros(b, r, dtype=torch.bool))
        for i, (row, p, st) in enumerate(zip(ids, prompt_len, steps)):
            if p < 1 or not st or sum(st) != len(row) - p or min(st) < 1:
                raise HamburgerError(f"steps {st} must be lengths >= 1 summing to the response ({len(row) - p})")
            out.ids[i, : len(row)] = torch.tensor(row)
            out.step_of[i, :p] = -1
            out.valid[i, : len(row) - p] = True
            start = p
            for j, n in enumerate(st):
                out.step_of[i, start : start + n] = j
                out.step_tokens[i, j] = (start + torch.arange(w)).clamp(max=start + n - 1)
                out.step_len[i, j] = n
                out.starts[i, start - p] = True
                start += n
        return out.to(device) if device is not None else out

    def to(self, device) -> Layout:
        return Layout(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def parallel_forward(base, merger: KVMerger | None, ids, prompt_len, steps, merged: bool = True,
                     window: int = 0) -> torch.Tensor:
    """Logits (B, R, V) predicting each response token r (from position prompt_len - 1 + r), every query
    seeing the prompt's tokens, earlier steps as merged entries and its own step's earlier tokens. With
    `merged=False` (merger unused), the plain base. One example or a right-padded batch (see `Layout.valid`).
    With `window` > 1 (compress mode's `merge_window`), a query sees an earlier step's own tokens instead of its
    merged entry while that step ends fewer than `window` positions before the query's step begins."""
    if isinstance(prompt_len, int):  # one example
        ids, prompt_len, steps = [ids], [prompt_len], [steps]
    lay = Layout.build(ids, prompt_len, steps, next(base.parameters()).device)
    return forward_layout(base, merger, lay, merged, window)


def forward_layout(base, merger: KVMerger | None, lay: Layout, merged: bool = True, window: int = 0) -> torch.Tensor:
    model = base.base_model
    b, t = lay.ids.shape
    if merged and int(lay.step_len.max()) > merger.max_step_tokens:  # checked once, not per layer (a host sync)
        raise HamburgerError(f"steps of more than {merger.max_step_tokens} tokens do not fit this merger")
    s = lay.step_len.shape[1]
    heads = base.config.num_attention_heads
    pos = torch.arange(t, device=lay.ids.device)
    visible = (pos[:, None] >= pos[None, :])[None].expand(b, -1, -1)  # (B, query, key)
    if merged:
        q_step, k_step = lay.step_of[:, :, None], lay.step_of[:, None, :]
        own = visible & ((k_step == -1) | (k_step == q_step))  # the prompt, and this step's earlier tokens
        past = torch.arange(s, device=pos.device) < q_step  # (B, T, S) merged entries of earlier steps
        if window > 1:  # earlier steps ending within `window` positions before the query's step: their own tokens
            step_of = lay.step_of.clamp(min=0)
            q_start = lay.step_tokens[..., 0].gather(1, step_of)  # (B, T) where each query's step begins
            recent = lay.step_tokens[..., -1][:, None, :] > q_start[:, :, None] - window  # (B, T, S)
            raw = recent.gather(2, step_of[:, None, :].expand(-1, t, -1))  # (B, T, T): the key's step is recent
            own = own | (visible & (k_step >= 0) & (k_step < q_step) & raw)
            past = past & ~recent
        visible = torch.cat([own, past], -1)
    x = model.embed_tokens(lay.ids)
    mask = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill(~visible, float("-inf"))[:, None]
    rope = model.rotary_emb(x, pos[None].expand(b, -1))
    rows = torch.arange(b, device=x.device)[:, None, None]
    for i, layer in enumerate(model.layers):
        q, k, v = project(layer, x, rope)
        layer_mask = mask
        if merged:
            # Gather each step's tokens (B, S, W, kvh, hd) -> (B, S, kvh, W, hd), merge, back to (B, kvh, S, hd).
            sk = k.transpose(1, 2)[rows, lay.step_tokens].transpose(2, 3)
            sv = v.transpose(1, 2)[rows, lay.step_tokens].transpose(2, 3)
            mk, mv = merger.merge(i, sk, sv, lay.step_len)
            k = torch.cat([k, mk.squeeze(-2).transpose(1, 2)], 2)
            v = torch.cat([v, mv.squeeze(-2).transpose(1, 2)], 2)
            bias = merger.bias(i, lay.step_len).to(x.dtype).transpose(1, 2)[:, :, None]  # (B, H, 1, S)
            layer_mask = torch.cat([mask[..., :t].expand(-1, heads, -1, -1), mask[..., t:] + bias], -1)
        x = attend(layer, x, q, k, v, layer_mask)
    at = (lay.prompt_len[:, None] - 1 + torch.arange(lay.valid.shape[1], device=x.device)).clamp(max=t - 1)
    return base.get_output_embeddings()(model.norm(x[rows[:, :, 0], at]))


# --- the stepwise (decoding) reference -------------------------------------------------------------------

@torch.no_grad()
def _entries_mask(entries: list[tuple], heads: int, n: int, dtype: torch.dtype, dev) -> torch.Tensor:
    """(1, H, n, all entries) additive mask of `stepwise_forward`'s pass: each entry's merger bias (0 for an unmerged
    one), causal among the n new tokens."""
    cols = [torch.zeros(1, heads, ek.shape[2], dtype=dtype, device=dev) if eb is None
            else eb.to(dtype)[:, :, None] for ek, _, eb in entries]
    mask = torch.cat(cols, -1)[:, :, None].repeat(1, 1, n, 1)
    mask[..., -n:] += torch.full((n, n), float("-inf"), device=dev).triu(1)
    return mask


def stepwise_forward(base, merger: KVMerger | None, ids: list[int], prompt_len: int, steps: list[int],
                     merged: bool = True, window: int = 0) -> torch.Tensor:
    """The same logits (1, R, V) computed as a decoder would: the prompt prefilled, then each response token
    alone against a list cache [prompt entries, merged entries of earlier steps, own step so far]; a finished
    step's entries are merged and appended. Plain and slow: the reference for `parallel_forward`. With
    `window` > 1, a finished step keeps its tokens' own entries until the next token's position is `window`
    or more past its last token (checked when a step closes), as compress mode's `merge_window`."""
    model = base.base_model
    dev = next(base.parameters()).device
    heads = base.config.num_attention_heads
    cache: list[list[tuple]] = [[] for _ in model.layers]  # per layer: (keys, values, bias (1, H) or None)
    own: list[list[tuple]] = [[] for _ in model.layers]  # per layer: the current step's (keys, values)
    recent: list[tuple[int, list[tuple]]] = []  # closed steps not merged yet: (last position, per-layer (k, v))

    def run(tokens: list[int], start: int) -> torch.Tensor:
        x = model.embed_tokens(torch.tensor([tokens], device=dev))
        rope = model.rotary_emb(x, torch.arange(start, start + len(tokens), device=dev)[None])
        n = len(tokens)
        for i, layer in enumerate(model.layers):
            q, k, v = project(layer, x, rope)
            own[i].append((k, v))
            entries = cache[i] + [(ek, ev, None) for _, layers in recent for ek, ev in [layers[i]]] + \
                [(ek, ev, None) for ek, ev in own[i]]
            mask = _entries_mask(entries, heads, n, x.dtype, dev)
            x = attend(layer, x, q, torch.cat([e[0] for e in entries], 2), torch.cat([e[1] for e in entries], 2), mask)
        return base.get_output_embeddings()(model.norm(x[:, -1]))

    def close_step(merge: bool) -> None:
        layers = [(torch.cat([e[0] for e in own[i]], 2), torch.cat([e[1] for e in own[i]], 2))
                  for i in range(len(model.layers))]
        for i in range(len(model.layers)):
            own[i] = []
        if merge and window > 1:
            recent.append((pos - 1, layers))
            while recent and pos - recent[0][0] >= window:
                append(recent.pop(0)[1], True)
        else:
            append(layers, merge)

    def append(layers: list[tuple], merge: bool) -> None:
        for i, (k, v) in enumerate(layers):
            if merge:
                n = torch.tensor([k.shape[2]], device=dev)
                mk, mv = merger.merge(i, k, v, n)
                cache[i].append((mk, mv, merger.bias(i, n)))
            else:
                cache[i].append((k, v, None))

    logits = [run(ids[:prompt_len], 0)]
    close_step(merge=False)  # the prompt's entries stay individual
    pos, last = prompt_len, len(ids) - 1
    for n in steps:
        for _ in range(n):
            if pos == last:  # the final token predicts nothing we compare
                return torch.stack(logits, 1)
            logits.append(run([ids[pos]], pos))
            pos += 1
        close_step(merged)
    return torch.stack(logits, 1)
