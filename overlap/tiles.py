"""Shared GEMM pieces: the tile product every overlapped kernel uses, tuning knobs, a plain
persistent GEMM (`matmul`, to compare with cuBLAS on its own) and the symmetric workspaces.

A tile is BLOCK_M x BLOCK_N of C = A @ B, accumulated in fp32 over BLOCK_K steps. Persistent
kernels launch `min(num_tiles, programs)` programs that each walk tiles pid, pid + nprog, ...
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

import tilecomm


@dataclass(frozen=True)
class GemmConfig:
    """Block shape and launch knobs of the tile GEMM."""

    BLOCK_M: int = 128
    BLOCK_N: int = 128
    BLOCK_K: int = 64
    num_warps: int = 8
    num_stages: int = 3


# Keyed by (large M, large N). Measured on one H200 with `python -m tilecomm.bench.gemm` (BENCHMARKS.md):
# 128x256x64/8 warps/3 stages was best of 11 configs on every shape with M >= 2048 (71-81% of cuBLAS), and
# 64x64x64/4/4 at 512x1024x1024 (80%: enough tiles to fill 132 SMs). (True, False) is not measured yet.
_TABLE = {(True, True): GemmConfig(128, 256, 64, 8, 3), (True, False): GemmConfig(128, 128, 64, 8, 3),
          (False, True): GemmConfig(64, 64, 64, 4, 4), (False, False): GemmConfig(64, 64, 64, 4, 4)}
_CPU = GemmConfig(16, 16, 16, 1, 1)  # interpreter: small tiles keep CPU ranks fast


def config_for(m: int, n: int, device: torch.device) -> GemmConfig:
    if device.type != "cuda":
        return _CPU
    return _TABLE[(m >= 1024, n >= 1024)]


def num_programs(num_tiles: int, device: torch.device) -> int:
    if device.type != "cuda":
        return max(1, min(num_tiles, 4))
    return max(1, min(num_tiles, torch.cuda.get_device_properties(device).multi_processor_count))


@tilecomm.jit
def mma_tile(a_ptr, b_ptr, rows, cols, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] tile of A[rows, :] @ B[:, cols] (rows < M, cols < N masked)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak,
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0)
        b = tl.load(b_ptr + ks[:, None].to(tl.int64) * stride_bk + cols[None, :] * stride_bn,
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0)
        acc = tl.dot(a, b, acc)
    return acc


@tilecomm.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = mma_tile(a_ptr, b_ptr, rows, cols, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                       BLOCK_M, BLOCK_N, BLOCK_K)
        tl.store(c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))


def check_operands(what: str, a: torch.Tensor, b: torch.Tensor, a_name: str = "a", b_name: str = "b") -> None:
    for name, t in ((a_name, a), (b_name, b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{what}: {name} must be a 2-D tensor, got {getattr(t, 'shape', type(t))}")
    if a.dtype != b.dtype or a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{what}: {a_name} and {b_name} must share a dtype in float16/bfloat16/float32, got {a.dtype}, {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{what}: {a_name} is on {a.device}, {b_name} on {b.device}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{what}: inner dimensions differ: {a_name} {tuple(a.shape)} @ {b_name} {tuple(b.shape)}")
    if not a.is_contiguous():
        raise ValueError(f"{what}: {a_name} must be contiguous (row-major), got strides {tuple(a.stride())}")


def matmul(a: torch.Tensor, b: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """C = a @ b with the persistent tile kernel (the GEMM the fused kernels are built from)."""
    check_operands("tilecomm.overlap.matmul", a, b)
    M, K = a.shape
    N = b.shape[1]
    cfg = config or config_for(M, N, a.device)
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    tiles = triton.cdiv(M, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N)
    _matmul_kernel[(num_programs(tiles, a.device),)](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0),
                                                    b.stride(1), BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                                                    BLOCK_K=cfg.BLOCK_K, num_warps=cfg.num_warps,
                                                    num_stages=cfg.num_stages)
    return c


class SymmetricWorkspace:
    """Symmetric buffers of one fused op, per (shape, dtype) key, allocated once (collectively) and
    kept in the runtime context; `epoch` counts the op's calls (the same on every rank)."""

    def __init__(self, tensors: dict):
        self.__dict__.update(tensors)
        self.epoch = 0

    @classmethod
    def get(cls, key, make):
        ctx = tilecomm.current()
        ws = ctx.caches.get(key)
        if ws is None:
            ws = ctx.caches[key] = cls(make())
            tilecomm.barrier()
        ws.epoch += 1
        return ws
