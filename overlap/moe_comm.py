"""The communication kernels of the fused MoE experts (moe_fused.py): the token push into the expert ranks
and, on each token's own rank, the reduction of the expert rows that land there.

W ranks, T tokens here, K = top-k, E experts, E_l = E / W on each rank, M = max tokens per rank,
S = M * K slots per (local expert, source rank), H hidden. Symmetric buffers: moe_fused.fused_moe_specs.

* send (programs: blocks of BT tokens): each token's row [H] goes ONCE to every rank that owns one of its
  experts, into stage[me, t] there (the Dispatcher's `_send_rows`). Then per pair (t, k) with expert e on
  rank r (local expert el there): its slot j, the index of the pair among this rank's pairs for e (earlier
  blocks' counts from the route kernel + its rank inside the block: dispatch/normal.py's `pair_slots`; kept in slots[t, k] for
  the backward, which sends with the same slots), its routing weight into pair_w[el, me, j] on r, and last
  the word seq << 32 | (t * K + k) into words[el, me, j] on r (release: row and weight land first). The
  receiver's row (el, me, j) is ready once the word's high half reaches seq: flag and pair index in one
  store. Worked example, W = 1, E = 2, topk = [[1, 0], [1, -1]]: expert 0 gets pair (t0, k1) in slot 0;
  expert 1 gets (t0, k0) in slot 0 and (t1, k0) in slot 1.
* reduce (programs: blocks of BT tokens here): waits until flags[t * K + k] >= seq for every pair of its
  tokens that has an expert (the expert rank SETs it after writing the pair's row to back[t * K + k]),
  then out[t] = sum over k, in order, of coef[t, k] * back[t * K + k] (HAS_COEF: the routing weights, applied
  here as the unfused combine applies them to the rounded expert rows; fp32 mul-then-add, launched without FMA
  contraction; fp64 for fp64 data) and values[t, k] = back_w[t * K + k] (0 where no expert). The last program SETs consumed[me] = seq on every
  rank: expert ranks may write this rank's back rows again.

`wait_words(base, offs, mask, value)`: acquire-wait until every word base[offs] (where mask) is >= value,
made of scalar tcl.wait calls on the first word still behind, so every wait has tcl's timeout; returns the
words (read again after the acquire; 0 where masked).
"""
from __future__ import annotations

import triton
import triton.language as tl

import tilecomm
import tilecomm.language as tcl
from tilecomm.dispatch._device import last_program, peer_offset, signal_all, wait_all
from tilecomm.dispatch.normal import _send_rows, block_owners, pair_slots, token_pairs

_NONE = tl.constexpr(2 ** 62)  # "no word behind" (beyond every offset)


@triton.jit
def wait_words(base, offs, mask, value):
    """Acquire-wait until base[offs] >= value for every lane of mask (1-D); returns the words. A word that
    times out (GPU: the error is recorded, the host raises at the next launch) ends the wait."""
    cur = tl.atomic_add(base + offs, 0, mask=mask, sem="acquire", scope="sys")
    behind = tl.min(tl.where(mask & (cur < value), offs.to(tl.int64), _NONE), 0)
    while behind != _NONE:
        seen = tcl.wait(base + behind, value, tcl.CMP_GE)
        if seen < value:  # timed out
            behind = tl.full((), _NONE, tl.int64)
        else:
            cur = tl.atomic_add(base + offs, 0, mask=mask, sem="acquire", scope="sys")
            behind = tl.min(tl.where(mask & (cur < value), offs.to(tl.int64), _NONE), 0)
    tl.debug_barrier()  # every thread reads after every lane's acquire
    # the words once more, by plain loads: a tensor atomic's old values reach only the thread that issued it
    # in some compiled layouts (each lane is held by several threads), and the words no longer change
    return tl.load(base + offs, mask=mask, other=0, volatile=True)


