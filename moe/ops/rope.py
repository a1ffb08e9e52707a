"""Rotary position embedding of a fused qkv projection, as one op.

    q, k, v = rope_qkv(qkv, cos, sin, offset)    qkv [B, S, 3, nh, hd] -> each [B, nh, S, hd]

q and k get the interleaved rotation: the pair (x[2i], x[2i+1]) at position p = offset + s turns by
the angle whose cosine / sine are cos[p, i] / sin[p, i] (tables [max_seq, hd/2], fp32):
    (x[2i] c - x[2i+1] s,  x[2i] s + x[2i+1] c);   v is passed through.
The kernel writes q, k (rotated) and v into one new [B, S, 3, nh, hd] tensor (one program per
token and part), so q, k, v are the same strided views of it that slicing qkv gives. The backward
turns the gradients of q and k back (the same kernel with -sin) and writes dqkv in one tensor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Kernel, use_triton


def _rope_kernel(src_ptr, src_sb, src_ss, src_sh, dst_ptr, dst_sb, dst_ss, dst_sh, cos_ptr, sin_ptr, S, offset,
                 sign, NH, HALF, ROTATE: tl.constexpr, BLOCK_NH: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One (b, s) per program: all heads of one part; strides in elements, the head dim contiguous."""
    pid = tl.program_id(0)
    b = (pid // S).to(tl.int64)
    s = (pid % S).to(tl.int64)
    heads = tl.arange(0, BLOCK_NH)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NH) & (i < HALF)
    src = src_ptr + b * src_sb + s * src_ss + heads * src_sh + 2 * i
    dst = dst_ptr + b * dst_sb + s * dst_ss + heads * dst_sh + 2 * i
    x_even = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x_odd = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    if ROTATE:
        c = tl.load(cos_ptr + (s + offset) * HALF + i, mask=i < HALF, other=0.0)
        sn = tl.load(sin_ptr + (s + offset) * HALF + i, mask=i < HALF, other=0.0) * sign
        x_even, x_odd = x_even * c - x_odd * sn, x_even * sn + x_odd * c
    tl.store(dst, x_even.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + 1, x_odd.to(dst_ptr.dtype.element_ty), mask=mask)


_ROPE = Kernel(_rope_kernel)


def _launch(src: torch.Tensor, dst: torch.Tensor, cos, sin, offset: int, rotate: bool, sign: float) -> None:
    """src, dst: [B, S, nh, hd] views (any strides, the last one 1)."""
    B, S, nh, hd = src.shape
    if B * S == 0:
        return
    _ROPE[(B * S,)](src, src.stride(0), src.stride(1), src.stride(2), dst, dst.stride(0), dst.stride(1),
                    dst.stride(2), cos, sin, S, offset, sign, nh, hd // 2, ROTATE=rotate,
                    BLOCK_NH=triton.next_power_of_2(nh), BLOCK_HALF=triton.next_power_of_2(hd // 2))


def _as_bshd(t: torch.Tensor) -> torch.Tensor:
    """A gradient [B, nh, S, hd] as a [B, S, nh, hd] view with a contiguous last dim."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    return t.transpose(1, 2)


class RopeQKVFn(torch.autograd.Function):
    """The Triton path of `rope_qkv`."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, offset):
        out = torch.empty_like(qkv, memory_format=torch.contiguous_format)
        for part in range(3):
            _launch(qkv[:, :, part], out[:, :, part], cos, sin, offset, part < 2, 1.0)
        ctx.save_for_backward(cos, sin)
        ctx.offset, ctx.shape, ctx.dtype = offset, qkv.shape, qkv.dtype
        return tuple(out[:, :, part].transpose(1, 2) for part in range(3))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        dqkv = torch.empty(ctx.shape, dtype=ctx.dtype, device=cos.device)
        for part, grad in enumerate((dq, dk, dv)):
            if grad is None:
                dqkv[:, :, part].zero_()
            else:
                _launch(_as_bshd(grad), dqkv[:, :, part], cos, sin, ctx.offset, part < 2, -1.0)
        return dqkv, None, None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Reference: x (B, nh, S, D), tables starting at x's first position -> x rotated (x's dtype;
    the products in fp32 or wider, as the kernel)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x[..., 0::2].to(acc), x[..., 1::2].to(acc)
    cos, sin = cos[: x.shape[2]].to(acc), sin[: x.shape[2]].to(acc)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(x.dtype)


def rope_qkv_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int = 0):
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    return apply_rope(q, cos[offset:], sin[offset:]), apply_rope(k, cos[offset:], sin[offset:]), v


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int = 0):
    """qkv [B, S, 3, nh, hd], cos / sin [max_seq, hd/2] fp32, offset: position of s = 0 ->
    (q, k, v), each [B, nh, S, hd]. Triton on CUDA (see _common.use_triton), else the reference."""
    if qkv.dim() != 5 or qkv.shape[2] != 3 or qkv.shape[-1] % 2:
        raise ValueError(f"rope_qkv: qkv must be [B, S, 3, nh, hd] with hd even, got {tuple(qkv.shape)}")
    if cos.shape != sin.shape or cos.shape[-1] != qkv.shape[-1] // 2 or offset + qkv.shape[1] > cos.shape[0]:
        raise ValueError(f"rope_qkv: tables {tuple(cos.shape)} do not cover positions {offset}..{offset + qkv.shape[1]} "
                         f"of head dim {qkv.shape[-1]}")
    if not use_triton(qkv) or qkv.stride(-1) != 1 or cos.dtype != torch.float32 or not cos.is_contiguous():
        return rope_qkv_ref(qkv, cos, sin, offset)
    return RopeQKVFn.apply(qkv, cos, sin, offset)
