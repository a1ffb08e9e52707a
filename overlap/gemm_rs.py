"""gemm_rs: this rank's row block of sum over ranks of a_r @ b_r, with the reduce-scatter fused into the GEMM.

    a [M, k], b [k, N] on every member of the team (a torch.distributed group, default the world, of
    W ranks; M divisible by W) -> out [M/W, N], rows me*M/W ... of the sum (me: index in the group)

Two ways (`GemmRsWorkspace.push`, chosen as ag_gemm's push is: team.push_mode):

"copy" (every member directly reachable: NVLink peers, CPU ranks). Block by block on the caller's stream,
members me+1, me+2, ... and the own block last: the block's GEMM (torch.mm: cuBLAS) into a local stage, then
the copy engine, on the workspace's stream, copies it into slot me of that member's symmetric recv buffer and
writes the member's flag[me] = epoch behind it (a stream write, tilecomm.stream_ops). The copies run beside the
next blocks' GEMMs and take no SM. Then the own block's GEMM (cuBLAS) goes straight into `out`, and one kernel
(`_add_slots_kernel`) adds the other members' slots (fp32) once their flags hold the call's epoch: on 4 H200s
1.14x / 1.07x the GEMM alone for 8192x3584x4096 / 8192x7168x8192, the add pass ~22 µs of the small shape's ~50
over the GEMM (BENCHMARKS.md, 2026-11-27 from 17:52 UTC). With FUSED_OWN_BLOCK the own block is instead the fused
kernel below run over the own tiles only: each tile's main loop, then a wait for every member's flag of its rows
(WAIT_LATE: the block the last member computed for this rank is still on its way while the own block is
computed), then the slots added in the epilogue and the sum stored into `out`. With one flag per block that was
slower (on 2 H200s 402.2 µs against 372.9 for 8192x3584x4096: the peer's 33.5 MB block lands ~90 µs into the own
block, so the first tiles waited for all of it; 2026-11-27 from 19:26 UTC; on 4 H200s 405.7 against 390.2), so a
block now goes in COPY_CHUNKS row chunks, a flag behind each, and a tile waits for its rows' chunk only (the
first chunks land before the first wave of tiles ends; not measured on GPUs yet: tests/copy_push_probe.py times
both forms). At W = 1 there is nothing to add: the op is cuBLAS's GEMM. The recv buffer is double-buffered by
call parity, so no copy waits for its reader (call e + 1 writes the half call e - 1 used: ag_gemm's argument,
module docstring there). The fused kernel as the whole op (below) took 1.37x / 1.15x, its tile stores over
NVLink stalling the math.

"kernel" (TILECOMM_TRANSPORT=nvshmem, or a member without a load/store mapping). One persistent kernel (the
TMA tile GEMM of tiles.py) walks the row blocks owner by owner, starting with member me+1 and ending with its
own:

* a peer's tile is stored straight into slot me of the owner's symmetric receive buffer, and the
  owner's flag[me, tile] is SET to the call's epoch after the program's *next* main loop (or before it
  waits on peers, or at its end): the SET's release must wait until the tile's stores have landed, and
  right after the stores that wait is the whole tile crossing the link (every program stores its tile at
  the same moment: ~8 MB at once per rank), where after a main loop they have long landed. With the SET
  right after the stores, the fused call took as long as the GEMM and NCCL's reduce_scatter in sequence
  on the small shape at W = 4 (499 µs against 342 + 202, BENCHMARKS.md 2026-11-27 from 16:11 UTC). A
  deferred SET is never held across a wait on this call's flags: a program SETs it before an own tile's
  waits (two programs each holding the flag the other waits for would deadlock);
* an own tile is reduced in its epilogue: for every other member it waits for flag[src, tile], adds
  that partial tile (fp32) and stores the sum into `out` (TMA). No separate reduce pass.

Before writing into a peer's buffer the kernel waits for the peer's consumed word from the last call;
a one-program kernel SETs consumed[me] on every member at the end. On CPU ranks the interpreter runs
programs one after another, so peer tiles and own tiles are two launches there (an own tile waits for
peers' first launches only); on GPUs one launch (all programs are resident).
A call with nothing to compute spends no epoch.
Kernels see team indices; `pes_ptr` maps them to PEs (team.py). Buffers live in a `GemmRsWorkspace`
made up front (layers make theirs in `__init__`); without one, a temporary workspace per call.
`gemm_rs_reference` is the torch version the tests use.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import triton.language as tl

import tilecomm
import tilecomm.language as tcl
from tilecomm import stream_ops
from tilecomm.jit import CachedLaunch, cdiv

from .team import OpWorkspace, release, team_of, workspace_team
from .tiles import (b_desc3, c_desc3, check_operands, desc3, dot_precision, launch_gemm, matmul,
                    resolve_config, split_cols, store_tile, tile_position, tile_product, tma_operand)

MIN_BLOCK = 16  # flags are sized for the smallest tile any config uses
# push="copy" with FUSED_OWN_BLOCK: a block goes to its owner in up to this many row chunks (copy_chunk_rows), each
# with its flag, so an own tile waits only for the rows it adds (flags [W, COPY_CHUNKS])
COPY_CHUNKS = 8


def copy_chunk_rows(mb: int) -> int:
    """Rows per chunk of an [mb, N] block: a function of mb alone, so that writers and readers agree whatever tiles
    each rank's GEMM runs."""
    return cdiv(cdiv(mb, COPY_CHUNKS), MIN_BLOCK) * MIN_BLOCK


