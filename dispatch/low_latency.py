"""Low-latency dispatch/combine (decode): fixed capacity, no host synchronisation, CUDA-graph capturable.

E_l local experts, W ranks, M = max_tokens_per_rank = the capacity per (expert, source rank), K top-k,
H hidden, cap = W * M. Buffers: buffers.low_latency_specs (made once by the Dispatcher). A token's row
crosses to each destination rank once, however many of that rank's experts it picked; the destination
expands it to its experts' rows, and in combine reduces them to one partial row per (token, rank),
which is what crosses back. Dispatch and combine are one launch each (two with `recv_hook`).

dispatch (one kernel, two roles; programs take their role from a ticket, see below):
- send (token x column chunk): the slot of pair (t, k) = its index among this rank's pairs for that
  expert (token order, then k). Once each owner r of its pairs has consumed the previous call (r's
  consumed[me] word), the row goes once to each such r, to r's recv[me, t]; the
  pair's weight and t * K + k go to r's recv_w / recv_src[e_l, me, slot]. A slot >= M is never used:
  the error is recorded (raised at the next call). Pairs per expert are counted with integer atomics;
  the last send program waits until every rank has consumed the previous call, then SETs count[e_l, me] =
  epoch * (M + 1) + count on every r (release).
- receive (local expert x source x column chunk): waits for the counts of its expert from the sources up
  to its own (the rows of lower sources come first), copies each (expert, source) pair's row from
  recv[source, t] to out[e_l, (rows of lower sources) + slot]: expert-major, then source rank, then token,
  then k; records the row in pair_row[source, t, k].
  The last receive program SETs consumed[me] on every source (a sender waits for it before it overwrites
  a peer's staging rows) and advances the epoch word.

combine (one kernel, two roles):
- reduce on the expert side (source x token x column chunk, sources from me + 1 on, so that every rank
  does not send to the same rank at once): partial = sum over k (in order) of
  w * y[pair_row[s, t, k]] (fp32, mul then add, cast to y's dtype) goes to s's back[t, me]. The last
  program SETs back_ready[me] on every rank.
- sum on the source (token x column chunk): out[t] = sum over ranks r (in order) of the partial rows
  that came back: reference.ReferenceEngine.combine's operations, so both agree bit for bit. The last
  program SETs back_consumed[me] and advances the combine epoch.

Roles: a program's role comes from a ticket taken with an atomic when it starts (first tickets: the
role that waits for nothing in this launch), not from its program id, so a program that waits was
started after every program it waits for on its own rank: no deadlock however the hardware schedules
the grid, and none in the interpreter, which runs programs one after another. With `recv_hook` the
receive role is launched later as its own grid.

Epochs live in device words (dispatch: epoch[0], combine: epoch[1]) and are advanced by the kernels,
so nothing reads a device value on the host and the calls can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

import tilecomm
import tilecomm.language as tcl
from tilecomm.jit import cdiv, next_pow2

from tilecomm.language.abi import ERR_BAD_EXPERT, ERR_CAPACITY, record_error, take_ticket

from ._device import last_of, peer_offset, signal_all, wait_all

_SIG_CONSUMED, _SIG_BACK_READY, _SIG_BACK_CONSUMED = range(3)
# LowLatencyConfig.trace: what each program of a traced launch writes to its row (its ticket) of the trace (int64 ns
# of tcl.clock): when it started (after its ticket), when it was ready, when it ended, and its role. Dispatch: a
# sender (SENT) is ready once every owner of its token has consumed the previous call, the last sender (PUBLISHED)
# ends after publishing the counts, a receiver (RECEIVED) is ready once its counts have come. Combine: an expert-side
# reducer (SENT) is ready once its source has summed the previous call's partial rows, the last one (PUBLISHED) ends
# after signalling every rank, a summer (RECEIVED) is ready once every rank's partial rows have come
TRACE_FIELDS = ("start", "ready", "end", "role")
SENT, PUBLISHED, RECEIVED = 1, 2, 3
_TRACE_WORDS, _SENT, _PUBLISHED, _RECEIVED = (tl.constexpr(v) for v in (len(TRACE_FIELDS), SENT, PUBLISHED, RECEIVED))
# counter words (int32, each kernel's own three): ticket, programs done in the first role, in the second
_DISPATCH_COUNTERS, _COMBINE_COUNTERS = 0, 3


@dataclass(frozen=True)
class LowLatencyConfig:
    """block_h: columns per step; col_programs: column chunks per row (programs per token in send and
    sum, per (expert, source) in receive, per (source, token) in the expert-side reduce); block_rows:
    rows per step in receive. trace: the dispatch's and the combine's programs time themselves (TRACE_FIELDS; read
    by LowLatencyEngine.trace; tests/ll_probe.py --trace), a diagnostic: off by default."""

    block_h: int = 2048
    col_programs: int = 4
    block_rows: int = 2
    num_warps: int = 4
    trace: bool = False

    @staticmethod
    def for_device(device: torch.device, hidden: int, world: int = 1) -> "LowLatencyConfig":
        # (world: not used; NormalConfig.for_device's signature, so the probes sweep both alike)
        # GPU: from tests/ll_probe.py (128 x 7168, top-8 of 256; 2026-11-27 on H200 at world 1 and 4): two column
        # programs per row, each a single step of up to 4096 columns (dispatch / combine 35.9 / 17.2 µs at world 1,
        # 52.6 / 46.5 at world 4, against 45.5 / 21.2 and 54.5 / 57.9 with four of 2048); 8 warps were slower
        if device.type == "cuda":
            col_programs = max(1, min(2, cdiv(hidden, 2048)))
            return LowLatencyConfig(block_h=min(4096, max(2048, next_pow2(cdiv(hidden, col_programs)))),
                                    col_programs=col_programs)
        return LowLatencyConfig(block_h=min(256, next_pow2(hidden)), col_programs=1, block_rows=8,
                                num_warps=1)


@tilecomm.jit(do_not_specialize=["T", "N_SEND", "N_RECV"])
def _dispatch_kernel(x_ptr, topk_ptr, w_ptr, recv_ptr, recv_w_ptr, recv_src_ptr, count_ptr, consumed_ptr, epoch_ptr,
                     err_ptr, pairs_ptr, counter_ptr, out_ptr, out_w_ptr, maps_ptr, per_expert_ptr, N_SEND, N_RECV,
                     CP, T, E, E_L, W, M, H, ROW, trace_ptr, K: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_EL: tl.constexpr, BLOCK_W: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, ALIGN: tl.constexpr, TRACE: tl.constexpr):
    """Programs: N_SEND senders (token x column chunk), then N_RECV receivers (expert x source x chunk).
    maps: pair_row [W, M, K] then token_ranks [M, W] (LowLatencyHandle). TRACE: each program writes its times to
    trace_ptr[ticket, :] (TRACE_FIELDS)."""
    ticket = take_ticket(counter_ptr, N_SEND + N_RECV)
    trace_row = trace_ptr + ticket.to(tl.int64) * _TRACE_WORDS
    if TRACE:
        tl.store(trace_row, tcl.clock())
    pair_row_ptr = maps_ptr
    token_ranks_ptr = maps_ptr + W * M * K
    epoch = tl.load(epoch_ptr) + 1
    if ticket < N_SEND:
        _send(ticket // CP, ticket % CP, ticket, x_ptr, topk_ptr, w_ptr, recv_ptr, recv_w_ptr, recv_src_ptr,
              consumed_ptr, err_ptr, pairs_ptr, pair_row_ptr, token_ranks_ptr, epoch, N_SEND, CP, T, E, E_L, W, M, H,
              ROW, trace_row, K, BLOCK_K, BLOCK_C, BLOCK_W, BLOCK_H, ALIGN, TRACE)
        if last_of(counter_ptr + 1, N_SEND):
            _publish_counts(pairs_ptr, count_ptr, consumed_ptr, err_ptr, tcl.rank(), epoch, E_L, W, M, BLOCK_EL)
            if TRACE:
                tl.store(trace_row + 3, _PUBLISHED)
    else:
        r = ticket - N_SEND
        _receive(r // (W * CP), (r // CP) % W, r % CP, recv_ptr, recv_w_ptr, recv_src_ptr, count_ptr, out_ptr,
                 out_w_ptr, pair_row_ptr, per_expert_ptr, epoch, CP, W, M, H, ROW, trace_row, K, BLOCK_W, BLOCK_R,
                 BLOCK_H, TRACE)
        if last_of(counter_ptr + 2, N_RECV):
            signal_all(consumed_ptr + tcl.rank(), epoch, W)
            tl.store(epoch_ptr, epoch)
    if TRACE:  # (each time goes to memory as it is read: no register held through the copies)
        tl.store(trace_row + 2, tcl.clock())


@triton.jit
def _send(t, j, p, x_ptr, topk_ptr, w_ptr, recv_ptr, recv_w_ptr, recv_src_ptr, consumed_ptr, err_ptr, pairs_ptr,
          pair_row_ptr, token_ranks_ptr, epoch, N_SEND, CP, T, E, E_L, W, M, H, ROW, trace_row, K: tl.constexpr,
          BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr,
          ALIGN: tl.constexpr, TRACE: tl.constexpr):
    """One sender. TRACE: its role and the time every owner of its token had consumed the previous call."""
    me = tcl.rank()
    # this launch's pair_row (local, read by the receivers after the counts) starts at -1: a stripe each
    n_map = W * M * K
    stripe = tl.cdiv(n_map, N_SEND)
    for c0 in range(p * stripe, tl.minimum(n_map, p * stripe + stripe), BLOCK_C):
        fc = c0 + tl.arange(0, BLOCK_C)
        tl.store(pair_row_ptr + fc, tl.full((BLOCK_C,), -1, tl.int32), mask=fc < tl.minimum(n_map, p * stripe + stripe))
    kk = tl.arange(0, BLOCK_K)
    km = tl.where(t < T, kk < K, False)  # (scalar & vector masks break the interpreter)
    f = t.to(tl.int64) * K + kk
    ids = tl.load(topk_ptr + f, mask=km, other=-1).to(tl.int64)
    valid = km & (ids >= 0) & (ids < E)
    slot = tl.zeros((BLOCK_K,), tl.int32)  # pairs before (t, k), in (token, k) order, with the same expert
    for c0 in range(0, t * K + K, BLOCK_C):
        fc = c0 + tl.arange(0, BLOCK_C)
        ids_c = tl.load(topk_ptr + fc, mask=fc < T * K, other=-1).to(tl.int64)
        slot += tl.sum(((ids_c[None, :] == ids[:, None]) & (fc[None, :] < f[:, None])).to(tl.int32), axis=1)
    bad = km & ((ids < -1) | (ids >= E))
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        record_error(err_ptr, ERR_BAD_EXPERT, me, t, tl.max(tl.where(bad, ids, -2 ** 62), axis=0), E, 0)
    ok = valid & (slot < M)
    owner = tl.where(ok, ids // E_L, -1)
    # the row goes to each owner once: at the first of that owner's pairs, in k order
    earlier = (kk[None, :] < kk[:, None]) & (owner[None, :] == owner[:, None])  # [k, k'] with k' < k
    first = ok & (tl.max(earlier.to(tl.int32), axis=1) == 0)
    # each owner of this token has copied out my previous rows (not every rank): their words in one wait
    any_owner = tl.max(tl.where(first, owner, -1), axis=0)
    if any_owner >= 0:
        tcl.wait(consumed_ptr + tl.where(first, owner, any_owner), epoch - 1, tcl.CMP_GE)
    if TRACE:
        tl.store(trace_row + 1, tcl.clock())
        tl.store(trace_row + 3, _SENT)
    if j == 0:
        dst = ((ids % E_L) * W + me) * M + slot  # [e_l, me, slot]
        to = tl.where(ok, owner, 0)
        # pairs per expert (integer: exact); relaxed: the publisher reads them after last_of's release / acquire
        tl.atomic_add(pairs_ptr + tl.where(valid, ids, 0), 1, mask=valid, sem="relaxed", scope="gpu")
        tl.store(recv_w_ptr + peer_offset(recv_w_ptr, to, 1) + dst, tl.load(w_ptr + f, mask=ok), mask=ok)
        tl.store(recv_src_ptr + peer_offset(recv_src_ptr, to, 1) + dst, f.to(tl.int32), mask=ok)
        ww = tl.arange(0, BLOCK_W)
        sent = tl.sum(((owner[:, None] == ww[None, :]) & first[:, None]).to(tl.int32), axis=0)
        tl.store(token_ranks_ptr + t.to(tl.int64) * W + ww, sent, mask=tl.where(t < T, ww < W, False))
    at = peer_offset(recv_ptr, tl.where(first, owner, 0), ALIGN) + (me.to(tl.int64) * M + t) * ROW
    for h in range(j * BLOCK_H, H, CP * BLOCK_H):
        cols = h + tl.arange(0, BLOCK_H)
        cm = cols < H
        v = tl.load(x_ptr + t.to(tl.int64) * H + cols, mask=tl.where(t < T, cm, False))
        for k in tl.static_range(K):
            sel = kk == k
            first_k = tl.max((sel & first).to(tl.int32), axis=0) > 0
            at_k = tl.multiple_of(tl.sum(tl.where(sel, at, 0), axis=0), ALIGN)
            tl.store(recv_ptr + at_k + cols, v, mask=tl.where(first_k, cm, False))


@triton.jit
def _publish_counts(pairs_ptr, count_ptr, consumed_ptr, err_ptr, me, epoch, E_L, W, M, BLOCK_EL: tl.constexpr):
    """SET count[e_l, me] = epoch * (M + 1) + min(rows, M) on every rank r, for r's experts; clear pairs.
    First every rank has read my previous counts (its receive of the last call is done: consumed)."""
    wait_all(consumed_ptr, epoch - 1, W)
    el = tl.arange(0, BLOCK_EL)
    for r in range(0, W):
        n = tl.load(pairs_ptr + r * E_L + el, mask=el < E_L, other=0)
        tl.store(pairs_ptr + r * E_L + el, tl.zeros((BLOCK_EL,), tl.int32), mask=el < E_L)
        if tl.max(n, axis=0) > M:
            worst = tl.argmax(n, axis=0)
            record_error(err_ptr, ERR_CAPACITY, me, r * E_L + worst, tl.max(n, axis=0), M, 0)
        tagged = epoch * (M + 1) + tl.minimum(n, M).to(tl.int64)
        last = tl.sum(tl.where(el == E_L - 1, tagged, 0), axis=0)  # padding lanes repeat the last word
        tcl.signal(count_ptr + tl.minimum(el, E_L - 1) * W + me, tl.where(el < E_L, tagged, last), r,
                   tcl.SIGNAL_SET)


@triton.jit
def _receive(el, src, j, recv_ptr, recv_w_ptr, recv_src_ptr, count_ptr, out_ptr, out_w_ptr, pair_row_ptr,
             per_expert_ptr, epoch, CP, W, M, H, ROW, trace_row, K: tl.constexpr, BLOCK_W: tl.constexpr,
             BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, TRACE: tl.constexpr):
    """One receiver. TRACE: its role and the time its counts had come."""
    base = epoch * (M + 1)
    # the counts of sources up to src only (the rows of lower sources come first in the expert's block), in
    # one wait (lanes past src repeat src's word): a program starts copying once they have published, not the
    # slowest rank; the last source's programs wait for every count and write the expert's total
    rr = tl.arange(0, BLOCK_W)
    n = tcl.wait(count_ptr + el * W + tl.minimum(rr, src), base, tcl.CMP_GE) - base
    if TRACE:
        tl.store(trace_row + 1, tcl.clock())
        tl.store(trace_row + 3, _RECEIVED)
    offset = tl.sum(tl.where(rr < src, n, 0), axis=0)
    count = tl.sum(tl.where(rr == src, n, 0), axis=0)
    if (src == W - 1) & (j == 0):
        tl.store(per_expert_ptr + el, offset + count)
    first = el.to(tl.int64) * W * M + offset  # output row of slot 0
    for i0 in range(0, count, BLOCK_R):
        ii = i0 + tl.arange(0, BLOCK_R)
        im = ii < count
        staged = (el.to(tl.int64) * W + src) * M + ii
        pair = tl.load(recv_src_ptr + staged, mask=im, other=0)  # t * K + k
        if j == 0:
            tl.store(out_w_ptr + first + ii, tl.load(recv_w_ptr + staged, mask=im), mask=im)
            tl.store(pair_row_ptr + src.to(tl.int64) * M * K + pair, (first + ii).to(tl.int32), mask=im)
        row = src.to(tl.int64) * M + pair // K
        for h in range(j * BLOCK_H, H, CP * BLOCK_H):
            cols = h + tl.arange(0, BLOCK_H)
            m = im[:, None] & (cols < H)[None, :]
            v = tl.load(recv_ptr + row[:, None] * ROW + cols[None, :], mask=m)
            tl.store(out_ptr + (first + ii)[:, None] * H + cols[None, :], v, mask=m)


@tilecomm.jit(do_not_specialize=["T", "N_BACK", "N_SUM"])
def _combine_kernel(y_ptr, w_ptr, maps_ptr, back_ptr, out_ptr, ready_ptr, consumed_ptr,
                    epoch_ptr, counter_ptr, N_BACK, N_SUM, CP, T, W, M, H, ROW, trace_ptr, K: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr, ALIGN: tl.constexpr,
                    ACC: tl.constexpr, TRACE: tl.constexpr):
    """Programs: N_BACK expert-side reducers (source x token x column chunk), then N_SUM summers (token x chunk).
    TRACE: each program writes its times to trace_ptr[ticket, :] (TRACE_FIELDS)."""
    ticket = take_ticket(counter_ptr, N_BACK + N_SUM)
    trace_row = trace_ptr + ticket.to(tl.int64) * _TRACE_WORDS
    if TRACE:
        tl.store(trace_row, tcl.clock())
    pair_row_ptr = maps_ptr
    token_ranks_ptr = maps_ptr + W * M * K
    me = tcl.rank()
    epoch = tl.load(epoch_ptr + 1) + 1
    if ticket < N_BACK:
        s = (me + 1 + ticket // (M * CP)) % W  # sources from me + 1 on: the ranks send to different ranks at a time
        t = (ticket // CP) % M
        tcl.wait(consumed_ptr + s, epoch - 1, tcl.CMP_GE)  # s has summed my previous partial rows
        if TRACE:
            tl.store(trace_row + 1, tcl.clock())
            tl.store(trace_row + 3, _SENT)
        kk = tl.arange(0, BLOCK_K)
        rows = tl.load(pair_row_ptr + (s.to(tl.int64) * M + t) * K + kk, mask=kk < K, other=-1)
        if tl.max(rows, axis=0) >= 0:
            w = tl.load(w_ptr + rows, mask=rows >= 0, other=0.0).to(ACC)
            at = peer_offset(back_ptr, s, ALIGN) + (t.to(tl.int64) * W + me) * ROW
            for h in range((ticket % CP) * BLOCK_H, H, CP * BLOCK_H):
                cols = h + tl.arange(0, BLOCK_H)
                cm = cols < H
                acc = tl.zeros((BLOCK_H,), ACC)
                for k in tl.static_range(K):
                    sel = kk == k
                    row_k = tl.sum(tl.where(sel, rows, 0), axis=0)
                    w_k = tl.sum(tl.where(sel, w, 0.0), axis=0)
                    v = tl.load(y_ptr + row_k.to(tl.int64) * H + cols, mask=tl.where(row_k >= 0, cm, False), other=0.0)
                    acc = acc + v.to(ACC) * w_k
                tl.store(back_ptr + at + cols, acc.to(back_ptr.dtype.element_ty), mask=cm)
        if last_of(counter_ptr + 1, N_BACK):
            signal_all(ready_ptr + me, epoch, W)
            if TRACE:
                tl.store(trace_row + 3, _PUBLISHED)
    else:
        p = ticket - N_BACK
        t = p // CP
        wait_all(ready_ptr, epoch, W)
        if TRACE:
            tl.store(trace_row + 1, tcl.clock())
            tl.store(trace_row + 3, _RECEIVED)
        ww = tl.arange(0, BLOCK_W)
        sent = tl.load(token_ranks_ptr + t.to(tl.int64) * W + ww, mask=tl.where(t < T, ww < W, False), other=0)
        for h in range((p % CP) * BLOCK_H, H, CP * BLOCK_H):
            cols = h + tl.arange(0, BLOCK_H)
            cm = cols < H
            acc = tl.zeros((BLOCK_H,), ACC)
            for r in range(0, W):
                from_r = tl.sum(tl.where(ww == r, sent, 0), axis=0) > 0
                v = tl.load(back_ptr + (t.to(tl.int64) * W + r) * ROW + cols, mask=tl.where(from_r, cm, False), other=0.0)
                acc = acc + v.to(ACC)
            tl.store(out_ptr + t.to(tl.int64) * H + cols, acc.to(out_ptr.dtype.element_ty), mask=tl.where(t < T, cm, False))
        if last_of(counter_ptr + 2, N_SUM):
            signal_all(consumed_ptr + me, epoch, W)
            tl.store(epoch_ptr + 1, epoch)
    if TRACE:
        tl.store(trace_row + 2, tcl.clock())
