"""What a float16 KV cache moves, teacher-forced. The float base's greedy replies to the bench's prompts (2 a
set, 128 new tokens, as benchmarks/quant_quality.py), scored by one causal pass over prompt + reply through the
engine's cached layers (`kv.layer_forward`) with the cache in float32 and in float16: the NLL of the float model's
tokens and how often the top-1 token is the float model's (float32 weights, float32 cache). Rows: the float model and
the default's int4/int8 weights, each with both caches.

    python benchmarks/kv_fidelity.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hamburger.evaluation.bench_systems import SETS, bench_messages
from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache, layer_forward
from hamburger.loading import quantize_loaded
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import HamburgerModel, load_model


def logits(model, ids: list[int], dtype) -> torch.Tensor:
    inner = model.base.base_model
    x = inner.embed_tokens(torch.tensor([ids]))
    cache = KVCache.for_layers(inner.layers, inner.config, 1, len(ids), dtype, "cpu")
    rope = inner.rotary_emb(x, torch.arange(len(ids))[None])
    mask = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()[None, None]
    for i, layer in enumerate(inner.layers):
        x = layer_forward(layer, x, rope, cache, i, 0, mask)
    return model.base.lm_head(inner.norm(x))[0].float()


model, _ = load_model("default")
model.eval()
prompts = [encode_chat(model.tokenizer, m) for s in SETS for m in bench_messages(s, 2)]
with torch.inference_mode():
    plain = Engine(HamburgerModel.plain(model.base, model.tokenizer), kv_dtype="float32")
    replies = [plain.generate([p], max_new_tokens=128).tokens[0] for p in prompts]
    quant, _ = load_model("default")
    quant.eval()
    quantize_loaded(quant, "int4/int8", quiet=True)
    reference, rows = None, []
    for name, m in (("float32 weights", model), ("int4/int8 weights (the default's)", quant)):
        for dtype in (torch.float32, torch.float16):
            nll, agree, count, tops = 0.0, 0, 0, []
            for p, r in zip(prompts, replies):
                out = logits(m, p + r, dtype)[len(p) - 1:-1]
                nll += F.cross_entropy(out, torch.tensor(r), reduction="sum").item()
                tops.append(out.argmax(-1))
                count += len(r)
            if reference is None:
                reference = tops
            agree = sum(int((a == b).sum()) for a, b in zip(tops, reference))
            rows.append((name, str(dtype).removeprefix("torch."), nll / count, agree / count))
tokens = sum(len(r) for r in replies)
print(f"the float base's greedy replies to {len(prompts)} bench prompts ({tokens} tokens; prompts "
      f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens), teacher-forced through the engine's cached layers\n")
print("| weights | KV cache | NLL of the float model's tokens | top-1 = the float model's (float32 cache) |")
print("| --- | --- | ---: | ---: |")
for name, kv, nll, agree in rows:
    print(f"| {name} | {kv} | {nll:.4f} | {agree:.3f} |")
