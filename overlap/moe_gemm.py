"""The grouped GEMMs of the fused MoE experts (moe_fused.py), each with its communication inside.

Rows are expert-major as a Dispatcher gives them (local expert, then source rank, then source token, then k);
expert e's rows are [offs[e-1], offs[e]) and source s's rows of e start at plan[W + 1 + e * W + s] (the
route kernel's plan). Every kernel is persistent: programs walk items pid, pid + nprog, ..., one item per
BLOCK_M rows of one expert (the loop over output column tiles is inside, so a row tile's rows are finished,
and signalled, by one program). Weights are read by TMA descriptors; rows that arrive from other ranks by
index (pointer gathers): the expert-major copy of the tokens is never built before the GEMM.

* `_gate_up_kernel` (forward GEMM1): for each row tile, wait for its rows' words (moe_comm.py send: flag
  and pair index), gather the staged token rows, h = x @ w_gate_up[e] ([gate | up], two accumulators), and
  the SwiGLU epilogue act = silu(g) * u. Writes h [R, 2F] and act [R, F] (what the backward needs), each
  row's pair index, source rank and routing weight, and with SAVE_X the gathered rows [R, H] (for the
  weight gradient).
* `_down_grad_kernel` (backward of GEMM2 + SwiGLU): the same waits and gathers over the token gradients
  g that the sources sent; d_act = w * (g @ w_down[e]^T), dh = SwiGLU backward (h from the forward);
  grad_w of each row = sum_f (g @ w_down[e]^T)[f] * act[f] (= <g, y>, the routing weight's gradient);
  also the scaled rows w * g [R, H] (for w_down's gradient).
* `_scatter_kernel` (forward GEMM2, backward of GEMM1): y = a @ w[e] (w[e]^T with B_TRANS), rounded to the
  data type as the unfused grouped GEMM's output, stored straight into the source rank's back[t * K + k] (the
  source applies the routing weight as it sums: moe_comm.py reduce; with HAS_VALS one float per row into its
  back_w), then the row's flag SET to seq there (release).
"""
from __future__ import annotations

import triton
import triton.language as tl

import tilecomm
import tilecomm.language as tcl
from tilecomm.dispatch._device import peer_offset, wait_all

from .grouped import _expert_table, _pick
from .moe_comm import wait_words
from .tiles import b_desc3, desc3, split_cols, tile_product_acc