class GemmRsWorkspace(OpWorkspace):
    """Buffers of gemm_rs over `group` for outputs of up to `max_rows` rows (M/W) of `N` columns of `dtype`
    (collective over the world). push (module docstring): "copy", "kernel" or "auto" ("copy" where every member
    is directly reachable and stream writes work, else "kernel"; the choice is in `self.push`).
    "kernel": symmetric recv [W, max_rows, N], flags [W * tiles], consumed [W].
    "copy": symmetric recv [2, W, max_rows, N] (by call parity) and flags [W, COPY_CHUNKS] (a block's row chunks); a
    local stage [W - 1, max_rows, N]
    for the partial blocks on their way out, a stream for the copies and the events that order the two."""

    def __init__(self, N: int, dtype: torch.dtype, max_rows: int, group=None, push: str = "auto"):
        team, push = workspace_team("GemmRsWorkspace", group, push, N=N, max_rows=max_rows)
        self.N, self.dtype, self.max_rows, self.push = N, dtype, max_rows, push
        super().__init__(team, "tilecomm.overlap.gemm_rs", self.specs(N, dtype, max_rows, team.size, push))
        if push != "copy":
            return
        W, me, device = team.size, team.index, self.recv.device
        self.stage = torch.empty((W - 1, max_rows, N), dtype=dtype, device=device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.issuer = stream_ops.StreamIssuer(device, self.stream)
        # by address: member d's recv and flags as this rank's mapped views of d's heap
        self.peer_recv_addr = {d: tilecomm.peer(self.recv, team.ranks[d]).data_ptr() for d in range(W) if d != me}
        self.peer_flags_addr = {d: tilecomm.peer(self.flags, team.ranks[d]).data_ptr() for d in range(W) if d != me}
        cuda = self.stream is not None
        self.computed = [torch.cuda.Event() if cuda else None for _ in range(W - 1)]  # stage block k is ready
        self.pushed = torch.cuda.Event() if cuda else None  # every copy of the call has been issued before it

    @staticmethod
    def specs(N: int, dtype: torch.dtype, max_rows: int, W: int, push: str) -> dict:
        if push == "copy":
            return {"recv": ((2, W, max_rows, N), dtype, False), "flags": ((W * COPY_CHUNKS,), torch.int64, True)}
        return {"recv": ((W, max_rows, N), dtype, False),
                "flags": ((W * cdiv(max_rows, MIN_BLOCK) * cdiv(N, MIN_BLOCK),), torch.int64, True),
                "consumed": ((W,), torch.int64, True)}

    @classmethod
    def heap_bytes(cls, N: int, dtype: torch.dtype, max_rows: int, W: int) -> int:
        """Symmetric heap bytes of GemmRsWorkspace(N, dtype, max_rows) over a group of W ranks, on each rank
        (the larger of the two pushes': "auto" picks at run time)."""
        return max(cls.heap_bytes_of(cls.specs(N, dtype, max_rows, W, push)) for push in ("copy", "kernel"))


@tilecomm.jit
def _add_part(c, part_ptr, rows_left, cols_left, N, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """c [BLOCK_M, WIDTH] + the tile at part_ptr (row stride N) in fp32, rows >= rows_left and columns >=
    cols_left read as zero; loaded as two [BLOCK_M, WIDTH // 2] halves (as `_put_part` stores)."""
    HALF: tl.constexpr = WIDTH // 2
    r = tl.arange(0, BLOCK_M)
    k = tl.arange(0, HALF)
    offs = r[:, None] * N + k[None, :]
    c0, c1 = split_cols(c, BLOCK_M, WIDTH)
    c0 += tl.load(part_ptr + offs, mask=(r[:, None] < rows_left) & (k[None, :] < cols_left), other=0).to(tl.float32)
    c1 += tl.load(part_ptr + HALF + offs, mask=(r[:, None] < rows_left) & (k[None, :] < cols_left - HALF),
                  other=0).to(tl.float32)
    return tl.join(c0, c1).permute(0, 2, 1).reshape(BLOCK_M, WIDTH)


@tilecomm.jit
def _put_part(c, slot_ptr, rows_left, cols_left, stride, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """Store c [BLOCK_M, WIDTH] (fp32) at slot_ptr (row stride `stride`) in the slot's dtype, inside rows_left x
    cols_left, as two [BLOCK_M, WIDTH // 2] stores (whole-half pointer stores spilled registers)."""
    HALF: tl.constexpr = WIDTH // 2
    r = tl.arange(0, BLOCK_M)
    k = tl.arange(0, HALF)
    offs = r[:, None] * stride + k[None, :]
    c0, c1 = split_cols(c, BLOCK_M, WIDTH)
    tl.store(slot_ptr + offs, c0.to(slot_ptr.dtype.element_ty),
             mask=(r[:, None] < rows_left) & (k[None, :] < cols_left))
    tl.store(slot_ptr + HALF + offs, c1.to(slot_ptr.dtype.element_ty),
             mask=(r[:, None] < rows_left) & (k[None, :] < cols_left - HALF))


@tilecomm.jit
def _set_flag(flags_ptr, me, flag_stride, t, epoch, owner_pe):
    """SET the owner's flag[me, t] to the call's epoch: my partial tile t is in its receive buffer."""
    tcl.signal(flags_ptr + me * flag_stride + t, epoch, owner_pe, tcl.SIGNAL_SET)


@tilecomm.jit
def _wait_parts(flags_ptr, me, W, flag_stride, index, epoch):
    """Wait until every other member's flag word `index` holds the call's epoch; returns me, ordered after the
    waits (what is read through it sees their data)."""
    ready = me
    for s in range(1, W):
        tok = tcl.wait(flags_ptr + ((me + s) % W) * flag_stride + index, epoch, tcl.CMP_GE)
        ready = tcl.consume_token(ready, tok).to(tl.int32)
    return ready


@tilecomm.jit(do_not_specialize=["epoch"])
def _gemm_rs_kernel(a_ptr, b_ptr, out_ptr, recv_ptr, flags_ptr, consumed_ptr, pes_ptr, epoch, mb, N, K, me, W,
                    tile_begin, tile_end, stride_am, stride_b, stride_om, slot_stride, flag_stride, flag_span,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    EPILOGUE_SPLIT: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, B_TRANS: tl.constexpr,
                    C_TMA: tl.constexpr, PRECISION: tl.constexpr, WAIT_LATE: tl.constexpr):
    """Tiles tile_begin .. tile_end - 1 of the walk over owners me+1, me+2, ..., me (module docstring). A flag
    covers flag_span tiles of one member's partial block (push="kernel": one tile). WAIT_LATE (push="copy", the own
    tiles only): an own tile waits for the partial tiles after its main loop, not before it (the members' blocks
    land while the own block is being computed), and a flag covers flag_span rows (a row chunk of the member's
    block, flag[src, chunk] at flag_stride COPY_CHUNKS; the chunks land in order, so a tile waits for the chunk of
    its last row)."""
    # Register budget (a 128x256 fp32 accumulator is 128 of 255 registers per thread): the epilogue works on column
    # halves (HALF = BLOCK_N // 2; EPILOGUE_SPLIT is not used), own tiles read partial tiles by TMA when rows are
    # 16-byte aligned, pointer loads/stores go in quarters with int32 in-tile offsets, and no wait runs while the
    # accumulator is live. Each of these spilled registers in the sm_90 build before (tests/gpu_compile.py).
    HALF: tl.constexpr = BLOCK_N // 2
    a_desc = desc3(a_ptr, W, mb, K, tl.cast(mb, tl.int64) * stride_am, stride_am, BLOCK_M, BLOCK_K)
    # one group: any aligned group stride will do
    b_desc = b_desc3(b_ptr, 1, K, N, tl.cast(K + N, tl.int64) * stride_b, stride_b, BLOCK_K, BLOCK_N, B_TRANS)
    o_desc = c_desc3(out_ptr, 1, mb, N, tl.cast(mb, tl.int64) * stride_om, stride_om, BLOCK_M, HALF, C_TMA)
    r_desc = c_desc3(recv_ptr, W, mb, N, slot_stride, N, BLOCK_M, HALF, C_TMA)  # partial tiles, recv [W, max_rows, N]
    tiles_m = tl.cdiv(mb, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_owner = tiles_m * tiles_n
    pending = tl.full((), -1, tl.int32)  # the peer tile whose flag is not SET yet (module docstring), or -1
    pending_pe = tl.full((), 0, tl.int32)  # ... and its owner's PE
    for tile in range(tile_begin + tl.program_id(0), tile_end, tl.num_programs(0)):
        owner = (me + 1 + tile // per_owner) % W  # team index; its PE is pes[owner]
        t = tile % per_owner
        pid_m, pid_n = tile_position(t, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        base = tl.cast(off_m, tl.int64) * N + off_n  # the tile's first element in a [mb, N] slot
        rows_left = mb - off_m
        cols_left = N - off_n
        owner_pe = tl.load(pes_ptr + owner)
        flag = (tl.minimum(off_m + BLOCK_M, mb) - 1) // flag_span if WAIT_LATE else t // flag_span
        # Waits come before the main loop: a spin loop with the fp32 accumulator live spilled it.
        ready = me
        if owner == me:  # every peer's partial tile is in (an own tile is the last step: they are due)
            if pending >= 0:  # first this program's own deferred flag: a peer may be waiting for it
                _set_flag(flags_ptr, me, flag_stride, pending, epoch, pending_pe)
                pending = tl.full((), -1, tl.int32)
            parts = recv_ptr
            if not WAIT_LATE:
                ready = _wait_parts(flags_ptr, me, W, flag_stride, flag, epoch)
        else:  # the owner has finished reading the last call's slot
            tok = tcl.wait(consumed_ptr + owner, epoch - 1, tcl.CMP_GE)
            parts = tcl.consume_token(tcl.symm_at(recv_ptr, owner_pe), tok) + tl.cast(me, tl.int64) * slot_stride
        acc = tile_product(a_desc, owner, off_m, b_desc, 0, off_n, K, BLOCK_M, BLOCK_N, BLOCK_K, B_TRANS, PRECISION)
        c0, c1 = split_cols(acc, BLOCK_M, BLOCK_N)
        if owner == me:
            if WAIT_LATE:
                ready = _wait_parts(flags_ptr, me, W, flag_stride, flag, epoch)
            if C_TMA:  # partial tiles by TMA (pointer loads with their masks spilled registers)
                g = tcl.proxy_fence(ready)  # TMA reads see the peers' stores
                for s in range(1, W):
                    src = (g + s) % W
                    c0 += r_desc.load([src, off_m, off_n]).reshape(BLOCK_M, HALF).to(tl.float32)
                    c1 += r_desc.load([src, off_m, off_n + HALF]).reshape(BLOCK_M, HALF).to(tl.float32)
            else:
                for s in range(1, W):
                    part = parts + tl.cast((ready + s) % W, tl.int64) * slot_stride + base
                    c0 = _add_part(c0, part, rows_left, cols_left, N, BLOCK_M, HALF)
                    c1 = _add_part(c1, part + HALF, rows_left, cols_left - HALF, N, BLOCK_M, HALF)
            if C_TMA:
                store_tile(o_desc, 0, out_ptr, stride_om, mb, N, c0, off_m, off_n, BLOCK_M, HALF, 1, True)
                store_tile(o_desc, 0, out_ptr, stride_om, mb, N, c1, off_m, off_n + HALF, BLOCK_M, HALF, 1, True)
            else:
                out_tile = out_ptr + tl.cast(off_m, tl.int64) * stride_om + off_n
                _put_part(c0, out_tile, rows_left, cols_left, stride_om, BLOCK_M, HALF)
                _put_part(c1, out_tile + HALF, rows_left, cols_left - HALF, stride_om, BLOCK_M, HALF)
        else:  # the last peer tile's flag (its stores landed during this main loop), then this tile into slot me
            if pending >= 0:  # of the owner's receive buffer; its flag waits for the next main loop
                _set_flag(flags_ptr, me, flag_stride, pending, epoch, pending_pe)
            _put_part(c0, parts + base, rows_left, cols_left, N, BLOCK_M, HALF)
            _put_part(c1, parts + base + HALF, rows_left, cols_left - HALF, N, BLOCK_M, HALF)
            pending = t
            pending_pe = owner_pe
    if pending >= 0:
        _set_flag(flags_ptr, me, flag_stride, pending, epoch, pending_pe)


_GEMM_RS = CachedLaunch(_gemm_rs_kernel)  # compiled kernels by config and dtype (module-level, like Triton's cache)


def _check(what, a, b, group, workspace):
    team = team_of(group, what)
    check_operands(what, a, b)
    ctx = tilecomm.current()
    if a.device.type != ctx.device.type:
        raise ValueError(f"{what}: a is on {a.device}; the runtime's tensors are on {ctx.device}")
    M, N, W = a.shape[0], b.shape[1], team.size
    if M % W:
        raise ValueError(f"{what}: a has {M} rows; M must be a multiple of the group size ({W})")
    if N >= 1 << 23:  # in-tile offsets are int32: BLOCK_M * N < 2**31
        raise ValueError(f"{what}: b has {N} columns; at most {(1 << 23) - 1} are supported")
    if workspace is not None:
        if not isinstance(workspace, GemmRsWorkspace) or workspace.team.ranks != team.ranks:
            raise ValueError(f"{what}: workspace must be a GemmRsWorkspace made for this group, got {workspace!r}")
        if (N, a.dtype) != (workspace.N, workspace.dtype) or M // W > workspace.max_rows:
            raise ValueError(f"{what}: output [{M // W}, {N}] {a.dtype} does not fit the workspace (N={workspace.N}, "
                             f"{workspace.dtype}, up to max_rows={workspace.max_rows} rows)")
    return team


def gemm_rs(a: torch.Tensor, b: torch.Tensor, group=None, workspace: GemmRsWorkspace | None = None,
            config=None) -> torch.Tensor:
    """This rank's [M/W, N] row block of the sum over `group`'s W ranks of a @ b (fp32 reduction of the
    partial tiles). b may be row- or column-major. workspace: a GemmRsWorkspace for this group, N and
    dtype (None: a temporary one, made and freed in the call; slower). config: the fused kernel's tiles
    (tiles.resolve_config): push="kernel" every tile; push="copy" runs cuBLAS (with FUSED_OWN_BLOCK, the
    own block's tiles are the fused kernel's).
    Collective over the group (None: the world)."""
    what = "tilecomm.overlap.gemm_rs"
    team = _check(what, a, b, group, workspace)
    (M, K), N, W = a.shape, b.shape[1], team.size
    mb = M // W
    ws = workspace or GemmRsWorkspace(N, a.dtype, max(mb, 1), group)
    out = torch.empty((mb, N), dtype=a.dtype, device=a.device)
    if mb and N and K:  # (every member has the same shapes: the workspace compares the calls')
        epoch = ws.begin(("gemm_rs", M, K, N, str(a.dtype)))
        if ws.push == "copy":
            _gemm_then_copy(a, b, out, ws, epoch, team, config)
        else:
            _launch(a, b, out, ws, epoch, team, config)
            release(ws, team)
    else:  # nothing moves: no epoch is spent, so the parity argument of the module docstring holds
        out.zero_()
    if workspace is None:
        ws.free()
    return out


@tilecomm.jit(do_not_specialize=["epoch"])
def _add_slots_kernel(recv_ptr, out_ptr, flags_ptr, epoch, me, W, numel, slot_stride, flag_stride,
                      BLOCK: tl.constexpr):
    """push="copy": out[i] += the other members' slots' element i, members me + 1, me + 2, ... in turn (fp32; recv
    [W, slot_stride] of this call's parity), for this program's BLOCK elements, once every other member's flag
    says its block of this call has landed (the block in one chunk: flag[src, 0])."""
    g = _wait_parts(flags_ptr, me, W, flag_stride, 0, epoch)
    offs = tl.cast(tl.program_id(0), tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(out_ptr + offs, mask=mask, other=0).to(tl.float32)
    for s in range(1, W):  # (g == me: the loads below depend on the waits)
        slot = recv_ptr + tl.cast((g + s) % W, tl.int64) * slot_stride
        acc += tl.load(slot + offs, mask=mask, other=0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_ADD_SLOTS = CachedLaunch(_add_slots_kernel)
_ADD_BLOCK = 4096  # elements per program of _add_slots_kernel
# push="copy" at W > 1: True: the own block and the sum of the slots in the fused kernel (its own tiles,
# WAIT_LATE); False: cuBLAS's GEMM of the own block, then _add_slots_kernel (module docstring; the faster one
# measured for 8192x3584x4096: on 2 H200s 372.9 µs against 402.2, on 4 H200s 390.2 against 405.7, BENCHMARKS.md)
FUSED_OWN_BLOCK = False


def _gemm_then_copy(a, b, out, ws: GemmRsWorkspace, epoch: int, team, config) -> None:
    """push="copy" (module docstring): member d's block a[d rows] @ b into the stage, then by the copy engine
    into slot me of d's recv (this call's parity), a row chunk at a time with d's flag[me, chunk] written behind
    each, members me + 1, me + 2, ... in turn; then the own block and the other members' slots summed into out
    (FUSED_OWN_BLOCK: in the fused kernel's own tiles, each waiting for its rows' chunk; else cuBLAS, then the add
    pass, the block in one chunk; at W = 1 the own block is the whole sum)."""
    (M, _), N, W, me = a.shape, b.shape[1], team.size, team.index
    mb, parity = M // W, epoch % 2
    slot_bytes, row_bytes = ws.max_rows * N * a.element_size(), N * a.element_size()
    fused = FUSED_OWN_BLOCK and W > 1
    chunk_rows = copy_chunk_rows(mb) if fused else mb
    main = torch.cuda.current_stream(a.device) if ws.stream is not None else None
    for k in range(1, W):
        d = (me + k) % W
        block = ws.stage[k - 1, :mb]
        torch.mm(a[d * mb:(d + 1) * mb], b, out=block)
        if main is not None:  # the copy after the block's GEMM, beside the next block's
            ws.computed[k - 1].record(main)
            ws.stream.wait_event(ws.computed[k - 1])
        for c, row in enumerate(range(0, mb, chunk_rows)):
            ws.issuer.copy(ws.peer_recv_addr[d] + (parity * W + me) * slot_bytes + row * row_bytes,
                           block.data_ptr() + row * row_bytes, min(chunk_rows, mb - row) * row_bytes)
            ws.issuer.write(ws.peer_flags_addr[d] + 8 * (me * COPY_CHUNKS + c), epoch)
    if W == 1:  # nothing to add: the own block is the whole sum
        torch.mm(a, b, out=out)
    elif fused:
        _launch(a, b, out, ws, epoch, team, config, own_only=True)
    else:
        torch.mm(a[me * mb:(me + 1) * mb], b, out=out)
        _ADD_SLOTS.launch_keyed((cdiv(mb * N, _ADD_BLOCK),), ws.recv[parity], out, ws.flags, epoch, me, W, mb * N,
                                ws.max_rows * N, COPY_CHUNKS, BLOCK=_ADD_BLOCK)
    if main is not None:  # the stage is free again (and the caller's stream past this call) once the copies are
        ws.pushed.record(ws.stream)
        main.wait_event(ws.pushed)


def _launch(a, b, out, ws: GemmRsWorkspace, epoch: int, team, config, own_only: bool = False) -> None:
    """The fused kernel: push="kernel", every tile (module docstring); own_only (push="copy"), the own block's
    tiles, each adding the other members' slots of this call's parity after its main loop, once the members'
    flags of its rows' chunk (copy_chunk_rows) hold the call's epoch."""
    (M, K), N, W, me = a.shape, b.shape[1], team.size, team.index
    mb = M // W
    a_t, _ = tma_operand(a)
    bt, b_trans = tma_operand(b, allow_trans=True)
    cfg = resolve_config(config, mb, N, a.dtype, a.device, lambda cfg: matmul(a_t[:mb], b, cfg))
    per_owner = cdiv(mb, cfg.BLOCK_M) * cdiv(N, cfg.BLOCK_N)
    if own_only:
        recv, consumed = ws.recv[epoch % 2], ws.flags  # (consumed: unread)
        flag_stride, flag_span = COPY_CHUNKS, copy_chunk_rows(mb)
        ranges = [((W - 1) * per_owner, W * per_owner)]
    else:
        recv, flag_span, consumed = ws.recv, 1, ws.consumed
        flag_stride = cdiv(ws.max_rows, MIN_BLOCK) * cdiv(N, MIN_BLOCK)
        # GPUs: one launch over every tile; CPU ranks: peer tiles, then own tiles (see the module docstring)
        own = ((W - 1) * per_owner, W * per_owner)
        ranges = [(0, W * per_owner)] if a.is_cuda else [(0, own[0]), own]
    for begin, end in ranges:
        if end > begin:
            launch_gemm(_GEMM_RS, end - begin, cfg, a_t, bt, out, recv, ws.flags, consumed, team.pes, epoch,
                        mb, N, K, me, W, begin, end, a_t.stride(0), bt.stride(0), out.stride(0), recv.stride(0),
                        flag_stride, flag_span, B_TRANS=b_trans, C_TMA=out.stride(0) * out.element_size() % 16 == 0,
                        PRECISION=dot_precision(a.dtype), WAIT_LATE=own_only)


def gemm_rs_reference(a: torch.Tensor, b: torch.Tensor, group=None) -> torch.Tensor:
    """torch.matmul + torch.distributed.reduce_scatter_tensor (sum) over `group` (None: the world);
    pass float64 operands for a float64 reference."""
    world = dist.get_world_size(group)
    full = a @ b
    out = torch.empty((a.shape[0] // world, b.shape[1]), dtype=full.dtype, device=full.device)
    # torch >= 2.13 names it reduce_scatter_single (same signature) and deprecates the old name
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, full.contiguous(), group=group)
    return out