@tilecomm.jit(do_not_specialize=["T", "seq"])
def _send_kernel(x_ptr, topk_ptr, w_ptr, counts_ptr, slots_ptr, stage_ptr, pair_w_ptr, words_ptr, consumed_ptr,
                 T, seq, E, E_L, W, M, H, S, K: tl.constexpr, BT: tl.constexpr, BLOCK_P: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr,
                 BLOCK_H: tl.constexpr, ALIGN: tl.constexpr, WITH_META: tl.constexpr):
    """WITH_META (forward): compute slots (kept in slots_ptr) and send the routing weights; else (backward)
    read the forward's slots and send rows and words only."""
    b = tl.program_id(0)
    me = tcl.rank()
    wait_all(consumed_ptr, seq - 1, W)  # every rank has read the rows and words of my previous call
    tok, tok_ok, owner2 = block_owners(topk_ptr, b, T, E, E_L, K, BT, BLOCK_T, BLOCK_K)
    _send_rows(x_ptr, stage_ptr, owner2, tok, tok_ok, me, W, M, H, H, BLOCK_W, BLOCK_H, ALIGN)
    p, flat, ok, ids, valid = token_pairs(topk_ptr, b, T, E, K, BT, BLOCK_P)
    e = tl.where(valid, ids, 0)
    if WITH_META:
        slot = pair_slots(counts_ptr, ids, valid, p, b, E, BLOCK_P, BLOCK_B)
        tl.store(slots_ptr + flat, slot, mask=ok)
    else:
        slot = tl.load(slots_ptr + flat, mask=valid, other=0)
    owner = e // E_L
    at = ((e % E_L) * W + me) * S + slot
    if WITH_META:
        w = tl.load(w_ptr + flat, mask=valid, other=0.0)
        tl.store(pair_w_ptr + peer_offset(pair_w_ptr, owner, 1) + at, w, mask=valid)
    # every thread's row and weight stores before the words: the barrier, then release at system scope
    # (cumulative, as in dispatch._device.last_of; no per-thread fence)
    tl.debug_barrier()
    word = (tl.full((), seq, tl.int64) << 32) | flat
    tl.atomic_xchg(words_ptr + peer_offset(words_ptr, owner, 1) + at, word, mask=valid, sem="release", scope="sys")


@tilecomm.jit(do_not_specialize=["T", "seq"])
def _reduce_kernel(back_ptr, back_w_ptr, flags_ptr, topk_ptr, coef_ptr, out_ptr, values_ptr, consumed_ptr, counter_ptr,
                   T, seq, E, W, H, K: tl.constexpr, BT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_COEF: tl.constexpr, HAS_VALUES: tl.constexpr,
                   ACC: tl.constexpr):
    me = tcl.rank()
    b = tl.program_id(0)
    _, flat, _, _, valid = token_pairs(topk_ptr, b, T, E, K, BT, BLOCK_P)
    wait_words(flags_ptr, flat, valid, seq)
    tok, tok_ok, owner = block_owners(topk_ptr, b, T, E, 1, K, BT, BLOCK_T, BLOCK_K)  # owner: the expert, -1 none
    kk = tl.arange(0, BLOCK_K)
    for h in range(0, H, BLOCK_H):
        cols = h + tl.arange(0, BLOCK_H)
        acc = tl.zeros((BLOCK_T, BLOCK_H), ACC)
        for k in tl.static_range(K):  # k order, as the unfused combine sums a token's pairs
            has = tl.max(tl.where(kk[None, :] == k, owner, -1), axis=1) >= 0
            v = tl.load(back_ptr + (tok * K + k)[:, None] * H + cols[None, :],
                        mask=has[:, None] & (cols < H)[None, :], other=0.0).to(ACC)
            if HAS_COEF:
                v = v * tl.load(coef_ptr + tok * K + k, mask=has, other=0.0).to(ACC)[:, None]
            acc = acc + v
        tl.store(out_ptr + tok[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tok_ok[:, None] & (cols < H)[None, :])
    if HAS_VALUES:
        at = tok[:, None] * K + kk[None, :]
        pm = tok_ok[:, None] & (kk < K)[None, :]
        tl.store(values_ptr + at, tl.load(back_w_ptr + at, mask=owner >= 0, other=0.0), mask=pm)
    if last_program(counter_ptr):
        signal_all(consumed_ptr + me, seq, W)