@triton.jit
def _row_tile(tile, starts, counts, item_ends, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """Expert, its first row and row count, and this item's rows r [BLOCK_M] with their mask."""
    idx = tl.arange(0, E_PAD)
    e = tl.sum((item_ends <= tile).to(tl.int32), 0)
    start, rows = _pick(starts, idx, e), _pick(counts, idx, e)
    pid_m = tile - (_pick(item_ends, idx, e) - tl.cdiv(rows, BLOCK_M))
    r = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return e, start + pid_m * BLOCK_M, r, r < start + rows


@triton.jit
def _arrived_rows(words_ptr, plan_ptr, e, r, ok, seq, W, M, S, K_TOP, BLOCK_W: tl.constexpr):
    """Wait for rows r of expert e to arrive (their words reach seq); returns (pair index t * K + k, source
    rank, staged row src * M + t, the word's slot offset)."""
    s = tl.arange(0, BLOCK_W)
    first = tl.load(plan_ptr + W + 1 + e * W + s, mask=s < W, other=2 ** 62)  # first row of (e, s)
    src = tl.sum((r[:, None] >= first[None, :]).to(tl.int32), axis=1) - 1
    slot = r - tl.sum(tl.where(s[None, :] == src[:, None], first[None, :], 0), axis=1)
    at = (e * W + src) * S + slot
    word = wait_words(words_ptr, at, ok, tl.full((), seq, tl.int64) << 32)
    pair = tl.where(ok, word % (1 << 32), 0)
    return pair, src, src.to(tl.int64) * M + pair // K_TOP, at


@triton.jit
def _gather(stage_ptr, staged, ok, k, H, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_K] columns k.. of the staged rows (zero past H and for masked rows)."""
    cols = k + tl.arange(0, BLOCK_K)
    return tl.load(stage_ptr + staged[:, None] * H + cols[None, :], mask=ok[:, None] & (cols < H)[None, :], other=0.0)


@triton.jit
def _store_cols(ptr, r, ok, stride, c0, n, limit, vals, BLOCK_N: tl.constexpr):
    """vals [BLOCK_M, BLOCK_N] into ptr[r, c0 + n + j] for n + j < limit, in ptr's dtype."""
    cols = n + tl.arange(0, BLOCK_N)
    tl.store(ptr + r[:, None].to(tl.int64) * stride + c0 + cols[None, :], vals.to(ptr.dtype.element_ty),
             mask=ok[:, None] & (cols < limit)[None, :])


@tilecomm.jit(do_not_specialize=["seq"])
def _gate_up_kernel(stage_ptr, words_ptr, pair_w_ptr, w_ptr, plan_ptr, offs_ptr, h_ptr, act_ptr, x_out_ptr,
                    row_pair_ptr, row_src_ptr, row_w_ptr, seq, R, H, F, E_L, W, M, S, K_TOP, stride_we, stride_wk,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
                    E_PAD: tl.constexpr, SAVE_X: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    dtype = h_ptr.dtype.element_ty
    w_desc = desc3(w_ptr, E_L, H, 2 * F, stride_we, stride_wk, BLOCK_K, BLOCK_N)
    starts, counts, item_ends = _expert_table(offs_ptr, R, E_L, 1, BLOCK_M, E_PAD)
    for tile in range(tl.program_id(0), tl.max(item_ends, 0), tl.num_programs(0)):
        e, _, r, ok = _row_tile(tile, starts, counts, item_ends, BLOCK_M, E_PAD)
        pair, src, staged, at = _arrived_rows(words_ptr, plan_ptr, e, r, ok, seq, W, M, S, K_TOP, BLOCK_W)
        tl.store(row_pair_ptr + r, pair.to(tl.int32), mask=ok)
        tl.store(row_src_ptr + r, src, mask=ok)
        tl.store(row_w_ptr + r, tl.load(pair_w_ptr + at, mask=ok, other=0.0), mask=ok)
        for n in range(0, F, BLOCK_N):
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), ACC)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), ACC)
            for k in range(0, H, BLOCK_K):
                a = _gather(stage_ptr, staged, ok, k, H, BLOCK_K)
                if SAVE_X:
                    if n == 0:
                        _store_cols(x_out_ptr, r, ok, H, 0, k, H, a, BLOCK_K)
                # gate columns past F read up columns: those outputs are never stored
                acc_g = tl.dot(a, w_desc.load([e, k, n]).reshape(BLOCK_K, BLOCK_N), acc_g, input_precision=PRECISION)
                acc_u = tl.dot(a, w_desc.load([e, k, F + n]).reshape(BLOCK_K, BLOCK_N), acc_u,
                               input_precision=PRECISION)
            g = acc_g.to(dtype)  # h is rounded as the unfused grouped GEMM rounds it; SwiGLU reads it so
            u = acc_u.to(dtype)
            _store_cols(h_ptr, r, ok, 2 * F, 0, n, F, g, BLOCK_N)
            _store_cols(h_ptr, r, ok, 2 * F, F, n, F, u, BLOCK_N)
            gf = g.to(ACC)
            silu = (gf * tl.sigmoid(gf)).to(dtype).to(ACC)  # rounded as torch's silu of the data type
            _store_cols(act_ptr, r, ok, F, 0, n, F, silu * u.to(ACC), BLOCK_N)


