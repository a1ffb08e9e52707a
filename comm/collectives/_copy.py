"""How the collectives' kernels move a run of elements: `copy_elements` (vector loads and stores), and `move`:
the same, or with its whole tiles of 256-byte rows by TMA (sm_90+) where the launch asks for it.

TMA: a pair's data is viewed as rows of 256 bytes and moved in tiles of 32 rows (8 KiB), each a tile load from
the source's descriptor and a tile store through the destination's (`row_desc`: either may be a peer's heap as
mapped here), so one program keeps 8 KiB transfers going with a handful of instructions where vector loads and
stores need a thread per 16 bytes. On 4 H200s (2026-11-27, tests/a2a_engine_probe.py) TMA stores to the peers
moved an all_to_all's 4096x7168 bf16 at 322 GB/s per GPU, against 196 by vector stores (NCCL 252, tilecomm's
exchange 270), and lost at 128x7168 (28 GB/s against 40: a program's share there is under one tile). In the
exchange itself it does not pay (4 H200s, one run of the probe, 4096x7168): staged 163.1 µs by vector copies,
174.4 with TMA pushes, 195.7 with TMA pushes and reads; in place 166.8, 161.4 with TMA reads. The bare pushes
never wait for their stores; the exchange's writer waits for each chunk's stores to complete before it signals
the chunk (tcl.bulk_wait: a round trip over NVLink per 128 KiB chunk), and its staged reader copied the ring out
one 8 KiB tile at a time (that loop is pipelined since, untimed). So TMA stays two knobs, off by default
(CollectiveState.tma_push / tma_read).
"""
from __future__ import annotations

import triton.language as tl

from .. import language as tcl
from ..jit import jit

ROW_BYTES = tl.constexpr(256)  # a TMA row: the widest box a descriptor's inner dimension allows for 1-byte elements
TILE_ROWS = tl.constexpr(32)  # 8 KiB tiles (32x128 and 64x128 bf16 tiles moved the same 322 GB/s on 4 H200s)


@jit
def copy_elements(dst_ptr, dst_off, src_ptr, src_off, n, BLOCK: tl.constexpr, VEC: tl.constexpr,
                  LOAD_POLICY: tl.constexpr, STORE_POLICY: tl.constexpr):
    """dst[dst_off : dst_off + n] = src[src_off : ...]; both offsets multiples of VEC elements (16 bytes).
    Whole blocks go unmasked, the tail's whole vectors under a mask of VEC-element granules (so still
    16-byte vectors: a mask `offs < n` with n of unknown divisibility makes every access scalar, which cost
    a 128x7168 all_to_all 44 µs instead of 28 on 4 H200s), then the last n % VEC elements one by one.
    LOAD_POLICY / STORE_POLICY: "" (loads .cg, stores plain), or an L2 eviction policy for the source's /
    destination's lines ("evict_first", "evict_last": CollectiveState.ring_hints)."""
    dst = dst_ptr + dst_off // VEC * VEC  # (an identity here) tells the compiler the alignment
    src = src_ptr + src_off // VEC * VEC
    full = n // BLOCK * BLOCK
    for s in range(0, full, BLOCK):
        offs = tl.multiple_of(s, BLOCK) + tl.arange(0, BLOCK)
        tl.store(dst + offs, load(src + offs, None, LOAD_POLICY), eviction_policy=STORE_POLICY)
    whole = n // VEC * VEC
    if full < whole:
        offs = full + tl.arange(0, BLOCK)
        mask = offs < whole
        tl.store(dst + offs, load(src + offs, mask, LOAD_POLICY), mask=mask, eviction_policy=STORE_POLICY)
    if whole < n:
        offs = whole + tl.arange(0, VEC)
        mask = offs < n
        tl.store(dst + offs, load(src + offs, mask, LOAD_POLICY), mask=mask, eviction_policy=STORE_POLICY)


@jit
def load(ptrs, mask, POLICY: tl.constexpr):
    """A copy's load: cached in L2 only (.cg), or with an L2 eviction policy (PTX allows no .cg with one)."""
    if POLICY == "":
        return tl.load(ptrs, mask=mask, cache_modifier=".cg")
    return tl.load(ptrs, mask=mask, eviction_policy=POLICY)


@jit
def row_desc(ptr, n):
    """A TMA descriptor of ptr's first n elements as whole ROW_BYTES rows, moved in tiles of TILE_ROWS rows
    (at least one row: a descriptor of none is not allowed; `move` never reads or writes past n). ptr is
    16-byte aligned; it may be a peer's heap as mapped here."""
    ROW: tl.constexpr = ROW_BYTES // (ptr.dtype.element_ty.primitive_bitwidth // 8)
    rows = tl.maximum(n // ROW, 1).to(tl.int32)
    return tl.make_tensor_descriptor(ptr, [rows, ROW], [ROW, 1], [TILE_ROWS, ROW])


@jit
def move(dst_desc, dst_ptr, dst_off, dst_row, src_desc, src_ptr, src_off, src_row, n, BLOCK: tl.constexpr,
         VEC: tl.constexpr, LOAD_POLICY: tl.constexpr, STORE_POLICY: tl.constexpr, TMA: tl.constexpr, complete):
    """dst[dst_off : dst_off + n] = src[src_off : ...] (`copy_elements`). TMA: the whole tiles first, from row
    src_row of src_desc to row dst_row of dst_desc (`row_desc`s; the same elements as the offsets name), then
    the rest (under one tile) by copy_elements. The tiles are fenced on both sides: their loads see what this
    program acquired before (a peer's signalled data), and, where `complete`, their stores are complete, ordered
    before this program's later signals (tcl.proxy_fence, tcl.bulk_wait); a caller that passes False waits once
    itself (tcl.bulk_wait) before its next signal. Without TMA the descriptors are not used."""
    done = n * 0
    if TMA:
        ROW: tl.constexpr = ROW_BYTES // (dst_ptr.dtype.element_ty.primitive_bitwidth // 8)
        rows = (n // (ROW * TILE_ROWS) * TILE_ROWS).to(tl.int32)  # (a chunk: at most a ring slot)
        if rows > 0:
            tcl.proxy_fence(tl.full((), 0, tl.int32))  # (not pure: kept, and kept before the loads)
            # pipelined: the next tiles' loads in flight while a tile is stored (a plain loop kept one tile in
            # flight, 16 KiB of shared memory; this one takes 24 KiB, compiled for sm_90, not yet timed on a GPU)
            for r in tl.range(0, rows, TILE_ROWS, num_stages=3):
                tile = src_desc.load([tl.cast(src_row + r, tl.int32), 0])
                dst_desc.store([tl.cast(dst_row + r, tl.int32), 0], tile)
            if complete:
                tcl.bulk_wait(tl.full((), 0, tl.int32))
        done = rows.to(tl.int64) * ROW
    copy_elements(dst_ptr, dst_off + done, src_ptr, src_off + done, n - done, BLOCK, VEC, LOAD_POLICY, STORE_POLICY)
