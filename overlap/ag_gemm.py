"""ag_gemm: C = all_gather(A) @ B with the gather hidden behind the GEMM.

    a_shard [m, K] on every member of the team (member r holds rows r*m ... (r+1)*m - 1 of A),
    b [K, n] -> C [W*m, n]; the team is a torch.distributed group (default: the world) of W ranks

Member me puts its shard into slot me of every other member's symmetric gather buffer (and of its own where its
GEMM reads the own shard from there: push="kernel", OWN_SHARD="copied") and SETs that member's flag to the call's
epoch, members in the order they read it; the GEMM computes the own shard's rows first, then shard me+1, me+2,
..., each once its flag is set.
Two ways (`AgGemmWorkspace.push`):

* "copy" (every member directly reachable: NVLink peers, CPU ranks). On the workspace's stream the copy engine
  moves the shard into each peer's heap, one memcpy per member by address (a StreamIssuer made with the
  workspace; padded gather rows go through torch's strided copy_), each followed by the member's flag as a stream
  write (tilecomm.stream_ops): no SM is taken from the GEMM. On the caller's stream, the own shard's rows of C
  are one cuBLAS GEMM (torch.mm, reading the shard in place) while the first copies land, then one persistent
  TMA GEMM (below) computes the W - 1 peer shards' rows, each tile once its shard's flag is set.
  Measured on 4 H200s (BENCHMARKS.md, 2026-11-27): feeding the fused GEMM all W shards (own one included) took
  the small shape 8192x4096x3584 to 1.19x cuBLAS, the large one to 1.07x; one cuBLAS GEMM per shard, each behind
  a wait kernel, to 1.23x / 1.13x. This form: 1.07x / 1.05x on 2 H200s, 1.24x / 1.09x on 4 (2026-11-27 from
  21:01 UTC): at W = 4 the small shape's W row-block GEMMs alone cost 1.20x the whole one (the persistent GEMM
  alone read 1.11x cuBLAS there, an artefact of timing cuBLAS first: 0.97-1.00x timed in turn, 2026-11-28).
  The other form of the own shard (`OWN_SHARD`, by default chosen per call by `own_shard_form`): "in_place", one
  persistent GEMM over all W shards whose own shard's tiles come first and read a_shard itself (no copy, no wait;
  the one wave tail of the whole product instead of the cuBLAS GEMM's and the peer shards' two), taken where
  it runs fewer waves of tiles: on 2 H200s at 448 tiles a shard, 1.10x cuBLAS against 1.25x (2026-11-28).
  ("copied", for comparison: the copy engine copies the own shard into its gather slot too, and the GEMM waits for
  that copy before its first tile: 1.18x at W = 1.)
* "kernel" (TILECOMM_TRANSPORT=nvshmem, or a member without a load/store mapping): a push kernel, a few
  programs per member, tcl.put row by row and tcl.signal per row tile, puts the shard into every member's gather
  slot, its own included (a put at distance 0: the own shard takes the path a peer's does), and one persistent
  GEMM computes all W shards' rows from the gather buffer: tiles in ring order, own shard first, then shards
  me+1, me+2, ...; before a tile it waits for that row tile's flag, so the first tiles compute while later ones
  are still arriving. The push programs must hold SMs before the persistent GEMM takes them all (the GEMM
  waits for their flags). On sm_90+ GPUs the push goes on the caller's stream and the GEMM is launched as its
  programmatic dependent (PDL): every push program first calls gdc_launch_dependents, so no GEMM program starts
  before every push program has, and each GEMM program ends with gdc_wait, so what follows on the stream is
  ordered after both. (Elsewhere: the workspace's stream, queued before the GEMM, which only the GPU's launch
  order keeps first.) On CPU ranks the push runs first, then the GEMM.

The persistent GEMM (`_gemm_kernel`, the TMA tile GEMM of tiles.py) reads every shard through one descriptor of
the gather buffer [W, m, K] made once per program ("in_place": the own shard through one of a_shard); a flag
covers `flag_rows` rows of a member's shard (copy: the whole shard; kernel: one row tile).

The gather buffer is double-buffered by call parity, so no call waits for the members to have read the last
one: call e + 1 writes the buffer call e - 1 used, and it starts (the push stream waits for the current one)
after this rank's call e, which could only finish once every member's call e push had come, each issued after
that member's call e - 1 GEMM. A call with nothing to move spends no epoch. Kernels see team indices;
`pes_ptr` maps them to PEs (team.py). The buffers live in an `AgGemmWorkspace` made up front (layers make
theirs in `__init__`); without one, the call makes a temporary workspace and frees it. `ag_gemm_reference` is
the torch version tests use.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import triton.language as tl

import tilecomm
import tilecomm.language as tcl
from tilecomm.jit import CachedLaunch, cdiv, pdl_available

from tilecomm import stream_ops

from .team import OpWorkspace, team_of, workspace_team
from .tiles import (b_desc3, c_desc3, check_operands, desc3, dot_precision, launch_gemm, matmul, num_programs,
                    resolve_config, store_tile, tile_position, tile_product, tma_operand)

MIN_BLOCK_M = 16  # flags are sized for the smallest row tile any config uses
_PUSH_PROGRAMS = 8  # push="kernel": programs per peer
# push="copy", the own shard's rows (module docstring): "cublas" (one cuBLAS GEMM, the persistent GEMM over the
# peer shards), "in_place" (the persistent GEMM over every shard, the own one read from a_shard with no wait),
# "copied" (the copy engine also copies the own shard into its gather slot, then the persistent GEMM over every
# shard: the form of 2026-11-27 before bc42dae, kept for tests/copy_push_probe.py to compare) or "auto"
# (`own_shard_form`: "in_place" where it runs fewer waves of tiles than "cublas", else "cublas")
OWN_SHARD = "auto"
OWN_SHARD_FORMS = ("auto", "cublas", "in_place", "copied")


def own_shard_form(m: int, N: int, W: int, cfg, device: torch.device) -> str:
    """OWN_SHARD="auto"'s choice for shards of m rows and N columns over W members: "in_place" where one persistent
    GEMM over the W shards runs fewer waves of cfg's tiles (one per program, programs = SMs) than "cublas"'s two
    GEMMs, the own shard then the W - 1 others, each with a wave tail of its own; else "cublas" (cuBLAS's GEMM of
    the own shard ran 1-3% faster than our tiles, tests/copy_push_probe.py). On 2 H200s (2026-11-28, µs against
    cuBLAS's whole GEMM timed in turn), the four shapes agree with it: m = 4096, N = 3584, K = 4096 (448 tiles a
    shard, 4 + 4 waves against 7): "in_place" 1.102 against "cublas" 1.246; N = 7168 with K = 4096 or 8192 and
    N = 14336 with K = 8192 (equal waves): "cublas" 1.064 / 1.012 / 1.020 against 1.051 / 1.030 / 1.042."""
    tiles = cdiv(m, cfg.BLOCK_M) * cdiv(N, cfg.BLOCK_N)
    slots = num_programs(1 << 30, device, cfg.PROGRAMS_PER_SM)  # (the grid of a product of enough tiles)
    return "in_place" if cdiv(tiles, slots) + cdiv((W - 1) * tiles, slots) > cdiv(W * tiles, slots) else "cublas"


class AgGemmWorkspace(OpWorkspace):
    """Symmetric buffers of ag_gemm over `group` for shards of up to `max_rows` rows of `K` columns of
    `dtype` (collective over the world): gather [2, W, max_rows, K rounded up to 16 bytes] (by call parity),
    flags [W * max_rows / 16]. push: "copy", "kernel" (module docstring) or "auto" ("copy" where every member
    is directly reachable and stream writes work, else "kernel"; the choice is in `self.push`)."""

    def __init__(self, K: int, dtype: torch.dtype, max_rows: int, group=None, push: str = "auto"):
        team, push = workspace_team("AgGemmWorkspace", group, push, K=K, max_rows=max_rows)
        self.K, self.dtype, self.max_rows, self.push = K, dtype, max_rows, push
        super().__init__(team, "tilecomm.overlap.ag_gemm", self.specs(K, dtype, max_rows, team.size))
        # push="copy": every member's gather buffer and flags (this rank's own too), as local views of its heap
        members = range(team.size) if push == "copy" else []
        self.peer_gather = {i: tilecomm.peer(self.gather, team.ranks[i]) for i in members}
        self.peer_flags = {i: tilecomm.peer(self.flags, team.ranks[i]) for i in members}
        self.stream = torch.cuda.Stream(self.gather.device) if self.gather.is_cuda else None
        # the push's copies and flags by address (_push_by_copy), and the two events that order the streams
        self.issuer = stream_ops.StreamIssuer(self.gather.device, self.stream) if push == "copy" else None
        self.peer_gather_addr = {i: t.data_ptr() for i, t in self.peer_gather.items()}
        self.peer_flags_addr = {i: t.data_ptr() for i, t in self.peer_flags.items()}
        self.queued, self.pushed = (torch.cuda.Event(), torch.cuda.Event()) if self.stream is not None else (None, None)
        # push="kernel" on sm_90+: the push on the caller's stream, the GEMM its programmatic dependent
        self.pdl = push == "kernel" and pdl_available(self.gather.device)

    @staticmethod
    def specs(K: int, dtype: torch.dtype, max_rows: int, W: int) -> dict:
        pad = 16 // torch.empty((), dtype=dtype).element_size()
        return {"gather": ((2, W, max_rows, cdiv(K, pad) * pad), dtype, False),
                "flags": ((W * cdiv(max_rows, MIN_BLOCK_M),), torch.int64, True)}

    @classmethod
    def heap_bytes(cls, K: int, dtype: torch.dtype, max_rows: int, W: int) -> int:
        """Symmetric heap bytes of AgGemmWorkspace(K, dtype, max_rows) over a group of W ranks, on each rank."""
        return cls.heap_bytes_of(cls.specs(K, dtype, max_rows, W))


@tilecomm.jit(do_not_specialize=["epoch"])
def _push_kernel(a_ptr, gather_ptr, flags_ptr, pes_ptr, epoch, m, K, stride_gm, slot_stride, flag_stride, me, W,
                 BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    """push="kernel": program (j, i) puts row tiles i, i + P, ... of the shard to the member that reads it at
    its step j (j = 0: this member, at distance 0) and SETs that member's flag of each tile (one per row tile)."""
    if PDL:  # the GEMM, launched as its dependent, may start once every program of this grid has
        tl.extra.cuda.gdc_launch_dependents()
    dest = (me + W - tl.program_id(0)) % W  # team index; it reads this shard at its step program_id(0)
    dest_pe = tl.load(pes_ptr + dest)
    slot = gather_ptr + tl.cast(me, tl.int64) * slot_stride
    for tile in range(tl.program_id(1), tl.cdiv(m, BLOCK_M), tl.num_programs(1)):
        for r in range(tile * BLOCK_M, tl.minimum(m, (tile + 1) * BLOCK_M)):
            tcl.put(slot + tl.cast(r, tl.int64) * stride_gm, a_ptr + tl.cast(r, tl.int64) * K, K, dest_pe)
        tcl.signal(flags_ptr + me * flag_stride + tile, epoch, dest_pe, tcl.SIGNAL_SET)


