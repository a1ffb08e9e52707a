"""Token permutation for one process's experts (EP = 1), with the routing-weight multiply fused in.

T tokens, K choices each: pair p = t * K + k. After sorting the pairs by expert, row r of the
permuted tensor holds pair row_pair[r] (-1: a row of a dropped pair, always zero); pair_row [T, K]
is the inverse map (-1: pair dropped by capacity).

    permute(x [T, H], row_pair [R], pair_row [T, K])   out[r] = x[row_pair[r] // K]
        backward: dx[t] = sum_k dout[pair_row[t, k]]                         (fp32 sums)
    unpermute(y [R, H], w [T, K], pair_row, row_pair)  out[t] = sum_k w[t, k] * y[pair_row[t, k]]  (fp32 sums)
        backward: dy[r] = w[p] * dout[p // K],  dw[p] = <dout[p // K], y[r]>   (p = row_pair[r])

Example, T = 2, K = 2, token 0 -> experts (1, 0), token 1 -> (1, 2); pairs 0..3 sorted by expert:
row_pair = [1, 0, 2, 3] (expert 0: pair 1; expert 1: pairs 0, 2; expert 2: pair 3), pair_row = [[1, 0], [2, 3]].

Each kernel reads every row once and writes it once (no index_put / scatter-add, no atomics), so the
permutation costs four passes over the [R, H] rows per layer and step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Kernel, check_2d, check_same_device, use_triton

BLOCK_R, BLOCK_H = 8, 512


def _permute_kernel(x_ptr, row_pair_ptr, out_ptr, R, H, K, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[None, :]
    pair = tl.load(row_pair_ptr + rows, mask=rows < R, other=-1).to(tl.int64)
    token = tl.where(pair >= 0, pair // K, 0)[:, None]
    vals = tl.load(x_ptr + token * H + cols, mask=(pair[:, None] >= 0) & (cols < H), other=0.0)
    tl.store(out_ptr + rows[:, None] * H + cols, vals, mask=(rows[:, None] < R) & (cols < H))


def _unpermute_kernel(y_ptr, pair_row_ptr, w_ptr, out_ptr, T, H, K, HAS_W: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    tokens = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
    for k in range(0, K):
        row = tl.load(pair_row_ptr + tokens * K + k, mask=tokens < T, other=-1).to(tl.int64)
        vals = tl.load(y_ptr + tl.where(row >= 0, row, 0)[:, None] * H + cols, mask=(row[:, None] >= 0) & (cols < H),
                       other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + tokens * K + k, mask=row >= 0, other=0.0).to(tl.float32)
            vals = vals * w[:, None]
        acc += vals
    tl.store(out_ptr + tokens[:, None] * H + cols, acc.to(out_ptr.dtype.element_ty), mask=(tokens[:, None] < T) & (cols < H))


def _unpermute_bwd_kernel(dout_ptr, y_ptr, row_pair_ptr, w_ptr, dy_ptr, dw_ptr, R, H, K, BLOCK_R: tl.constexpr,
                          BLOCK_H: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    pair = tl.load(row_pair_ptr + rows, mask=rows < R, other=-1).to(tl.int64)
    live = pair >= 0
    token = tl.where(live, pair // K, 0)
    w = tl.load(w_ptr + tl.where(live, pair, 0), mask=live, other=0.0).to(tl.float32)
    dot = tl.zeros([BLOCK_R], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = (h0 + tl.arange(0, BLOCK_H))[None, :]
        g = tl.load(dout_ptr + token[:, None] * H + cols, mask=live[:, None] & (cols < H), other=0.0).to(tl.float32)
        y = tl.load(y_ptr + rows[:, None] * H + cols, mask=live[:, None] & (cols < H), other=0.0).to(tl.float32)
        dot += tl.sum(g * y, axis=1)
        tl.store(dy_ptr + rows[:, None] * H + cols, (g * w[:, None]).to(dy_ptr.dtype.element_ty),
                 mask=(rows[:, None] < R) & (cols < H))
    tl.store(dw_ptr + pair, dot, mask=live)


_PERMUTE = Kernel(_permute_kernel)
_UNPERMUTE = Kernel(_unpermute_kernel)
_UNPERMUTE_BWD = Kernel(_unpermute_bwd_kernel)


def _combine(src: torch.Tensor, pair_row: torch.Tensor, w, dtype) -> torch.Tensor:
    """out[t] = sum_k (w[t, k] *) src[pair_row[t, k]] through the unpermute kernel."""
    T, K = pair_row.shape
    H = src.shape[1]
    out = torch.empty(T, H, dtype=dtype, device=src.device)
    if out.numel():
        _UNPERMUTE[(triton.cdiv(T, BLOCK_R), triton.cdiv(H, BLOCK_H))](
            src, pair_row, w if w is not None else pair_row, out, T, H, K, HAS_W=w is not None, BLOCK_R=BLOCK_R,
            BLOCK_H=BLOCK_H)
    return out


class PermuteFn(torch.autograd.Function):
    """The Triton path of `permute` (x [T, H] contiguous)."""

    @staticmethod
    def forward(ctx, x, row_pair, pair_row):
        R, H = row_pair.shape[0], x.shape[1]
        out = torch.empty(R, H, dtype=x.dtype, device=x.device)
        if out.numel():
            _PERMUTE[(triton.cdiv(R, BLOCK_R), triton.cdiv(H, BLOCK_H))](x, row_pair, out, R, H, pair_row.shape[1],
                                                                      BLOCK_R=BLOCK_R, BLOCK_H=BLOCK_H)
        ctx.save_for_backward(pair_row)
        return out

    @staticmethod
    def backward(ctx, dout):
        (pair_row,) = ctx.saved_tensors
        return _combine(dout.contiguous(), pair_row, None, dout.dtype), None, None


class UnpermuteFn(torch.autograd.Function):
    """The Triton path of `unpermute` (y [R, H] contiguous, w [T, K] float32)."""

    @staticmethod
    def forward(ctx, y, w, pair_row, row_pair):
        ctx.save_for_backward(y, w, row_pair)
        return _combine(y, pair_row, w, y.dtype)

    @staticmethod
    def backward(ctx, dout):
        y, w, row_pair = ctx.saved_tensors
        R, H = y.shape
        dy = torch.empty_like(y)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        if R:
            _UNPERMUTE_BWD[(triton.cdiv(R, BLOCK_R),)](dout.contiguous(), y, row_pair, w, dy, dw, R, H, w.shape[1],
                                                      BLOCK_R=BLOCK_R, BLOCK_H=BLOCK_H)
        return dy, dw.to(w.dtype), None, None


def _check(name, rows: torch.Tensor, row_pair: torch.Tensor, pair_row: torch.Tensor) -> None:
    check_2d(f"{name}: rows", rows)
    if row_pair.dim() != 1 or pair_row.dim() != 2 or row_pair.dtype != torch.int64 or pair_row.dtype != torch.int64:
        raise ValueError(f"{name}: row_pair must be [R] int64 and pair_row [T, K] int64, got {tuple(row_pair.shape)} "
                         f"{row_pair.dtype} and {tuple(pair_row.shape)} {pair_row.dtype}")
    check_same_device(rows=rows, row_pair=row_pair, pair_row=pair_row)


def permute_ref(x, row_pair, pair_row):
    K = pair_row.shape[1]
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return padded[torch.where(row_pair >= 0, row_pair // K, x.shape[0])]


def unpermute_ref(y, w, pair_row):
    """fp32 (or wider) sums in k order, as the kernel."""
    acc = torch.promote_types(y.dtype, torch.float32)
    padded = torch.cat([y, y.new_zeros(1, y.shape[1])]).to(acc)
    vals = padded[torch.where(pair_row >= 0, pair_row, y.shape[0])]  # [T, K, H]
    weights = torch.where(pair_row >= 0, w.to(acc), 0.0)
    return (vals * weights[..., None]).sum(1).to(y.dtype)


def permute(x: torch.Tensor, row_pair: torch.Tensor, pair_row: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> [R, H] rows in row_pair's order (see the module docstring); differentiable in x."""
    _check("permute", x, row_pair, pair_row)
    if x.shape[0] != pair_row.shape[0]:
        raise ValueError(f"permute: x has {x.shape[0]} tokens, pair_row {pair_row.shape[0]}")
    if not use_triton(x):
        return permute_ref(x, row_pair, pair_row)
    return PermuteFn.apply(x.contiguous(), row_pair, pair_row)


def unpermute(y: torch.Tensor, w: torch.Tensor, pair_row: torch.Tensor, row_pair: torch.Tensor) -> torch.Tensor:
    """y [R, H], w [T, K] -> [T, H] weighted sums (see the module docstring); differentiable in y and w."""
    _check("unpermute", y, row_pair, pair_row)
    if w.shape != pair_row.shape or y.shape[0] != row_pair.shape[0]:
        raise ValueError(f"unpermute: w {tuple(w.shape)} must match pair_row {tuple(pair_row.shape)} and y's "
                         f"{y.shape[0]} rows row_pair's {row_pair.shape[0]}")
    if not use_triton(y, w) or w.dtype != torch.float32:
        return unpermute_ref(y, w, pair_row)
    return UnpermuteFn.apply(y.contiguous(), w.contiguous(), pair_row, row_pair)
