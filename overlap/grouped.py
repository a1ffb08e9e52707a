"""grouped_mm: one GEMM per expert over its rows, as torch._grouped_mm, differentiable in x and w.

    x [R, K] (rows grouped by expert), w [E, K, N], offs [E] int32 cumulative row ends
    -> y [R, N], y[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ w[e]   (offs[-1] = 0)

Worked example: offs = [2, 2, 5] -> rows 0-1 use w[0], expert 1 has no rows, rows 2-4 use w[2].

Two persistent TMA kernels (tiles.py) cover the three products:
* `_rows_kernel`: y = x @ w[e] per group of rows (forward), and dx = dy @ w[e]^T (B_TRANS: w read in
  place). Work items are (expert, row tile, column tile), numbered expert by expert; every program
  finds an item's expert from offs in registers (no host sync, one launch). Full row tiles store by TMA,
  an expert's last partial tile by masked stores.
* dw[e] = x[rows of e]^T @ dy[rows of e], items (expert, K tile, N tile), two loop forms chosen by the
  mean rows per expert: `_wgrad_kernel` (many rows: per item, a loop over the expert's row steps) and
  `_wgrad_flat_kernel` (few rows, e.g. ~128 in a 256-expert layer: one flat loop over all its items' row
  steps, so the pipeliner overlaps an item's store with the next item's loads). An expert's row steps are
  aligned to its end: the first one reaches back before its start, and TMA reads those rows as zeros
  (tiles.clipped_rows_desc: no register mask, both operands go from shared memory to the MMA, and no row
  outside the experts' rows is read, so padding past offs[-1] may hold anything). Empty experts give 0.
`grouped_mm_reference` is the float64-capable torch loop the tests compare with.
"""
from __future__ import annotations

import torch
import triton.language as tl

import tilecomm
from tilecomm.jit import CachedLaunch, cdiv, next_pow2

from .tiles import (_TABLE, GemmConfig, b_desc3, c_desc3, clipped_rows_desc, clipped_rows_load, desc3, dot_precision,
                    launch_gemm, resolve_config, store_tile, tile_position, tile_product, tma_operand)

# Weight-gradient configs, per loop form (`python -m tilecomm.bench.gemm --sweep-grouped ...`, one H100, 2026-11-25).
_WGRAD = {"per_item": GemmConfig(128, 256, 64, 8, 8, 3, 2, False), "flat": GemmConfig(128, 256, 64, 8, 8, 3, 1, False),
          "cpu": GemmConfig(16, 16, 16, 1, 1, 1, 1, False)}
