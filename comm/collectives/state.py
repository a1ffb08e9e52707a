"""`CollectiveState`: everything the collectives keep between calls, created once by `tilecomm.init`.

Sized once, from the world size, the GPU's SM count and the workspace (or 1 program per peer on CPU ranks):

    programs_per_peer  P: two programs per SM where the workspace holds their rings (`programs_per_peer()`);
                       each call runs W * P programs (all_to_all, all_gather; reduce_scatter: W * P
                       output columns, each with one slot per writer, so W * W * P slots)
    chunk_bytes        bytes a program moves per step (one ring slot; reduce_scatter's: the power of two
                       at most 1/W of it, so its W times as many slots fit a ring of the same size)
    ring               uint8 [W * P * DEPTH * chunk_bytes] on the symmetric heap: all_to_all's and all_gather's
                       staging ring (pair slot pid's region on a rank is written by that slot's writer, which
                       pushes into it)
    rs_ring            the same for reduce_scatter (a ring of its own: its writers push into it while the
                       reader may still be in an all_to_all that reads its other ring)
    words              int64 [9 * W * P + 1] on the heap: meta [W * P, 4] (each pair slot's header: offset,
                       count, mode, tag; stored there by the slot's writer), then the ready and done
                       signal words and the epochs (each slot's call count, bumped by the kernels) [W * P] each,
                       a ticket counter (each program's index: the order programs start, _exchange.py), then
                       the receive headers [W * P, 2] (where the slot's reader takes its data, stored there by it)
    rs_words           int64 [7 * W * W * P + 1]: the same for reduce_scatter's slots (its own epochs), without
                       receive headers
    tables             int64 [SLOTS, 4 * W] pinned host memory: uneven split tables beyond TABLE_ARG_RANKS ranks
                       (up to that, an uneven call's counts are kernel arguments), read by the kernels
                       directly (no H2D copy), reused round-robin once the call that used a slot is done. (Copying
                       each call's table to device memory first was measured and dropped, 2026-11-26: on one H100
                       the copy added 17 GPU µs and 12-17 host µs to a 128-row uneven all_to_all, on 2 H100s it cut
                       the kernel from 35 to 18 µs but the call from 70 to 96 µs.)

`tma_push` / `tma_read` (sm_90+ GPUs; off by default, BENCHMARKS.md 2026-11-27 from 21:01 UTC): the pairs kernel's
writers push / readers copy a large pair's whole tiles of 256-byte rows by TMA (_copy.py), where a program's share
of the pair is at least `tma_min_bytes`; below it building the descriptors costs more than they move.
`direct` (off by default, BENCHMARKS.md 2026-11-27 from 22:51 UTC): DIRECT pairs where both ranks' outputs lie on the
heap (_exchange.py, steps 0 and 2).

Nothing is allocated per call (but a TMA call's descriptor scratch, Triton's: 128 bytes a descriptor and
program). `free()` (called by `tilecomm.finalize`) returns the heap space.
Any transfer size works: data streams through the ring. Calls are ordered on the current stream;
a call returns once its kernel is queued.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional, Tuple

import torch
import triton.language as tl

from ..errors import require
from ..jit import CachedLaunch, next_pow2, prepare_tma
from . import _exchange as kx, _reduce as kr

DEPTH = 2  # ring slots per pair slot: a writer pushes chunk i + 1 while its reader copies chunk i out
TABLE_SLOTS = 64
# Up to this many ranks an uneven all_to_all passes its element counts as kernel arguments (two 30-bit counts per
# int64: _exchange._packed_counts; each direction's total below 2^30 elements, else the table). Before, each of
# the W * P programs read its four table words from pinned host memory, ~1000 PCIe reads per call at world 4 (23
# GPU µs of a 264-program grid on one H100, against 2.4 from device memory, 2026-11-26); the uneven 128-row call
# went from 2.1x the even one's time to 1.4x (36.6 µs at world 4, 4 x H200, 2026-11-27, BENCHMARKS.md).
TABLE_ARG_RANKS = 8
_NO_TABLE_ARGS = (0,) * TABLE_ARG_RANKS  # t0..t7 of a launch that does not use them
_MARK = 1 << 62  # set in every packed count word (_exchange._packed_counts)
# GPU tuning, from tests/collective_sweep.py on 4 H200s (2026-11-26 afternoon, BENCHMARKS.md): two programs
# per SM (both kernels keep to 128 registers a thread, so two 256-thread programs share an SM's registers),
# 128 KiB chunks and 32 KiB steps (128 bytes in flight per thread). Against one program per SM: all_to_all
# 4096x7168 149 vs 166 µs, all_gather 8192^2 331 vs 353, reduce_scatter 429 vs 535 (NCCL 170, 357, 351).
# Two rings of 2 x 132 x DEPTH such chunks take 132 MiB of the workspace (the default GPU heap, 1 GiB, keeps
# a quarter of itself for them); a smaller workspace gets one program per SM before it gets smaller chunks.
_GPU_PROGRAMS_PER_SM = 2
# Two 256-thread programs share an SM's 64 K registers only at <= 128 registers a thread: ptxas is held to that
# (Triton's maxnreg). Left free, the GPU machine's ptxas gave the reduce_scatter kernel 184-198 registers (ncu,
# one H200, 2026-11-28; the sm_90 build of tests/gpu_compile.py gave 128): one program per SM, the grid in two
# waves. Held to 128 (no spills), the default reduce_scatter 8192^2 at world 1 took as long (154-162 µs), the one
# on a 16.5 MiB ring with L2 hints 136 against 187 µs (`bench self`, same machine).
PROGRAM_REGS = 128
_GPU_CHUNK_BYTES = 128 << 10
_CPU_CHUNK_BYTES = 256 << 10
_BLOCK_BYTES = 32 << 10
# With tma_push / tma_read, a pair moves by TMA where each of its P programs moves at least this much: bare TMA pushes
# (tests/a2a_engine_probe.py, 4 H200s) lost at 128x7168, a program's 7 KiB under one 8 KiB tile, and won at 4096x7168,
# 222 KiB a program (_copy.py).
TMA_MIN_BYTES = 64 << 10
# Element types moved bit for bit as an integer of the same width (all_to_all, all_gather).
_BITS = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


def _accumulator(dtype: torch.dtype):
    if dtype == torch.float64:
        return tl.float64
    if dtype.is_floating_point:
        return tl.float32
    return tl.int64


def ring_chunk_bytes(workspace_bytes: int, slots: int, chunk_bytes: int, step_bytes: int, depth: int = DEPTH) -> int:
    """Bytes per ring slot: at most chunk_bytes, with two rings of `slots` x depth slots within workspace_bytes,
    a multiple of 4 KiB; below one load step (step_bytes; CPU ranks move a chunk as one step), a power of
    two, so that a step (tl.arange: a power of two) is the whole chunk or divides it."""
    chunk = min(chunk_bytes, (workspace_bytes // (2 * slots * depth)) // 4096 * 4096)
    if 0 < chunk < step_bytes:
        chunk = 1 << (chunk.bit_length() - 1)
    return chunk


def programs_per_peer(sms: int, world: int, programs_per_sm: int, workspace_bytes: int, chunk_bytes: int,
                      step_bytes: int, depth: int = DEPTH) -> int:
    """P (the grid is world * P programs): programs_per_sm per SM where the workspace holds two rings of whole
    chunks for them, else the most programs per SM (at least one) that it does hold them for; with none,
    one per SM (and chunks as large as fit)."""
    for per_sm in range(programs_per_sm, 0, -1):
        P = max(1, per_sm * sms // world)
        if per_sm == 1 or ring_chunk_bytes(workspace_bytes, world * P, chunk_bytes, step_bytes, depth) == chunk_bytes:
            return P
    return 1


@dataclass
class CollectiveState:
    """See the module docstring. Made by `CollectiveState.create(ctx)` (collective: every rank)."""

    ctx: object
    programs_per_peer: int
    chunk_bytes: int
    block_bytes: int  # bytes per load/store step of a program
    ring: torch.Tensor
    rs_ring: torch.Tensor
    words: torch.Tensor
    rs_words: torch.Tensor
    tables: torch.Tensor
    num_warps: int
    depth: int  # ring slots per pair slot (DEPTH unless a sweep says otherwise)
    rs_stagger: bool  # reduce_scatter: odd columns reduce before they push (_reduce.py; on by default)
    table_arg_ranks: int = TABLE_ARG_RANKS  # uneven calls of up to this many ranks: counts as kernel arguments
    # the staged collectives: the ring's lines kept in L2 (evict_last: pushes into it and, in reduce_scatter, every
    # writer's chunk read) and the input's and output's streamed (evict_first), so that a ring slot is rewritten in
    # L2 instead of written back. Off by default (BENCHMARKS.md, 2026-11-28 from 12:22 UTC): at world 1 (one H200)
    # all_gather 8192^2 took 127.9 µs against 138.6 (and, on a 32 KiB ring, reduce_scatter 135.0 against 154.5),
    # but at world 2 (2 H200s, in turn with the default) every collective was 1-4% slower (all_gather 217.4-222.7
    # against 212.9-214.5 µs). Under ncu the world-1 all_gather with the hints on a 16.5 MiB ring moved one copy's
    # bytes through HBM (1.91 TB/s for 129 µs) and took as long as the default, which moves ~1.7 copies' (3.56 TB/s
    # for 130 µs): both pass every byte through L2 four times (input, ring in, ring out, output) at ~4.1 TB/s, about a
    # copy_'s rate, so a staged call costs ~1.9 copies whatever the ring's traffic to HBM
    ring_hints: bool = False
    # all_to_all / all_gather (16-byte aligned calls): the writers' pushes (tma_push) and the readers' copies
    # (tma_read) of a pair by TMA where each program's share is at least tma_min_bytes (TMA_MIN_BYTES; CPU tests set 0
    # to run the path on small pairs). Off by default: on 4 H200s (2026-11-27, tests/a2a_engine_probe.py, one run) an
    # all_to_all 4096x7168 bf16 took 163.1 µs staged, 174.4 with tma_push, 195.7 with both; in place 166.8, 161.4 with
    # tma_read (NCCL 184.2; the probe's bare TMA pushes, no protocol, 140.6)
    tma_push: bool = False
    tma_read: bool = False
    tma_min_bytes: int = TMA_MIN_BYTES
    # all_to_all / all_gather: DIRECT pairs (_exchange.py) where both ranks' outputs lie on the heap, the writer
    # storing straight into the reader's output (with tma_push: by TMA, one completion wait per program). Every rank
    # must agree (its readers announce where they take data: every rank creates its state with the same knobs). Off
    # by default: on 2 H200s (2026-11-27, vector stores, TMA waiting per chunk) it moved 4096x7168 no faster than
    # staging (112.4 against 107.7 µs), and one world-1 run of heap tensors read 1.40x a copy against 1.29 in place
    # on another machine; on 4 H200s (2026-11-28) it beat the in-place heap exchange by 2-3% (163.7 / 166.9 µs by
    # vector / TMA stores against 169.5) but not staging on ordinary tensors (158.3), and lost at 128 rows
    direct: bool = False
    # every collective: where a program's share of a pair takes several chunks, chunks of equal size (_exchange.
    # _chunk_size). Why: at world 1 a 4096x7168 bf16 all_to_all gives each of 264 programs 1.7 ring slots of data, so
    # 184 programs move two whole chunks and 80 one, and the kernel ends with the first group. Off by default: at
    # world 1 (one H200, 2026-11-28 from 09:55 UTC, tests/collective_sweep.py in turn with the default) it gained 1-4%
    # on that all_to_all and nothing measurable elsewhere; not timed on several GPUs yet
    balanced_chunks: bool = False
    # the staged collectives: a reader drops each ring chunk's L2 lines once it has read them (tcl.discard: dirty
    # lines leave L2 unwritten), so the ring costs no write-back to HBM: at world 1 a staged all_gather 8192^2 takes
    # two copies' time, as if the ring's bytes went to memory and back. Off by default: at world 1 (one H200,
    # 2026-11-28, three runs of `bench self`) all_gather 8192^2 136.9-138.8 µs against 137.3-142.4 without, and
    # reduce_scatter 148.2-156.9 against 156.0-162.4, within the runs' spread; not timed on several GPUs
    ring_discard: bool = False
    # reduce_scatter: every program records where its time went (waits for the writers' ready signals and for ring
    # slots, its push and reduce steps: _reduce.TRACE_FIELDS) in `trace_words`, read by reduce_scatter_trace(); a
    # diagnostic (tests/rs_trace.py), off by default: two clock reads a step. ncu cannot say this for a kernel that
    # waits on its peers: it replays the kernel alone
    trace: bool = False
    trace_words: Optional[torch.Tensor] = None
    # made once by create(): the two kernels' launchers, the heap as each element type reduce_scatter adds
    # (views made once), launch constexprs per (element size, alignment) and the launches bound to this
    # state's buffers (jit.BoundLaunch: a call converts only its own arguments), the ring's heap offset, the split
    # tables' slots (views, the event of the call that last used each, a NumPy view to fill them)
    _pairs: Optional[CachedLaunch] = None
    _reduce: Optional[CachedLaunch] = None
    _heap_views: dict = field(default_factory=dict)
    _configs: dict = field(default_factory=dict)
    _bound: dict = field(default_factory=dict)  # per (dtypes, key): the launch bound to the state's buffers
    _max_w: int = 1
    _ring_offset: int = 0
    _rs_ring_offset: int = 0
    _table_views: List[torch.Tensor] = field(default_factory=list)
    _table_events: List[Optional[torch.cuda.Event]] = field(default_factory=list)
    _tables_np: object = None
    _graph_tables: List[torch.Tensor] = field(default_factory=list)  # tables of captured calls, kept for replays
    _next_table: "itertools.count" = field(default_factory=itertools.count)
    _last_table: int = 0
    # fixed per runtime, read on every call: the heap's base address and size, the error record,
    # the all_to_all / all_gather grid, whether this is a CPU rank
    _heap_base: int = 0
    _heap_bytes: int = 0
    _error: Optional[torch.Tensor] = None
    _pairs_grid: Tuple[int] = (1,)
    _on_cpu: bool = True

    @classmethod
    def create(cls, ctx, workspace_bytes: int, programs_per_sm: int = _GPU_PROGRAMS_PER_SM, chunk_bytes: Optional[int] = None,
               block_bytes: int = _BLOCK_BYTES, depth: int = DEPTH, rs_stagger: bool = True,
               ring_hints: bool = False, tma_push: bool = False, tma_read: bool = False,
               direct: bool = False, balanced_chunks: bool = False, ring_discard: bool = False,
               trace: bool = False) -> "CollectiveState":
        """programs_per_sm, chunk_bytes, block_bytes, depth, rs_stagger, ring_hints, tma_push, tma_read, direct,
        balanced_chunks, ring_discard: the tuning knobs (GPU; the benchmarks sweep them; TMA needs sm_90+ on GPUs);
        trace: reduce_scatter's programs time their steps (reduce_scatter_trace). Collective: every rank passes the
        same knobs."""
        W, heap = ctx.world_size, ctx.heap
        on_gpu = ctx.backend == "cuda"
        require(not (on_gpu and (tma_push or tma_read)) or torch.cuda.get_device_capability(ctx.device)[0] >= 9,
                "CollectiveState.create: tma_push / tma_read need an sm_90+ GPU (TMA)", ValueError)
        if on_gpu:
            sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
            chunk = chunk_bytes or _GPU_CHUNK_BYTES
            P = programs_per_peer(sms, W, programs_per_sm, workspace_bytes, chunk, block_bytes, depth)
        else:
            P, chunk = 1, chunk_bytes or _CPU_CHUNK_BYTES
        chunk = ring_chunk_bytes(workspace_bytes, W * P, chunk, block_bytes if on_gpu else chunk, depth)
        smallest = next_pow2(4096 * W)
        require(chunk >= 4096 * W, f"TILECOMM_WORKSPACE_BYTES={workspace_bytes} is too small for {W} ranks: the "
                f"collectives need at least {2 * W * P * depth * smallest} bytes (two rings of {W * P} programs × "
                f"{depth} ring slots × {smallest} bytes: reduce_scatter's slots are 1/{W} of one)", MemoryError)
        slots = W * P

        def heap_tensor(shape, dtype):
            nbytes = torch.empty((), dtype=dtype).element_size()
            for s in shape:
                nbytes *= s
            return heap.view(heap.local, heap.alloc(nbytes), shape, dtype)

        ring = heap_tensor((slots * depth * chunk,), torch.uint8)
        rs_ring = heap_tensor((slots * depth * chunk,), torch.uint8)
        words = heap_tensor((9 * slots + 1,), torch.int64)
        words.zero_()
        rs_words = heap_tensor((7 * W * slots + 1,), torch.int64)
        rs_words.zero_()
        tables = torch.zeros((TABLE_SLOTS, 4 * W), dtype=torch.int64, pin_memory=on_gpu)
        dtypes = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                  torch.float32, torch.float64)
        return cls(ctx, P, chunk, block_bytes, ring, rs_ring, words, rs_words, tables, 8 if on_gpu else 1, depth,
                   rs_stagger, ring_hints=ring_hints, tma_push=tma_push, tma_read=tma_read, direct=direct,
                   balanced_chunks=balanced_chunks, ring_discard=ring_discard, trace=trace,
                   trace_words=torch.zeros((slots, kr.TRACE_WORDS), dtype=torch.int64, device=ctx.device)
                   if trace else None,
                   _pairs=CachedLaunch(kx._pairs_kernel), _reduce=CachedLaunch(kr._reduce_kernel),
                   _heap_views={d: heap.local.view(d) for d in dtypes}, _max_w=next_pow2(W),
                   _ring_offset=heap.offset_of(ring), _rs_ring_offset=heap.offset_of(rs_ring),
                   _table_views=[tables[i] for i in range(TABLE_SLOTS)],
                   _table_events=[None] * TABLE_SLOTS, _tables_np=tables.numpy(), _heap_base=heap.local.data_ptr(),
                   _heap_bytes=heap.local.numel() * heap.local.element_size(), _error=ctx.device_state.error, _pairs_grid=(W * P,), _on_cpu=not on_gpu)

    @classmethod
    def sizes_only(cls, backend: str, world: int, chunk_bytes: int, rs_stagger: bool = True,
                   max_w: Optional[int] = None) -> "CollectiveState":
        """A state that holds no memory, only what `_launch_config` reads (a ring chunk of chunk_bytes, the default
        step, warps and depth): the launch configs a real state of these sizes makes, for the sm_90 build's cases
        (tests/gpu_compile.py) and the size checks, without a runtime. Launching through it fails."""
        state = cls.__new__(cls)
        state.ctx = SimpleNamespace(backend=backend, world_size=world)
        state.chunk_bytes, state.block_bytes, state.num_warps, state.depth = chunk_bytes, _BLOCK_BYTES, 8, DEPTH
        state._configs, state._max_w, state.rs_stagger = {}, max_w or next_pow2(world), rs_stagger
        return state

    def free(self) -> None:
        """Return the heap space (finalize does it; the state is unusable afterwards)."""
        heap = self.ctx.heap
        for t in (self.ring, self.rs_ring, self.words, self.rs_words):
            if heap.local is not None:
                heap.release(heap.offset_of(t))
        self.ring = self.rs_ring = self.words = self.rs_words = self._error = None
        self._heap_views, self._bound = {}, {}

    # -- helpers ----------------------------------------------------------------------------------
    def _table(self, flat: List[int], capturing: bool) -> torch.Tensor:
        """A pinned split table for one call: flat = (offset, count) per peer, sent then received."""
        if capturing:
            table = torch.tensor(flat, dtype=torch.int64).pin_memory()  # lives as long as the graph may replay
            self._graph_tables.append(table)
            return table
        i = self._last_table = next(self._next_table) % TABLE_SLOTS
        event = self._table_events[i]
        if event is not None and not event.query():
            event.synchronize()  # only when the GPU is TABLE_SLOTS calls behind the host
        self._tables_np[i, : len(flat)] = flat
        return self._table_views[i]

    def _after_launch(self) -> None:
        """Mark the table slot _table just handed out as in use until the queued kernel has run (GPU, not
        capturing)."""
        i = self._last_table
        event = self._table_events[i] or torch.cuda.Event()
        event.record()
        self._table_events[i] = event

    def _placement(self, t: torch.Tensor, offsets_aligned: bool):
        """(heap offset in elements, on the heap): whether peers may address t (an input read in place, an output
        written straight into) because it lies on the heap and every piece a peer takes or puts starts on a
        16-byte boundary; else it goes through the ring. (t is contiguous and on the runtime's device: a pointer
        range check says whether it is on the heap.)"""
        if not offsets_aligned:
            return 0, False
        off = t.data_ptr() - self._heap_base
        if off < 0 or off % 16 or off + t.numel() * t.element_size() > self._heap_bytes or not t.numel():
            return 0, False
        return off // t.element_size(), True

    def _launch_config(self, key: tuple) -> dict:
        """The constexprs of a launch, made once per key: (kernel, element size, aligned, then the kernel's flags:
        EVEN, GATHER, IN_PLACE, OUT_HEAP, TABLE_ARGS, TMA_PUSH, TMA_READ for pairs, whose OPEN is the state's
        `direct`; OP, AVG, IN_PLACE, accumulator for reduce)."""
        config = self._configs.get(key)
        if config is None:
            kernel, elem, aligned = key[:3]
            # reduce_scatter: at most 1/W of a slot, a power of two (CPU ranks move a chunk as one block)
            rs_bytes = 1 << ((self.chunk_bytes // self.ctx.world_size).bit_length() - 1)
            chunk = (self.chunk_bytes if kernel == "pairs" else rs_bytes) // elem
            on_gpu = self.ctx.backend == "cuda"
            block = min(chunk, self.block_bytes // elem) if on_gpu else chunk
            config = dict(CHUNK=chunk, DEPTH=self.depth, BLOCK=block, VEC=16 // elem if aligned else 1,
                          BALANCED=self.balanced_chunks, DISCARD=self.ring_discard, num_warps=self.num_warps,
                          **({"maxnreg": PROGRAM_REGS} if on_gpu else {}))
            if kernel == "pairs":
                even, gather, in_place, out_heap, table_args, push, read = key[3:]
                config.update(EVEN=even, GATHER=gather, IN_PLACE=in_place, OPEN=self.direct, OUT_HEAP=out_heap,
                              TABLE_ARGS=table_args,
                              TMA_PUSH=push,
                              TMA_READ=read, MOVE=_BITS[elem], TAG=kx.op_tag(2 if gather else 1, elem),
                              STREAM="evict_first" if self.ring_hints else "",
                              KEEP="evict_last" if self.ring_hints else "")
            else:
                op, average, in_place, acc = key[3:]
                # a reduce step loads W writers' blocks at once and accumulates in fp32: half a step, and pushes of half
                # a step (within PROGRAM_REGS on sm_90 without spills: 8192 bf16 elements each, where pushes of 16384
                # spilled 136 bytes a thread; tests/gpu_compile.py builds these sizes). A quarter-step reduce (4096)
                # took the in-place reduce_scatter at world 1 from 83 to 104 µs (one H200, 2026-11-28)
                config.update(OP=op, ACC=acc, AVG=average, IN_PLACE=in_place, MAX_W=self._max_w,
                              TAG=kx.op_tag(3, elem), STAGGER=self.rs_stagger, TRACE=self.trace,
                              STREAM="evict_first" if self.ring_hints else "",
                              KEEP="evict_last" if self.ring_hints else "",
                              PUSH_BLOCK=max(block // 2, 1) if on_gpu else block,
                              BLOCK=max(block // 2, 1) if on_gpu else block)
            self._configs[key] = config
        return config

    # -- the collectives ----------------------------------------------------------------------------
    def exchange(self, src: torch.Tensor, out: torch.Tensor, splits: Optional[Tuple[List[int], List[int], int]],
                 n_even: int, gather: bool) -> None:
        """all_to_all / all_gather on contiguous tensors (any shape, elements of 1-8 bytes). splits: (rows sent
        to each peer, rows received from each, elements per row), or None with n_even elements per pair
        (offset p * n_even, or 0 for gather). Uneven calls of up to table_arg_ranks ranks pass the element counts
        as kernel arguments; beyond that, through a pinned table (`_table`)."""
        elem = src.element_size()
        even = splits is None
        capturing = table_args = False
        table, extra = self.words, _NO_TABLE_ARGS
        if even:  # offsets are multiples of n_even
            send_ok = recv_ok = n_even * elem % 16 == 0
        else:
            in_rows, out_rows, row = splits
            send_ok, recv_ok = _offsets_aligned(in_rows, row * elem), _offsets_aligned(out_rows, row * elem)
            table_args = (len(in_rows) <= min(self.table_arg_ranks, TABLE_ARG_RANKS)
                          and max(sum(in_rows), sum(out_rows)) * row < 1 << 30)
            if table_args:  # bit 62 set: every count word is an int64 argument (Triton types smaller ints i32)
                extra = (*(_MARK | o * row << 32 | i * row for i, o in zip(in_rows, out_rows)),
                         *_NO_TABLE_ARGS[len(in_rows):])
            else:
                capturing = not self._on_cpu and torch.cuda.is_current_stream_capturing()
                table = self._table(_split_table(in_rows, out_rows, row), capturing)
        in_heap_off, in_place = self._placement(src, send_ok)
        out_heap_off, out_heap = self._placement(out, recv_ok) if self.direct else (0, False)
        aligned = send_ok and recv_ok and (out.data_ptr() | src.data_ptr()) & 15 == 0
        push = read = False
        if self.tma_push or self.tma_read:  # (off by default: the common call computes nothing here)
            largest = n_even if even else max(max(in_rows), max(out_rows)) * row
            large = aligned and largest * elem >= self.programs_per_peer * self.tma_min_bytes
            push, read = self.tma_push and large, self.tma_read and large
            if push or read:
                prepare_tma()
        key = ("pairs", elem, aligned, even, gather, in_place, out_heap, table_args, push, read)
        bound = self._bound.get((src.dtype, out.dtype) + key)
        if bound is None:  # varying: src, out, the heap offsets, then the packed counts, or the table and n_even
            varying = (0, 1, 7, 8) + tuple(range(11, 11 + TABLE_ARG_RANKS)) if table_args else (0, 1, 4, 7, 8, 9)
            bound = self._bound[(src.dtype, out.dtype) + key] = self._pairs.bind(
                (src.dtype, out.dtype) + key,
                [src, out, self._heap_views[torch.uint8], self.words, table, self._error, self._ring_offset // elem,
                 in_heap_off, out_heap_off, n_even, self.programs_per_peer, *extra], varying,
                **self._launch_config(key))
        if table_args:
            bound.launch(self._pairs_grid, src, out, in_heap_off, out_heap_off, *extra)
        else:
            bound.launch(self._pairs_grid, src, out, table, in_heap_off, out_heap_off, n_even)
            if not (even or self._on_cpu or capturing):
                self._after_launch()
        if self._on_cpu:
            self._raise_mismatch_now()

    def reduce_scatter(self, src: torch.Tensor, out: torch.Tensor, op: int, average: bool) -> None:
        """out[j] = op over ranks of their src[rank * n + j] (contiguous tensors, n = out.numel())."""
        n = out.numel()
        elem = src.element_size()
        in_heap_off, in_place = self._placement(src, n * elem % 16 == 0)
        aligned = n * elem % 16 == 0 and (out.data_ptr() | src.data_ptr()) & 15 == 0
        key = ("reduce", elem, aligned, op, average, in_place, _accumulator(src.dtype))
        columns = self._pairs_grid[0]  # W * P: every SM reduces (and stages) a share
        bound = self._bound.get((src.dtype,) + key)
        if bound is None:  # varying: src, out, in_heap_off, n
            bound = self._bound[(src.dtype,) + key] = self._reduce.bind(
                (src.dtype,) + key,
                [src, out, self._heap_views[src.dtype], self.rs_words, self._error, self._rs_ring_offset // elem,
                 in_heap_off, n, columns, self.trace_words if self.trace else self.rs_words], (0, 1, 6, 7),
                **self._launch_config(key))
        bound.launch((columns,), src, out, in_heap_off, n)
        if self._on_cpu:
            self._raise_mismatch_now()

    def reduce_scatter_trace(self) -> dict:
        """With `trace` on: what each program of the last reduce_scatter recorded, {field: int64 tensor [programs]}
        on the host (_reduce.TRACE_FIELDS; times in ns of tcl.clock). Waits for the call to finish."""
        require(self.trace, "reduce_scatter_trace: this CollectiveState was made without trace=True", ValueError)
        words = self.trace_words.cpu()
        return {name: words[:, i] for i, name in enumerate(kr.TRACE_FIELDS)}

    def _raise_mismatch_now(self) -> None:
        """CPU ranks (the only callers) ran the kernel already: raise what it recorded at once (GPUs: at
        the next call)."""
        self.ctx.device_state.raise_if_error()


def _split_table(in_rows: List[int], out_rows: List[int], row: int) -> List[int]:
    """The pinned table of an uneven call, in elements: (offset, count) sent to each peer, then received from each."""
    table = []
    for rows in (in_rows, out_rows):
        at = 0
        for c in rows:
            table += (at * row, c * row)
            at += c
    return table


def _offsets_aligned(rows: List[int], row_bytes: int) -> bool:
    """Whether every peer's piece (rows[p] rows of row_bytes, one after another) starts on a 16-byte boundary."""
    if row_bytes % 16 == 0:
        return True
    at = 0
    for c in rows[:-1]:
        at += c
        if at * row_bytes % 16:
            return False
    return True
