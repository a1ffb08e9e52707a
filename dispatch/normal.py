"""Normal-mode dispatch and combine as fused device kernels (backend "tilecomm").

W ranks, T tokens here, K = top-k, E experts, E_l = E / W local ones, M = max tokens per rank. A
dispatch is three launches and one host read:

1. route (programs: blocks of BT tokens): histogram of each block's pairs by expert -> counts[b, :], also
   added (atomics) into running sums per expert. The last program takes the sums (and clears them), writes
   this rank's token count and its pair counts for rank r's experts into row [me] of r's notify buffer (SET
   notify_sig[me] = seq on r), waits for every rank's row and writes the receive plan: first received token
   of each source (N tokens in all), first output row of each (local expert, source), tokens per expert,
   R = rows to receive. Worked example, W = 1, E = 2: topk = [[1, 0], [1, -1]] -> counts [1, 2]; rows of
   expert 0: (t0, k1); of expert 1: (t0, k0), (t1, k0).
2. send (the same blocks): the slot of each pair (its index among this rank's pairs for that expert:
   earlier blocks' counts + its rank inside the block), then for every rank r: route/slot/weight of each
   token (-1 = no local expert) and, ONCE per token that has an expert on r, its row into r's
   rows[me, t]. Stores go through symm_at(., r), r == me included. Then the block's signal: SET
   blocks[me, b] = seq on every rank r (release: the block's rows and meta land first).
3. expand (programs: chunks of received tokens in the order they land: token chunk k of every source,
   sources from me + 1 on, then chunk k + 1...): once blocks[s, b] says the send blocks of a chunk's tokens
   have landed, the row of (s, t) is read once and written to out[row_off[e, s] + slot] for each of its
   pairs here (local expert, then source, then token, then k). Last program: SET consumed[me] = seq on
   every s. On sm_90 GPUs it is launched right after the host sync as a programmatic dependent of the send
   (PDL): its programs take SM slots as soon as every send program has started (none can then be kept from
   running by an expand program waiting for it) and trail the senders block by block; its last program
   waits for the send grid to end, so what follows on the stream is ordered after both.

Kernels here; the host side (FusedEngine: buffers, launches, FusedPlan) is in normal_engine.py.
The host reads (R, N) after route (one D2H copy while send runs: the only sync) to size the output.
Combine (two launches, no host sync):
4. combine_send (received-token chunks in arrival order, as the expand takes them): partial = sum_k coef *
   y[row] over the token's pairs here (fp32, k order), cast to y's dtype, stored once into source s's
   back_rows[me, t] (+ per-pair values). The chunk that completes a block of s's tokens SETs
   back_blocks[me, b] = seq on s.
5. combine_recv (programs: chunks of this rank's tokens; on sm_90 GPUs a programmatic dependent of
   combine_send, as the expand is of the send): once the ranks holding a token's experts say its block has
   landed, out[t] = sum over ranks r, in order, of back_rows[r, t] (fp32). Last program: SET consumed[me]
   on every r.

A sender waits for consumed[r] >= seq - 1 (r has read the previous call) before it writes into r; an
expand program reads a send block only after its blocks word, and combine_recv a block only after its
back_blocks word (each released after the stores it covers). Sums are mul-then-add in reference.py's order
with FMA contraction off: bit-identical results.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

import tilecomm
import tilecomm.language as tcl
from tilecomm.jit import next_pow2

from ._device import last_of, last_program, peer_offset, signal_all, wait_all

_BIG = tl.constexpr(2 ** 63 - 1)


@dataclass(frozen=True)
class NormalConfig:
    """Launch shapes. pairs_per_program: route/send block (tokens = this // next_pow2(K), at most 16);
    send_programs: the send's grid (0: a program per block; G: G programs, program g sending blocks g, g + G, ...,
    so that with PDL the expand finds landed blocks while the send runs); send_block_h / block_h: columns per
    step in send / in expand and combine; tokens_per_program:
    received (or own) tokens per expand / combine chunk; trailing (GPUs of sm_90 on): the expand and
    combine_recv launch as programmatic dependents of the send / combine_send (PDL): their programs may take
    SM slots once every program of the kernel they trail has started, and wait per block (False: after it).
    send_tma: the send stores rows by TMA (a row a tile of 256-byte pieces; rows that are not whole pieces, and
    the FP8 scales, by vector stores). Off: on 2 H200s (2026-11-28, tests/dispatch_probe.py) the 4096x7168 top-8
    dispatch took 348.5 µs with it (345.2 with 132 send programs) against 312.3 without."""

    pairs_per_program: int = 128
    send_programs: int = 0
    send_block_h: int = 1024  # H200, world 1: send 60.0 µs against 71.5 with 256 columns (tests/dispatch_probe.py)
    block_h: int = 1024
    tokens_per_program: int = 1
    num_warps: int = 4
    trailing: bool = True
    send_tma: bool = False

    @staticmethod
    def for_device(device: torch.device, hidden: int, world: int = 1) -> "NormalConfig":
        if device.type == "cuda":
            if world == 1:  # no link: one program per block sends fastest, and the expand trails it anyway
                return NormalConfig()
            # over links: ~0.73 programs per SM, so that blocks land in rounds that the PDL expand copies while
            # the send runs (tests/dispatch_probe.py, 4096 x 7168 top-8 of 256, 4 x H200, 2026-11-27: dispatch
            # 671.7 µs at 96 programs, 688.3 at 66, 704.1 at 128, 773.7 at one per block; world 1 with 66:
            # 324.3 against 243.4)
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            return NormalConfig(send_programs=max(1, sms * 8 // 11))
        h = min(256, next_pow2(hidden))  # the interpreter: few programs (3 send programs: the strided walk), small tiles
        return NormalConfig(pairs_per_program=256, send_programs=3, send_block_h=h, block_h=h, tokens_per_program=64,
                            num_warps=1, trailing=False)


# ---- kernels ---------------------------------------------------------------------------------------
@triton.jit
def _notify(totals_ptr, minmax_ptr, notify_ptr, nsig_ptr, plan_ptr, info_ptr, ends_ptr, T, seq, E, E_L,
            W, BLOCK_E: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_EL: tl.constexpr, ROW_ENDS: tl.constexpr):
    me = tcl.rank()
    bins = tl.arange(0, BLOCK_E)
    # the pairs per expert the route programs added up (totals[E:]), taken and cleared for the next call: one load,
    # where summing the blocks' counts here took a loop of dependent loads in this one program
    tot = tl.load(totals_ptr + E + bins, mask=bins < E, other=0)
    tl.store(totals_ptr + E + bins, tl.zeros((BLOCK_E,), tl.int64), mask=bins < E)
    tl.store(totals_ptr + bins, tot, mask=bins < E)
    tl.store(info_ptr + 2, tl.atomic_xchg(minmax_ptr, _BIG))
    tl.store(info_ptr + 3, tl.atomic_xchg(minmax_ptr + 1, -_BIG))
    tl.debug_barrier()
    el = tl.arange(0, BLOCK_EL)
    row = notify_ptr + me * (E_L + 1)
    for r in range(0, W):
        mine = tl.load(totals_ptr + r * E_L + el, mask=el < E_L, other=0)
        dst = row + peer_offset(notify_ptr, r, 1)
        tl.store(dst, tl.full((), T, tl.int64))
        tl.store(dst + 1 + el, mine, mask=el < E_L)
        tcl.signal(nsig_ptr + me, seq, r, tcl.SIGNAL_SET)
    wait_all(nsig_ptr, seq, W)
    s = tl.arange(0, BLOCK_W)
    sm = s < W
    em = el < E_L
    got = tl.load(notify_ptr + s[:, None] * (E_L + 1) + 1 + el[None, :], mask=sm[:, None] & em[None, :], other=0)
    toks = tl.load(notify_ptr + s * (E_L + 1), mask=sm, other=0)
    n_tok = tl.sum(toks, axis=0)
    tl.store(plan_ptr + s, tl.cumsum(toks, axis=0) - toks, mask=sm)
    tl.store(plan_ptr + W, n_tok)
    per_e = tl.sum(got, axis=0)
    row_off = (tl.cumsum(per_e, axis=0) - per_e)[None, :] + tl.cumsum(got, axis=0) - got
    tl.store(plan_ptr + W + 1 + el[None, :] * W + s[:, None], row_off, mask=sm[:, None] & em[None, :])
    tl.store(plan_ptr + W + 1 + E_L * W + el, per_e, mask=em)
    if ROW_ENDS:  # the int32 row end of each local expert (torch._grouped_mm's offs), for the fused GEMMs
        tl.store(ends_ptr + el, tl.cumsum(per_e, axis=0).to(tl.int32), mask=em)
    tl.store(info_ptr, tl.sum(per_e, axis=0))
    tl.store(info_ptr + 1, n_tok)
    tl.store(info_ptr + 4, tl.max(toks, axis=0))  # the most tokens of one source: the chunks in arrival order


@tilecomm.jit(do_not_specialize=["T", "seq"])
def _route_kernel(topk_ptr, counts_ptr, totals_ptr, minmax_ptr, counter_ptr, notify_ptr, nsig_ptr, plan_ptr, info_ptr,
                  ends_ptr, T, seq, E, E_L, W, K: tl.constexpr, BT: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_EL: tl.constexpr, ROW_ENDS: tl.constexpr):
    """totals [2E] int64: the per-expert totals the last program writes, then the programs' running sums (zero
    between calls: the last program clears them)."""
    b = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    flat = b.to(tl.int64) * (BT * K) + p
    ok = (p < BT * K) & (flat < T * K)
    ids = tl.load(topk_ptr + flat, mask=ok, other=-1).to(tl.int64)
    tl.atomic_min(minmax_ptr, tl.min(tl.where(ok, ids, _BIG), axis=0))
    tl.atomic_max(minmax_ptr + 1, tl.max(tl.where(ok, ids, -_BIG), axis=0))
    valid = ok & (ids >= 0) & (ids < E)
    bins = tl.arange(0, BLOCK_E)
    hist = tl.histogram(tl.where(valid, ids, E).to(tl.int32), BLOCK_E)
    tl.store(counts_ptr + b * E + bins, hist, mask=bins < E)
    # (relaxed: last_program's barrier and release order them before the last program reads the sums)
    tl.atomic_add(totals_ptr + E + bins, hist.to(tl.int64), mask=(bins < E) & (hist > 0), sem="relaxed", scope="gpu")
    if last_program(counter_ptr):
        _notify(totals_ptr, minmax_ptr, notify_ptr, nsig_ptr, plan_ptr, info_ptr, ends_ptr, T, seq, E, E_L, W, BLOCK_E,
                BLOCK_W, BLOCK_EL, ROW_ENDS)


@triton.jit
def block_owners(topk_ptr, b, T, E, E_L, K: tl.constexpr, BT: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Tokens of block b (index, in range) and the rank owning each pair's expert [BLOCK_T, BLOCK_K] (-1: none)."""
    tt = tl.arange(0, BLOCK_T)
    tok = b.to(tl.int64) * BT + tt
    tok_ok = (tt < BT) & (tok < T)
    kk = tl.arange(0, BLOCK_K)
    ids = tl.load(topk_ptr + tok[:, None] * K + kk[None, :], mask=tok_ok[:, None] & (kk < K)[None, :], other=-1)
    return tok, tok_ok, tl.where((ids >= 0) & (ids < E), ids // E_L, -1)


@triton.jit
def token_pairs(topk_ptr, b, T, E, K: tl.constexpr, BT: tl.constexpr, BLOCK_P: tl.constexpr):
    """The pairs of token block b: lane p, flat pair index t * K + k, in range, expert id, has an expert."""
    p = tl.arange(0, BLOCK_P)
    flat = b.to(tl.int64) * (BT * K) + p
    ok = (p < BT * K) & (flat < T * K)
    ids = tl.load(topk_ptr + flat, mask=ok, other=-1).to(tl.int64)
    return p, flat, ok, ids, ok & (ids >= 0) & (ids < E)


@triton.jit
def pair_slots(counts_ptr, ids, valid, p, b, E, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr):
    """Slot of each pair of token block b (lanes p in (t, k) order, expert ids, valid mask): its index among
    this rank's pairs for its expert = pairs of earlier blocks (counts[b', e] from the route kernel) + pairs
    of the same expert before it in the block."""
    e = tl.where(valid, ids, 0)
    slot = tl.zeros((BLOCK_P,), tl.int32)
    for b0 in range(0, b, BLOCK_B):
        rb = b0 + tl.arange(0, BLOCK_B)
        slot += tl.sum(tl.load(counts_ptr + rb[:, None] * E + e[None, :], mask=(rb < b)[:, None] & valid[None, :],
                               other=0), axis=0)
    before = (ids[:, None] == ids[None, :]) & (p[None, :] < p[:, None]) & valid[None, :]
    return slot + tl.sum(before.to(tl.int32), axis=1)


@triton.jit
def _send_meta(topk_ptr, w_ptr, counts_ptr, route_ptr, slot_ptr, weight_ptr, b, me, T, E, E_L, W, M,
               K: tl.constexpr, BT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr):
    """Route, slot and weight of this block's pairs into every rank's [me, t, k] (slot: earlier blocks'
    counts of the pair's expert + pairs of that expert before it in this block)."""
    p, flat, ok, ids, valid = token_pairs(topk_ptr, b, T, E, K, BT, BLOCK_P)
    e = tl.where(valid, ids, 0)
    slot = pair_slots(counts_ptr, ids, valid, p, b, E, BLOCK_P, BLOCK_B)
    w = tl.load(w_ptr + flat, mask=ok, other=0.0)
    owner = e // E_L
    el = (e % E_L).to(tl.int32)
    at = me.to(tl.int64) * M * K + flat
    lanes = tl.arange(0, BLOCK_W)
    pes = tl.minimum(lanes, W - 1)  # padding lanes: a valid rank, never selected
    route_to, slot_to, weight_to = peer_offset(route_ptr, pes, 1), peer_offset(slot_ptr, pes, 1), peer_offset(weight_ptr, pes, 1)
    for r in range(0, W):
        tl.store(route_ptr + tl.sum(tl.where(lanes == r, route_to, 0), axis=0) + at,
                 tl.where(valid & (owner == r), el, -1), mask=ok)
        tl.store(slot_ptr + tl.sum(tl.where(lanes == r, slot_to, 0), axis=0) + at, slot, mask=ok)
        tl.store(weight_ptr + tl.sum(tl.where(lanes == r, weight_to, 0), axis=0) + at, w, mask=ok)


@triton.jit
def _send_rows(src_ptr, dst_ptr, owner, tok, tok_ok, me, W, M, H, ROW, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr,
               ALIGN: tl.constexpr):
    """Each token's row [H] once into rows[me, t] of every rank that owns one of its experts."""
    lanes = tl.arange(0, BLOCK_W)
    pes = tl.minimum(lanes, W - 1)  # padding lanes: a valid rank, never selected
    to_pe = peer_offset(dst_ptr, pes, ALIGN)
    cols0 = tl.arange(0, BLOCK_H)
    dst_row = (me.to(tl.int64) * M + tok) * ROW
    for h in range(0, H, BLOCK_H):
        cols = h + cols0
        cm = cols < H
        v = tl.load(src_ptr + tok[:, None] * H + cols[None, :], mask=tok_ok[:, None] & cm[None, :])
        for i in range(0, W):  # from me + 1 on: the ranks do not all store to the same rank first
            r = (me + 1 + i) % W
            hit = tl.max((owner == r).to(tl.int32), axis=1) > 0
            dst = dst_ptr + tl.multiple_of(tl.sum(tl.where(lanes == r, to_pe, 0), axis=0), ALIGN)
            tl.store(dst + dst_row[:, None] + cols[None, :], v, mask=hit[:, None] & cm[None, :])


@triton.jit
def _send_rows_tma(src_ptr, dst_ptr, owner, tok, tok_ok, me, T, W, M, H, ROW, BLOCK_T: tl.constexpr,
                   PIECES: tl.constexpr):
    """`_send_rows` by TMA (NormalConfig.send_tma): a row is one tile of PIECES pieces of 256 bytes (the pieces past
    H: zeros loaded, stores clipped), loaded and stored into each rank's rows[me, t] per rank, the loads of the next
    rows in flight while one is stored. The stores are complete before the block's signal (tcl.bulk_wait)."""
    PIECE: tl.constexpr = 256 // (src_ptr.dtype.element_ty.primitive_bitwidth // 8)
    src = tl.make_tensor_descriptor(src_ptr, [tl.maximum(T, 1), H // PIECE, PIECE], [H, PIECE, 1], [1, PIECES, PIECE])
    tcl.proxy_fence(tl.full((), 0, tl.int32))  # the TMA stores come after the consumed words' acquire
    for i in range(0, W):  # from me + 1 on, as _send_rows
        r = (me + 1 + i) % W
        hit = tok_ok & (tl.max((owner == r).to(tl.int32), axis=1) > 0)
        order = tl.cumsum(hit.to(tl.int32), axis=0) - 1  # a hit token's index among the block's hits
        n = tl.sum(hit.to(tl.int32), axis=0)
        if n > 0:
            dst = tl.make_tensor_descriptor(tcl.symm_at(dst_ptr, r), [W * M, H // PIECE, PIECE], [ROW, PIECE, 1],
                                            [1, PIECES, PIECE])
            for j in tl.range(0, n, num_stages=3):
                t = tl.sum(tl.where(hit & (order == j), tok, 0), axis=0).to(tl.int32)
                dst.store([me * M + t, 0, 0], src.load([t, 0, 0]))
    tcl.bulk_wait(tl.full((), 0, tl.int32))


@tilecomm.jit(do_not_specialize=["T", "seq"])
def _send_kernel(x_ptr, x2_ptr, topk_ptr, w_ptr, counts_ptr, rows_ptr, rows2_ptr, route_ptr, slot_ptr, weight_ptr,
                 blocks_ptr, consumed_ptr, T, seq, E, E_L, W, M, H, ROW, H2, ROW2,
                 K: tl.constexpr, BT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr, ALIGN: tl.constexpr,
                 ALIGN2: tl.constexpr, WITH_META: tl.constexpr, HAS_X2: tl.constexpr, PDL: tl.constexpr,
                 TMA_PIECES: tl.constexpr):
    if PDL:  # the expand, launched as its dependent, may start once every program of this grid has
        tl.extra.cuda.gdc_launch_dependents()
    me = tcl.rank()
    wait_all(consumed_ptr, seq - 1, W)  # every rank has read my previous call's rows
    # program g: blocks g, g + G, ... (G = the grid: one program per block, or fewer, so that the first blocks
    # land while the later ones are sent)
    for blk in range(tl.program_id(0), tl.cdiv(T, BT), tl.num_programs(0)):
        b = blk + 0 * tl.program_id(0)  # (a tensor in the interpreter too)
        if WITH_META:
            _send_meta(topk_ptr, w_ptr, counts_ptr, route_ptr, slot_ptr, weight_ptr, b, me, T, E, E_L, W, M, K, BT,
                       BLOCK_P, BLOCK_B, BLOCK_W)
        tok, tok_ok, owner = block_owners(topk_ptr, b, T, E, E_L, K, BT, BLOCK_T, BLOCK_K)
        if TMA_PIECES:  # (0: vector stores)
            _send_rows_tma(x_ptr, rows_ptr, owner, tok, tok_ok, me, T, W, M, H, ROW, BLOCK_T, TMA_PIECES)
        else:
            _send_rows(x_ptr, rows_ptr, owner, tok, tok_ok, me, W, M, H, ROW, BLOCK_W, BLOCK_H, ALIGN)
        if HAS_X2:
            _send_rows(x2_ptr, rows2_ptr, owner, tok, tok_ok, me, W, M, H2, ROW2, BLOCK_W, BLOCK_H, ALIGN2)
        # the block's signal: tcl.signal meets the program's threads at a barrier, then signals with release at
        # system scope (cumulative: every thread's rows and meta land first; under NVSHMEM it fences each thread)
        signal_all(blocks_ptr + me.to(tl.int64) * M + b, seq, W)


@triton.jit
def _arriving(plan_ptr, c, me, W, BT: tl.constexpr, BLOCK_T: tl.constexpr):
    """Received tokens of chunk c (expand, combine_send), in the order they land: chunk c holds tokens
    [k BT, (k + 1) BT) of source s = (me + 1 + c % W) % W, k = c // W. Every source sends its tokens about in
    order, all at once, so a consumer can trail them; and at any moment the programs of one rank work for
    every source alike (a rank does not store into one rank first: no incast). Returns flat index i (plan
    order), mask, source (vector), token index there."""
    s = (me + 1 + c % W) % W
    tt = tl.arange(0, BLOCK_T)
    t = (c // W).to(tl.int64) * BT + tt
    first = tl.load(plan_ptr + s)
    i_ok = (tt < BT) & (t < tl.load(plan_ptr + s + 1) - first)
    return first + t, i_ok, tl.zeros((BLOCK_T,), tl.int64) + s, t


@triton.jit
def _wait_sent(blocks_ptr, i_ok, src, t, seq, M, SEND_BT):
    """Wait until the send blocks holding these tokens (one source) have landed here (blocks[s, b] >= seq)."""
    if tl.max(i_ok.to(tl.int32), axis=0) > 0:
        s = tl.max(tl.where(i_ok, src, 0), axis=0)
        lo = tl.min(tl.where(i_ok, t, _BIG), axis=0) // SEND_BT
        hi = tl.max(tl.where(i_ok, t, -1), axis=0) // SEND_BT
        for b in range(lo, hi + 1):
            tcl.wait(blocks_ptr + s * M + b, seq, tcl.CMP_GE)


@triton.jit
def _expand_rows(src_ptr, dst_ptr, rows, src_row, H, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """Read each received row once, write it to every output row of its pairs (rows [BLOCK_T, BLOCK_K], -1 = none)."""
    kk = tl.arange(0, BLOCK_K)
    has = tl.max((rows >= 0).to(tl.int32), axis=1) > 0
    cols0 = tl.arange(0, BLOCK_H)
    for h in range(0, H, BLOCK_H):
        cols = h + cols0
        cm = cols < H
        v = tl.load(src_ptr + src_row[:, None] + cols[None, :], mask=has[:, None] & cm[None, :])
        for k in tl.static_range(K):
            row_k = tl.sum(tl.where(kk[None, :] == k, rows, 0), axis=1)  # rows[:, k]
            tl.store(dst_ptr + row_k[:, None] * H + cols[None, :], v, mask=(row_k >= 0)[:, None] & cm[None, :])


@tilecomm.jit(do_not_specialize=["seq"])
def _expand_kernel(rows_ptr, rows2_ptr, out_ptr, out2_ptr, route_ptr, slot_ptr, weight_ptr, out_w_ptr, token_rows_ptr,
                   plan_ptr, blocks_ptr, consumed_ptr, counter_ptr, seq, W, M, H, ROW, H2, ROW2, SEND_BT,
                   K: tl.constexpr, BT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_H: tl.constexpr, FROM_META: tl.constexpr, HAS_X2: tl.constexpr, PDL: tl.constexpr):
    """Program c: chunk c in arrival order (_arriving), once the send blocks of its tokens have landed."""
    me = tcl.rank()
    i, i_ok, src, t = _arriving(plan_ptr, tl.program_id(0), me, W, BT, BLOCK_T)
    _wait_sent(blocks_ptr, i_ok, src, t, seq, M, SEND_BT)
    kk = tl.arange(0, BLOCK_K)
    pm = i_ok[:, None] & (kk < K)[None, :]
    if FROM_META:  # output row = first row of (expert, source) + the pair's slot
        at = (src * M + t)[:, None] * K + kk[None, :]
        el = tl.load(route_ptr + at, mask=pm, other=-1)
        here = el >= 0
        first = tl.load(plan_ptr + W + 1 + el * W + src[:, None], mask=here, other=0)
        rows = tl.where(here, first + tl.load(slot_ptr + at, mask=here, other=0), -1)
        tl.store(token_rows_ptr + i[:, None] * K + kk[None, :], rows.to(tl.int32), mask=pm)
        tl.store(out_w_ptr + rows, tl.load(weight_ptr + at, mask=here), mask=here)
    else:
        rows = tl.load(token_rows_ptr + i[:, None] * K + kk[None, :], mask=pm, other=-1).to(tl.int64)
    _expand_rows(rows_ptr, out_ptr, rows, (src * M + t) * ROW, H, K, BLOCK_K, BLOCK_H)
    if HAS_X2:
        _expand_rows(rows2_ptr, out2_ptr, rows, (src * M + t) * ROW2, H2, K, BLOCK_K, BLOCK_H)
    if last_program(counter_ptr):
        signal_all(consumed_ptr + me, seq, W)
        if PDL:  # this grid ends after the send's: what follows on the stream is ordered after both
            tl.extra.cuda.gdc_wait()


@tilecomm.jit(do_not_specialize=["seq"])
def _combine_send_kernel(y_ptr, coef_ptr, vals_ptr, token_rows_ptr, plan_ptr, back_ptr, back_w_ptr, landed_ptr,
                         done_ptr, consumed_ptr, seq, W, M, H, ROW, LAND_BT, K: tl.constexpr, BT: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, ALIGN: tl.constexpr,
                         HAS_ROWS: tl.constexpr, HAS_COEF: tl.constexpr, HAS_VALS: tl.constexpr, ACC: tl.constexpr,
                         PDL: tl.constexpr):
    """Program c: received-token chunk c in arrival order (_arriving). The chunk that completes block b (LAND_BT
    tokens) of source s SETs back_blocks[me, b] = seq on s (done: this rank's per-block chunk counters)."""
    if PDL:  # combine_recv, launched as its dependent, may start once every program of this grid has
        tl.extra.cuda.gdc_launch_dependents()
    me = tcl.rank()
    i, i_ok, src, t = _arriving(plan_ptr, tl.program_id(0), me, W, BT, BLOCK_T)
    if tl.max(i_ok.to(tl.int32), axis=0) > 0:  # (chunks past a source's tokens: nothing to send or count)
        wait_all(consumed_ptr, seq - 1, W)  # every rank has summed the previous call's rows
        kk = tl.arange(0, BLOCK_K)
        rows = tl.load(token_rows_ptr + i[:, None] * K + kk[None, :], mask=i_ok[:, None] & (kk < K)[None, :],
                       other=-1).to(tl.int64)
        has = tl.max((rows >= 0).to(tl.int32), axis=1) > 0
        if HAS_ROWS:
            dst_row = peer_offset(back_ptr, src, ALIGN) + (me.to(tl.int64) * M + t) * ROW
            cols0 = tl.arange(0, BLOCK_H)
            for h in range(0, H, BLOCK_H):
                cols = h + cols0
                cm = cols < H
                acc = tl.zeros((BLOCK_T, BLOCK_H), ACC)
                for k in tl.static_range(K):
                    row_k = tl.sum(tl.where(kk[None, :] == k, rows, 0), axis=1)  # rows[:, k]
                    rm = row_k >= 0
                    v = tl.load(y_ptr + row_k[:, None] * H + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0).to(ACC)
                    if HAS_COEF:
                        v = v * tl.load(coef_ptr + row_k, mask=rm, other=0.0).to(ACC)[:, None]
                    acc = acc + v
                tl.store(back_ptr + dst_row[:, None] + cols[None, :], acc.to(back_ptr.dtype.element_ty),
                         mask=has[:, None] & cm[None, :])
        if HAS_VALS:
            vals = tl.load(vals_ptr + rows, mask=rows >= 0, other=0.0)
            at = peer_offset(back_w_ptr, src, 1) + (me.to(tl.int64) * M + t) * K
            tl.store(back_w_ptr + at[:, None] + kk[None, :], vals, mask=has[:, None] & (kk < K)[None, :])
        s = tl.max(src, axis=0)
        b = tl.min(tl.where(i_ok, t, _BIG), axis=0) // LAND_BT
        n_s = tl.load(plan_ptr + s + 1) - tl.load(plan_ptr + s)
        if last_of(done_ptr + s * M + b, tl.cdiv(tl.minimum(n_s, b * LAND_BT + LAND_BT) - b * LAND_BT, BT)):
            tcl.signal(landed_ptr + me.to(tl.int64) * M + b, seq, s, tcl.SIGNAL_SET)


@tilecomm.jit(do_not_specialize=["T", "seq"])
def _combine_recv_kernel(back_ptr, back_w_ptr, topk_ptr, out_ptr, vals_out_ptr, landed_ptr, consumed_ptr, counter_ptr,
                         T, seq, E, E_L, W, M, H, ROW, LAND_BT, K: tl.constexpr, BT: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_ROWS: tl.constexpr,
                         HAS_VALS: tl.constexpr, ACC: tl.constexpr, PDL: tl.constexpr):
    """Program c: this rank's tokens [c BT, (c + 1) BT), once the ranks holding their experts say the rows of
    their blocks have landed (back_blocks[r, b])."""
    me = tcl.rank()
    tt = tl.arange(0, BLOCK_T)
    tok = tl.program_id(0).to(tl.int64) * BT + tt
    tok_ok = (tt < BT) & (tok < T)
    kk = tl.arange(0, BLOCK_K)
    pm = tok_ok[:, None] & (kk < K)[None, :]
    ids = tl.load(topk_ptr + tok[:, None] * K + kk[None, :], mask=pm, other=-1)
    valid = (ids >= 0) & (ids < E)
    owner = tl.where(valid, ids // E_L, -1)
    lo = tl.min(tl.where(tok_ok, tok, _BIG), axis=0) // LAND_BT
    hi = tl.max(tl.where(tok_ok, tok, -1), axis=0) // LAND_BT
    for r in range(0, W):  # the ranks with rows for these tokens: their blocks have landed
        if tl.sum((owner == r).to(tl.int32)) > 0:
            for b in range(lo, hi + 1):
                tcl.wait(landed_ptr + r * M + b, seq, tcl.CMP_GE)
    if HAS_ROWS:
        cols0 = tl.arange(0, BLOCK_H)
        for h in range(0, H, BLOCK_H):
            cols = h + cols0
            cm = cols < H
            acc = tl.zeros((BLOCK_T, BLOCK_H), ACC)
            for r in range(0, W):
                hit = tl.max((owner == r).to(tl.int32), axis=1) > 0
                at = (r * M + tok) * ROW
                acc = acc + tl.load(back_ptr + at[:, None] + cols[None, :], mask=hit[:, None] & cm[None, :],
                                    other=0.0).to(ACC)
            tl.store(out_ptr + tok[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=tok_ok[:, None] & cm[None, :])
    if HAS_VALS:
        vals = tl.load(back_w_ptr + (owner * M + tok[:, None]) * K + kk[None, :], mask=valid, other=0.0)
        tl.store(vals_out_ptr + tok[:, None] * K + kk[None, :], vals, mask=pm)
    if last_program(counter_ptr):
        signal_all(consumed_ptr + me, seq, W)
        if PDL:  # this grid ends after combine_send's: what follows on the stream is ordered after both
            tl.extra.cuda.gdc_wait()
