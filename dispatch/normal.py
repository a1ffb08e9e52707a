"""Normal-mode dispatch and combine as fused device kernels (backend "tilecomm").

W ranks, T tokens here, K = top-k, E experts, E_l = E / W local ones, M = max tokens per rank. A
dispatch is three launches and one host read:

1. route (programs: blocks of BT tokens): histogram of each block's pairs by expert -> counts[b, :].
   The last program sums them, writes this rank's token count and its pair counts for rank r's experts
   into row [me] of r's notify buffer (SET notify_sig[me] = seq on r), waits for every rank's row and
   writes the receive plan: first received token of each source (N tokens in all), first output row of
   each (local expert, source), tokens per expert, R = rows to receive. Worked example, W = 1, E = 2:
   topk = [[1, 0], [1, -1]] -> counts [1, 2]; rows of expert 0: (t0, k1); of expert 1: (t0, k0), (t1, k0).
2. send (the same blocks): the slot of each pair (its index among this rank's pairs for that expert:
   earlier blocks' counts + its rank inside the block), then for every rank r: route/slot/weight of each
   token (-1 = no local expert) and, ONCE per token that has an expert on r, its row into r's
   rows[me, t]. Stores go through symm_at(., r), r == me included. Last program: SET ready[me] = seq on r.
3. expand (programs: received tokens): after ready[s], the row of (s, t) is read once and written to
   out[row_off[e, s] + slot] for each of its pairs here (local expert, then source, then token, then k).
   Last program: SET consumed[me] = seq on every s.

The host reads (R, N) after route (one D2H copy while send runs: the only sync) to size the output.
Combine (two launches, no host sync):
4. combine_send (received tokens): partial = sum_k coef * y[row] over the token's pairs here (fp32,
   k order), cast to y's dtype, stored once into source s's back_rows[me, t] (+ per-pair values).
5. combine_recv (this rank's tokens): out[t] = sum over ranks r, in order, of back_rows[r, t] (fp32).

A sender waits for consumed[r] >= seq - 1 (r has read the previous call) before it writes into r, and
a receiver reads only after ready (released by the sender's last program, after all its programs'
stores). Sums are mul-then-add in reference.py's order with FMA contraction off: bit-identical results.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

import tilecomm
import tilecomm.language as tcl
from tilecomm.jit import CachedLaunch

from ._device import last_program, peer_offset, signal_all, wait_all
from .buffers import SymmetricState, normal_specs, row_bytes

_BIG = tl.constexpr(2 ** 63 - 1)


@dataclass(frozen=True)
class NormalConfig:
    """Launch shapes. pairs_per_program: route/send block (tokens = this // next_pow2(K), at most 16);
    send_block_h / block_h: columns per step in send / in expand and combine; tokens_per_program:
    received (or own) tokens per expand / combine program."""

    pairs_per_program: int = 128
    send_block_h: int = 256
    block_h: int = 1024
    tokens_per_program: int = 1
    num_warps: int = 4

    @staticmethod
    def for_device(device: torch.device, hidden: int) -> "NormalConfig":
        if device.type == "cuda":
            return NormalConfig()
        h = min(256, triton.next_power_of_2(hidden))  # the interpreter: few programs, small tiles
        return NormalConfig(pairs_per_program=256, send_block_h=h, block_h=h, tokens_per_program=64, num_warps=1)


# ---- kernels ---------------------------------------------------------------------------------------
@triton.jit
def _notify(counts_ptr, totals_ptr, minmax_ptr, notify_ptr, nsig_ptr, plan_ptr, info_ptr, T, NB, seq, E, E_L, W,
            BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_EL: tl.constexpr):
    me = tcl.rank()
    bins = tl.arange(0, BLOCK_E)
    tot = tl.zeros((BLOCK_E,), tl.int64)
    for b0 in range(0, NB, BLOCK_B):
        rb = b0 + tl.arange(0, BLOCK_B)
        tile = tl.load(counts_ptr + rb[:, None] * E + bins[None, :], mask=(rb < NB)[:, None] & (bins < E)[None, :], other=0)
        tot += tl.sum(tile, axis=0).to(tl.int64)
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
    tl.store(info_ptr, tl.sum(per_e, axis=0))
    tl.store(info_ptr + 1, n_tok)


@tilecomm.jit(do_not_specialize=["T", "seq"])
def _route_kernel(topk_ptr, counts_ptr, totals_ptr, minmax_ptr, counter_ptr, notify_ptr, nsig_ptr, plan_ptr, info_ptr,
                  T, seq, E, E_L, W, K: tl.constexpr, BT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_EL: tl.constexpr):
    b = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    flat = b.to(tl.int64) * (BT * K) + p
    ok = (p < BT * K) & (flat < T * K)
    ids = tl.load(topk_ptr + flat, mask=ok, other=-1).to(tl.int64)
    tl.atomic_min(minmax_ptr, tl.min(tl.where(ok, ids, _BIG), axis=0))
    tl.atomic_max(minmax_ptr + 1, tl.max(tl.where(ok, ids, -_BIG), axis=0))
    valid = ok & (ids >= 0) & (ids < E)
    bins = tl.arange(0, BLOCK_E)
    tl.store(counts_ptr + b * E + bins, tl.histogram(tl.where(valid, ids, E).to(tl.int32), BLOCK_E), mask=bins < E)
    if last_program(counter_ptr):
        _notify(counts_ptr, totals_ptr, minmax_ptr, notify_ptr, nsig_ptr, plan_ptr, info_ptr, T, tl.num_programs(0),
                seq, E, E_L, W, BLOCK_E, BLOCK_B, BLOCK_W, BLOCK_EL)


@triton.jit
def _send_meta(topk_ptr, w_ptr, counts_ptr, route_ptr, slot_ptr, weight_ptr, b, me, T, E, E_L, W, M,
               K: tl.constexpr, BT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr):
    """Route, slot and weight of this block's pairs into every rank's [me, t, k] (slot: earlier blocks'
    counts of the pair's expert + pairs of that expert before it in this block)."""
    p = tl.arange(0, BLOCK_P)
    flat = b.to(tl.int64) * (BT * K) + p
    ok = (p < BT * K) & (flat < T * K)
    ids = tl.load(topk_ptr + flat, mask=ok, other=-1).to(tl.int64)
    valid = ok & (ids >= 0) & (ids < E)
    e = tl.where(valid, ids, 0)
    slot = tl.zeros((BLOCK_P,), tl.int32)
    for b0 in range(0, b, BLOCK_B):
        rb = b0 + tl.arange(0, BLOCK_B)
        slot += tl.sum(tl.load(counts_ptr + rb[:, None] * E + e[None, :], mask=(rb < b)[:, None] & valid[None, :],
                               other=0), axis=0)
    before = (ids[:, None] == ids[None, :]) & (p[None, :] < p[:, None]) & valid[None, :]
    slot += tl.sum(before.to(tl.int32), axis=1)
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
        for r in range(0, W):
            hit = tl.max((owner == r).to(tl.int32), axis=1) > 0
            dst = dst_ptr + tl.multiple_of(tl.sum(tl.where(lanes == r, to_pe, 0), axis=0), ALIGN)
            tl.store(dst + dst_row[:, None] + cols[None, :], v, mask=hit[:, None] & cm[None, :])


@tilecomm.jit(do_not_specialize=["T", "seq"])
def _send_kernel(x_ptr, x2_ptr, topk_ptr, w_ptr, counts_ptr, rows_ptr, rows2_ptr, route_ptr, slot_ptr, weight_ptr,
                 ready_ptr, consumed_ptr, counter_ptr, T, seq, E, E_L, W, M, H, ROW, H2, ROW2,
                 K: tl.constexpr, BT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr, ALIGN: tl.constexpr,
                 ALIGN2: tl.constexpr, WITH_META: tl.constexpr, HAS_X2: tl.constexpr):
    b = tl.program_id(0)
    me = tcl.rank()
    wait_all(consumed_ptr, seq - 1, W)  # every rank has read my previous call's rows
    if WITH_META:
        _send_meta(topk_ptr, w_ptr, counts_ptr, route_ptr, slot_ptr, weight_ptr, b, me, T, E, E_L, W, M, K, BT,
                   BLOCK_P, BLOCK_B, BLOCK_W)
    tt = tl.arange(0, BLOCK_T)
    tok = b.to(tl.int64) * BT + tt
    tok_ok = (tt < BT) & (tok < T)
    kk = tl.arange(0, BLOCK_K)
    ids = tl.load(topk_ptr + tok[:, None] * K + kk[None, :], mask=tok_ok[:, None] & (kk < K)[None, :], other=-1)
    owner = tl.where((ids >= 0) & (ids < E), ids // E_L, -1)
    _send_rows(x_ptr, rows_ptr, owner, tok, tok_ok, me, W, M, H, ROW, BLOCK_W, BLOCK_H, ALIGN)
    if HAS_X2:
        _send_rows(x2_ptr, rows2_ptr, owner, tok, tok_ok, me, W, M, H2, ROW2, BLOCK_W, BLOCK_H, ALIGN2)
    if last_program(counter_ptr):
        signal_all(ready_ptr + me, seq, W)


@triton.jit
def _received(plan_ptr, W, BT: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's received tokens: flat index i, mask, source rank, token index there."""
    tt = tl.arange(0, BLOCK_T)
    i = tl.program_id(0).to(tl.int64) * BT + tt
    i_ok = (tt < BT) & (i < tl.load(plan_ptr + W))
    src = tl.zeros((BLOCK_T,), tl.int64)
    for r in range(1, W):
        src += (i >= tl.load(plan_ptr + r)).to(tl.int64)
    return i, i_ok, src, i - tl.load(plan_ptr + src)


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
                   plan_ptr, ready_ptr, consumed_ptr, counter_ptr, seq, W, M, H, ROW, H2, ROW2,
                   K: tl.constexpr, BT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_H: tl.constexpr, FROM_META: tl.constexpr, HAS_X2: tl.constexpr):
    me = tcl.rank()
    wait_all(ready_ptr, seq, W)
    i, i_ok, src, t = _received(plan_ptr, W, BT, BLOCK_T)
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


@tilecomm.jit(do_not_specialize=["seq"])
def _combine_send_kernel(y_ptr, coef_ptr, vals_ptr, token_rows_ptr, plan_ptr, back_ptr, back_w_ptr, ready_ptr,
                         consumed_ptr, counter_ptr, seq, W, M, H, ROW, K: tl.constexpr, BT: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, ALIGN: tl.constexpr,
                         HAS_ROWS: tl.constexpr, HAS_COEF: tl.constexpr, HAS_VALS: tl.constexpr, ACC: tl.constexpr):
    me = tcl.rank()
    wait_all(consumed_ptr, seq - 1, W)
    i, i_ok, src, t = _received(plan_ptr, W, BT, BLOCK_T)
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
    if last_program(counter_ptr):
        signal_all(ready_ptr + me, seq, W)


@tilecomm.jit(do_not_specialize=["T", "seq"])
def _combine_recv_kernel(back_ptr, back_w_ptr, topk_ptr, out_ptr, vals_out_ptr, ready_ptr, consumed_ptr, counter_ptr,
                         T, seq, E, E_L, W, M, H, ROW, K: tl.constexpr, BT: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_ROWS: tl.constexpr,
                         HAS_VALS: tl.constexpr, ACC: tl.constexpr):
    me = tcl.rank()
    wait_all(ready_ptr, seq, W)
    tt = tl.arange(0, BLOCK_T)
    tok = tl.program_id(0).to(tl.int64) * BT + tt
    tok_ok = (tt < BT) & (tok < T)
    kk = tl.arange(0, BLOCK_K)
    pm = tok_ok[:, None] & (kk < K)[None, :]
    ids = tl.load(topk_ptr + tok[:, None] * K + kk[None, :], mask=pm, other=-1)
    valid = (ids >= 0) & (ids < E)
    owner = tl.where(valid, ids // E_L, -1)
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


# ---- host side -------------------------------------------------------------------------------------
@dataclass
class FusedPlan:
    """What one fused dispatch leaves for combine and the backward passes (this rank's part).

    topk_idx: [T, K] the caller's routing (kept, not copied); plan: [W + 1 + E_l * W + E_l] int64 on the
    device: first received token of each source then N, first output row of each (local expert, source),
    tokens per expert; token_rows: [>= N, K] int32 output row of each received pair (-1: expert elsewhere);
    tokens_per_expert: [E_l] int64 view of plan; N received tokens (all sources), R output rows."""

    topk_idx: torch.Tensor
    plan: torch.Tensor
    token_rows: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_tokens: int
    num_recv_tokens: int
    num_recv_rows: int


_SIG_NOTIFY, _SIG_FWD_READY, _SIG_FWD_CONSUMED, _SIG_BWD_READY, _SIG_BWD_CONSUMED = range(5)
_P2 = triton.next_power_of_2


class FusedEngine:
    """Normal-mode dispatch/combine over buffers made once here (collective: every rank, same order).

    Same interface as reference.ReferenceEngine: dispatch / redispatch / combine. Symmetric state: see
    buffers.normal_specs; local scratch: per-block expert counts, launch counters, the (R, N) words
    the host reads. `free()` returns the symmetric bytes (collective)."""

    def __init__(self, num_experts: int, hidden: int, max_tokens: int, topk: int, dtype: torch.dtype):
        ctx = tilecomm.current()
        W, dev = ctx.world_size, ctx.device
        self.W, self.E, self.E_L, self.M, self.K, self.H, self.dtype = (W, num_experts, num_experts // W, max_tokens,
                                                                        topk, hidden, dtype)
        self.cuda = dev.type == "cuda"
        self.cfg = NormalConfig.for_device(dev, hidden)
        self.state = SymmetricState("Dispatcher(mode='normal')", normal_specs(W, num_experts, max_tokens, topk, hidden,
                                                                              dtype), zeroed=("sig",))
        self.row_bytes = row_bytes(hidden, dtype)
        # route/send tokens per program (the interpreter on CPU ranks: fewer, larger programs)
        self.bt = max(1, min(16 if self.cuda else 64, self.cfg.pairs_per_program // _P2(topk)))
        self._counts = torch.zeros((triton.cdiv(max_tokens, self.bt), num_experts), dtype=torch.int32, device=dev)
        self._totals = torch.zeros(num_experts, dtype=torch.int64, device=dev)
        self._minmax = torch.tensor([_BIG.value, -_BIG.value], dtype=torch.int64, device=dev)
        counters = torch.zeros(5, dtype=torch.int32, device=dev)
        self._ctr = [counters[i:i + 1] for i in range(5)]
        self._sig = [self.state.sig[i] for i in range(5)]
        self._info = torch.zeros(4, dtype=torch.int64, device=dev)  # R, N, min id, max id
        self._info_host = torch.zeros(4, dtype=torch.int64, pin_memory=self.cuda)
        self._event = torch.cuda.Event() if self.cuda else None
        self._dummies, self._typed_views = {}, {}
        self.seq = [0, 0, 0]  # notify, forward channel, backward channel: the same on every rank
        # launched through the compiled kernels (no per-call Triton binding: the expand launch follows the
        # host sync, so its cost would idle the GPU); keys: the dtypes and flags that vary between calls
        self._route, self._send_k, self._expand_k, self._cs, self._cr = (CachedLaunch(k) for k in (
            _route_kernel, _send_kernel, _expand_kernel, _combine_send_kernel, _combine_recv_kernel))

    def free(self) -> None:
        self.state.free()

    # -- helpers -------------------------------------------------------------------------------------
    def _or_dummy(self, t: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """t, or a small tensor of dtype where t is None or empty (kernels get a valid pointer either way)."""
        if t is not None and t.numel():
            return t
        if dtype not in self._dummies:
            self._dummies[dtype] = torch.zeros(16, dtype=dtype, device=self._info.device)
        return self._dummies[dtype]

    def _typed(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        key = (name, dtype)
        if key not in self._typed_views:
            self._typed_views[key] = self.state.views[name].view(-1).view(dtype)
        return self._typed_views[key]

    def _row(self, dtype: torch.dtype, cols: int, what: str) -> int:
        size = dtype.itemsize
        if cols * size > self.row_bytes:
            raise ValueError(f"{what}: rows of {cols} x {dtype} do not fit the Dispatcher's staging rows "
                             f"({self.row_bytes} bytes: hidden={self.H} x {self.dtype})")
        return self.row_bytes // size

    # -- dispatch ------------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 x2: Optional[torch.Tensor] = None):
        """x [T, H], topk_idx [T, K], topk_weights [T, K] (, x2 [T, H2]: a second payload, e.g. FP8 scales)
        -> (rows [R, H], weights [R] float32, rows2 [R, H2] or None, FusedPlan). One host sync."""
        self.state.check_live()
        W, E, E_L, K, cfg = self.W, self.E, self.E_L, self.K, self.cfg
        T = x.shape[0]
        topk = topk_idx.contiguous()
        self.seq[0] += 1
        plan = torch.empty(W + 1 + E_L * W + E_L, dtype=torch.int64, device=x.device)
        nb = max(1, triton.cdiv(T, self.bt))
        self._route.launch((nb,), topk.dtype, self._or_dummy(topk, topk.dtype), self._counts,
                           self._totals, self._minmax, self._ctr[0],
                             self.state.notify, self._sig[_SIG_NOTIFY], plan, self._info, T, self.seq[0], E, E_L, W,
                             K=K, BT=self.bt, BLOCK_P=_P2(self.bt * K), BLOCK_E=_P2(E + 1), BLOCK_B=16,
                             BLOCK_W=_P2(W), BLOCK_EL=_P2(E_L), num_warps=cfg.num_warps)
        if self.cuda:
            self._info_host.copy_(self._info, non_blocking=True)
            self._event.record()
        self._send(x, x2, topk, topk_weights.float().contiguous())
        token_rows = torch.empty((W * self.M, K), dtype=torch.int32, device=x.device)  # >= N rows; made before the sync
        if self.cuda:
            self._event.synchronize()  # the one host sync: R and N size the outputs
        R, N, lo, hi = (self._info_host if self.cuda else self._info).tolist()
        out = torch.empty((R, x.shape[1]), dtype=x.dtype, device=x.device)
        out_w = torch.empty(R, dtype=torch.float32, device=x.device)
        out2 = None if x2 is None else torch.empty((R, x2.shape[1]), dtype=x2.dtype, device=x.device)
        p = FusedPlan(topk, plan, token_rows, plan[-E_L:], T, N, R)
        self._expand(p, out, out_w, out2)
        if lo < -1 or hi >= E:  # every kernel of the call ran: peers are not left waiting
            raise ValueError(f"dispatch: topk_idx values must be in [-1, {E}), got min {lo}, max {hi}")
        return out, out_w, out2, p

    def redispatch(self, p: FusedPlan, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [R, H] with p's routing (no host sync)."""
        self.state.check_live()
        self._send(x, None, p.topk_idx, None)
        out = torch.empty((p.num_recv_rows, x.shape[1]), dtype=x.dtype, device=x.device)
        self._expand(p, out, None, None)
        return out

    def _send(self, x, x2, topk, weights) -> None:
        self.seq[1] += 1
        row = self._row(x.dtype, x.shape[1], "dispatch")
        h2, row2, rows2, align2 = 0, 0, None, 1
        if x2 is not None:
            row2 = self._row(x2.dtype, x.shape[1] * x.element_size() // x2.element_size() + x2.shape[1], "dispatch")
            h2, align2 = x2.shape[1], 16 // x2.element_size()
            rows2 = self._typed("rows", x2.dtype)[x.shape[1] * x.element_size() // x2.element_size():]
        st, K = self.state, self.K
        nb = max(1, triton.cdiv(x.shape[0], self.bt))
        key = (x.dtype, None if x2 is None else x2.dtype, topk.dtype, weights is None)
        self._send_k.launch((nb,), key, self._or_dummy(x, x.dtype), self._or_dummy(x2, torch.float32),
                            self._or_dummy(topk, topk.dtype),
                            self._or_dummy(weights, torch.float32), self._counts, self._typed("rows", x.dtype),
                            self._or_dummy(rows2, torch.float32), st.route, st.slot, st.weight,
                            self._sig[_SIG_FWD_READY], self._sig[_SIG_FWD_CONSUMED], self._ctr[1], x.shape[0],
                            self.seq[1], self.E, self.E_L, self.W, self.M, x.shape[1], row, h2, row2, K=K, BT=self.bt,
                            BLOCK_P=_P2(self.bt * K), BLOCK_T=_P2(self.bt), BLOCK_K=_P2(K), BLOCK_B=16,
                            BLOCK_W=_P2(self.W), BLOCK_H=self.cfg.send_block_h, ALIGN=16 // x.element_size(), ALIGN2=align2,
                            WITH_META=weights is not None, HAS_X2=x2 is not None, num_warps=self.cfg.num_warps)

    def _expand(self, p: FusedPlan, out, out_w, out2) -> None:
        st, K, tpp = self.state, self.K, self.cfg.tokens_per_program
        h2 = row2 = 0
        rows2 = out2_arg = None
        if out2 is not None:
            skip = out.shape[1] * out.element_size() // out2.element_size()
            rows2, out2_arg = self._typed("rows", out2.dtype)[skip:], out2
            h2, row2 = out2.shape[1], self.row_bytes // out2.element_size()
        key = (out.dtype, None if out2 is None else out2.dtype, out_w is None)
        self._expand_k.launch(
            (max(1, triton.cdiv(p.num_recv_tokens, tpp)),), key, self._typed("rows", out.dtype), self._or_dummy(rows2, torch.float32), self._or_dummy(out, out.dtype),
            self._or_dummy(out2_arg, torch.float32), st.route, st.slot, st.weight, self._or_dummy(out_w, torch.float32),
            self._or_dummy(p.token_rows, torch.int32), p.plan, self._sig[_SIG_FWD_READY], self._sig[_SIG_FWD_CONSUMED],
            self._ctr[2], self.seq[1], self.W, self.M, out.shape[1], self.row_bytes // out.element_size(), h2, row2,
            K=K, BT=tpp, BLOCK_T=_P2(tpp), BLOCK_K=_P2(K), BLOCK_H=self.cfg.block_h, FROM_META=out_w is not None,
            HAS_X2=out2 is not None, num_warps=self.cfg.num_warps)

    # -- combine -------------------------------------------------------------------------------------
    def combine(self, p: FusedPlan, y: Optional[torch.Tensor], coef: Optional[torch.Tensor] = None,
                values: Optional[torch.Tensor] = None):
        """y [R, H] (or None), coef [R] float or None (= 1), values [R] float (or None) -> (out [T, H] of
        y's dtype: sum_k coef * y over each token's rows, values back at each pair [T, K] float32 or None)."""
        self.state.check_live()
        self.seq[2] += 1
        dtype = self.dtype if y is None else y.dtype
        row = self._row(dtype, self.H, "combine")
        back = self._typed("back_rows", dtype)
        st, K, tpp, T, dev = self.state, self.K, self.cfg.tokens_per_program, p.num_tokens, p.plan.device
        acc = tl.float64 if dtype == torch.float64 else tl.float32
        f32 = torch.float32
        flags = (dtype, y is None, coef is None, values is None)
        self._cs.launch(
            (max(1, triton.cdiv(p.num_recv_tokens, tpp)),), flags, self._or_dummy(y, dtype), self._or_dummy(coef, f32), self._or_dummy(values, f32),
            self._or_dummy(p.token_rows, torch.int32), p.plan, back, st.back_w, self._sig[_SIG_BWD_READY],
            self._sig[_SIG_BWD_CONSUMED], self._ctr[3], self.seq[2], self.W, self.M, self.H, row, K=K, BT=tpp,
            BLOCK_T=_P2(tpp), BLOCK_K=_P2(K), BLOCK_H=self.cfg.block_h, ALIGN=16 // back.element_size(),
            HAS_ROWS=y is not None, HAS_COEF=coef is not None, HAS_VALS=values is not None, ACC=acc,
            num_warps=self.cfg.num_warps, enable_fp_fusion=False)
        out = None if y is None else torch.empty((T, self.H), dtype=dtype, device=dev)
        vals = None if values is None else torch.empty((T, K), dtype=f32, device=dev)
        self._cr.launch(
            (max(1, triton.cdiv(T, tpp)),), flags + (p.topk_idx.dtype,), back, st.back_w, self._or_dummy(p.topk_idx, p.topk_idx.dtype), self._or_dummy(out, dtype),
            self._or_dummy(vals, f32), self._sig[_SIG_BWD_READY], self._sig[_SIG_BWD_CONSUMED], self._ctr[4], T,
            self.seq[2], self.E, self.E_L, self.W, self.M, self.H, row, K=K, BT=tpp, BLOCK_T=_P2(tpp),
            BLOCK_K=_P2(K), BLOCK_H=self.cfg.block_h, HAS_ROWS=y is not None, HAS_VALS=values is not None, ACC=acc,
            num_warps=self.cfg.num_warps, enable_fp_fusion=False)
        return out, vals
