"""PyTorch's weight-only matmul kernels on this CPU, per input dtype: why int8/int4 compute in bfloat16.

For each layer shape of the default (SmolLM2-135M: attention 576x576, k/v 192x576, MLP 1536x576 and 576x1536, the
LM head 49152x576) and rows M (1 = a decode step at batch 1, 4 = a verify pass, 64 = a prefill chunk), the
milliseconds per call of: float32 `F.linear`, FBGEMM's float16 weights (`--quantize fp16`), and
`aten._weight_int8pack_mm` / `aten._weight_int4pack_mm_for_cpu` (group 32) with float32, float16 and bfloat16
inputs. The kernels take turns within each round (`--rounds`), and the median is printed. The weights are random
(the speed does not depend on their values) and stay in cache between calls of one kernel, so these are the
kernels' speeds, not the memory-bound speeds of a whole decode step (`decode_step.py` measures those).

    python benchmarks/int_kernels.py                     # about 1 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]


def per_call_ms(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def kernels(n: int, k: int, m: int) -> dict:
    """name -> a zero-argument call of that kernel on (m, k) inputs and (n, k) weights."""
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(n, k, generator=gen) * 0.02, torch.randn(m, k, generator=gen)
    packed16 = torch.ops.quantized.linear_prepack_fp16(w)
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    s8 = torch.rand(n, generator=gen) * 1e-3
    q4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32,
                                                                          generator=gen), 2)
    sz = torch.rand(k // 32, n, 2, generator=gen) * 1e-3
    wb, xb = w.bfloat16(), x.bfloat16()
    out = {"float32 F.linear": lambda: F.linear(x, w),
           "bfloat16 F.linear (oneDNN)": lambda: F.linear(xb, wb),
           "fp16 (FBGEMM)": lambda: torch.ops.quantized.linear_dynamic_fp16(x, packed16)}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        xd, s8d, szd = x.to(dtype), s8.to(dtype), sz.to(dtype)
        name = str(dtype).removeprefix("torch.")
        out[f"int8, {name} in"] = lambda xd=xd, s8d=s8d: torch.ops.aten._weight_int8pack_mm(xd, q8, s8d)
        out[f"int4, {name} in"] = lambda xd=xd, szd=szd: torch.ops.aten._weight_int4pack_mm_for_cpu(xd, q4, 32, szd)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,64", help="comma list of M")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget-ms", type=float, default=20.0, help="about this long per kernel per round")
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"ms per call, median of {args.rounds} rounds, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for m in rows:
        for n, k in SHAPES:
            calls = kernels(n, k, m)
            counts = {name: max(1, int(args.budget_ms / max(per_call_ms(fn, 2), 1e-3))) for name, fn in calls.items()}
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, fn in calls.items():
                    times[name].append(per_call_ms(fn, counts[name]))
            cells = ", ".join(f"{name} {statistics.median(t):.3f}" for name, t in times.items())
            print(f"M={m:<3} {n}x{k}: {cells}", flush=True)


if __name__ == "__main__":
    main()
