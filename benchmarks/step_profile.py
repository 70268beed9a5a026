"""Where a base decode step's time goes at batch 1: the step against the sum of its matrix products and the memory
bandwidth's floor, per weight scheme, eager.

A step is what decoding repeats: the base pass over one new slot after `--cached` cached ones (the cache grows a
slot a step) and the full LM head. For each scheme (`--schemes fp16,int4`), with the decoder layers module by
module and in the engine's one native call (`inference/native_layers.py`, the engine's default), it reports:

- `step ms`: the step's wall time (median of rounds, the schemes taking turns so a slow spell falls on all alike);
- `GEMMs ms`: the same step's matrix-product kernels alone, called back to back with inputs of the shapes the step
  gave them (recorded by hooks), already in the kernel's dtype, so what the step costs beyond them is the
  per-operator work: conversions, norms, rotary embedding, the cache writes, attention, views, Python;
- `floor ms`: the weights' bytes read per step divided by this machine's measured memory read bandwidth,
  what no kernel beats at batch 1 (measured by a large sum);
- `ops / step`: aten operators dispatched per step (from `torch.profiler`), and its self-time split into GEMMs,
  attention and the rest (profiled times are inflated by the profiler's own cost; the shares are what count).

The layers: `modules` on a copy quantized for PyTorch's kernels (`native.turned_off`), `native` (every
layer of the step in one native call, the native products; the engine's default where they build) on a copy with
the native kernels' layouts; the same weights. A native step's products run inside its one call, so its `GEMMs ms`
are the native products called alone, and its operators are those around the call.

    python benchmarks/step_profile.py --schemes fp16,int4            # about 3 min on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import Counter

import torch
from torch import nn

from hamburger.inference.engine import Engine
from hamburger.inference.kv import KVCache
from hamburger.kernels import native
from hamburger.kernels.qlinear import QuantizedLinear
from hamburger.kernels.quantize import DEFAULT_SKIP, quantize_model
from hamburger.model.hamburger_model import load_model

GEMM_OPS = ("quantized::linear_dynamic_fp16", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm",
            "aten::mm", "aten::addmm", "aten::bmm")
ATTENTION_OPS = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu")


class Scheme:
    """One scheme's model, eager engine and growing cache, with the shapes of the step's matrix products."""

    def __init__(self, model, scheme: str, layers: str, cached: int, steps: int) -> None:
        self.name, self.model = f"{scheme} {layers}", model
        self.engine = Engine(model, native_layers=layers == "native")
        if layers == "native" and self.engine.runner.native is None:
            raise SystemExit(f"{scheme}: the native layers do not apply to this model")
        self.cache = KVCache.for_layers(self.engine.runner.base.layers, model.base.config, 1, cached + steps + 64,
                                        self.engine.runner.kv_dtype, "cpu")
        self.x = model.embed(torch.tensor([[1]])).float()
        self.head = model.base.get_output_embeddings()
        self.slot = cached
        self.times: list[float] = []
        self.calls = self._record_gemms()
        self.weight_bytes = sum(_weight_bytes(layer) for layer, _ in self.calls)

    def step(self) -> None:
        mask = torch.ones(1, 1, 1, self.slot + 1, dtype=torch.bool)
        with torch.inference_mode():
            states = self.engine.runner.base_pass(self.x, torch.tensor([[self.slot]]), self.cache, self.slot, mask)
            self.head(states[0])
        self.slot += 1

    def _record_gemms(self) -> list[tuple[nn.Module, torch.Size]]:
        """(layer, input shape) of every matrix product of one step, in order (fused siblings counted once)."""
        calls, seen = [], set()

        def hook(module, args, _out):
            target = getattr(module, "group", None)
            layer = target.linear if target is not None else module
            key = (id(layer), id(args[0]))
            if key not in seen:
                seen.add(key)
                calls.append((layer, args[0].shape))

        layers = [m for m in self.model.base.modules() if isinstance(m, (QuantizedLinear, nn.Linear))]
        handles = [m.register_forward_hook(hook) for m in layers]
        self.step()
        for h in handles:
            h.remove()
        return calls

    def run(self, steps: int) -> None:
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.times.append((time.perf_counter() - start) / steps * 1e3)

    def gemms_ms(self, repeats: int) -> float:
        """The step's matrix products alone, back to back, ms (median of `repeats`)."""
        inputs = []
        for layer, shape in self.calls:  # the kernel alone: its input already 2-D and in its dtype
            x = torch.randn(shape).reshape(-1, shape[-1])
            if isinstance(layer, QuantizedLinear):
                inputs.append((layer._mm, x.to(layer.compute_dtype).contiguous()))
            else:
                inputs.append((layer, x))
        times = []
        with torch.inference_mode():
            for _ in range(repeats):
                start = time.perf_counter()
                for kernel, x in inputs:
                    kernel(x)
                times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def profile(self, steps: int) -> dict:
        """Operators per step and the self-time shares of GEMMs, attention and the rest."""
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                self.step()
        self_us: Counter = Counter()
        top_ops = 0
        for e in prof.events():
            kind = "gemm" if e.name in GEMM_OPS else "attention" if e.name in ATTENTION_OPS else "other"
            self_us[kind] += e.self_cpu_time_total
            if e.name.startswith(("aten::", "quantized::", "hamburger::")) and e.cpu_parent is None:
                top_ops += 1
        total = sum(self_us.values())
        return {"ops": top_ops / steps, **{k: self_us[k] / total for k in ("gemm", "attention", "other")}}


