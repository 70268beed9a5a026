"""The arithmetic of the int8 and int4 weight codes (pure functions): quantizing float weights to codes and scales
(PyTorch's kernels' per-channel int8 and (scale, zero) int4; the native kernels' GGUF Q8_0 and Q4_1 blocks, here
the reference that `native.quantize_q8_0` / `quantize_q4_1` compute in one pass, bit for bit: a test),
the portable nibble packing of the disk cache, and the CUDA int4 packing's tile size. `qlinear.py` holds the layers
that multiply with them.
"""

from __future__ import annotations

import torch


def int8_weights(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (int8 codes in -127..127, per-row scales in `dtype`) with w ≈ q · scale."""
    w32 = w.detach().float()
    amax = w32.abs().amax(1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).to(dtype)
    q = (w32 / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def int4_weights(w: torch.Tensor, group_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float -> (uint8 codes in 0..15 (N, K), scales (N, K/g), mins (N, K/g)) with w ≈ q · scale + min.

    Min/max per group (Q4_1's rule): a group's smallest weight gets q = 0, its largest q = 15. The scale
    and the kernels' zero (min + 8·scale) are rounded to `dtype` first and the codes are computed
    against the rounded values; the returned mins are those the kernel reproduces (zero - 8·scale).
    """
    n, k = w.shape
    groups = w.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    tiny = torch.finfo(dtype).tiny  # constant groups: any scale works; a tiny one keeps zero == min
    scale = torch.where(hi > lo, (hi - lo) / 15, torch.full_like(lo, tiny)).to(dtype).float()
    zero = (lo + 8 * scale).to(dtype).float()
    low = zero - 8 * scale
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale.to(dtype), low.to(dtype)


def q4_1_weights(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float -> (uint8 codes 0..15 (N, K), float16 scales (N, K/g), float16 mins (N, K/g)), w ≈ q · scale + min:
    GGUF's Q4_1 (the native kernels' 4-bit weights). Min/max per group, the scale and the min rounded to float16
    and the codes computed against the rounded values. Weights that came from Q4_1 blocks (the embedded default's
    projections) get their own codes, scales and mins back exactly: each block's smallest weight is its min
    (q = 0), its largest min + 15 · scale."""
    n, k = w.shape
    groups = w.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    _check_half(lo, hi)
    scale = ((hi - lo) / 15).half().float()
    low = lo.half().float()
    step = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((groups - low[..., None]) / step[..., None]).round().clamp(0, 15)
    q = torch.where(scale[..., None] > 0, q, torch.zeros_like(q)).to(torch.uint8)
    return q.reshape(n, k), scale.half(), low.half()


def q8_0_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (int8 codes -127..127 (N, K), float16 scales (N, K/32)), w ≈ q · scale: GGUF's Q8_0 (the
    native kernels' 8-bit weights), symmetric blocks of 32. Weights that came from Q8_0 blocks (the embedded
    default's embedding and LM head) get their own codes and scales back exactly."""
    n, k = w.shape
    blocks = w.detach().float().reshape(n, k // 32, 32)
    amax = blocks.abs().amax(-1)
    _check_half(-amax, amax)
    scale = (amax / 127).half().float()
    step = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / step[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k), scale.half()


def untile_q4(tiles: torch.Tensor, n: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The native kernels' 4-bit tiles (ceil(N/16), K/32, 320) (`native.tile_q4`) -> (codes (N, K) uint8, float16
    scales and mins (N, K/group)): per 16 outputs and block of 32 inputs, 128 16-bit words (part j, output l, input e: the
    word's nibble h is input 8j + 2h + e), then 16 scales and 16 mins."""
    t, b = tiles.shape[:2]
    words = tiles[..., :256].contiguous().view(torch.int16).to(torch.int32).reshape(t, b, 4, 16, 1, 2)
    nibbles = (words >> torch.arange(0, 16, 4, dtype=torch.int32).reshape(4, 1)) & 15  # (t, b, j, l, h, e)
    q = nibbles.permute(0, 3, 1, 2, 4, 5).reshape(t * 16, b * 32)[:n].to(torch.uint8)

    def per_output(start: int) -> torch.Tensor:
        values = tiles[..., start:start + 32].contiguous().view(torch.float16)  # (t, b, 16)
        return values.permute(0, 2, 1).reshape(t * 16, b)[:n, ::group // 32].contiguous()

    return q, per_output(256), per_output(288)


def untile_q8(tiles: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The native kernels' 8-bit tiles (ceil(N/16), K/32, 544) (`native.tile_q8`) -> (codes (N, K) int8, float16
    scales (N, K/32)): per 16 outputs and block of 32 inputs, 16 parts p of 32 bytes (output l's input 2p + e at byte
    2l + e), then 16 scales."""
    t, b = tiles.shape[:2]
    codes = tiles[..., :512].contiguous().view(torch.int8).reshape(t, b, 16, 16, 2)  # (t, b, p, l, e)
    q = codes.permute(0, 3, 1, 2, 4).reshape(t * 16, b * 32)[:n]
    scales = tiles[..., 512:].contiguous().view(torch.float16).permute(0, 2, 1).reshape(t * 16, b)[:n]
    return q.contiguous(), scales.contiguous()


def _check_half(lo: torch.Tensor, hi: torch.Tensor) -> None:
    top = float(torch.finfo(torch.float16).max)
    if lo.numel() and (float(lo.min()) < -top or float(hi.max()) > top):
        raise ValueError("weights beyond float16's range cannot take 4-bit or 8-bit codes with float16 scales")


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K/2) uint8, even columns in the low nibble (the cache's portable layout)."""
    q = q.to(torch.uint8)
    return q[:, ::2] | (q[:, 1::2] << 4)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p & 15, p >> 4], -1).reshape(p.shape[0], -1)


def inner_k_tiles(k: int) -> int:
    """The CUDA packing's innerKTiles: the largest of 8, 4, 2 with K a multiple of innerKTiles·16."""
    return next(t for t in (8, 4, 2) if k % (t * 16) == 0)
