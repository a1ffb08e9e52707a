"""The grouped GEMMs of the fused MoE experts (moe_fused.py), each with its communication inside.

Rows are expert-major as a Dispatcher gives them (local expert, then source rank, then source token, then k);
expert e's rows are [offs[e-1], offs[e]) and source s's rows of e start at plan[W + 1 + e * W + s] (the
route kernel's plan). Every kernel is persistent: programs walk items pid, pid + nprog, ..., one item per
BLOCK_M rows of one expert (the loop over output column tiles is inside, so a row tile's rows are finished,
and signalled, by one program). Rows that arrive from other ranks are read by index once per row tile and
copied into the row buffer the weight gradient needs anyway; every product then reads both operands by TMA
(`tiles.tile_product_acc`, the tile GEMM's main loop: one dot per step; a proxy fence makes the program's own row stores
visible to its TMA reads). On sm_90 with Triton 3.6 a pointer-gathered dot operand (cp.async-pipelined) gave
wrong products: the up half of gate_up, scattered elements of the down-projection backward.

* `_gate_up_kernel` (forward GEMM1): for each row tile, wait for its rows' words (moe_comm.py send: flag
  and pair index), copy the staged token rows into x_rows [R, H], h = x @ w_gate_up[e] (gate and up columns
  through two descriptors, UP elements apart, so no box straddles them; both products in one main loop that
  loads each x tile once: `_tile_dot_pair`), and the SwiGLU epilogue act = silu(g) * u. Writes h [R, 2F] and
  act [R, F] (what the backward needs) and each row's pair index, source rank and routing weight. With items
  that split the columns (ITEM_N < F), `_gather_kernel` does the waits, records and copies in a launch before.
* `_down_grad_kernel` (backward of GEMM2 + SwiGLU): the same waits over the token gradients g that the
  sources sent, copied into g_rows [R, H]; d_act = w * (g @ w_down[e]^T), dh = SwiGLU backward (h from the
  forward); grad_w of each row = sum_f (g @ w_down[e]^T)[f] * act[f] (= <g, y>, the routing weight's
  gradient); also act_w = w * act [R, F] (w_down's gradient is act_w^T @ g per expert).
* `_scatter_kernel` (forward GEMM2, backward of GEMM1): y = a @ w[e] (w[e]^T with B_TRANS), rounded to the
  data type as the unfused grouped GEMM's output, stored straight into the source rank's back[t * K + k] (the
  source applies the routing weight as it sums: moe_comm.py reduce; with HAS_VALS one float per row into its
  back_w), then the row's flag SET to seq there (release). Its items may split a row tile's columns (ITEM_N):
  the item that completes a row tile sets the flags.
"""
from __future__ import annotations

import triton
import triton.language as tl

import tilecomm
import tilecomm.language as tcl
from tilecomm.dispatch._device import last_of, peer_offset, wait_all

from .grouped import _expert_table, _pick
from .moe_comm import wait_words
from .tiles import b_desc3, desc3, split_cols, tile_position, tile_product_acc


@triton.jit
def _item_tile(item, starts, counts, item_ends, col_items, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr,
               E_PAD: tl.constexpr):
    """Work item -> (expert, first row, rows r [BLOCK_M], their mask, column item, row tile). Items are numbered
    expert by expert (_expert_table with tiles_n = col_items), col_items per row tile, in bands of GROUP_M
    row tiles (tiles.tile_position); row tiles are numbered expert by expert too."""
    idx = tl.arange(0, E_PAD)
    e = tl.sum((item_ends <= item).to(tl.int32), 0)
    start, rows = _pick(starts, idx, e), _pick(counts, idx, e)
    tiles_m = tl.cdiv(rows, BLOCK_M)
    first = _pick(item_ends, idx, e) - tiles_m * col_items  # the expert's first item
    pid_m, pid_c = tile_position(item - first, tiles_m, col_items, GROUP_M)
    r = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return e, start + pid_m * BLOCK_M, r, r < start + rows, pid_c, first // col_items + pid_m


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
def _gather_tile(stage_ptr, words_ptr, pair_w_ptr, plan_ptr, x_rows_ptr, row_pair_ptr, row_src_ptr, row_w_ptr, e, r,
                 ok, seq, H, W, M, S, K_TOP, stride_xm, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
                 COPY_N: tl.constexpr):
    """Rows r of expert e: wait for them, record each row's pair index, source rank and routing weight, copy the
    staged token rows into x_rows."""
    pair, src, staged, at = _arrived_rows(words_ptr, plan_ptr, e, r, ok, seq, W, M, S, K_TOP, BLOCK_W)
    tl.store(row_pair_ptr + r, pair.to(tl.int32), mask=ok)
    tl.store(row_src_ptr + r, src, mask=ok)
    tl.store(row_w_ptr + r, tl.load(pair_w_ptr + at, mask=ok, other=0.0), mask=ok)
    _copy_rows(stage_ptr, staged, x_rows_ptr, r, ok, H, stride_xm, BLOCK_M, COPY_N)