# A third form was built and measured (2026-11-27, one H200, tests/wgrad_probe.py): x's tile held in registers
# over a strip of N tiles, so that only dy's rows are loaded per tile (1.0 byte loaded per byte stored instead
# of 1.5): 1.3-1.9x slower than flat on every shape (DeepSeek-like gate_up 9350 vs 6909 µs); not kept. The
# stores alone (the same tiles, no loads or MMA) run at 3.8-4.0 TB/s, so the flat kernel's 2.2 is its chain.
# The flat form up to this many rows per expert on average. Measured with the clipped row reads (one H200,
# tests/wgrad_probe.py, 2026-11-27, µs flat / per item): ~128 rows (DeepSeek-like) 5813 / 7751 and 2868 / 4144;
# ~512 rows (its share at EP = 4) 3406 / 3606 and 1702 / 1874; 1536 rows (pretraining down) 332 / 365; ~2048 rows
# (Mixtral-like) 5620 / 5792 and 2863 / 2792: flat is faster up to 1536, the two even at 2048.
FLAT_MAX_ROWS = 1536
# Rows through clipped descriptors instead of x's tile masked in registers: 0.94-0.96x -> 1.13-1.21x
# torch._grouped_mm on the DeepSeek-like layer (one H200, 2026-11-27). Two earlier forms clipped at the expert's
# end with a view based before the operand: R rows before it (inside pytest it died of an illegal address,
# every time, never in the benchmarks or alone), then 64 guard rows of storage the caller had to allocate
# (BENCHMARKS.md, 2026-11-27 from 11:29 UTC). Steps aligned to the expert's end clip at its start instead,
# through a negative coordinate: the view starts at the operand itself.
# The row kernels' configs (the flattened loop; tiles._TABLE's are matmul's), bucketed by (rows per expert, N).
# "narrow" (one of them below 1024: the DeepSeek-like layer's ~128 rows per expert, the pretraining down
# projection's dx with N = 768): 128x256 tiles in bands of 4 row tiles, one H200, 2026-11-27 (--sweep-grouped):
# pretraining down dx 1.141x torch against 0.970 with matmul's narrow 128x128 tiles, DeepSeek-like down dx 1.376
# against 1.237. The band size is not settled: a later sweep had bands of 8 or 16 ahead by 4-7% on four narrow
# products, within the spread of the DeepSeek-like products' timings (BENCHMARKS.md, 2026-11-27 from 14:02 UTC).
# The large bucket's dx in bands of 8 or 4 was tried (two H200 sweeps, 2026-11-27): the pretraining gate_up dx went
# 0.994 -> 0.914 (8) / 1.021 (4), the Mixtral-like gate_up dx 0.954-0.991 -> 0.987-1.031 (8) / 1.013-1.035 (4), its
# down dx 1.039 -> 1.031 / 1.005: within the runs' spread, so dx keeps the forward's bands of 16.
_ROWS_LARGE = GemmConfig(128, 256, 64, 16, 8, 3, 2, False)
_ROWS_NARROW = GemmConfig(128, 256, 64, 4, 8, 3, 2, False)
_ROWS_TABLE = {**_TABLE, "large": _ROWS_LARGE, "mid": _ROWS_LARGE, "narrow": _ROWS_NARROW}
# What `python -m tilecomm.bench.gemm --sweep-grouped ...` times (the data behind _WGRAD and the rows' configs).
WGRAD_CANDIDATES = [GemmConfig(*c) for c in [
    (128, 256, 64, 8, 8, 3, 2, False), (128, 256, 64, 16, 8, 3, 1, False), (128, 256, 64, 4, 8, 3, 1, False),
    (128, 256, 64, 8, 8, 2, 1, False)]] + [
    # few rows per expert: the gradient's stores bound the kernel (2 TB/s of TMA stores on an H200, BENCHMARKS.md);
    # fire-and-forget pointer stores let the next item's loads start without waiting for them (not measured yet)
    GemmConfig(128, 256, 64, 8, 8, 3, 1, False, POINTER_STORES=True)] + [
    # the flat form writes the DeepSeek-like layer's 22.5 GB of bf16 gradient at ~2.2 TB/s, as torch's CUTLASS
    # kernel does: two programs per SM (one's store beside the other's steps) and BLOCK_K 128 (a ~128-row
    # expert in one step) were all slower than the default on one H200 (BENCHMARKS.md, 2026-11-26 morning)
    GemmConfig(*c) for c in [
        (128, 128, 64, 8, 4, 2, 1, False, True, 2), (128, 128, 64, 8, 4, 3, 2, False, True, 2),
        (64, 256, 64, 8, 4, 2, 1, False, True, 2), (128, 128, 128, 8, 8, 2, 1, False, True, 1),
        (128, 256, 64, 8, 8, 4, 2, False, True, 1)]]
