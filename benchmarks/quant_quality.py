"""How far each weights scheme's products move the default's predictions, on the float model's own replies.

The float base decodes the bench's prompts (2 a set, 128 new tokens, greedy); each scheme then scores those
replies teacher-forced (one full pass through transformers' own forward, the quantized layers' products): the
mean negative log-likelihood of the float model's tokens, and how often its top-1 token is the float model's.
Schemes (int4/fp16: 4-bit layers, the LM head in fp16), each with PyTorch's kernels (`native.turned_off`: FBGEMM's float16, the packed int4 kernel with bfloat16
activations) and the native kernels (float16; int4 with int16 activations in blocks of 32).

    python benchmarks/quant_quality.py                       # fp16, int4, int4/fp16; 2 min on 2 cores
    python benchmarks/quant_quality.py int4/int8 fp16        # the schemes given (SCHEME or SCHEME/HEAD)
    python benchmarks/quant_quality.py int4/int8 int4/int8+a8   # +a8: the native 4-bit products' inputs in 8 bits
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F

from hamburger.evaluation.bench_systems import SETS, bench_messages
from hamburger.inference.engine import Engine
from hamburger.kernels import native
from hamburger.loading import quantize_loaded, split_a8
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import HamburgerModel, load_model


def scored(model, sequences: list[tuple[list[int], list[int]]], reference: list[torch.Tensor] | None):
    """(mean NLL of the replies' tokens, top-1 agreement with `reference`'s argmaxes, this model's argmaxes)."""
    nll, agree, count, argmaxes = 0.0, 0, 0, []
    with torch.inference_mode():
        for i, (prompt, reply) in enumerate(sequences):
            ids = torch.tensor([prompt + reply])
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()
            target = torch.tensor(reply)
            nll += F.cross_entropy(logits, target, reduction="sum").item()
            top = logits.argmax(-1)
            argmaxes.append(top)
            if reference is not None:
                agree += int((top == reference[i]).sum())
            count += len(reply)
    return nll / count, agree / count, argmaxes


def main() -> None:
    model, _ = load_model("default")
    model.eval()
    prompts = [encode_chat(model.tokenizer, m) for s in SETS for m in bench_messages(s, 2)]
    plain = Engine(HamburgerModel.plain(model.base, model.tokenizer))
    with torch.inference_mode():
        replies = [plain.generate([p], max_new_tokens=128).tokens[0] for p in prompts]
    sequences = list(zip(prompts, replies))
    float_nll, _, reference = scored(model.base, sequences, None)
    rows = [("float32 (the reference)", float_nll, 1.0)]
    for spec in (sys.argv[1:] or ("fp16", "int4", "int4/fp16")):
        for kernels in ("torch", "native"):  # (+a8: the native kernels' only)
            if (kernels == "native" and not native.available()) or (kernels == "torch" and split_a8(spec)[1]):
                continue
            with native.turned_off() if kernels == "torch" else contextlib.nullcontext():
                copy, _ = load_model("default")
                copy.eval()
                quantize_loaded(copy, spec, quiet=True)  # SCHEME/HEAD, +a8: as the command line's --quantize
            nll, agree, _ = scored(copy.base, sequences, reference)
            rows.append((f"{spec}, {kernels} kernels", nll, agree))
    tokens = sum(len(r) for r in replies)
    print(f"\nthe float base's greedy replies to {len(prompts)} bench prompts ({tokens} tokens), teacher-forced\n")
    print("| weights | NLL of the float model's tokens | top-1 = the float model's |")
    print("| --- | ---: | ---: |")
    for name, nll, agree in rows:
        print(f"| {name} | {nll:.4f} | {agree:.3f} |")


if __name__ == "__main__":
    main()