@tilecomm.jit(do_not_specialize=["epoch"])
def _gemm_kernel(gather_ptr, own_ptr, b_ptr, c_ptr, flags_ptr, epoch, m, N, K, me, W, first_step, stride_gm, stride_om,
                 slot_stride, flag_stride, flag_rows, stride_b, stride_cm, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr,
                 WARP_SPECIALIZE: tl.constexpr, B_TRANS: tl.constexpr, C_TMA: tl.constexpr, PRECISION: tl.constexpr,
                 PDL: tl.constexpr, OWN_IN_PLACE: tl.constexpr):
    """C's rows of shards me + first_step, me + first_step + 1, ... (mod W), read from the gather buffer, each
    tile once the flag of its rows (flag_rows rows per flag) holds the call's epoch. OWN_IN_PLACE (first_step
    0): the own shard's tiles come first and read own_ptr (the caller's shard, row stride stride_om) with no
    wait, in matmul's flattened loop; the tile numbering is the same, so the peer tiles follow on each program
    as if one loop ran (one wave tail for the whole product)."""
    a_desc = desc3(gather_ptr, W, m, K, slot_stride, stride_gm, BLOCK_M, BLOCK_K)  # every slot, made once
    # one group: any aligned group stride will do
    b_desc = b_desc3(b_ptr, 1, K, N, tl.cast(K + N, tl.int64) * stride_b, stride_b, BLOCK_K, BLOCK_N, B_TRANS)
    c_desc = c_desc3(c_ptr, W, m, N, tl.cast(m, tl.int64) * stride_cm, stride_cm, BLOCK_M, BLOCK_N // EPILOGUE_SPLIT,
                     C_TMA)
    tiles_m = tl.cdiv(m, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_shard = tiles_m * tiles_n
    start = tl.program_id(0)
    if OWN_IN_PLACE:
        own_desc = desc3(own_ptr, 1, m, K, tl.cast(m, tl.int64) * stride_om, stride_om, BLOCK_M, BLOCK_K)
        for tile in tl.range(start, per_shard, tl.num_programs(0), flatten=not WARP_SPECIALIZE,
                             warp_specialize=WARP_SPECIALIZE):
            pid_m, pid_n = tile_position(tile, tiles_m, tiles_n, GROUP_M)
            acc = tile_product(own_desc, 0, pid_m * BLOCK_M, b_desc, 0, pid_n * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                               B_TRANS, PRECISION)
            store_tile(c_desc, me, c_ptr + tl.cast(me, tl.int64) * m * stride_cm, stride_cm, m, N, acc,
                       pid_m * BLOCK_M, pid_n * BLOCK_N, BLOCK_M, BLOCK_N, EPILOGUE_SPLIT, C_TMA)
        # this program's first tile past the own shard's
        start += tl.cdiv(tl.maximum(per_shard - start, 0), tl.num_programs(0)) * tl.num_programs(0)
    for tile in range(start, (W - first_step) * per_shard, tl.num_programs(0)):
        src = (me + first_step + tile // per_shard) % W
        pid_m, pid_n = tile_position(tile % per_shard, tiles_m, tiles_n, GROUP_M)
        flag = flags_ptr + src * flag_stride + pid_m * BLOCK_M // flag_rows
        tok = tcl.wait(flag, epoch, tcl.CMP_GE)  # the push's flag of these rows
        g = tcl.proxy_fence(tcl.consume_token(src, tok))  # TMA reads see the pushed data
        acc = tile_product(a_desc, g, pid_m * BLOCK_M, b_desc, 0, pid_n * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                           B_TRANS, PRECISION)
        store_tile(c_desc, src, c_ptr + tl.cast(src, tl.int64) * m * stride_cm, stride_cm, m, N, acc,
                   pid_m * BLOCK_M, pid_n * BLOCK_N, BLOCK_M, BLOCK_N, EPILOGUE_SPLIT, C_TMA)
    if PDL:  # the push this grid trails has ended too: what follows on the stream is ordered after both
        tl.extra.cuda.gdc_wait()


# The kernels' launchers (compiled kernels by config and dtype; module-level like Triton's own kernel cache).
_PUSH = CachedLaunch(_push_kernel)
_GEMM = CachedLaunch(_gemm_kernel)


def _check(what: str, a_shard, b, group, workspace):
    team = team_of(group, what)
    check_operands(what, a_shard, b, "a_shard", "b")
    ctx = tilecomm.current()
    if a_shard.device.type != ctx.device.type:
        raise ValueError(f"{what}: a_shard is on {a_shard.device}; the runtime's tensors are on {ctx.device}")
    if workspace is not None:
        if not isinstance(workspace, AgGemmWorkspace) or workspace.team.ranks != team.ranks:
            raise ValueError(f"{what}: workspace must be an AgGemmWorkspace made for this group, got {workspace!r}")
        m, K = a_shard.shape
        if (K, a_shard.dtype) != (workspace.K, workspace.dtype) or m > workspace.max_rows:
            raise ValueError(f"{what}: a_shard {tuple(a_shard.shape)} {a_shard.dtype} does not fit the workspace "
                             f"(K={workspace.K}, {workspace.dtype}, up to max_rows={workspace.max_rows} rows)")
    return team


def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, return_gathered: bool = False, group=None,
            workspace: AgGemmWorkspace | None = None, config=None):
    """all_gather(a_shard) @ b over `group`'s W ranks, rows in group-rank order: [W*m, n]. With
    return_gathered, also the gathered A [W*m, K] (a copy). b may be row- or column-major. workspace:
    an AgGemmWorkspace for this group, K and dtype (None: a temporary one, made and freed in the call;
    slower). config: the persistent GEMM's tiles (tiles.resolve_config): every shard under push="kernel",
    the peer shards under push="copy" (the own shard is cuBLAS's unless OWN_SHARD says otherwise). Collective over
    the group (None: the world)."""
    what = "tilecomm.overlap.ag_gemm"
    team = _check(what, a_shard, b, group, workspace)
    if OWN_SHARD not in OWN_SHARD_FORMS:
        raise ValueError(f"{what}: ag_gemm.OWN_SHARD = {OWN_SHARD!r}; expected one of {OWN_SHARD_FORMS}")
    (m, K), N, W, me = a_shard.shape, b.shape[1], team.size, team.index
    ws = workspace or AgGemmWorkspace(K, a_shard.dtype, max(m, 1), group)
    c = torch.empty((W * m, N), dtype=a_shard.dtype, device=a_shard.device)
    gathered = None
    if m and N and K:  # (every member has the same m: the workspace compares the calls' shapes)
        epoch = ws.begin(("ag_gemm", m, K, N, str(a_shard.dtype)))
        _launch(a_shard, b, c, ws, epoch, team, config)
        if return_gathered:
            gathered = ws.gather[epoch % 2, :, :m, :K].reshape(W * m, K).clone()
            gathered[me * m:(me + 1) * m] = a_shard  # the own shard never goes through the buffer
    else:  # nothing moves: no epoch is spent, so the parity argument of the module docstring holds
        c.zero_()
        if return_gathered:  # m == 0: empty; K == 0 or N == 0: the shards did not move, A is not gathered
            if m and K:
                raise ValueError(f"{what}: return_gathered with n == 0 is not supported (nothing is gathered)")
            gathered = torch.empty((W * m, K), dtype=a_shard.dtype, device=a_shard.device)
    if workspace is None:
        ws.free()
    return (c, gathered) if return_gathered else c


def _push_by_copy(a_shard: torch.Tensor, ws: AgGemmWorkspace, epoch: int, team, first_step: int) -> None:
    """Copy engine, on the workspace's stream: the shard into the gather slot of the members that read it at steps
    first_step, ..., W - 1 (step 0: this member), in that order, each copy followed by the member's flag (word 0
    of this shard's flags). Unpadded rows (gather row = K columns) go by address through ws.issuer, one memcpy per
    member; padded rows through torch's strided copy_ into the member's heap view."""
    (m, K), W, me = a_shard.shape, team.size, team.index
    flag_stride = cdiv(ws.max_rows, MIN_BLOCK_M)
    row = K * a_shard.element_size()  # bytes of a row in a_shard (contiguous) and, unpadded, in a slot
    slot_bytes = ws.max_rows * row  # (unpadded) one member's slot of the gather buffer [2, W, max_rows, K]
    for step in range(first_step, W):
        dest = (me - step) % W  # reads this shard at its step `step`
        if ws.gather.shape[-1] == K:
            ws.issuer.copy(ws.peer_gather_addr[dest] + ((epoch % 2) * W + me) * slot_bytes, a_shard.data_ptr(),
                           m * row)
            ws.issuer.write(ws.peer_flags_addr[dest] + me * flag_stride * 8, epoch)
            continue
        with torch.cuda.stream(ws.stream) if ws.stream is not None else contextlib.nullcontext():
            ws.peer_gather[dest][epoch % 2, me, :m, :K].copy_(a_shard, non_blocking=True)
            stream_ops.write_word(ws.peer_flags[dest][me * flag_stride], epoch, ws.stream)


def _launch(a_shard, b, c, ws: AgGemmWorkspace, epoch: int, team, config) -> None:
    """The push and the GEMMs of one call (module docstring). The push goes on the workspace's stream, after
    what the caller queued, except a PDL push and a push kernel with no other member (those go first on the
    caller's stream); a call with nothing to copy queues nothing there."""
    (m, K), W, me = a_shard.shape, team.size, team.index
    pdl = ws.push == "kernel" and ws.pdl
    own = OWN_SHARD if ws.push == "copy" else "copied"  # (the push kernel puts the own shard too: distance 0)

    def tiles_for(rows: int):  # the persistent GEMM's config for `rows` rows of C
        return resolve_config(config, rows, b.shape[1], a_shard.dtype, a_shard.device,
                              lambda cfg: matmul(a_shard, b, cfg))
    cfg = tiles_for(W * m)  # every shard's rows (all but the "cublas" form)
    if own == "auto":
        own = own_shard_form(m, b.shape[1], W, cfg, a_shard.device)
    first_step = 1 if own == "cublas" else 0
    if first_step:
        cfg = tiles_for(max(W - 1, 1) * m)
    # the steps the push copies: none of the own shard's unless "copied"
    push_from = 0 if own == "copied" else 1
    side_stream = ws.stream is not None and not pdl and (W > 1 if ws.push == "kernel" else W > push_from)
    if side_stream:
        ws.queued.record(torch.cuda.current_stream(a_shard.device))  # the push after what the caller queued
        ws.stream.wait_event(ws.queued)
    g = ws.gather[epoch % 2]
    if ws.push == "copy":
        _push_by_copy(a_shard, ws, epoch, team, push_from)
        if own == "cublas":
            torch.mm(a_shard, b, out=c[me * m:(me + 1) * m])  # cuBLAS, while the first copies land
        flag_rows = m  # one flag per shard
    else:
        with torch.cuda.stream(ws.stream) if side_stream else contextlib.nullcontext():
            _PUSH.launch((W, min(cdiv(m, cfg.BLOCK_M), _PUSH_PROGRAMS)), (a_shard.dtype, cfg.BLOCK_M, pdl), a_shard,
                         g, ws.flags, team.pes, epoch, m, K, g.stride(1), g.stride(0), cdiv(ws.max_rows, MIN_BLOCK_M),
                         me, W, BLOCK_M=cfg.BLOCK_M, PDL=pdl)
        flag_rows = cfg.BLOCK_M  # one flag per row tile
    if W > first_step:
        own_shard = tma_operand(a_shard)[0] if own == "in_place" else None
        _launch_gemm(g, own_shard, b, c, ws, epoch, team, cfg, first_step, flag_rows, pdl)
    if side_stream:  # the caller's stream past the push (a_shard is free once it has been copied)
        ws.pushed.record(ws.stream)
        torch.cuda.current_stream(a_shard.device).wait_event(ws.pushed)
        a_shard.record_stream(ws.stream)


def _launch_gemm(g, own_shard, b, c, ws: AgGemmWorkspace, epoch: int, team, cfg, first_step: int, flag_rows: int,
                 pdl: bool) -> None:
    """The persistent GEMM over shards me + first_step, ... from the gather buffer g [W, max_rows, K'], the own
    one from own_shard (TMA-aligned) when given."""
    N, W, m, K = b.shape[1], team.size, c.shape[0] // team.size, ws.K
    bt, b_trans = tma_operand(b, allow_trans=True)
    # (without OWN_IN_PLACE the kernel reads neither own_ptr nor stride_om: g and its row stride stand in)
    own, stride_om = (g, g.stride(1)) if own_shard is None else (own_shard, own_shard.stride(0))
    launch_gemm(_GEMM, (W - first_step) * cdiv(m, cfg.BLOCK_M) * cdiv(N, cfg.BLOCK_N), cfg, g, own, bt, c, ws.flags,
                epoch, m, N, K, team.index, W, first_step, g.stride(1), stride_om, g.stride(0),
                cdiv(ws.max_rows, MIN_BLOCK_M), flag_rows, bt.stride(0), c.stride(0), B_TRANS=b_trans,
                C_TMA=c.stride(0) * c.element_size() % 16 == 0, PRECISION=dot_precision(g.dtype), PDL=pdl,
                OWN_IN_PLACE=own_shard is not None, **({"launch_pdl": True} if pdl else {}))


def ag_gemm_reference(a_shard: torch.Tensor, b: torch.Tensor, group=None) -> torch.Tensor:
    """torch.distributed.all_gather_into_tensor over `group` (None: the world) + torch.matmul; pass
    float64 operands for a float64 reference."""
    world = dist.get_world_size(group)
    full = torch.empty((world * a_shard.shape[0], a_shard.shape[1]), dtype=a_shard.dtype, device=a_shard.device)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(full, a_shard.contiguous(), group=group)
    return full @ b