@triton.jit
def _copy_rows(stage_ptr, staged, rows_ptr, r, ok, H, stride, BLOCK_M: tl.constexpr, COPY_N: tl.constexpr):
    """rows[r] = stage[staged] ([H] each, where ok) in steps of COPY_N columns (wide steps: more loads in flight,
    fewer memory latencies in a row), then a proxy fence and a barrier: this program's TMA reads of rows r see
    the stores."""
    for k in range(0, H, COPY_N):
        cols = k + tl.arange(0, COPY_N)
        m = ok[:, None] & (cols < H)[None, :]
        v = tl.load(stage_ptr + staged[:, None] * H + cols[None, :], mask=m)
        tl.store(rows_ptr + r[:, None].to(tl.int64) * stride + cols[None, :], v, mask=m)
    tcl.proxy_fence(tl.full((), 0, tl.int32))
    tl.debug_barrier()


@triton.jit
def _tile_dot_pair(a_desc, off_m, b1_desc, b2_desc, e, off_n, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):
    """(A @ B1_e, A @ B2_e) at columns off_n.. of both, [BLOCK_M, BLOCK_N] each, in one main loop: each A tile
    is loaded once for both products (gate and up), and one pipeline fills and drains per column step."""
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([0, off_m, k * BLOCK_K]).reshape(BLOCK_M, BLOCK_K)
        b1 = b1_desc.load([e, k * BLOCK_K, off_n]).reshape(BLOCK_K, BLOCK_N)
        b2 = b2_desc.load([e, k * BLOCK_K, off_n]).reshape(BLOCK_K, BLOCK_N)
        acc1 = tl.dot(a, b1, acc1, input_precision=PRECISION, out_dtype=ACC)
        acc2 = tl.dot(a, b2, acc2, input_precision=PRECISION, out_dtype=ACC)
    return acc1, acc2


@triton.jit
def _store_cols(ptr, r, ok, stride, c0, n, limit, vals, BLOCK_N: tl.constexpr):
    """vals [BLOCK_M, BLOCK_N] into ptr[r, c0 + n + j] for n + j < limit, in ptr's dtype."""
    cols = n + tl.arange(0, BLOCK_N)
    tl.store(ptr + r[:, None].to(tl.int64) * stride + c0 + cols[None, :], vals.to(ptr.dtype.element_ty),
             mask=ok[:, None] & (cols < limit)[None, :])


@tilecomm.jit(do_not_specialize=["seq"])
def _gather_kernel(stage_ptr, words_ptr, pair_w_ptr, plan_ptr, offs_ptr, x_rows_ptr, row_pair_ptr, row_src_ptr,
                   row_w_ptr, seq, R, H, E_L, W, M, S, K_TOP, stride_xm, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
                   COPY_N: tl.constexpr, E_PAD: tl.constexpr, RECORD: tl.constexpr):
    """For every row tile, ahead of a `_gate_up_kernel` (RECORD: `_gather_tile`) or `_down_grad_kernel` (the
    arrived rows copied, nothing recorded) whose items split the columns (their GATHER off)."""
    starts, counts, item_ends = _expert_table(offs_ptr, R, E_L, 1, BLOCK_M, E_PAD)
    for item in range(tl.program_id(0), tl.max(item_ends, 0), tl.num_programs(0)):
        e, _, r, ok, _, _ = _item_tile(item, starts, counts, item_ends, 1, BLOCK_M, 1, E_PAD)
        if RECORD:
            _gather_tile(stage_ptr, words_ptr, pair_w_ptr, plan_ptr, x_rows_ptr, row_pair_ptr, row_src_ptr, row_w_ptr,
                         e, r, ok, seq, H, W, M, S, K_TOP, stride_xm, BLOCK_M, BLOCK_W, COPY_N)
        else:
            _, _, staged, _ = _arrived_rows(words_ptr, plan_ptr, e, r, ok, seq, W, M, S, K_TOP, BLOCK_W)
            _copy_rows(stage_ptr, staged, x_rows_ptr, r, ok, H, stride_xm, BLOCK_M, COPY_N)


