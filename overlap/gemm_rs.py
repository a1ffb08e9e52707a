"""gemm_rs: this rank's row block of sum over ranks of a_r @ b_r, with the reduce-scatter hidden
behind the GEMM.

    a [M, k], b [k, N] on every member of the team (a torch.distributed group, default the world, of
    W ranks; M divisible by W) -> out [M/W, N], rows me*M/W ... of the sum (me: index in the group)

* GEMM (persistent): computes the row blocks of a @ b owner by owner, starting with member me+1 and
  ending with its own, and stores each finished tile straight into slot me of the owner's symmetric
  receive buffer, then SETs the owner's flag[me, tile] to the call's epoch: the tile crosses the link
  while later tiles compute.
* reduce (per output tile): waits for every member's flag, sums the W partial tiles in member order
  in fp32, writes the result; then one program SETs consumed[me] on every member, which the next
  call's GEMM waits for before it writes into a peer's receive buffer again.

Kernels see team indices; `pes_ptr` maps them to PEs (team.py).

`gemm_rs_reference` is the torch version the tests use.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import tilecomm
import tilecomm.language as tcl

from .team import release, team_of, team_workspace
from .tiles import check_operands, config_for, mma_tile, num_programs


@tilecomm.jit
def _gemm_push_kernel(a_ptr, b_ptr, recv_ptr, flags_ptr, consumed_ptr, pes_ptr, epoch, mb, N, K, me, W, stride_bk,
                      stride_bn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tiles_m = tl.cdiv(mb, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_owner = tiles_m * tiles_n
    for tile in range(tl.program_id(0), W * per_owner, tl.num_programs(0)):
        owner = (me + 1 + tile // per_owner) % W  # team index; its PE is pes[owner]
        owner_pe = tl.load(pes_ptr + owner)
        t = tile % per_owner
        local_rows = (t // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = mma_tile(a_ptr + tl.cast(owner, tl.int64) * mb * K, b_ptr, local_rows, cols, mb, N, K, K, 1,
                       stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K)
        tok = tcl.wait(consumed_ptr + owner, epoch - 1, tcl.CMP_GE)
        slot = tcl.consume_token(tcl.symm_at(recv_ptr, owner_pe), tok) + tl.cast(me, tl.int64) * mb * N
        tl.store(slot + local_rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(recv_ptr.dtype.element_ty),
                 mask=(local_rows[:, None] < mb) & (cols[None, :] < N))
        tcl.signal(flags_ptr + me * per_owner + t, epoch, owner_pe, tcl.SIGNAL_SET)


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
    for src in range(W):
        tok = tcl.wait(flags_ptr + src * per_owner + t, epoch, tcl.CMP_GE)
        part = tcl.consume_token(recv_ptr + tl.cast(src, tl.int64) * mb * N, tok)
        acc += tl.load(part + offs, mask=mask, other=0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemm_rs(a: torch.Tensor, b: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's [M/W, N] row block of the sum over `group`'s W ranks of a @ b (fp32 reduction).
    Collective over the group (None: the world); see team.py for the SPMD assumption on first use."""
    what = "tilecomm.overlap.gemm_rs"
    team = team_of(group, what)
    check_operands(what, a, b)
    ctx = tilecomm.current()
    if a.device.type != ctx.device.type:
        raise ValueError(f"{what}: a is on {a.device}; the runtime's tensors are on {ctx.device}")
    (M, K), N, W, me = a.shape, b.shape[1], team.size, team.index
    if M % W:
        raise ValueError(f"{what}: a has {M} rows; M must be a multiple of the group size ({W})")
    mb = M // W
    cfg = config_for(mb, N, a.device)
    per_owner = triton.cdiv(mb, cfg.BLOCK_M) * triton.cdiv(N, cfg.BLOCK_N)
    ws = team_workspace(team, ("gemm_rs", mb, N, a.dtype, cfg.BLOCK_M, cfg.BLOCK_N), {
        "recv": ((W, mb, N), a.dtype, False),
        "flags": ((W * per_owner,), torch.int64, True),
        "consumed": ((W,), torch.int64, True)})
    out = torch.empty((mb, N), dtype=a.dtype, device=a.device)
    if mb and N:
        _gemm_push_kernel[(num_programs(W * per_owner, a.device),)](
            a, b, ws.recv, ws.flags, ws.consumed, team.pes, ws.epoch, mb, N, K, me, W, b.stride(0), b.stride(1),
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        _reduce_kernel[(per_owner,)](ws.recv, ws.flags, out, ws.epoch, mb, N, W, BLOCK_M=cfg.BLOCK_M,
                                     BLOCK_N=cfg.BLOCK_N)
    release(ws, team)
    return out


def gemm_rs_reference(a: torch.Tensor, b: torch.Tensor, group=None) -> torch.Tensor:
    """torch.matmul + torch.distributed.reduce_scatter_tensor (sum) over `group` (None: the world);
    pass float64 operands for a float64 reference."""
    world = dist.get_world_size(group)
    full = a @ b
    out = torch.empty((a.shape[0] // world, b.shape[1]), dtype=full.dtype, device=full.device)
    # torch >= 2.13 names it reduce_scatter_single (same signature) and deprecates the old name
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, full.contiguous(), group=group)
    return out
