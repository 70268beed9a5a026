"""The native CPU kernels (`native.c`): built on this machine at first use, kept in the cache, called through ctypes.

PyTorch's CPU kernels for weight-only float16 and 4-bit weights are made for batches; at batch 1 a decode step is
the weights streamed once, and most of its time goes to the ~40 operators a layer dispatches around the matrix
products (`benchmarks/step_profile.py`). `native.c` has the matrix products for float16 weights and for 4-bit
weights in groups, and a whole Llama-style decoder layer (norms, rotary embedding, the cache writes, attention,
the MLP) run for every layer of a pass in one call. Each output row is computed alike whatever the other rows of
the call (the C file says how), so a multi-position verify pass gives each position what a one-position step does.

One variant a build, by instruction set (`native.h` is the contract, a file per family): "avx512-vnni" (x86-64
with AVX-512 F, BW and VNNI), "avx2-vnni" / "avx2" (x86-64 with AVX2, FMA and F16C, with or without AVX-VNNI),
"neon-i8mm" / "neon-dotprod" / "neon" (aarch64). Every variant gives the same bits. By default it is built with
the machine's C compiler for this CPU (`cc -O3 -march=native -fopenmp`, about a second), which picks the best the
CPU has; `HAMBURGER_NATIVE=avx2` (or another variant's name, or a family's: avx512, avx2, neon) builds that
variant with its own flags instead (where the CPU runs it), `HAMBURGER_NATIVE=0` turns the kernels off (PyTorch's
then). The library goes to `<cache>/native/<hash>.so`, the hash over the sources, the compiler's version, the
flags and the CPU's flags; `variant()` names what runs, `why_unavailable()` says why nothing does.
The OpenMP runtime is the one PyTorch loaded (the same `libgomp.so.1`), so its threads are PyTorch's.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch

SOURCE = Path(__file__).with_name("native.c")
SOURCES = tuple(SOURCE.with_name(name) for name in ("native.c", "native.h", "native_avx512.h", "native_avx2.h",
                                                    "native_neon.h"))
# -ffp-contract=off: no multiply-add fused but those the sources write, so every variant rounds alike
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=off")
NATIVE = ("-march=native",)  # the default build: the best variant this CPU and compiler have


class Variant(NamedTuple):
    isa: int                    # what its hb_isa() returns
    arch: str                   # platform.machine()'s family: x86_64 or aarch64
    flags: tuple[str, ...]      # how to build it on purpose (`HAMBURGER_NATIVE=<name>`)
    cpu: frozenset[str]         # the CPU's flags (/proc/cpuinfo) it needs


_X86 = ("-mavx2", "-mfma", "-mf16c", "-mtune=native")
VARIANTS = {
    "avx512-vnni": Variant(512, "x86_64", ("-march=native",), frozenset({"avx512f", "avx512bw", "avx512_vnni"})),
    "avx2-vnni": Variant(257, "x86_64", (*_X86, "-mavxvnni"), frozenset({"avx2", "fma", "f16c", "avx_vnni"})),
    "avx2": Variant(256, "x86_64", _X86, frozenset({"avx2", "fma", "f16c"})),
    "neon-i8mm": Variant(3, "aarch64", ("-march=armv8.6-a+dotprod+i8mm",), frozenset({"asimddp", "i8mm"})),
    "neon-dotprod": Variant(2, "aarch64", ("-march=armv8.2-a+dotprod",), frozenset({"asimddp"})),
    "neon": Variant(1, "aarch64", ("-march=armv8-a",), frozenset()),
}
FAMILIES = {"avx512": "avx512-vnni", "neon": "neon"}  # a family's name for its variant (avx2: the plain one)
OFF = ("0", "off", "no", "false")
# The kinds of weights (native.c's hb_weights): float16; GGUF's Q4_1 and Q8_0 blocks in tiles of 16 outputs by 32
# inputs (`tile_q4` / `tile_q8`), the activations quantized to int16 in blocks of 32 (about 3e-5 of each product
# off its float value); INT4_Q8: INT4_Q16's tiles with the activations in 8 bits (`--quantize ...+a8`: llama.cpp's
# precision, multiplied twice as many at a time where the CPU multiplies bytes; native.h)
FP16, INT4_Q16, INT8_Q16, INT4_Q8 = 1, 3, 5, 7
TILE_OUT, CODES_TILE, CODES_BLOCK = 4, 16, 32  # float16's outputs a tile computes; the codes' tiles and blocks
TILE_BYTES = {INT4_Q16: 320, INT8_Q16: 544, INT4_Q8: 320}  # a tile's 16 outputs by 32 inputs: codes, scales (and mins)
MAX_HEAD_DIM = 256
_lock = threading.RLock()
_using: list[str] = []  # `using(name)` blocks open: the innermost one's variant
_off = [0]  # how many `turned_off()` blocks are open: PyTorch's kernels for layers made meanwhile, in every thread


class Weights(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("unused", ctypes.c_int32), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("group", ctypes.c_int64), ("w", ctypes.c_void_p), ("sz", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("qkv", Weights), ("o", Weights),
                ("gate_up", Weights), ("down", Weights), ("index", ctypes.c_int64), ("ctx_gate", ctypes.c_void_p),
                ("ctx_index", ctypes.c_int64)]


class Pass(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("b", "t", "d", "heads", "kv_heads", "head_dim", "inner",
                                                    "slots_len")]
    _fields_ += [("eps", ctypes.c_float), ("scaling", ctypes.c_float), ("cos", ctypes.c_void_p),
                 ("sin", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]
    _fields_ += [(name, ctypes.c_int64) for name in ("s_layer", "s_row", "s_head", "s_slot")]
    _fields_ += [("slots", ctypes.c_void_p), ("mask", ctypes.c_void_p), ("scratch", ctypes.c_void_p)]
    _fields_ += [("copies", ctypes.c_int64), ("copy_after", ctypes.c_void_p), ("copy_to", ctypes.c_void_p)]
    _fields_ += [("ctx_k", ctypes.c_void_p), ("ctx_v", ctypes.c_void_p)]
    _fields_ += [(name, ctypes.c_int64) for name in ("c_s_layer", "c_s_row", "c_s_head", "c_s_slot", "ctx_len")]
    _fields_ += [("ctx_mask", ctypes.c_void_p), ("log_k", ctypes.c_void_p), ("merged", ctypes.c_void_p),
                 ("bias_a", ctypes.c_void_p), ("bias_c", ctypes.c_void_p)]
    _fields_ += [("out_norm", ctypes.c_void_p), ("normed", ctypes.c_void_p), ("out_eps", ctypes.c_float),
                 ("out_last", ctypes.c_int64), ("head", ctypes.c_void_p), ("head_idx", ctypes.c_void_p)]
    _fields_ += [("kv_half", ctypes.c_int64)]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def sources_text() -> str:
    """The sources, in one string (what a build's hash covers)."""
    return "\0".join(path.read_text() for path in SOURCES)


def _build(cc: str, flags: tuple[str, ...], target: Path) -> None:
    """Compile `SOURCE` into `target` (atomically: a half-written library is never loaded)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".building-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        run = subprocess.run([cc, *FLAGS, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                             timeout=300, check=False)
        if run.returncode:
            raise RuntimeError(f"{cc} failed: {run.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def runnable(name: str) -> str | None:
    """Why this CPU cannot run variant `name` (None if it can)."""
    if name not in VARIANTS:
        return f"no native variant {name!r} (one of {', '.join(VARIANTS)})"
    v = VARIANTS[name]
    if _arch() != v.arch:
        return f"the {name} kernels are for {v.arch} CPUs, not {platform.machine()}"
    missing = sorted(v.cpu - set(_cpu_flags().split()))
    return f"this CPU has no {', '.join(missing)} for the {name} kernels" if missing else None


def variants() -> list[str]:
    """The variants this CPU runs, best first (what the tests run each of)."""
    return [name for name in VARIANTS if runnable(name) is None]


@cache
def _asked() -> str:
    """HAMBURGER_NATIVE's variant ("" for this CPU's best, "0" for off), read once."""
    spec = os.environ.get("HAMBURGER_NATIVE", "").strip().lower()
    return "" if spec in ("", "1", "on", "yes", "true", "auto", "native") else spec


def _wanted() -> str:
    """The variant asked for: a `using` block's, else HAMBURGER_NATIVE's."""
    return _using[-1] if _using else _asked()


@cache
def _load_variant(spec: str) -> tuple[ctypes.CDLL | None, str | None, str | None]:
    """(the library, its variant's name, None), or (None, None, why not)."""
    if spec in OFF:
        return None, None, "turned off by HAMBURGER_NATIVE"
    name = FAMILIES.get(spec, spec)
    if name and (why := runnable(name)) is not None:
        return None, None, why
    if not name and _arch() not in ("x86_64", "aarch64"):
        return None, None, f"the native kernels are for x86-64 and aarch64 CPUs, not {platform.machine()}"
    if (cc := _compiler()) is None:
        return None, None, "no C compiler (cc or gcc) to build the native kernels"
    flags = VARIANTS[name].flags if name else NATIVE
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
        key = hashlib.sha256("\0".join([sources_text(), version, " ".join(FLAGS + flags), _cpu_flags(),
                                        torch.__version__]).encode()).hexdigest()[:16]
        from hamburger.model.base import cache_dir  # here: keeps this module light to import

        root = cache_dir()
        with _lock:
            if root is None:  # caching off: a private build for this process
                target = Path(tempfile.mkdtemp(prefix="hamburger-native-")) / "native.so"
                _build(cc, flags, target)
            else:
                target = root / "native" / f"{key}.so"
                if not target.is_file():
                    _build(cc, flags, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, None, f"the native kernels could not be built: {exc}"
    built = next((n for n, v in VARIANTS.items() if v.isa == lib.hb_isa()), None)
    if built is None:
        return None, None, ("this CPU (or compiler) has none of the instruction sets the native kernels need "
                            "(x86-64: AVX2, FMA and F16C; aarch64: NEON)")
    if name and built != name:
        return None, None, f"built for {name}, the library is {built}"
    lib.hb_linear.argtypes = [ctypes.c_void_p, ctypes.POINTER(Weights), ctypes.c_void_p, ctypes.c_int64]
    lib.hb_linear.restype = ctypes.c_int
    lib.hb_linear_argmax.argtypes = [ctypes.c_void_p, ctypes.POINTER(Weights), ctypes.c_int64, ctypes.c_void_p]
    lib.hb_linear_argmax.restype = ctypes.c_int
    lib.hb_layers.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(Pass), ctypes.c_void_p]
    lib.hb_layers.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.hb_quantize_q4_1.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr]
    lib.hb_quantize_q4_1.restype = ctypes.c_int
    lib.hb_quantize_q8_0.argtypes = [ptr, i64, i64, ptr, ptr]
    lib.hb_quantize_q8_0.restype = ctypes.c_int
    lib.hb_tile.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr]
    lib.hb_tile.restype = None
    lib.hb_scratch_floats.argtypes = [ctypes.c_int64] * 6
    lib.hb_scratch_floats.restype = ctypes.c_int64
    return lib, built, None


