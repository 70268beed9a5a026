"""The arithmetic of the int8 and int4 weight codes (pure functions): quantizing float weights to codes and scales,
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


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K/2) uint8, even columns in the low nibble (the cache's portable layout)."""
    q = q.to(torch.uint8)
    return q[:, ::2] | (q[:, 1::2] << 4)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p & 15, p >> 4], -1).reshape(p.shape[0], -1)


def inner_k_tiles(k: int) -> int:
    """The CUDA packing's innerKTiles: the largest of 8, 4, 2 with K a multiple of innerKTiles·16."""
    return next(t for t in (8, 4, 2) if k % (t * 16) == 0)