@tilecomm.jit(do_not_specialize=["seq"])
def _gate_up_kernel(stage_ptr, words_ptr, pair_w_ptr, w_ptr, plan_ptr, offs_ptr, h_ptr, act_ptr, x_rows_ptr,
                    row_pair_ptr, row_src_ptr, row_w_ptr, seq, R, H, F, ITEM_N, E_L, W, M, S, K_TOP, stride_xm,
                    stride_we, stride_wk, UP, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, GATHER: tl.constexpr, BLOCK_W: tl.constexpr, COPY_N: tl.constexpr,
                    E_PAD: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """w [E_l, H, *]: gate columns from 0, up columns from UP (elements; 16-byte aligned), F of each. Items: (row
    tile, ITEM_N of the F columns). GATHER: each item gathers its row tile first (one item per row tile: ITEM_N
    >= F); else `_gather_kernel` ran before and the items only compute (wide layers: the programs running
    at one time share an expert's weight columns in L2 instead of each streaming all of them)."""
    dtype = h_ptr.dtype.element_ty
    rows = tl.maximum(R, 1)
    x_desc = desc3(x_rows_ptr, 1, rows, H, tl.cast(rows, tl.int64) * stride_xm, stride_xm, BLOCK_M, BLOCK_K)
    gate_desc = desc3(w_ptr, E_L, H, F, stride_we, stride_wk, BLOCK_K, BLOCK_N)
    up_desc = desc3(w_ptr + UP, E_L, H, F, stride_we, stride_wk, BLOCK_K, BLOCK_N)
    col_items = tl.cdiv(F, ITEM_N)
    starts, counts, item_ends = _expert_table(offs_ptr, R, E_L, col_items, BLOCK_M, E_PAD)
    for item in range(tl.program_id(0), tl.max(item_ends, 0), tl.num_programs(0)):
        e, off_m, r, ok, pid_c, _ = _item_tile(item, starts, counts, item_ends, col_items, BLOCK_M, GROUP_M, E_PAD)
        if GATHER:
            _gather_tile(stage_ptr, words_ptr, pair_w_ptr, plan_ptr, x_rows_ptr, row_pair_ptr, row_src_ptr,
                         row_w_ptr, e, r, ok, seq, H, W, M, S, K_TOP, stride_xm, BLOCK_M, BLOCK_W, COPY_N)
        for n in range(pid_c * ITEM_N, tl.minimum(F, pid_c * ITEM_N + ITEM_N), BLOCK_N):
            acc_g, acc_u = _tile_dot_pair(x_desc, off_m, gate_desc, up_desc, e, n, H, BLOCK_M, BLOCK_N, BLOCK_K,
                                          PRECISION, ACC)
            g = acc_g.to(dtype)  # h is rounded as the unfused grouped GEMM rounds it; SwiGLU reads it so
            _store_cols(h_ptr, r, ok, 2 * F, 0, n, F, g, BLOCK_N)
            u = acc_u.to(dtype)
            _store_cols(h_ptr, r, ok, 2 * F, F, n, F, u, BLOCK_N)
            gf = g.to(ACC)
            silu = (gf * tl.sigmoid(gf)).to(dtype).to(ACC)  # rounded as torch's silu of the data type
            _store_cols(act_ptr, r, ok, F, 0, n, F, silu * u.to(ACC), BLOCK_N)


@triton.jit
def _swiglu_backward(acc, wt, h_ptr, dh_ptr, act_w_ptr, r, ok, F, n, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
    """Columns n.. of rows r: acc [BLOCK_M, BLOCK_N] = g @ w_down^T there. Stores dh (gate and up columns) for
    d_act = w * acc, rounded as torch's SwiGLU backward in the data type rounds, and act_w = w * act; returns
    sum_f acc * act (act as the forward stored it) per row."""
    dtype = dh_ptr.dtype.element_ty
    cols = n + tl.arange(0, BLOCK_N)
    cm = ok[:, None] & (cols < F)[None, :]
    at = r[:, None].to(tl.int64) * 2 * F + cols[None, :]
    g = tl.load(h_ptr + at, mask=cm, other=0.0).to(ACC)
    u = tl.load(h_ptr + at + F, mask=cm, other=0.0).to(ACC)
    sig = tl.sigmoid(g)
    silu = (g * sig).to(dtype).to(ACC)
    act = (silu * u).to(dtype).to(ACC)
    _store_cols(act_w_ptr, r, ok, F, 0, n, F, act * wt[:, None], BLOCK_N)
    d_act = (acc * wt[:, None]).to(dtype).to(ACC)
    d_silu = (d_act * u).to(dtype).to(ACC)  # d_act * up, rounded, then silu's derivative
    _store_cols(dh_ptr, r, ok, 2 * F, 0, n, F, d_silu * sig * (1.0 + g * (1.0 - sig)), BLOCK_N)
    _store_cols(dh_ptr, r, ok, 2 * F, F, n, F, d_act * silu, BLOCK_N)
    return tl.sum(acc * act, axis=1)


@tilecomm.jit(do_not_specialize=["seq"])
def _down_grad_kernel(stage_ptr, words_ptr, w_ptr, plan_ptr, offs_ptr, row_w_ptr, h_ptr, dh_ptr, g_rows_ptr,
                      act_w_ptr, row_gw_ptr, seq, R, H, F, ITEM_N, E_L, W, M, S, K_TOP, stride_gm, stride_we,
                      stride_wf, stride_gw, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, GATHER: tl.constexpr, BLOCK_W: tl.constexpr, COPY_N: tl.constexpr,
                      E_PAD: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """Items (row tile, ITEM_N of the F columns), as `_gate_up_kernel`'s (GATHER: the item gathers its rows; else
    `_gather_kernel` ran before). row_gw [F / ITEM_N, stride_gw]: each item's part of its rows' sums."""
    rows = tl.maximum(R, 1)
    g_desc = desc3(g_rows_ptr, 1, rows, H, tl.cast(rows, tl.int64) * stride_gm, stride_gm, BLOCK_M, BLOCK_K)
    w_desc = desc3(w_ptr, E_L, F, H, stride_we, stride_wf, BLOCK_N, BLOCK_K)  # w_down [E_l, F, H], read transposed
    col_items = tl.cdiv(F, ITEM_N)
    starts, counts, item_ends = _expert_table(offs_ptr, R, E_L, col_items, BLOCK_M, E_PAD)
    for item in range(tl.program_id(0), tl.max(item_ends, 0), tl.num_programs(0)):
        e, off_m, r, ok, pid_c, _ = _item_tile(item, starts, counts, item_ends, col_items, BLOCK_M, GROUP_M, E_PAD)
        if GATHER:
            _, _, staged, _ = _arrived_rows(words_ptr, plan_ptr, e, r, ok, seq, W, M, S, K_TOP, BLOCK_W)
            _copy_rows(stage_ptr, staged, g_rows_ptr, r, ok, H, stride_gm, BLOCK_M, COPY_N)
        wt = tl.load(row_w_ptr + r, mask=ok, other=0.0).to(ACC)
        gw = tl.zeros((BLOCK_M,), ACC)
        for n in range(pid_c * ITEM_N, tl.minimum(F, pid_c * ITEM_N + ITEM_N), BLOCK_N):
            acc = tile_product_acc(g_desc, 0, off_m, w_desc, e, n, H, BLOCK_M, BLOCK_N, BLOCK_K, True, PRECISION, ACC)
            # the epilogue in two column halves (registers: h's gate and up columns are loaded for it)
            acc0, acc1 = split_cols(acc, BLOCK_M, BLOCK_N)
            gw += _swiglu_backward(acc0, wt, h_ptr, dh_ptr, act_w_ptr, r, ok, F, n, BLOCK_N // 2, ACC)
            gw += _swiglu_backward(acc1, wt, h_ptr, dh_ptr, act_w_ptr, r, ok, F, n + BLOCK_N // 2, BLOCK_N // 2, ACC)
        tl.store(row_gw_ptr + pid_c.to(tl.int64) * stride_gw + r, gw.to(row_gw_ptr.dtype.element_ty), mask=ok)


@tilecomm.jit(do_not_specialize=["seq"])
def _scatter_kernel(a_ptr, w_ptr, offs_ptr, row_pair_ptr, row_src_ptr, vals_ptr, back_ptr, back_w_ptr,
                    flags_ptr, consumed_ptr, done_ptr, seq, R, KA, N, ITEM_N, E_L, W, stride_am, stride_we, stride_w,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    E_PAD: tl.constexpr, B_TRANS: tl.constexpr, HAS_VALS: tl.constexpr, ALIGN: tl.constexpr,
                    ACC: tl.constexpr, PRECISION: tl.constexpr):
    """a [R, KA] expert-major, w [E_l, KA, N] (B_TRANS: [E_l, N, KA]); rows go to back[pair] on their source.

    Items are (row tile, ITEM_N columns) of one expert, GROUP_M row tiles per band (`_item_tile`), so the
    programs running at one time share an expert's weight columns in L2: with wide N (7168) and few rows per
    expert, items that own whole row tiles read each expert's weights once per row tile from memory. The item
    that finishes a row tile's last columns (done_ptr: a counter per row tile, reset by that item) releases its
    rows' flags."""
    dtype = back_ptr.dtype.element_ty
    a_desc = desc3(a_ptr, 1, R, KA, tl.cast(R, tl.int64) * stride_am, stride_am, BLOCK_M, BLOCK_K)
    w_desc = b_desc3(w_ptr, E_L, KA, N, stride_we, stride_w, BLOCK_K, BLOCK_N, B_TRANS)
    col_items = tl.cdiv(N, ITEM_N)
    starts, counts, item_ends = _expert_table(offs_ptr, R, E_L, col_items, BLOCK_M, E_PAD)
    wait_all(consumed_ptr, seq - 1, W)  # every source has reduced my previous call's rows
    for item in range(tl.program_id(0), tl.max(item_ends, 0), tl.num_programs(0)):
        e, off_m, r, ok, pid_c, row_tile = _item_tile(item, starts, counts, item_ends, col_items, BLOCK_M, GROUP_M,
                                                      E_PAD)
        pair = tl.load(row_pair_ptr + r, mask=ok, other=0).to(tl.int64)
        src = tl.load(row_src_ptr + r, mask=ok, other=0)
        dst = peer_offset(back_ptr, src, ALIGN) + pair * N  # element offsets of the rows on their sources
        for n in range(pid_c * ITEM_N, tl.minimum(N, pid_c * ITEM_N + ITEM_N), BLOCK_N):
            acc = tile_product_acc(a_desc, 0, off_m, w_desc, e, n, KA, BLOCK_M, BLOCK_N, BLOCK_K, B_TRANS,
                                   PRECISION, ACC)
            y = acc.to(dtype)  # rounded as the unfused grouped GEMM's output
            cols = n + tl.arange(0, BLOCK_N)
            tl.store(back_ptr + dst[:, None] + cols[None, :], y, mask=ok[:, None] & (cols < N)[None, :])
        if last_of(done_ptr + row_tile, col_items):  # (its barrier and acq_rel count order this item's stores first)
            if HAS_VALS:
                tl.store(back_w_ptr + peer_offset(back_w_ptr, src, 1) + pair, tl.load(vals_ptr + r, mask=ok), mask=ok)
            # every thread's stores (and, by the count's acquire, every item's) before the flags: the barrier, then
            # release at system scope (cumulative, as in last_of; no per-thread fence)
            tl.debug_barrier()
            tl.atomic_xchg(flags_ptr + peer_offset(flags_ptr, src, 1) + pair, tl.full((BLOCK_M,), seq, tl.int64),
                           mask=ok, sem="release", scope="sys")
