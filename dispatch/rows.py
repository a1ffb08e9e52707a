"""Row movement on one rank: the two local operations dispatch and combine are made of.

    gather_rows(src[N, H], idx[M])                 out[i] = src[idx[i]]            (idx -1: zeros)
    combine_rows(src[N, H], idx[M, J], coef[M, J]) out[i] = sum_j coef[i, j] * src[idx[i, j]]
                                                   (idx -1 skipped; fp32 accumulation, fp64 for fp64; coef None = 1)

Each has a Triton kernel (`tilecomm` backend; runs on CPU ranks through the interpreter) and a torch
version (`torch` ops: the NCCL path and the reference the tests compare the kernels with).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

import tilecomm

BLOCK_M, BLOCK_H = 16, 256


@tilecomm.jit
def _gather_rows_kernel(src_ptr, idx_ptr, out_ptr, M, H, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < M
    src_row = tl.load(idx_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    col_ok = cols[None, :] < H
    vals = tl.load(src_ptr + src_row[:, None] * H + cols[None, :], mask=(src_row[:, None] >= 0) & col_ok, other=0)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * H + cols[None, :], vals, mask=row_ok[:, None] & col_ok)


@tilecomm.jit
def _combine_rows_kernel(src_ptr, idx_ptr, coef_ptr, out_ptr, M, H, J, HAS_COEF: tl.constexpr, ACC: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < M
    col_ok = cols[None, :] < H
    acc = tl.zeros((BLOCK_M, BLOCK_H), ACC)
    for j in range(0, J):
        src_row = tl.load(idx_ptr + rows.to(tl.int64) * J + j, mask=row_ok, other=-1).to(tl.int64)
        vals = tl.load(src_ptr + src_row[:, None] * H + cols[None, :], mask=(src_row[:, None] >= 0) & col_ok,
                       other=0).to(ACC)
        if HAS_COEF:
            coef = tl.load(coef_ptr + rows.to(tl.int64) * J + j, mask=row_ok & (src_row >= 0), other=0).to(ACC)
            vals = vals * coef[:, None]
        acc += vals
    tl.store(out_ptr + rows[:, None].to(tl.int64) * H + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok)


def _grid(m: int, h: int):
    return (max(1, triton.cdiv(m, BLOCK_M)), max(1, triton.cdiv(h, BLOCK_H)))


def gather_rows(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Triton: src [N, H], idx [M] int64 -> [M, H] (rows with idx -1 are zero)."""
    src, idx = src.contiguous(), idx.contiguous()
    out = torch.empty((idx.shape[0], src.shape[1]), dtype=src.dtype, device=src.device)
    if out.numel():
        _gather_rows_kernel[_grid(*out.shape)](src, idx, out, out.shape[0], out.shape[1],
                                              BLOCK_M=BLOCK_M, BLOCK_H=BLOCK_H)
    return out


def combine_rows(src: torch.Tensor, idx: torch.Tensor, coef: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """Triton: src [N, H], idx [M, J] int64, coef [M, J] or None -> [M, H] of out_dtype, fp32 sums."""
    src, idx = src.contiguous(), idx.contiguous()
    m, j = idx.shape
    out = torch.empty((m, src.shape[1]), dtype=out_dtype, device=src.device)
    if out.numel():
        coef_arg = coef.contiguous() if coef is not None else idx
        _combine_rows_kernel[_grid(m, src.shape[1])](src, idx, coef_arg, out, m, src.shape[1], j,
                                                    HAS_COEF=coef is not None, ACC=tl.float64 if _acc(src.dtype) == torch.float64 else tl.float32,
                                                    BLOCK_M=BLOCK_M, BLOCK_H=BLOCK_H)
    return out


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation type: float64 for float64 data, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _with_zero_row(src: torch.Tensor, idx: torch.Tensor):
    """src plus one zero row at the end, and idx with -1 pointing at it (works for empty src too)."""
    padded = torch.cat([src, src.new_zeros((1,) + tuple(src.shape[1:]))])
    return padded, torch.where(idx >= 0, idx, src.shape[0])


def gather_rows_torch(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    padded, safe = _with_zero_row(src, idx)
    return padded[safe]


def combine_rows_torch(src: torch.Tensor, idx: torch.Tensor, coef: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    acc = _acc(src.dtype)
    padded, safe = _with_zero_row(src, idx)
    vals = padded[safe].to(acc)  # [M, J, H]
    weight = (idx >= 0).to(acc) if coef is None else torch.where(idx >= 0, coef.to(acc), 0.0)
    return (vals * weight[..., None]).sum(1).to(out_dtype)
