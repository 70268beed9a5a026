"""Whether training computes under bfloat16 autocast: only where the hardware multiplies bfloat16 natively."""

from __future__ import annotations

import sys

import torch


def bf16_autocast(requested: bool, device_type: str) -> bool:
    """True when bf16 autocast was asked for (the trainers' default) and pays on `device_type`: CUDA with bf16
    support, or a CPU with native bf16 instructions (AVX512-BF16 / AMX, oneDNN's check). On other CPUs (AVX2
    only) bf16 matmuls are emulated, 8x slower than float32 (measured on an AMD EPYC): float32 then, said once
    on stderr."""
    if not requested:
        return False
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device_type == "cpu" and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return True
    print(f"bf16 autocast off: no native bfloat16 on this {device_type} (it would be slower than float32); "
          "training in float32", file=sys.stderr)
    return False
