"""Greedy decoding's LM head on the native kernels: the fused argmax (`native.linear_argmax`) against the product
alone (`native.linear`) and the product followed by PyTorch's `max` (what greedy decoding ran before), on the
embedded default's head (49152 x 576, its GGUF's Q8_0 blocks, in cache) at 1 and 3 rows. The three take turns
within each round; the median over rounds is printed, ms per call.

    python benchmarks/head_argmax.py            # under a minute on 2 cores
"""

from __future__ import annotations

import statistics
import time

import torch

from hamburger.kernels import native
from hamburger.loading import load


def main() -> None:
    model, _ = load("default", quantize="auto", decode_only=True)
    head = model.base.get_output_embeddings()
    desc = head.native_desc()
    print("| rows | product alone | product, then torch max | fused argmax |\n| ---: | ---: | ---: | ---: |")
    for rows in (1, 3):
        x = torch.randn(rows, head.in_features, generator=torch.Generator().manual_seed(rows))
        calls = {"alone": lambda: native.linear(x, desc), "max": lambda: native.linear(x, desc).max(-1).indices,
                 "fused": lambda: native.linear_argmax(x, desc)}
        assert torch.equal(calls["max"](), calls["fused"]())
        times = {name: [] for name in calls}
        for _ in range(15):
            for name, fn in calls.items():
                start = time.perf_counter()
                for _ in range(20):
                    fn()
                times[name].append((time.perf_counter() - start) / 20 * 1e3)
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"| {rows} | {med['alone']:.3f} | {med['max']:.3f} | {med['fused']:.3f} |")


if __name__ == "__main__":
    main()
