"""gemm_rs: this rank's row block of sum over ranks of a_r @ b_r, with the reduce-scatter hidden
behind the GEMM.

    a [M, k], b [k, N] on every rank (M divisible by W) -> out [M/W, N], rows me*M/W ... of the sum

* GEMM (persistent): computes the row blocks of a @ b owner by owner, starting with rank me+1 and
  ending with its own, and stores each finished tile straight into slot me of the owner's symmetric
  receive buffer, then SETs the owner's flag[me, tile] to the call's epoch: the tile crosses the link
  while later tiles compute.
* reduce (per output tile): waits for every rank's flag, sums the W partial tiles in rank order in
  fp32, writes the result; then one program SETs consumed[me] on every rank, which the next call's
  GEMM waits for before it writes into a peer's receive buffer again.

`gemm_rs_reference` is the torch version the tests use.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import tilecomm
import tilecomm.language as tcl

from .ag_gemm import _release_kernel
from .tiles import SymmetricWorkspace, check_operands, config_for, mma_tile, num_programs


@tilecomm.jit
def _gemm_push_kernel(a_ptr, b_ptr, recv_ptr, flags_ptr, consumed_ptr, epoch, mb, N, K, W, stride_bk, stride_bn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    me = tcl.rank()
    tiles_m = tl.cdiv(mb, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_owner = tiles_m * tiles_n
    for tile in range(tl.program_id(0), W * per_owner, tl.num_programs(0)):
        owner = (me + 1 + tile // per_owner) % W
        t = tile % per_owner
        local_rows = (t // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = mma_tile(a_ptr + owner.to(tl.int64) * mb * K, b_ptr, local_rows, cols, mb, N, K, K, 1,
                       stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K)
        tok = tcl.wait(consumed_ptr + owner, epoch - 1, tcl.CMP_GE)
        slot = tcl.consume_token(tcl.symm_at(recv_ptr, owner), tok) + me.to(tl.int64) * mb * N
        tl.store(slot + local_rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(recv_ptr.dtype.element_ty),
                 mask=(local_rows[:, None] < mb) & (cols[None, :] < N))
        tcl.signal(flags_ptr + me * per_owner + t, epoch, owner, tcl.SIGNAL_SET)


@tilecomm.jit
def _reduce_kernel(recv_ptr, flags_ptr, out_ptr, epoch, mb, N, W, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_owner = tl.cdiv(mb, BLOCK_M) * tiles_n
    t = tl.program_id(0)
    rows = (t // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < mb) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for src in range(0, W):
        tok = tcl.wait(flags_ptr + src * per_owner + t, epoch, tcl.CMP_GE)
        part = tcl.consume_token(recv_ptr + tl.cast(src, tl.int64) * mb * N, tok)
        acc += tl.load(part + offs, mask=mask, other=0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemm_rs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """This rank's [M/W, N] row block of sum over ranks of a @ b (fp32 reduction). Collective."""
    what = "tilecomm.overlap.gemm_rs"
    check_operands(what, a, b)
    ctx = tilecomm.current()
    if a.device.type != ctx.device.type:
        raise ValueError(f"{what}: a is on {a.device}; the runtime's tensors are on {ctx.device}")
    (M, K), N, W = a.shape, b.shape[1], ctx.world_size
    if M % W:
        raise ValueError(f"{what}: a has {M} rows; M must be a multiple of the world size ({W})")
    mb = M // W
    cfg = config_for(mb, N, a.device)
    per_owner = triton.cdiv(mb, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N)

    def make():
        return {"recv": tilecomm.empty((W, mb, N), a.dtype), "flags": tilecomm.zeros((W * per_owner,), torch.int64),
                "consumed": tilecomm.zeros((W,), torch.int64)}

    ws = SymmetricWorkspace.get(("gemm_rs", mb, N, a.dtype, cfg.BLOCK_M, cfg.BLOCK_N), make)
    out = torch.empty((mb, N), dtype=a.dtype, device=a.device)
    if mb and N:
        _gemm_push_kernel[(num_programs(W * per_owner, a.device),)](
            a, b, ws.recv, ws.flags, ws.consumed, ws.epoch, mb, N, K, W, b.stride(0), b.stride(1),
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        _reduce_kernel[(per_owner,)](ws.recv, ws.flags, out, ws.epoch, mb, N, W, BLOCK_M=cfg.BLOCK_M,
                                     BLOCK_N=cfg.BLOCK_N)
    _release_kernel[(1,)](ws.consumed, ws.epoch, W)
    return out


def gemm_rs_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul + torch.distributed.reduce_scatter_tensor (sum)."""
    world = dist.get_world_size()
    full = a @ b
    out = torch.empty((a.shape[0] // world, b.shape[1]), dtype=full.dtype, device=full.device)
    # torch >= 2.13 names it reduce_scatter_single (same signature) and deprecates the old name
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, full.contiguous())
    return out
