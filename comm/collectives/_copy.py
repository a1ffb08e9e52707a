"""How the collectives' kernels move a run of elements: `copy_elements` (vector loads and stores) and `move`
(whole 256-byte rows by TMA where the launch asks for it, the rest by `copy_elements`).

TMA (sm_90+): a chunk is viewed as rows of 256 bytes and moved in tiles of 32 rows (8 KiB), a tile load
from the source's descriptor and a tile store through the destination's, either of which may be a peer's
heap as mapped here. One program then keeps several 8 KiB transfers in flight with a handful of
instructions, where vector loads and stores need a thread per 16 bytes: 4 H200s (2026-11-27, tests/
a2a_engine_probe.py) moved an all_to_all's 4096x7168 bf16 at 322 GB/s per GPU by TMA stores to the peers
against 196 by vector stores (NCCL 252, tilecomm's exchange then 270), and lost at 128x7168 (28 GB/s
against 40: a program's share there is under one tile, and building two descriptors costs more than it
moves). So the launch asks for TMA only for large pairs (CollectiveState's TMA_MIN_BYTES).
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
def tma_rows(dst, src, n):
    """dst[:m] = src[:m] by TMA for m = n rounded down to whole ROW_BYTES rows; returns m. dst and src are
    16-byte aligned (either may be a peer's, as mapped here). Fenced on both sides: reads see what this
    program acquired before (a peer's signalled data), and the writes are complete, ordered before this
    program's later signals (tcl.proxy_fence, tcl.bulk_wait)."""
    ROW: tl.constexpr = ROW_BYTES // (dst.dtype.element_ty.primitive_bitwidth // 8)
    rows = (n // ROW).to(tl.int32)  # (a chunk: at most a ring slot)
    if rows > 0:
        ordered = tcl.proxy_fence(tl.full((), 0, tl.int32))
        src_desc = tl.make_tensor_descriptor(src + ordered, [rows, ROW], [ROW, 1], [TILE_ROWS, ROW])
        dst_desc = tl.make_tensor_descriptor(dst, [rows, ROW], [ROW, 1], [TILE_ROWS, ROW])
        for r in range(0, rows, TILE_ROWS):
            dst_desc.store([r, 0], src_desc.load([r, 0]))
        tcl.bulk_wait(tl.full((), 0, tl.int32))
    return rows.to(tl.int64) * ROW


@jit
def move(dst_ptr, dst_off, src_ptr, src_off, n, BLOCK: tl.constexpr, VEC: tl.constexpr, LOAD_POLICY: tl.constexpr,
         STORE_POLICY: tl.constexpr, TMA: tl.constexpr):
    """`copy_elements`, with the whole rows by `tma_rows` first where TMA (the launch asks for it only where the
    offsets are 16-byte multiples: VEC = 16 bytes)."""
    if TMA:
        done = tma_rows(dst_ptr + dst_off, src_ptr + src_off, n)
        copy_elements(dst_ptr, dst_off + done, src_ptr, src_off + done, n - done, BLOCK, VEC, LOAD_POLICY,
                      STORE_POLICY)
    else:
        copy_elements(dst_ptr, dst_off, src_ptr, src_off, n, BLOCK, VEC, LOAD_POLICY, STORE_POLICY)
