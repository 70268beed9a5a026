"""Probe: the native weights' tiles in one arena of 2 MB pages (madvise MADV_HUGEPAGE) against PyTorch's own
allocations (4 KB pages where transparent huge pages are `madvise`), the base and verify mode interleaved prompt by
prompt. A hypothesis test: does streaming ~90 MB of weights over 4 KB pages (TLB misses, nested paging in a VM)
cost the pass and the Python after it?"""
from __future__ import annotations

import ctypes
import math
import sys
import threading
import time

import torch

import hamburger.kernels.native as native
from hamburger.evaluation.bench_systems import SETS, bench_messages
from hamburger.inference.engine import Engine
from hamburger.kernels.quantize import DEFAULT_SKIP, quantize_model
from hamburger.model.base import encode_chat
from hamburger.model.hamburger_model import HamburgerModel, load_model

HUGE = 2 << 20
libc = ctypes.CDLL(None)


class Arena:
    def __init__(self, size: int) -> None:
        self.raw = torch.empty(size + HUGE, dtype=torch.uint8)
        off = (-self.raw.data_ptr()) % HUGE
        self.buf = self.raw[off:off + size]
        rc = libc.madvise(ctypes.c_void_p(self.buf.data_ptr()), ctypes.c_size_t(size), 14)  # MADV_HUGEPAGE
        assert rc == 0
        self.used = 0

    def zeros(self, *shape) -> torch.Tensor:
        n = math.prod(shape)
        t = self.buf[self.used:self.used + n].view(*shape)
        self.used += -(-n // 4096) * 4096
        t.zero_()
        return t


def patched(arena: Arena):
    """native.tile_q4 / tile_q8 with their output in the arena (quantize_model tiles on a pool of threads)."""
    lock = threading.Lock()

    def out(n: int, k: int, kind: int) -> torch.Tensor:
        with lock:
            return arena.zeros(-(-n // native.CODES_TILE), k // native.CODES_BLOCK, native.TILE_BYTES[kind])

    def q4(q, scales, mins, group):
        n, k = q.shape
        o = out(n, k, native.INT4_Q16)
        q, scales, mins = (native._contiguous(t, d) for t, d in ((q, torch.uint8), (scales, torch.float16),
                                                                  (mins, torch.float16)))
        native._load()[0].hb_tile(q.data_ptr(), scales.data_ptr(), mins.data_ptr(), n, k, group, o.data_ptr())
        return o

    def q8(q, scales):
        n, k = q.shape
        o = out(n, k, native.INT8_Q16)
        q, scales = native._contiguous(q, torch.int8), native._contiguous(scales, torch.float16)
        native._load()[0].hb_tile(q.data_ptr(), scales.data_ptr(), None, n, k, native.CODES_BLOCK, o.data_ptr())
        return o
    return q4, q8


def build(arena: Arena | None):
    q4, q8 = native.tile_q4, native.tile_q8
    if arena is not None:
        native.tile_q4, native.tile_q8 = patched(arena)
    try:
        model, _ = load_model("default")
        model.eval()
        quantize_model(model, "int4", head="int8", skip=DEFAULT_SKIP, wide=False)
    finally:
        native.tile_q4, native.tile_q8 = q4, q8
    return model


def huge() -> str:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages"):
            return line.split(":")[1].strip()
    return "?"


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    arena = Arena(512 << 20)
    m_thp = build(arena)
    print(f"arena used {arena.used / 2**20:.1f} MiB, AnonHugePages {huge()}", flush=True)
    m_4k = build(None)
    engines = {}
    for tag, m in (("4k", m_4k), ("thp", m_thp)):
        engines[f"base {tag}"] = (Engine(HamburgerModel.plain(m.base, m.tokenizer)), {})
        engines[f"verify {tag}"] = (Engine(m), {"mode": "verify"})
    prompts = [encode_chat(m_4k.tokenizer, x) for s in SETS for x in bench_messages(s, 3)]
    names = list(engines)
    spent, toks, outs = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0), {}
    with torch.inference_mode():
        for name, (e, kw) in engines.items():
            e.generate([prompts[0][:16]], max_new_tokens=16, **kw)
        for r in range(rounds):
            for i, p in enumerate(prompts):
                shift = (i + r) % len(names)
                for name in names[shift:] + names[:shift]:
                    e, kw = engines[name]
                    out = e.generate([p], max_new_tokens=256, **kw)
                    spent[name] += out.stats.decode_s
                    toks[name] += out.stats.generated_tokens - 1
                    outs.setdefault((name.split()[0], i), set()).add(tuple(out.tokens[0]))
            print(f"round {r + 1}: " + ", ".join(f"{n} {toks[n] / spent[n]:.1f} tok/s" for n in names), flush=True)
    same = sum(len(v) == 1 for v in outs.values())
    print(f"AnonHugePages {huge()}; replies alike across the two weights' copies: {same}/{len(outs)}")
    for kind in ("base", "verify"):
        a, b = toks[f"{kind} 4k"] / spent[f"{kind} 4k"], toks[f"{kind} thp"] / spent[f"{kind} thp"]
        print(f"{kind}: 4 KB pages {a:.1f} tok/s, 2 MB pages {b:.1f} tok/s, {b / a:.3f}x")


if __name__ == "__main__":
    main()
