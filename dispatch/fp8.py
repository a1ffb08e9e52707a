"""FP8 dispatch payload: e4m3 values with one float32 scale per token per 128 columns.

    quantize(x [T, H]) -> (x_fp8 [T, H] float8_e4m3fn, scales [T, H / 128] float32)
    dequantize(x_fp8, scales) -> x [T, H] float32   (x ≈ x_fp8 * scale of its block)

scale = amax(|block|) / 448 (448 = e4m3's largest normal), 1 for an all-zero block, so every
block uses e4m3's full range. Halves the dispatch bytes of bf16; experts consume the pair directly
(an FP8 grouped GEMM) or dequantize.
"""
from __future__ import annotations

import torch

GROUP = 128
E4M3_MAX = 448.0


def quantize(x: torch.Tensor):
    T, H = x.shape
    if H % GROUP:
        raise ValueError(f"fp8 dispatch: hidden={H} must be a multiple of {GROUP} (one scale per {GROUP} columns)")
    blocks = x.float().view(T, H // GROUP, GROUP)
    amax = blocks.abs().amax(-1)
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scales[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(T, H), scales


def dequantize(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    T, H = x_fp8.shape
    return (x_fp8.float().view(T, H // GROUP, GROUP) * scales[..., None]).view(T, H)
