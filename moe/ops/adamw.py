"""One AdamW update of one parameter, in one pass: fp32 master weights, any gradient dtype, and the
low-precision copy the model computes with written in the same pass.

    g = grad * scale                      (scale: a device scalar; clipping and 1/ranks folded in)
    p = p * (1 - lr * wd)
    m = m + (1 - b1) * (g - m);  v = b2 * v + (1 - b2) * g^2
    p = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    out = p in the model's dtype          (optional)

The arithmetic is torch.optim.AdamW's (single-tensor) in the same order. The kernel reads grad (2 or
4 bytes), p, m, v (12) and writes p, m, v (12) and out (2): no separate unscale, clip, cast or copy
pass over the parameters.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import Kernel, use_triton

BLOCK = 2048


def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, scale_ptr, n, lr, beta1, beta2, eps, decay, step_size,
                  bias_corr2_sqrt, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(scale_ptr)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p = p * decay
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    p = p - step_size * (m / (tl.sqrt(v) / bias_corr2_sqrt + eps))
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)


_ADAMW = Kernel(_adamw_kernel)


def adamw_step_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                out: Optional[torch.Tensor], scale: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, impl: str = "auto") -> None:
    """Update master, exp_avg, exp_avg_sq (fp32, contiguous, like grad) in place for AdamW step
    `step` (1-based); then out (the model's parameter, any dtype, or None) = master. scale: fp32 scalar
    tensor on the device the gradient is multiplied by. impl: "auto" (Triton on CUDA), "triton", "torch"."""
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or t.shape != grad.shape or not t.is_contiguous():
            raise ValueError(f"adamw_step_: {name} must be contiguous float32 of the gradient's shape {tuple(grad.shape)}, "
                             f"got {t.dtype} {tuple(t.shape)}")
    if out is not None and out.shape != grad.shape:
        raise ValueError(f"adamw_step_: out {tuple(out.shape)} differs from the gradient's shape {tuple(grad.shape)}")
    if step < 1:
        raise ValueError(f"adamw_step_: step={step}; steps count from 1")
    bias1, bias2_sqrt = 1 - beta1 ** step, math.sqrt(1 - beta2 ** step)
    triton_ok = impl == "triton" or (impl == "auto" and use_triton(master, grad))
    if triton_ok and grad.is_contiguous() and (out is None or out.is_contiguous()):
        n = grad.numel()
        if n:
            _ADAMW[(triton.cdiv(n, BLOCK),)](master, grad, exp_avg, exp_avg_sq, out if out is not None else master,
                                             scale, n, lr, beta1, beta2, eps, 1 - lr * weight_decay, lr / bias1,
                                             bias2_sqrt, HAS_OUT=out is not None, BLOCK=BLOCK)
        return
    adamw_step_ref_(master, grad, exp_avg, exp_avg_sq, out, scale, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                    weight_decay=weight_decay, bias1=bias1, bias2_sqrt=bias2_sqrt)


def adamw_step_ref_(master, grad, exp_avg, exp_avg_sq, out, scale, *, lr, beta1, beta2, eps, weight_decay, bias1,
                    bias2_sqrt) -> None:
    """torch.optim.AdamW's single-tensor update (the reference, and the CPU path)."""
    g = grad.float() * scale
    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    master.addcdiv_(exp_avg, (exp_avg_sq.sqrt() / bias2_sqrt).add_(eps), value=-lr / bias1)
    if out is not None:
        out.copy_(master)
