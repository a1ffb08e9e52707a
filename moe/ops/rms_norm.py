"""RMSNorm, forward and backward each one pass over the rows.

    y = x * rsqrt(mean(x^2) + eps) * w          x [N, H] (any leading dims), w [H]; fp32 math

Backward with x_hat = x * rstd:  dx = rstd * (dy*w - x_hat * mean(dy*w*x_hat)),  dw = sum_rows dy * x_hat.
The forward runs one program per row and saves rstd [N] (fp32); the backward runs G programs, each
over rows pid, pid+G, ..., and writes its partial dw sums [G, H] (fp32), which torch adds up.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Kernel, check_2d, use_triton


def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, H, eps, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * H + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, N, H, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_H], tl.float32)
    for row in range(pid, N, tl.num_programs(0)):
        base = tl.cast(row, tl.int64) * H
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        wdy = dy * w
        c = tl.sum(x_hat * wdy, axis=0) / H
        tl.store(dx_ptr + base + cols, ((wdy - x_hat * c) * rstd).to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(dw_part_ptr + pid.to(tl.int64) * H + cols, dw, mask=mask)


_FWD = Kernel(_rms_norm_fwd_kernel)
_BWD = Kernel(_rms_norm_bwd_kernel)


def _bwd_programs(x: torch.Tensor, n: int) -> int:
    if x.is_cuda:
        return max(1, min(n, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count))
    return max(1, min(n, 4))


class RMSNormFn(torch.autograd.Function):
    """The Triton path of `rms_norm` (x [N, H] contiguous, w [H])."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        check_2d("rms_norm: x", x, weight.shape[0])
        n, h = x.shape
        y = torch.empty_like(x)
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        if n:
            _FWD[(n,)](x, weight, y, rstd, h, eps, BLOCK_H=triton.next_power_of_2(h))
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        n, h = x.shape
        dx = torch.empty_like(x)
        g = _bwd_programs(x, n)
        part = torch.zeros(g, h, dtype=torch.float32, device=x.device)
        if n:
            _BWD[(g,)](dy.contiguous(), x, weight, rstd, dx, part, n, h, BLOCK_H=triton.next_power_of_2(h))
        return dx, part.sum(0).to(weight.dtype), None


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch version: fp32 statistics and normalisation, rounded once to x's dtype, times weight
    (for fp32 x what the model computed before the kernel)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [..., H], weight [H] -> like x. Triton on CUDA (see _common.use_triton), else the reference."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x has {x.shape[-1]} features, weight {weight.shape[0]}")
    if not use_triton(x, weight) or x.dtype != weight.dtype:
        return rms_norm_ref(x, weight, eps)
    return RMSNormFn.apply(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)
