"""Every native variant gives the same bits (`kernels/native.h`'s contract), so one set of expected values serves
them all: the x86 variants this CPU runs, in this process, and the ARM variants (plain NEON, dot product, i8mm)
cross-compiled with aarch64-linux-gnu-gcc and run under qemu-aarch64 by a small driver (`native_check.c`), on the
same cases: products of each kind of weights, whole passes of layers (compress mode's bias and the micro-step
decoder's context attention included) and the quantizers."""

from __future__ import annotations

import ctypes
import math
import shutil
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from hamburger.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.why_unavailable()}")
DRIVER = Path(__file__).with_name("native_check.c")
ARM = ("neon", "neon-dotprod", "neon-i8mm")
CROSS, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"


@dataclass
class Case:
    """One call of the C API: its buffers (tensors), the structures with pointer fields holding a buffer's index +
    1 (native_check.c's format), and the call's other arguments."""
    op: int
    name: str
    buffers: list[torch.Tensor] = field(default_factory=list)
    structs: list[ctypes.Structure] = field(default_factory=list)
    args: list[int] = field(default_factory=list)

    def add(self, t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        self.buffers.append(t.detach().contiguous().clone())
        return len(self.buffers)


def relocated(s: ctypes.Structure, bufs: list[torch.Tensor]) -> ctypes.Structure:
    """A copy of `s` with each pointer field's buffer index turned into that buffer's address."""
    out = type(s).from_buffer_copy(s)
    for name, kind in s._fields_:
        if kind is ctypes.c_void_p:
            index = getattr(s, name)
            setattr(out, name, bufs[index - 1].data_ptr() if index else None)
        elif isinstance(kind, type) and issubclass(kind, ctypes.Structure):
            setattr(out, name, relocated(getattr(s, name), bufs))
    return out


def run_here(case: Case) -> tuple[int, list[torch.Tensor]]:
    """The case through the library in use here: its return value and its buffers after."""
    lib, bufs = native.library(), [b.clone() for b in case.buffers]
    ptr = [None, *(b.data_ptr() for b in bufs)]
    if case.op == 1:
        x, y, rows = case.args
        ret = lib.hb_linear(ptr[x], ctypes.byref(relocated(case.structs[0], bufs)), ptr[y], rows)
    elif case.op == 2:
        layers = (native.Layer * (len(case.structs) - 1))(*(relocated(s, bufs) for s in case.structs[:-1]))
        ret = lib.hb_layers(layers, len(layers), ctypes.byref(relocated(case.structs[-1], bufs)), ptr[case.args[0]])
    elif case.op == 3:
        w, n, k, group, q, s, m = case.args
        ret = lib.hb_quantize_q4_1(ptr[w], n, k, group, ptr[q], ptr[s], ptr[m])
    else:
        w, n, k, q, s = case.args
        ret = lib.hb_quantize_q8_0(ptr[w], n, k, ptr[q], ptr[s])
    return ret, bufs


def serialize(cases: list[Case]) -> bytes:
    out = [struct.pack("<q", len(cases))]
    for case in cases:
        out.append(struct.pack("<qq", case.op, len(case.buffers)))
        for b in case.buffers:
            raw = b.view(-1).view(torch.uint8).numpy().tobytes()
            out += [struct.pack("<q", len(raw)), raw]
        if case.op == 2:
            out.append(struct.pack("<q", len(case.structs) - 1))
        out += [bytes(s) for s in case.structs]
        out += [struct.pack("<q", a) for a in case.args]
    return b"".join(out)


def deserialize(data: bytes, cases: list[Case]) -> tuple[int, list[tuple[int, list[torch.Tensor]]]]:
    (isa,), at, results = struct.unpack_from("<q", data), 8, []
    for case in cases:
        (ret,), at = struct.unpack_from("<q", data, at), at + 8
        bufs = []
        for like in case.buffers:
            (size,), at = struct.unpack_from("<q", data, at), at + 8
            raw = torch.frombuffer(bytearray(data[at:at + size]), dtype=torch.uint8)
            bufs.append(raw.view(like.dtype).view(like.shape))
            at += size
        results.append((ret, bufs))
    assert at == len(data)
    return isa, results


def linear_case(kind: str, n: int, k: int, rows: int, seed: int, group: int = 32, extreme: bool = False) -> Case:
    """`extreme`: the last row's first block all at -max (its int16 codes all -32767: the products' sums at their
    largest)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    case = Case(1, f"linear {kind} {n}x{k} rows {rows}")
    bias = case.add(torch.randn(n, generator=gen))
    if kind == "fp16":
        desc = native.Weights(native.FP16, 0, n, k, 0, case.add(w.half()), None, bias)
    elif kind in ("int4", "int4a8"):
        desc = native.Weights(native.INT4_Q8 if kind == "int4a8" else native.INT4_Q16, 0, n, k, group,
                              case.add(native.tile_q4(*native.quantize_q4_1(w, group), group)), None, bias)
    else:
        desc = native.Weights(native.INT8_Q16, 0, n, k, 32, case.add(native.tile_q8(*native.quantize_q8_0(w))), None,
                              bias)
    x = torch.randn(rows, k, generator=gen) * 2
    x[0, :32] = 0  # a block of zeros
    if extreme:
        x[-1, :32] = -3.0
    case.structs.append(desc)
    case.args = [case.add(x), case.add(torch.zeros(rows, n)), rows]
    return case


def layers_case(kind: str, seed: int, compress: bool = False, context: bool = False, biases: bool = False,
                norm: str = "", half: bool = False) -> Case:
    """Two Llama-style layers over a cache, 2 rows of 3 positions, the second row with padding slots; `norm` "all"
    or "last": the final norm over every position or each row's last (`hb_pass.out_norm`); `half`: float16 caches
    (`hb_pass.kv_half`)."""
    gen = torch.Generator().manual_seed(seed)
    d, heads, kv, hd, inner, b, t, slots_len, count = 64, 4, 2, 16, 96, 2, 3, 20, 2
    case = Case(2, f"layers {kind}" + " compress" * compress + " context" * context + " biases" * biases
                + f" norm {norm}" * bool(norm) + " float16 cache" * half)
    stored = torch.float16 if half else torch.float32

    def weights(n: int, k: int, bias: bool = False) -> native.Weights:
        w, b_ = torch.randn(n, k, generator=gen) / math.sqrt(k), torch.randn(n, generator=gen) * 0.1 if bias else None
        if kind == "fp16":
            return native.Weights(native.FP16, 0, n, k, 0, case.add(w.half()), None, case.add(b_))
        if kind in ("int4", "int4a8"):
            return native.Weights(native.INT4_Q8 if kind == "int4a8" else native.INT4_Q16, 0, n, k, 32,
                                  case.add(native.tile_q4(*native.quantize_q4_1(w, 32), 32)), None, case.add(b_))
        return native.Weights(native.INT8_Q16, 0, n, k, 32, case.add(native.tile_q8(*native.quantize_q8_0(w))), None,
                              case.add(b_))

    for i in range(count):
        norms = [case.add(1 + 0.1 * torch.randn(d, generator=gen)) for _ in range(2)]
        gate = case.add(torch.tanh(torch.randn(heads, generator=gen))) if context else 0
        case.structs.append(native.Layer(norms[0], norms[1], weights((heads + 2 * kv) * hd, d, biases),
                                         weights(d, heads * hd), weights(2 * inner, d), weights(d, inner), index=i,
                                         ctx_gate=gate, ctx_index=count - 1 - i))
    slots = torch.tensor([5, 6, 7, 10, 11, 12])
    angles = slots[:, None].float() * (10000.0 ** (-torch.arange(hd // 2) / (hd // 2)))[None]
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([-angles.sin(), angles.sin()], 1)
    mask = (torch.arange(slots_len)[None] <= slots[:, None]).to(torch.uint8)
    mask[t:, :2] = 0  # the second row's padding
    cache = (count, b, kv, slots_len, hd)
    strides = [int(math.prod(cache[i + 1:])) for i in range(1, 5)]
    scratch = native.library().hb_scratch_floats(b * t, d, heads, kv, hd, inner)
    extra = {}
    if compress:
        extra = {"log_k": case.add(torch.randint(1, 5, (b, slots_len), generator=gen).float().log()),
                 "merged": case.add((torch.rand(b, slots_len, generator=gen) < 0.3).float()),
                 "bias_a": case.add(torch.randn(count, heads, generator=gen)),
                 "bias_c": case.add(torch.randn(count, heads, generator=gen))}
    if context:
        ctx_len = 18
        ctx_mask = torch.ones(b, ctx_len, dtype=torch.uint8)
        ctx_mask[0, :5] = 0
        ctx_mask[1] = 0  # sees no base entry
        shape = (count, b, kv, ctx_len, hd)
        extra |= {"ctx_k": case.add(torch.randn(shape, generator=gen).to(stored)),
                  "ctx_v": case.add(torch.randn(shape, generator=gen).to(stored)),
                  "ctx_len": ctx_len, "ctx_mask": case.add(ctx_mask),
                  **{f"c_s_{n}": int(math.prod(shape[i + 1:])) for i, n in enumerate(("layer", "row", "head", "slot"))}}
    if norm:
        extra |= {"out_norm": case.add(1 + 0.1 * torch.randn(d, generator=gen)), "out_eps": 1e-6,
                  "normed": case.add(torch.zeros(b if norm == "last" else b * t, d)), "out_last": int(norm == "last")}
    case.structs.append(native.Pass(
        b, t, d, heads, kv, hd, inner, slots_len, 1e-5, hd ** -0.5, case.add(cos), case.add(sin),
        case.add(torch.randn(cache, generator=gen).to(stored)), case.add(torch.randn(cache, generator=gen).to(stored)),
        *strides, case.add(slots), case.add(mask), case.add(torch.zeros(scratch)), 0, None, None, kv_half=int(half),
        **extra))
    case.args = [case.add(torch.randn(b * t, d, generator=gen))]
    return case


def quantize_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(24, 128, generator=gen) * torch.logspace(-4, 1, 24)[:, None]
    w[0, :64], w[1], w[2, :32] = 0.25, 0, torch.arange(32) / 31 * 15  # constant blocks, zeros, .5 ties
    q4, q8 = Case(3, "quantize q4_1"), Case(4, "quantize q8_0")
    q4.args = [q4.add(w), 24, 128, 64, q4.add(torch.zeros(24, 128, dtype=torch.uint8)),
               q4.add(torch.zeros(24, 2, dtype=torch.float16)), q4.add(torch.zeros(24, 2, dtype=torch.float16))]
    q8.args = [q8.add(w), 24, 128, q8.add(torch.zeros(24, 128, dtype=torch.int8)),
               q8.add(torch.zeros(24, 4, dtype=torch.float16))]
    return [q4, q8]


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    out = [linear_case(kind, n, k, rows, seed)
           for seed, (kind, n, k) in enumerate([("fp16", 40, 96), ("int4", 40, 128), ("int4", 48, 96), ("int8", 7, 96),
                                                ("int8", 40, 192), ("int4a8", 40, 128), ("int4a8", 48, 96)])
           for rows in (1, 3, 4, 5, 9)]
    # every row count a variant's products block rows by (1 to 8 and beyond), with one and two tiles of 16 outputs
    # a call, a partial second tile, a single block of inputs, and the largest sums
    out += [linear_case(kind, n, k, rows, 100 + seed, extreme=True)
            for seed, (kind, n, k) in enumerate([("int4", 56, 64), ("int8", 56, 64), ("int4", 16, 32), ("int8", 24, 32),
                                                 ("int4a8", 56, 64)])
            for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9)]
    out += [layers_case(kind, 10 + i) for i, kind in enumerate(("fp16", "int4", "int8"))]
    out += [layers_case("int4", 20, compress=True, biases=True), layers_case("fp16", 21, context=True),
            layers_case("int8", 22, compress=True, context=True), layers_case("int4a8", 23, biases=True)]
    out += [layers_case("int4", 24, norm="all"), layers_case("fp16", 25, context=True, norm="last")]
    out += [layers_case("int4", 26, half=True), layers_case("int8", 27, compress=True, context=True, half=True)]
    return out + quantize_cases()


@pytest.fixture(scope="module")
def expected(cases) -> list[tuple[int, list[torch.Tensor]]]:
    """What this CPU's best variant computes (the outputs checked against PyTorch by test_native.py and
    tests/inference/test_native_layers.py)."""
    with native.using(native.variants()[0]):
        return [run_here(case) for case in cases]


def check_same(cases, expected, got, who: str) -> None:
    for case, (ret, bufs), (want_ret, want) in zip(cases, got, expected, strict=True):
        assert ret == want_ret == 0, (who, case.name)
        for i, (a, b) in enumerate(zip(bufs, want, strict=True)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{who}: {case.name}, buffer {i}"


def test_the_cases_compute_something(cases, expected):
    """The expected values are outputs, not the inputs left as they were (a call that did nothing would pass)."""
    for case, (_, after) in zip(cases, expected, strict=True):
        changed = [not torch.equal(a, b) for a, b in zip(case.buffers, after, strict=True)]
        assert any(changed), case.name
        assert all(torch.isfinite(b).all() for b in after if b.is_floating_point()), case.name


@pytest.mark.parametrize("variant", native.variants()[1:] or ["(one variant here)"])
def test_each_x86_variant_gives_the_same_bits(variant, cases, expected):
    if variant not in native.VARIANTS:
        pytest.skip("this CPU runs one variant only")
    with native.using(variant):
        assert native.variant() == variant
        check_same(cases, expected, [run_here(case) for case in cases], variant)


def cross_tools() -> str | None:
    """Why the ARM variants cannot be checked here (None if they can)."""
    if native.variant() not in ("avx512-vnni", "avx2-vnni", "avx2"):
        return "the ARM variants are checked from an x86-64 machine (on ARM the in-process tests run them)"
    missing = [tool for tool in (CROSS, QEMU) if shutil.which(tool) is None]
    if missing:
        return (f"no {' or '.join(missing)} (Debian: apt-get install gcc-aarch64-linux-gnu qemu-user; `make setup` "
                "installs them as root)")
    return None


@pytest.mark.skipif(cross_tools() is not None, reason=f"ARM variants: {cross_tools()}")
@pytest.mark.parametrize("variant", ARM)
def test_each_arm_variant_under_qemu_gives_the_same_bits(variant, cases, expected, tmp_path):
    exe = tmp_path / "native_check"
    build = subprocess.run([CROSS, "-O2", "-static", "-fno-math-errno", "-ffp-contract=off",
                            *native.VARIANTS[variant].flags, f"-I{native.SOURCE.parent}", str(DRIVER), str(native.SOURCE),
                            "-o", str(exe), "-lm"], capture_output=True, text=True, timeout=300, check=False)
    assert build.returncode == 0, build.stderr[-2000:]
    (tmp_path / "in").write_bytes(serialize(cases))
    run = subprocess.run([QEMU, "-cpu", "max", str(exe), str(tmp_path / "in"), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    isa, got = deserialize((tmp_path / "out").read_bytes(), cases)
    assert isa == native.VARIANTS[variant].isa
    check_same(cases, expected, got, variant)