def _weight_bytes(layer: nn.Module) -> int:
    if isinstance(layer, QuantizedLinear):
        return layer.weight_nbytes
    return layer.weight.numel() * layer.weight.element_size()


def bandwidth_gbs(mbytes: int = 512, repeats: int = 5) -> float:
    """This machine's memory read bandwidth, GB/s: the best of `repeats` sums of a float32 tensor of `mbytes` MiB
    (far larger than the caches; the sum's arithmetic is not what limits it)."""
    a = torch.ones(mbytes * 2**20 // 4)
    best = min(_timed(a.sum) for _ in range(repeats))
    return a.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--schemes", default="fp16,int4", help="comma list of none, fp16, int8, int4")
    p.add_argument("--cached", type=int, default=300, help="cached slots before the first step")
    p.add_argument("--steps", type=int, default=5, help="steps per scheme per round")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--layers", default="modules,native",
                   help="comma list of modules, native (default: both)")
    args = p.parse_args()
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    if not schemes or any(s not in ("none", "fp16", "int8", "int4") for s in schemes):
        p.error(f"--schemes is a comma list of none, fp16, int8, int4, got {args.schemes!r}")
    layers = [s.strip() for s in args.layers.split(",") if s.strip()]
    if not layers or any(s not in ("modules", "native") for s in layers):
        p.error(f"--layers is a comma list of modules, native, got {args.layers!r}")
    if "native" in layers and (why := native.why_unavailable()) is not None:
        p.error(f"the native kernels are not available here: {why}")
    total = args.steps * args.rounds + 40
    rows = []
    for scheme in schemes:
        for kernels in ("torch", "native"):
            wanted = [kind for kind in layers if (kind == "native") == (kernels == "native")]
            if scheme == "none":
                wanted = [kind for kind in wanted if kind == "modules"]
            if not wanted:
                continue
            with native.turned_off() if kernels == "torch" else contextlib.nullcontext():
                model, _ = load_model(args.model, dtype=torch.float32)
                model.eval()
                if scheme != "none":
                    quantize_model(model, scheme, skip=DEFAULT_SKIP)
                rows += [Scheme(model, scheme, kind, args.cached, total) for kind in wanted]
    for row in rows:  # warm up
        row.run(3)
        row.times.clear()
    for _ in range(args.rounds):
        for row in rows:
            row.run(args.steps)
    gbs = bandwidth_gbs()
    print(f"one base decode step at batch 1 ({args.cached}+ cached slots), {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds of {args.steps} steps; memory bandwidth {gbs:.1f} GB/s (a large sum)")
    print(f"{'layers':<13} {'step ms':>8} {'GEMMs ms':>9} {'rest ms':>8} {'floor ms':>9} {'weights MB':>11} "
          f"{'ops/step':>9} {'gemm %':>7} {'attn %':>7} {'other %':>8}")
    for row in rows:
        step = statistics.median(row.times)
        gemm = row.gemms_ms(20)
        prof = row.profile(10)
        floor = row.weight_bytes / (gbs * 1e9) * 1e3  # a step reads its weights once
        print(f"{row.name:<13} {step:>8.2f} {gemm:>9.2f} {step - gemm:>8.2f} {floor:>9.2f} {row.weight_bytes / 1e6:>11.1f} "
              f"{prof['ops']:>9.0f} {prof['gemm'] * 100:>6.0f}% {prof['attention'] * 100:>6.0f}% "
              f"{prof['other'] * 100:>7.0f}%")


if __name__ == "__main__":
    main()
