"""SwiGLU activation of a fused [gate | up] projection, forward and backward one pass each.

    y = silu(g) * u            h [M, 2F] = [g | u] -> y [M, F]; fp32 math, one rounding
    dg = dy * u * s * (1 + g * (1 - s)),  du = dy * silu(g)      (s = sigmoid(g))

The backward reads h again rather than saving silu(g): [M, 2F] is what the gate/up GEMM's
backward needs anyway. Programs cover [BLOCK_M, BLOCK_F] tiles of y.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import Kernel, check_2d, use_triton

BLOCK_M, BLOCK_F = 8, 256


def _swiglu_fwd_kernel(h_ptr, y_ptr, M, F, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F))[None, :]
    mask = (rows < M) & (cols < F)
    g = tl.load(h_ptr + rows * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + rows * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + rows * F + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _swiglu_bwd_kernel(h_ptr, dy_ptr, dh_ptr, M, F, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F))[None, :]
    mask = (rows < M) & (cols < F)
    g = tl.load(h_ptr + rows * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + rows * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows * F + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    tl.store(dh_ptr + rows * 2 * F + cols, dg.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + rows * 2 * F + F + cols, du.to(dh_ptr.dtype.element_ty), mask=mask)


_FWD = Kernel(_swiglu_fwd_kernel)
_BWD = Kernel(_swiglu_bwd_kernel)


def _grid(m: int, f: int):
    return (triton.cdiv(m, BLOCK_M), triton.cdiv(f, BLOCK_F))


class SwiGLUFn(torch.autograd.Function):
    """The Triton path of `swiglu` (h [M, 2F] contiguous)."""

    @staticmethod
    def forward(ctx, h):
        check_2d("swiglu: h", h)
        m, f = h.shape[0], h.shape[1] // 2
        y = torch.empty(m, f, dtype=h.dtype, device=h.device)
        if y.numel():
            _FWD[_grid(m, f)](h, y, m, f, BLOCK_M=BLOCK_M, BLOCK_F=BLOCK_F)
        ctx.save_for_backward(h)
        return y

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        m, f = h.shape[0], h.shape[1] // 2
        dh = torch.empty_like(h)
        if dh.numel():
            _BWD[_grid(m, f)](h, dy.contiguous(), dh, m, f, BLOCK_M=BLOCK_M, BLOCK_F=BLOCK_F)
        return dh


def swiglu_ref(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """h [..., 2F] = [gate | up] -> silu(gate) * up [..., F]. Triton on CUDA, else the reference."""
    if h.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dim of h must be even ([gate | up]), got {tuple(h.shape)}")
    if not use_triton(h):
        return swiglu_ref(h)
    return SwiGLUFn.apply(h.reshape(-1, h.shape[-1]).contiguous()).view(*h.shape[:-1], h.shape[-1] // 2)