@triton.jit
def _swiglu_backward(acc, wt, h_ptr, dh_ptr, r, ok, F, n, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
    """Columns n.. of rows r: acc [BLOCK_M, BLOCK_N] = g @ w_down^T there. Stores dh (gate and up columns) for
    d_act = w * acc, rounded as torch's SwiGLU backward in the data type rounds; returns sum_f acc * act (act
    as the forward stored it) per row."""
    dtype = dh_ptr.dtype.element_ty
    cols = n + tl.arange(0, BLOCK_N)
    cm = ok[:, None] & (cols < F)[None, :]
    at = r[:, None].to(tl.int64) * 2 * F + cols[None, :]
    g = tl.load(h_ptr + at, mask=cm, other=0.0).to(ACC)
    u = tl.load(h_ptr + at + F, mask=cm, other=0.0).to(ACC)
    sig = tl.sigmoid(g)
    silu = (g * sig).to(dtype).to(ACC)
    gw = tl.sum(acc * (silu * u).to(dtype).to(ACC), axis=1)
    d_act = (acc * wt[:, None]).to(dtype).to(ACC)
    d_silu = (d_act * u).to(dtype).to(ACC)  # d_act * up, rounded, then silu's derivative
    _store_cols(dh_ptr, r, ok, 2 * F, 0, n, F, d_silu * sig * (1.0 + g * (1.0 - sig)), BLOCK_N)
    _store_cols(dh_ptr, r, ok, 2 * F, F, n, F, d_act * silu, BLOCK_N)
    return gw


@tilecomm.jit(do_not_specialize=["seq"])
def _down_grad_kernel(stage_ptr, words_ptr, w_ptr, plan_ptr, offs_ptr, row_w_ptr, h_ptr, dh_ptr, g_out_ptr,
                      row_gw_ptr, seq, R, H, F, E_L, W, M, S, K_TOP, stride_we, stride_wf,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
                      E_PAD: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    dtype = dh_ptr.dtype.element_ty
    w_desc = desc3(w_ptr, E_L, F, H, stride_we, stride_wf, BLOCK_N, BLOCK_K)  # w_down [E_l, F, H], read transposed
    starts, counts, item_ends = _expert_table(offs_ptr, R, E_L, 1, BLOCK_M, E_PAD)
    for tile in range(tl.program_id(0), tl.max(item_ends, 0), tl.num_programs(0)):
        e, _, r, ok = _row_tile(tile, starts, counts, item_ends, BLOCK_M, E_PAD)
        _, _, staged, _ = _arrived_rows(words_ptr, plan_ptr, e, r, ok, seq, W, M, S, K_TOP, BLOCK_W)
        wt = tl.load(row_w_ptr + r, mask=ok, other=0.0).to(ACC)
        gw = tl.zeros((BLOCK_M,), ACC)
        for n in range(0, F, BLOCK_N):
            acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
            for k in range(0, H, BLOCK_K):
                a = _gather(stage_ptr, staged, ok, k, H, BLOCK_K)
                if n == 0:  # the rows w * g: w_down's gradient is act^T @ (w * g) per expert
                    _store_cols(g_out_ptr, r, ok, H, 0, k, H, a.to(ACC) * wt[:, None], BLOCK_K)
                acc = tl.dot(a, w_desc.load([e, n, k]).reshape(BLOCK_N, BLOCK_K).T, acc, input_precision=PRECISION)
            # the epilogue in two column halves (registers: h's gate and up columns are loaded for it)
            acc0, acc1 = split_cols(acc, BLOCK_M, BLOCK_N)
            gw += _swiglu_backward(acc0, wt, h_ptr, dh_ptr, r, ok, F, n, BLOCK_N // 2, ACC)
            gw += _swiglu_backward(acc1, wt, h_ptr, dh_ptr, r, ok, F, n + BLOCK_N // 2, BLOCK_N // 2, ACC)
        tl.store(row_gw_ptr + r, gw.to(row_gw_ptr.dtype.element_ty), mask=ok)


@tilecomm.jit(do_not_specialize=["seq"])
def _scatter_kernel(a_ptr, w_ptr, offs_ptr, row_pair_ptr, row_src_ptr, vals_ptr, back_ptr, back_w_ptr,
                    flags_ptr, consumed_ptr, seq, R, KA, N, E_L, W, stride_am, stride_we, stride_w,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E_PAD: tl.constexpr,
                    B_TRANS: tl.constexpr, HAS_VALS: tl.constexpr, ALIGN: tl.constexpr,
                    ACC: tl.constexpr, PRECISION: tl.constexpr):
    """a [R, KA] expert-major, w [E_l, KA, N] (B_TRANS: [E_l, N, KA]); rows go to back[pair] on their source."""
    dtype = back_ptr.dtype.element_ty
    a_desc = desc3(a_ptr, 1, R, KA, tl.cast(R, tl.int64) * stride_am, stride_am, BLOCK_M, BLOCK_K)
    w_desc = b_desc3(w_ptr, E_L, KA, N, stride_we, stride_w, BLOCK_K, BLOCK_N, B_TRANS)
    starts, counts, item_ends = _expert_table(offs_ptr, R, E_L, 1, BLOCK_M, E_PAD)
    wait_all(consumed_ptr, seq - 1, W)  # every source has reduced my previous call's rows
    for tile in range(tl.program_id(0), tl.max(item_ends, 0), tl.num_programs(0)):
        e, off_m, r, ok = _row_tile(tile, starts, counts, item_ends, BLOCK_M, E_PAD)
        pair = tl.load(row_pair_ptr + r, mask=ok, other=0).to(tl.int64)
        src = tl.load(row_src_ptr + r, mask=ok, other=0)
        dst = peer_offset(back_ptr, src, ALIGN) + pair * N  # element offsets of the rows on their sources
        for n in range(0, N, BLOCK_N):
            acc = tile_product_acc(a_desc, 0, off_m, w_desc, e, n, KA, BLOCK_M, BLOCK_N, BLOCK_K, B_TRANS, PRECISION,
                                   ACC)
            y = acc.to(dtype)  # rounded as the unfused grouped GEMM's output
            cols = n + tl.arange(0, BLOCK_N)
            tl.store(back_ptr + dst[:, None] + cols[None, :], y, mask=ok[:, None] & (cols < N)[None, :])
        if HAS_VALS:
            tl.store(back_w_ptr + peer_offset(back_w_ptr, src, 1) + pair, tl.load(vals_ptr + r, mask=ok), mask=ok)
        tcl.fence()  # this thread's row stores are ordered before the flags...
        tl.debug_barrier()  # ...for every thread of the program
        tl.atomic_xchg(flags_ptr + peer_offset(flags_ptr, src, 1) + pair, tl.full((BLOCK_M,), seq, tl.int64),
                       mask=ok, sem="release", scope="sys")