ROWS_CANDIDATES = [GemmConfig(*c) for c in [
    # 128x256 in bands of 8 row tiles; matmul's "narrow" 128x128 tiles (the rows' narrow entry until 2026-11-27)
    (128, 256, 64, 8, 8, 3, 2, False, True, 1), (128, 128, 64, 8, 8, 4, 1, False, True, 1),
    # warp-specialised item loop (Triton 3.6 on sm_90): 1.09 / 1.38x torch on the pretraining / DeepSeek-like down
    # dx against 1.14 / 1.38 for _ROWS_NARROW, 1.09 / 1.02 on the Mixtral-like forward (= _ROWS_LARGE); one H200,
    # 2026-11-27. 128x256x64 with 4 stages needs 262 KB of shared memory (232 KB), 256x128 and two 128x128
    # programs per SM were 2-25% slower on all five products swept.
    (128, 256, 64, 16, 8, 3, 2, True, False, 1), (128, 256, 64, 16, 8, 3, 2, False, True, 1),
    (128, 256, 64, 4, 8, 3, 2, False, True, 1),
    # 64-row tiles (not measured yet): a DeepSeek-like expert's ~128 +- 11 rows take two 128-row tiles when they
    # pass 128, the second holding a few rows but running a full MMA; 64-row tiles waste at most 63 rows. sm_90:
    # 8 warps, 4 stages, 141 registers, 213 KB of shared memory, no spills (with 4 warps: 255 registers, spills)
    (64, 256, 64, 4, 8, 4, 2, False, True, 1)]]


