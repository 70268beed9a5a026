"""Operators that let `torch.compile` trace a whole base pass of the engine (`Engine(compile=True)`, `--compile`).

Two things in a pass defeat the compiler when written as plain PyTorch:

* FBGEMM's packed float16 GEMM (`--quantize fp16`) takes its weights as an opaque object: dynamo breaks the graph
  around every call. `fp16_linear` names the packed weights by an integer key instead.
* A KV cache write is an in-place write into a slice of the stacked cache. Traced as indexing, the compiler turns
  it into a functional update followed by a copy back, i.e. a copy of the whole cache at every layer (a
  compiled step slower than eager: benchmarks/decode_step.py). `kv_write` (slots `start..` for every row) and `kv_scatter` (each row's
  own slots) are opaque in-place writes instead.

Eager code does not use the operators (a Python-defined operator costs a few microseconds a call): `Fp16Linear`
and `KVCache` switch to them only while `torch.compiler.is_compiling()`, and otherwise call the same writes
(`write_slots`, `scatter_slots`) as plain functions.
"""

from __future__ import annotations

import itertools
import weakref

import torch

LIB = torch.library.Library("hamburger", "DEF")  # defined once, at import
LIB.define("fp16_linear(Tensor x, int key) -> Tensor")
LIB.define("kv_write(Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, SymInt start, Tensor k, Tensor v) -> ()")
LIB.define("kv_scatter(Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, Tensor slots, Tensor k, Tensor v) -> ()")

_keys = itertools.count()
_packed: dict[int, weakref.ref] = {}  # key -> the Fp16Linear whose packed weights it names
_out_features: dict[int, int] = {}


def register_fp16(module) -> int:
    """A key for `module`'s weights (`module.eager_mm`, `module.out_features`), dropped with the module."""
    key = next(_keys)
    _packed[key], _out_features[key] = weakref.ref(module), module.out_features
    weakref.finalize(module, _forget, key)
    return key


def _forget(key: int) -> None:
    _packed.pop(key, None)
    _out_features.pop(key, None)


def _fp16_linear(x: torch.Tensor, key: int) -> torch.Tensor:
    return _packed[key]().eager_mm(x.reshape(-1, x.shape[-1]).contiguous()).view(*x.shape[:-1], -1)


def _fp16_linear_fake(x: torch.Tensor, key: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _out_features[key])


def write_slots(k_cache, v_cache, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v (B, h, T, hd) into slots start..start+T-1 of every row of layer `layer` of the caches (eager code calls
    this directly; compiled code through `kv_write`)."""
    end = start + k.shape[2]
    k_cache[layer, :, :, start:end] = k
    v_cache[layer, :, :, start:end] = v


def scatter_slots(k_cache, v_cache, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v (B, h, T, hd) into each row's own slots (B, T) of layer `layer` of the caches (rows 0..B-1; compiled
    code calls it through `kv_scatter`)."""
    rows = torch.arange(k.shape[0], device=k.device)[:, None]
    k_cache[layer, rows, :, slots] = k.transpose(1, 2)
    v_cache[layer, rows, :, slots] = v.transpose(1, 2)


def _no_output(*args) -> None:
    return None


for _device in ("CPU", "CUDA"):
    LIB.impl("fp16_linear", _fp16_linear, _device)
    LIB.impl("kv_write", write_slots, _device)
    LIB.impl("kv_scatter", scatter_slots, _device)
torch.library.register_fake("hamburger::fp16_linear", _fp16_linear_fake, lib=LIB)
torch.library.register_fake("hamburger::kv_write", _no_output, lib=LIB)
torch.library.register_fake("hamburger::kv_scatter", _no_output, lib=LIB)

fp16_linear = torch.ops.hamburger.fp16_linear.default
kv_write = torch.ops.hamburger.kv_write.default
kv_scatter = torch.ops.hamburger.kv_scatter.default
