"""The native kernels' variants side by side on this CPU (`HAMBURGER_NATIVE=<variant>`'s choices): a whole pass of
the default's 30 decoder layers (SmolLM2-135M's shapes: 576 wide, 9 heads of 64 over 3 KV heads, MLP 1536) in one
`hb_layers` call, and its int8 LM head (49152 x 576, Q8_0) by `hb_linear`, at 1 row (a decode step) and 4 rows (a
verify pass), with int4 (Q4_1, group 32) or int8 (Q8_0) layers. Random weights (the speed does not depend on their
values), a cache of 256 slots of which the rows read 200. The variants take turns within each round; the median
milliseconds per call over rounds are printed.

    python benchmarks/native_variants.py                  # every variant this CPU runs, about a minute on 2 cores
    python benchmarks/native_variants.py --variants avx512-vnni,avx2
    python benchmarks/native_variants.py --variants avx2 --baseline HEAD~1   # also avx2 as built from HEAD~1's sources
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from hamburger.kernels import native

D, HEADS, KV, HD, INNER, LAYERS, VOCAB, SLOTS, FILLED = 576, 9, 3, 64, 1536, 30, 49152, 256, 200


def codes(kind: str, n: int, k: int, keep: list) -> native.Weights:
    w = torch.randn(n, k) / k ** 0.5
    if kind == "int4":
        tiles = native.tile_q4(*native.quantize_q4_1(w, 32), 32)
        keep.append(tiles)
        return native.Weights(native.INT4_Q16, 0, n, k, 32, tiles.data_ptr(), None, None)
    tiles = native.tile_q8(*native.quantize_q8_0(w))
    keep.append(tiles)
    return native.Weights(native.INT8_Q16, 0, n, k, 32, tiles.data_ptr(), None, None)


def model(kind: str, rows: int) -> tuple:
    """(layers, pass, x, head, keep): the C descriptions and the tensors they point into."""
    torch.manual_seed(0)
    keep: list = []
    layers = (native.Layer * LAYERS)()
    for i in range(LAYERS):
        norms = [torch.ones(D), torch.ones(D)]
        keep += norms
        layers[i] = native.Layer(norms[0].data_ptr(), norms[1].data_ptr(), codes(kind, (HEADS + 2 * KV) * HD, D, keep),
                                 codes(kind, D, HEADS * HD, keep), codes(kind, 2 * INNER, D, keep),
                                 codes(kind, D, INNER, keep), index=i)
    k_cache, v_cache = torch.randn(LAYERS, 1, KV, SLOTS, HD), torch.randn(LAYERS, 1, KV, SLOTS, HD)
    slots = torch.arange(FILLED - rows, FILLED)
    mask = (torch.arange(SLOTS)[None] <= slots[:, None]).to(torch.uint8)
    angles = slots[:, None].float() * (10000.0 ** (-torch.arange(HD // 2) / (HD // 2)))[None]
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([-angles.sin(), angles.sin()], 1)
    scratch = torch.zeros(native.library().hb_scratch_floats(rows, D, HEADS, KV, HD, INNER))
    keep += [k_cache, v_cache, slots, mask, cos, sin, scratch]
    p = native.Pass(1, rows, D, HEADS, KV, HD, INNER, SLOTS, 1e-5, HD ** -0.5, cos.data_ptr(), sin.data_ptr(),
                    k_cache.data_ptr(), v_cache.data_ptr(), KV * SLOTS * HD, KV * SLOTS * HD, SLOTS * HD, HD,
                    slots.data_ptr(), mask.data_ptr(), scratch.data_ptr(), 0, None, None)
    return layers, p, torch.randn(rows, D), codes("int8", VOCAB, D, keep), keep


def baseline_library(rev: str, name: str) -> ctypes.CDLL:
    """Variant `name` built from the kernels' sources at git revision `rev` (the same flags as native.py's)."""
    folder = Path(tempfile.mkdtemp(prefix="native-baseline-"))
    for path in native.SOURCES:
        text = subprocess.run(["git", "show", f"{rev}:src/hamburger/kernels/{path.name}"], capture_output=True,
                              text=True, check=True, cwd=native.SOURCE.parent).stdout
        (folder / path.name).write_text(text)
    target = folder / "native.so"
    subprocess.run([native._compiler(), *native.FLAGS, *native.VARIANTS[name].flags, str(folder / "native.c"), "-o",
                    str(target), "-lm"], check=True)
    lib = ctypes.CDLL(str(target))
    lib.hb_linear.argtypes = [ctypes.c_void_p, ctypes.POINTER(native.Weights), ctypes.c_void_p, ctypes.c_int64]
    lib.hb_layers.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(native.Pass), ctypes.c_void_p]
    return lib


def per_call_ms(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(native.variants()), help="comma list (default: all this CPU runs)")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--kinds", default="int4,int8", help="the layers' codes")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--baseline", help="a git revision: each variant also as built from that revision's sources "
                                      "(named variant@rev), in the same rounds")
    args = p.parse_args()
    names = args.variants.split(",")
    old = {f"{n}@{args.baseline}": baseline_library(args.baseline, n) for n in names} if args.baseline else {}
    names += list(old)
    print(f"threads {torch.get_num_threads()}; variants {', '.join(names)}")
    for kind in args.kinds.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            layers, pas, x, head, keep = model(kind, rows)
            y = torch.empty(rows, VOCAB)
            times: dict = {(n, what): [] for n in names for what in ("layers", "head")}
            for _ in range(args.rounds):
                for name in names:
                    with nullcontext() if name in old else native.using(name):
                        lib = old[name] if name in old else native.library()
                        assert lib is not None, native.why_unavailable()
                        xs = x.clone()
                        times[name, "layers"].append(per_call_ms(
                            lambda: lib.hb_layers(layers, LAYERS, ctypes.byref(pas), xs.data_ptr()), args.calls))
                        times[name, "head"].append(per_call_ms(
                            lambda: lib.hb_linear(x.data_ptr(), ctypes.byref(head), y.data_ptr(), rows), args.calls))
            for name in names:
                layer_ms, head_ms = (statistics.median(times[name, what]) for what in ("layers", "head"))
                print(f"{kind} layers, {rows} row(s), {name:20s}: 30 layers {layer_ms:7.3f} ms, int8 head "
                      f"{head_ms:7.3f} ms, both {layer_ms + head_ms:7.3f} ms")


if __name__ == "__main__":
    main()