def _load() -> tuple[ctypes.CDLL | None, str | None, str | None]:
    return _load_variant(_wanted())


@contextmanager
def using(name: str):
    """Inside this block the native kernels are variant `name` (a test runs each variant the CPU has), in every
    thread; layers made before it multiply with it too (the tiles' layout is every variant's)."""
    with _lock:
        _using.append(name)
    try:
        yield
    finally:
        with _lock:
            _using.remove(name)


def variant() -> str | None:
    """The variant that runs ("avx512-vnni", "avx2-vnni", "avx2", "neon-i8mm", "neon-dotprod", "neon"), or None."""
    return _load()[1]


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (`why_unavailable` says why)."""
    return _load()[0]


def why_unavailable() -> str | None:
    """Why the native kernels are not used here, or None when they are."""
    return _load()[2]


def available() -> bool:
    """Whether layers made now use the native kernels."""
    return not _off[0] and library() is not None


@contextmanager
def turned_off():
    """Layers and engines made inside this block use PyTorch's kernels (to measure one against the other in one
    process), in every thread: `quantize_model` makes layers on a pool of threads."""
    with _lock:
        _off[0] += 1
    try:
        yield
    finally:
        with _lock:
            _off[0] -= 1


def weights(kind: int, w: torch.Tensor, out_features: int, in_features: int, sz: torch.Tensor | None = None,
            group: int = 0, bias: torch.Tensor | None = None) -> Weights:
    """The C description of a layer's weights (the tensors must outlive it: the caller keeps them)."""
    return Weights(kind, 0, out_features, in_features, group, w.data_ptr(),
                   None if sz is None else sz.data_ptr(), None if bias is None else bias.data_ptr())


