"""ag_gemm: C = all_gather(A) @ B with the gather hidden behind the GEMM.

    a_shard [m, K] on every member of the team (member r holds rows r*m ... (r+1)*m - 1 of A),
    b [K, n] -> C [W*m, n]; the team is a torch.distributed group (default: the world) of W ranks

Two kernels run at once, on two streams (on CPU ranks: one after the other):

* push (communication stream), program (p, i): member me puts row tile i of its shard into slot me of
  member (me + p) % W's symmetric gather buffer and SETs that member's flag[me, i] to the call's epoch;
* GEMM (current stream), persistent: tiles in ring order, own shard first (no waiting, read in place),
  then shards me+1, me+2, ...; before a peer's tile it waits for flag[src, i] >= epoch, so the first
  tiles compute while later ones are still arriving.

A final one-program kernel SETs consumed[me] on every member; the next call's push waits for it
before overwriting a peer's gather slot. Kernels see team indices; `pes_ptr` maps them to PEs (team.py).
`ag_gemm_reference` is the torch version the tests use.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import tilecomm
import tilecomm.language as tcl

from .team import Team, release, team_of, team_workspace
from .tiles import SymmetricWorkspace, check_operands, config_for, mma_tile, num_programs


@tilecomm.jit
def _push_kernel(a_ptr, gather_ptr, flags_ptr, consumed_ptr, pes_ptr, epoch, m, K, me, W, BLOCK_M: tl.constexpr):
    dest = (me + tl.program_id(0)) % W  # team index; its PE is pes[dest]
    dest_pe = tl.load(pes_ptr + dest)
    tile = tl.program_id(1)
    rows = tl.minimum(m - tile * BLOCK_M, BLOCK_M)
    tok = tcl.wait(consumed_ptr + dest, epoch - 1, tcl.CMP_GE)  # dest has finished reading the last call
    start = (tl.cast(me, tl.int64) * m + tile * BLOCK_M) * K
    tcl.put(tcl.consume_token(gather_ptr, tok) + start, a_ptr + tl.cast(tile, tl.int64) * BLOCK_M * K, rows * K,
            dest_pe)
    tcl.signal(flags_ptr + me * tl.cdiv(m, BLOCK_M) + tile, epoch, dest_pe, tcl.SIGNAL_SET)


@tilecomm.jit
def _gemm_kernel(a_ptr, gather_ptr, b_ptr, c_ptr, flags_ptr, epoch, m, N, K, me, W, stride_bk, stride_bn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tiles_m = tl.cdiv(m, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), W * tiles_m * tiles_n, tl.num_programs(0)):
        step = tile // (tiles_m * tiles_n)
        i = (tile // tiles_n) % tiles_m
        src = (me + step) % W
        rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        if src == me:
            a_src = a_ptr
        else:
            tok = tcl.wait(flags_ptr + src * tiles_m + i, epoch, tcl.CMP_GE)
            a_src = tcl.consume_token(gather_ptr + tl.cast(src, tl.int64) * m * K, tok)
        acc = mma_tile(a_src, b_ptr, rows, cols, m, N, K, K, 1, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K)
        out_rows = tl.cast(src, tl.int64) * m + rows
        tl.store(c_ptr + out_rows[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(rows[:, None] < m) & (cols[None, :] < N))


def _workspace(team: Team, m: int, K: int, dtype: torch.dtype, block_m: int) -> SymmetricWorkspace:
    W = team.size
    return team_workspace(team, ("ag_gemm", m, K, dtype, block_m), {
        "gather": ((W * m, K), dtype, False),
        "flags": ((W * triton.cdiv(m, block_m),), torch.int64, True),
        "consumed": ((W,), torch.int64, True)})


@contextlib.contextmanager
def _comm_stream(device: torch.device):
    """The push kernel's stream on GPUs (so it runs beside the GEMM); a no-op on CPU ranks."""
    if device.type != "cuda":
        yield
        return
    ctx = tilecomm.current()
    stream = ctx.caches.setdefault(("comm_stream", device.index), torch.cuda.Stream(device))
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
    ctx.caches["comm_stream_pending"] = stream


def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, return_gathered: bool = False, group=None):
    """all_gather(a_shard) @ b over `group`'s W ranks, rows in group-rank order: [W*m, n]. With
    return_gathered, also the gathered A [W*m, K] (a copy; the op's buffer is reused by the next call).
    Collective over the group (None: the world); see team.py for the SPMD assumption on first use."""
    what = "tilecomm.overlap.ag_gemm"
    team = team_of(group, what)
    check_operands(what, a_shard, b, "a_shard", "b")
    ctx = tilecomm.current()
    if a_shard.device.type != ctx.device.type:
        raise ValueError(f"{what}: a_shard is on {a_shard.device}; the runtime's tensors are on {ctx.device}")
    (m, K), N, W, me = a_shard.shape, b.shape[1], team.size, team.index
    cfg = config_for(W * m, N, a_shard.device)
    ws = _workspace(team, m, K, a_shard.dtype, cfg.BLOCK_M)
    c = torch.empty((W * m, N), dtype=a_shard.dtype, device=a_shard.device)
    tiles_m = triton.cdiv(m, cfg.BLOCK_M)
    if m:
        with _comm_stream(a_shard.device):
            _push_kernel[(W, tiles_m)](a_shard, ws.gather, ws.flags, ws.consumed, team.pes, ws.epoch, m, K, me, W,
                                       BLOCK_M=cfg.BLOCK_M)
        tiles = W * tiles_m * triton.cdiv(N, cfg.BLOCK_N)
        _gemm_kernel[(num_programs(tiles, a_shard.device),)](
            a_shard, ws.gather, b, c, ws.flags, ws.epoch, m, N, K, me, W, b.stride(0), b.stride(1),
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        pending = ctx.caches.pop("comm_stream_pending", None)
        if pending is not None:
            torch.cuda.current_stream(a_shard.device).wait_stream(pending)
    release(ws, team)
    if not return_gathered:
        return c
    gathered = ws.gather.clone()
    gathered[me * m:(me + 1) * m] = a_shard  # own slot was filled by its own push too
    return c, gathered


def ag_gemm_reference(a_shard: torch.Tensor, b: torch.Tensor, group=None) -> torch.Tensor:
    """torch.distributed.all_gather_into_tensor over `group` (None: the world) + torch.matmul; pass
    float64 operands for a float64 reference."""
    world = dist.get_world_size(group)
    full = torch.empty((world * a_shard.shape[0], a_shard.shape[1]), dtype=a_shard.dtype, device=a_shard.device)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(full, a_shard.contiguous(), group=group)
    return full @ b