@tilecomm.jit
def _expert_table(offs_ptr, R, E, tiles_n, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """Per expert (vectors of E_PAD, zero past E): first row, row count, and its items' end (inclusive
    running sum of tiles_n * cdiv(rows, BLOCK_M): items are numbered expert by expert). Entry E holds
    the rows past offs[E-1] (none when offs[E-1] = R): their w index E is out of bounds, so they get 0."""
    idx = tl.arange(0, E_PAD)
    ends = tl.where(idx == E, R, tl.load(offs_ptr + idx, mask=idx < E, other=0))
    starts = tl.load(offs_ptr + idx - 1, mask=(idx >= 1) & (idx <= E), other=0)
    rows = ends - starts
    return starts, rows, tl.cumsum(tl.cdiv(rows, BLOCK_M) * tiles_n, 0)


@tilecomm.jit
def _pick(vec, idx, e):
    return tl.sum(tl.where(idx == e, vec, 0), 0)


@tilecomm.jit
def _rows_kernel(x_ptr, w_ptr, y_ptr, offs_ptr, R, K, N, E, stride_xm, stride_we, stride_w, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 EPILOGUE_SPLIT: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, B_TRANS: tl.constexpr,
                 C_TMA: tl.constexpr, PRECISION: tl.constexpr, FLATTEN: tl.constexpr, E_PAD: tl.constexpr):
    """y [R, N] = x [R, K] @ w[e] per expert's rows; w[e] is [K, N] (or [N, K] read transposed). FLATTEN: the
    item loop and the K loop become one pipelined loop (the next item's loads overlap this one's epilogue)."""
    x_desc = desc3(x_ptr, 1, R, K, tl.cast(R, tl.int64) * stride_xm, stride_xm, BLOCK_M, BLOCK_K)
    w_desc = b_desc3(w_ptr, E, K, N, stride_we, stride_w, BLOCK_K, BLOCK_N, B_TRANS)
    y_desc = c_desc3(y_ptr, 1, R, N, tl.cast(R, tl.int64) * stride_ym, stride_ym, BLOCK_M, BLOCK_N // EPILOGUE_SPLIT,
                     C_TMA)
    tiles_n = tl.cdiv(N, BLOCK_N)
    starts, counts, item_ends = _expert_table(offs_ptr, R, E, tiles_n, BLOCK_M, E_PAD)
    idx = tl.arange(0, E_PAD)
    for tile in tl.range(tl.program_id(0), tl.max(item_ends, 0), tl.num_programs(0),
                         flatten=FLATTEN and not WARP_SPECIALIZE, warp_specialize=WARP_SPECIALIZE):
        e = tl.sum((item_ends <= tile).to(tl.int32), 0)
        start, rows = _pick(starts, idx, e), _pick(counts, idx, e)
        tiles_m = tl.cdiv(rows, BLOCK_M)
        pid_m, pid_n = tile_position(tile - (_pick(item_ends, idx, e) - tiles_m * tiles_n), tiles_m, tiles_n, GROUP_M)
        off_m = start + pid_m * BLOCK_M
        acc = tile_product(x_desc, 0, off_m, w_desc, e, pid_n * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K, B_TRANS,
                           PRECISION)
        if C_TMA and (pid_m + 1) * BLOCK_M <= rows:
            store_tile(y_desc, 0, y_ptr, stride_ym, R, N, acc, off_m, pid_n * BLOCK_N, BLOCK_M, BLOCK_N,
                       EPILOGUE_SPLIT, True)
        else:  # the expert's last rows: masked stores (the next expert's rows are not ours)
            store_tile(y_desc, 0, y_ptr + tl.cast(start, tl.int64) * stride_ym, stride_ym, rows, N, acc,
                       pid_m * BLOCK_M, pid_n * BLOCK_N, BLOCK_M, BLOCK_N, EPILOGUE_SPLIT, False)


@tilecomm.jit
def _steps_of_program(offs_ptr, E, per_expert, BLOCK_K: tl.constexpr, E_PAD: tl.constexpr):
    """The row steps this program runs in `_wgrad_flat_kernel`: it takes items pid, pid + nprog, ... of the
    E * per_expert items (numbered expert by expert), and an item of expert e takes max(1, cdiv(rows_e,
    BLOCK_K)) steps (an empty expert: one all-masked step, which stores its zero tile)."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    idx = tl.arange(0, E_PAD)
    ends = tl.load(offs_ptr + idx, mask=idx < E, other=0)
    starts = tl.load(offs_ptr + idx - 1, mask=(idx >= 1) & (idx < E), other=0)
    steps = tl.where(idx < E, tl.maximum(tl.cdiv(ends - starts, BLOCK_K), 1), 0)
    first = idx * per_expert  # the expert's first item; items below x that are this program's: cdiv(x - pid, nprog)
    mine = tl.cdiv(tl.maximum(first + per_expert - pid, 0), nprog) - tl.cdiv(tl.maximum(first - pid, 0), nprog)
    return tl.sum(mine * steps, 0)


@tilecomm.jit
def _row_step(x_desc, dy_desc, acc, row, start, off_m, off_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):
    """acc + x[row:row + BLOCK_K, off_m:]^T @ dy[row:row + BLOCK_K, off_n:] with the rows before `start` (the
    previous expert's, or before the first row) out of the product: zeros in both operands (clipped_rows_load)."""
    a = clipped_rows_load(x_desc, row, start, off_m, BLOCK_K, BLOCK_M)
    b = clipped_rows_load(dy_desc, row, start, off_n, BLOCK_K, BLOCK_N)
    return tl.dot(a.T, b, acc, input_precision=PRECISION, out_dtype=ACC)


@tilecomm.jit
def _wgrad_kernel(x_ptr, dy_ptr, dw_ptr, offs_ptr, R, K, N, E, stride_xm, stride_dym, stride_dwe, stride_dw,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  EPILOGUE_SPLIT: tl.constexpr, C_TMA: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):
    """dw [E, K, N], dw[e] = x[rows of e]^T @ dy[rows of e]; items (expert, K tile of BLOCK_M, N tile), one at a
    time: the expert's rows in BLOCK_K-row steps back from its end (`_row_step`); ACC: the accumulator type
    (fp32; fp64 for fp64 operands)."""
    x_desc = clipped_rows_desc(x_ptr, R, K, stride_xm, BLOCK_K, BLOCK_M)
    dy_desc = clipped_rows_desc(dy_ptr, R, N, stride_dym, BLOCK_K, BLOCK_N)
    dw_desc = c_desc3(dw_ptr, E, K, N, stride_dwe, stride_dw, BLOCK_M, BLOCK_N // EPILOGUE_SPLIT, C_TMA)
    tiles_m = tl.cdiv(K, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for item in range(tl.program_id(0), E * tiles_m * tiles_n, tl.num_programs(0)):
        e = item // (tiles_m * tiles_n)
        pid_m, pid_n = tile_position(item % (tiles_m * tiles_n), tiles_m, tiles_n, GROUP_M)
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(offs_ptr + e)
        acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
        for i in tl.range(0, tl.cdiv(end - start, BLOCK_K)):
            acc = _row_step(x_desc, dy_desc, acc, end - (i + 1) * BLOCK_K, start, pid_m * BLOCK_M, pid_n * BLOCK_N,
                            BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, ACC)
        store_tile(dw_desc, e, dw_ptr + tl.cast(e, tl.int64) * stride_dwe, stride_dw, K, N, acc, pid_m * BLOCK_M,
                   pid_n * BLOCK_N, BLOCK_M, BLOCK_N, EPILOGUE_SPLIT, C_TMA)


@tilecomm.jit
def _wgrad_flat_kernel(x_ptr, dy_ptr, dw_ptr, offs_ptr, R, K, N, E, stride_xm, stride_dym, stride_dwe, stride_dw,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       EPILOGUE_SPLIT: tl.constexpr, C_TMA: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
                       E_PAD: tl.constexpr):
    """`_wgrad_kernel`'s product for experts of few rows: the same items, BLOCK_K rows a step, read the same way.

    One flat loop over this program's row steps, all its items in turn (the persistent-matmul form
    before Triton fused loop nests itself: an expert's row count varies, so Triton would not fuse an
    item loop with a row loop): the pipeliner then loads the next item's first rows while this item's
    tile is converted and stored, and the TMA store of one item overlaps the next item's steps. With
    ~128 rows per expert (a 256-expert layer) each item is two steps and a full-tile store: the
    stores, not the MMAs, bound the kernel. Steps go back from the expert's end, as there (`_row_step`)."""
    x_desc = clipped_rows_desc(x_ptr, R, K, stride_xm, BLOCK_K, BLOCK_M)
    dy_desc = clipped_rows_desc(dy_ptr, R, N, stride_dym, BLOCK_K, BLOCK_N)
    dw_desc = c_desc3(dw_ptr, E, K, N, stride_dwe, stride_dw, BLOCK_M, BLOCK_N // EPILOGUE_SPLIT, C_TMA)
    tiles_m = tl.cdiv(K, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_expert = tiles_m * tiles_n
    total = _steps_of_program(offs_ptr, E, per_expert, BLOCK_K, E_PAD)
    item = tl.program_id(0) - tl.num_programs(0)
    step = -1
    num_steps = 0
    e = 0
    start = 0
    end = 0
    off_m = 0
    off_n = 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    for _ in tl.range(0, total):
        step = tl.where(step == num_steps - 1, 0, step + 1)
        if step == 0:  # the next item
            item += tl.num_programs(0)
            e = item // per_expert
            pid_m, pid_n = tile_position(item % per_expert, tiles_m, tiles_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
            end = tl.load(offs_ptr + e)
            num_steps = tl.maximum(tl.cdiv(end - start, BLOCK_K), 1)
        acc = _row_step(x_desc, dy_desc, acc, end - (step + 1) * BLOCK_K, start, off_m, off_n, BLOCK_M, BLOCK_N,
                        BLOCK_K, PRECISION, ACC)
        if step == num_steps - 1:
            store_tile(dw_desc, e, dw_ptr + tl.cast(e, tl.int64) * stride_dwe, stride_dw, K, N, acc, off_m, off_n,
                       BLOCK_M, BLOCK_N, EPILOGUE_SPLIT, C_TMA)
            acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)


# The kernels' launchers (compiled kernels by config and dtype; module-level like Triton's own kernel cache).
_ROWS = CachedLaunch(_rows_kernel)
_WGRAD_LAUNCH = CachedLaunch(_wgrad_kernel)
_WGRAD_FLAT = CachedLaunch(_wgrad_flat_kernel)
_WGRAD_FORMS = {"per_item": _WGRAD_LAUNCH, "flat": _WGRAD_FLAT}
WGRAD_FORMS = tuple(_WGRAD_FORMS)


def _check(x, w, offs, check_offs: bool) -> None:
    what = "tilecomm.overlap.grouped_mm"
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{what}: x must be a 2-D tensor [R, K], got {getattr(x, 'shape', type(x))}")
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise ValueError(f"{what}: w must be a 3-D tensor [E, K, N], got {getattr(w, 'shape', type(w))}")
    if not isinstance(offs, torch.Tensor) or offs.dim() != 1:
        raise ValueError(f"{what}: offs must be a 1-D int32 tensor [E], got {getattr(offs, 'shape', type(offs))}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w.dtype != x.dtype:
        raise TypeError(f"{what}: x and w must share a dtype in bfloat16/float16/float32, got {x.dtype}, {w.dtype}")
    if offs.dtype != torch.int32:
        raise TypeError(f"{what}: offs must be int32 (cumulative row ends), got {offs.dtype}")
    if x.device != w.device or offs.device != x.device:
        raise ValueError(f"{what}: x, w and offs must be on one device, got {x.device}, {w.device}, {offs.device}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"{what}: x [R, K] and w [E, K, N] disagree on K: x {tuple(x.shape)}, w {tuple(w.shape)}")
    if offs.shape[0] != w.shape[0]:
        raise ValueError(f"{what}: offs must have one entry per expert (w has E={w.shape[0]}), got {offs.shape[0]}")
    if not x.is_contiguous():
        raise ValueError(f"{what}: x must be contiguous (row-major), got strides {tuple(x.stride())}")
    if w.stride(2) != 1 and w.stride(1) != 1:
        raise ValueError(f"{what}: w must be row- or column-major in its last two dims, got strides {tuple(w.stride())}")
    if check_offs and offs.numel():  # on GPUs this costs one host sync
        o = offs.cpu()
        if bool((o.diff() < 0).any()) or int(o[0]) < 0:
            raise ValueError(f"{what}: offs must be non-decreasing and >= 0, got {o.tolist()}")
        if int(o[-1]) != x.shape[0]:
            raise ValueError(f"{what}: offs[-1] must equal x's row count {x.shape[0]}, got {int(o[-1])}")


def _rows(x, w, offs, w_trans: bool, config) -> torch.Tensor:
    """y [R, N] per expert: x @ w[e] (w [E, K, N]), or with w_trans x @ w[e]^T (w [E, N, K])."""
    R, K = x.shape
    E, N = w.shape[0], (w.shape[1] if w_trans else w.shape[2])
    y = torch.empty((R, N), dtype=x.dtype, device=x.device)
    if R == 0 or N == 0 or E == 0:
        return y
    if K == 0:
        return y.zero_()
    x_t, _ = tma_operand(x)
    w_t, flip = tma_operand(w, allow_trans=True)  # w_t is w or w's transpose in the last two dims
    trans = w_trans != flip
    cfg = resolve_config(config, R // max(E, 1) + 1, N, x.dtype, x.device, lambda cfg: _launch_rows(
        x_t, w_t, trans, y, offs, cfg), table=_ROWS_TABLE)
    _launch_rows(x_t, w_t, trans, y, offs, cfg)
    return y


def _launch_rows(x, w, trans, y, offs, cfg: GemmConfig) -> None:
    (R, K), E, N = x.shape, w.shape[0], y.shape[1]
    tiles = (cdiv(R, cfg.BLOCK_M) + E + 1) * cdiv(N, cfg.BLOCK_N)
    launch_gemm(_ROWS, tiles, cfg, x, w, y, offs, R, K, N, E, x.stride(0), w.stride(0), w.stride(1),
                y.stride(0), B_TRANS=trans, C_TMA=y.stride(0) * y.element_size() % 16 == 0,
                PRECISION=dot_precision(x.dtype), E_PAD=next_pow2(E + 1))


def _wgrad(x, dy, offs, E: int, config, form: str | None = None) -> torch.Tensor:
    """dw [E, K, N], dw[e] = x[rows of e]^T @ dy[rows of e]. form: the kernel, one of WGRAD_FORMS (None: the
    flat one when the experts have at most FLAT_MAX_ROWS rows on average, else per item); config: a GemmConfig,
    else _WGRAD's for the form."""
    (R, K), N = x.shape, dy.shape[1]
    dw = torch.empty((E, K, N), dtype=x.dtype, device=x.device)
    if R == 0 or K == 0 or N == 0:
        return dw.zero_()
    if form is None:
        form = "flat" if R <= FLAT_MAX_ROWS * E else "per_item"
    if form not in WGRAD_FORMS:
        raise ValueError(f"_wgrad: form={form!r}; expected one of {WGRAD_FORMS} or None")
    x_t, _ = tma_operand(x)
    dy_t, _ = tma_operand(dy.contiguous())
    cfg = config if isinstance(config, GemmConfig) else _WGRAD[form if x.is_cuda else "cpu"]
    if x.is_cuda and x.dtype == torch.float32 and not isinstance(config, GemmConfig):
        cfg = _TABLE["fp32"]  # IEEE fp32: the FMA path's small tiles (a 128x256 tile's stages overflow shared memory)
    tiles = E * cdiv(K, cfg.BLOCK_M) * cdiv(N, cfg.BLOCK_N)
    extra = {"E_PAD": next_pow2(E + 1)} if form == "flat" else {}
    aligned = dw.stride(1) * dw.element_size() % 16 == 0
    launch_gemm(_WGRAD_FORMS[form], tiles, cfg, x_t, dy_t, dw, offs, R, K, N, E, x_t.stride(0),
                dy_t.stride(0), dw.stride(0), dw.stride(1), C_TMA=aligned and not cfg.POINTER_STORES,
                PRECISION=dot_precision(x.dtype), ACC=tl.float64 if x.dtype == torch.float64 else tl.float32,
                **extra)
    return dw


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, config):
        ctx.save_for_backward(x, w, offs)
        ctx.config = config
        return _rows(x, w, offs, False, config)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _rows(dy, w, offs, True, ctx.config) if ctx.needs_input_grad[0] else None
        dw = _wgrad(x, dy, offs, w.shape[0], None) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, config=None, check_offs: bool = True
               ) -> torch.Tensor:
    """x [R, K] rows grouped by expert, w [E, K, N], offs [E] int32 cumulative row ends (offs[-1] = R)
    -> [R, N] (x's dtype: bfloat16, float16 or float32). Differentiable in x and w; the backward
    products (dx = dy @ w[e]^T, dw[e] = x_e^T @ dy_e) are grouped GEMMs too. config: tiles.resolve_config.
    With check_offs (the default) offs is checked first: non-decreasing, last entry R (on GPUs this
    costs one host sync). With check_offs=False offs[-1] may be below R (a dispatcher's padding rows, last): those rows
    get zero outputs and zero gradients (the MoE experts build offs themselves and pass False)."""
    _check(x, w, offs, check_offs)
    return _GroupedMM.apply(x, w, offs, config)


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The per-expert loop in x's dtype (pass float64 for a float64 reference)."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    out = x.new_zeros(x.shape[0], w.shape[2])
    for e, (s, t) in enumerate(zip(starts, ends)):
        out[s:t] = x[s:t] @ w[e]
    return out