def fits(out_features: int, in_features: int, kind: int, group: int = 0) -> str | None:
    """Why the native products cannot take a layer of this shape (None if they can)."""
    if kind == FP16:
        if out_features % TILE_OUT or in_features % 16:
            return f"a float16 layer of {out_features} x {in_features} is not a multiple of {TILE_OUT} x 16 (native kernels)"
        return None
    if in_features % CODES_BLOCK or group % CODES_BLOCK:
        return (f"{in_features} inputs in groups of {group} are not multiples of {CODES_BLOCK} and {CODES_BLOCK} "
                "(native kernels)")
    return None


def _check_input(x: torch.Tensor, desc: Weights) -> None:
    if x.dim() != 2 or x.shape[1] != desc.k or x.dtype != torch.float32 or not x.is_contiguous() or x.is_cuda:
        raise ValueError(f"the native product takes a contiguous float32 CPU (rows, {desc.k}) input, got "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")


def linear(x: torch.Tensor, desc: Weights) -> torch.Tensor:
    """x (rows, k) float32 contiguous -> (rows, n) through the described weights (bias included)."""
    _check_input(x, desc)
    y = torch.empty(x.shape[0], desc.n, dtype=torch.float32)
    if _load()[0].hb_linear(x.data_ptr(), ctypes.byref(desc), y.data_ptr(), x.shape[0]):
        raise MemoryError("the native product could not allocate its quantized activations")
    return y


def linear_argmax(x: torch.Tensor, desc: Weights) -> torch.Tensor:
    """x (rows, k) float32 contiguous -> (rows,) int64: the index of each row's largest output through the described
    weights (the bias included), the first of equal ones, a NaN first: `linear(x, desc).max(-1).indices`, bit
    for bit, without the outputs (greedy decoding's LM head)."""
    _check_input(x, desc)
    idx = torch.empty(x.shape[0], dtype=torch.int64)
    if _load()[0].hb_linear_argmax(x.data_ptr(), ctypes.byref(desc), x.shape[0], idx.data_ptr()):
        raise MemoryError("the native product could not allocate its outputs")
    return idx


def _float_weights(w: torch.Tensor) -> torch.Tensor:
    w = w.detach()
    if w.dim() != 2 or w.device.type != "cpu":
        raise ValueError(f"native quantization takes (out, in) CPU weights, got {tuple(w.shape)} on {w.device}")
    return w.float().contiguous()


def quantize_q4_1(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) weights -> (codes (N, K) uint8, float16 scales (N, K/group), float16 mins (N, K/group)): what
    `qcodes.q4_1_weights` computes (a test), in one native pass."""
    w = _float_weights(w)
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.uint8)
    scales, mins = torch.empty(n, k // group, dtype=torch.float16), torch.empty(n, k // group, dtype=torch.float16)
    if _load()[0].hb_quantize_q4_1(w.data_ptr(), n, k, group, q.data_ptr(), scales.data_ptr(), mins.data_ptr()):
        raise ValueError("weights beyond float16's range cannot take 4-bit or 8-bit codes with float16 scales")
    return q, scales, mins


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) weights -> (codes (N, K) int8, float16 scales (N, K/32)): what `qcodes.q8_0_weights` computes (a
    test), in one native pass."""
    w = _float_weights(w)
    n, k = w.shape
    q, scales = torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // 32, dtype=torch.float16)
    if _load()[0].hb_quantize_q8_0(w.data_ptr(), n, k, q.data_ptr(), scales.data_ptr()):
        raise ValueError("weights beyond float16's range cannot take 4-bit or 8-bit codes with float16 scales")
    return q, scales


def _contiguous(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to("cpu", dtype).contiguous()


def tile_q4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int) -> torch.Tensor:
    """Codes 0..15 (N, K), scales and mins (N, K/group) -> `INT4_Q16`'s tiles (ceil(N/16), K/32, 320) uint8;
    `qcodes.untile_q4` reads them back."""
    n, k = q.shape
    out = torch.zeros(-(-n // CODES_TILE), k // CODES_BLOCK, TILE_BYTES[INT4_Q16], dtype=torch.uint8)
    q, scales, mins = _contiguous(q, torch.uint8), _contiguous(scales, torch.float16), _contiguous(mins, torch.float16)
    _load()[0].hb_tile(q.data_ptr(), scales.data_ptr(), mins.data_ptr(), n, k, group, out.data_ptr())
    return out


def tile_q8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Codes -127..127 (N, K), scales (N, K/32) -> `INT8_Q16`'s tiles (ceil(N/16), K/32, 544) uint8;
    `qcodes.untile_q8` reads them back."""
    n, k = q.shape
    out = torch.zeros(-(-n // CODES_TILE), k // CODES_BLOCK, TILE_BYTES[INT8_Q16], dtype=torch.uint8)
    q, scales = _contiguous(q, torch.int8), _contiguous(scales, torch.float16)
    _load()[0].hb_tile(q.data_ptr(), scales.data_ptr(), None, n, k, CODES_BLOCK, out.data_ptr())
    return out
