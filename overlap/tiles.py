"""The one Hopper tile GEMM every overlapped kernel is built from, its tuning table, and `matmul`.

A tile is BLOCK_M x BLOCK_N of C = A @ B, accumulated in fp32 over BLOCK_K steps. Operands move by
TMA: every kernel builds tensor descriptors on the device (`tl.make_tensor_descriptor`; Triton asks
`triton.set_allocator` for their scratch) over 3-D views, [groups, rows, cols], so a tile never reads
or writes past its group (a rank's shard, an owner's row block, an expert) even when the group's rows
are not a multiple of BLOCK_M: out-of-bounds rows and columns load as zero and are not stored.

    A  [G, rows, K]            load block [1, BLOCK_M, BLOCK_K] at (g, off_m, k)
    B  [E, K, N] (or [E, N, K] with B_TRANS: a transposed weight read in place)
    C  [G, rows, N]            stored in EPILOGUE_SPLIT column slices (epilogue subtiling)

Persistent kernels launch one program per SM (at most one per tile) that walks tiles pid, pid + nprog,
...; `tile_position` maps a linear tile id to (pid_m, pid_n) in GROUP_M-row bands (L2 reuse of B).
The same source runs compiled (Triton 3.6, sm_90) and interpreted on CPU ranks (Triton 3.9).

TMA needs 16-byte aligned base addresses and row strides: `tma_operand` gives an operand with unit
column stride and an aligned row stride (a padded copy only when the caller's tensor has neither);
an unaligned output is stored with masked pointer stores instead (C_TMA=False).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

import tilecomm
from tilecomm.jit import CachedLaunch, cdiv, prepare_tma


@dataclass(frozen=True)
class GemmConfig:
    """Block shape and launch knobs of the tile GEMM (the kernels' constexprs and launch options)."""

    BLOCK_M: int = 128
    BLOCK_N: int = 256
    BLOCK_K: int = 64
    GROUP_M: int = 8
    num_warps: int = 8
    num_stages: int = 3
    EPILOGUE_SPLIT: int = 2
    WARP_SPECIALIZE: bool = False
    FLATTEN: bool = True  # kernels that declare it: tile loop and K loop fused into one pipelined loop
    PROGRAMS_PER_SM: int = 1  # persistent programs per SM (more than 1: one's epilogue overlaps another's loads)
    POINTER_STORES: bool = False  # kernels that store C by TMA where it is aligned: masked pointer stores instead

    def launch(self) -> dict:
        """Keyword arguments of a kernel launch (a fresh dict; dataclasses.asdict, ~10 µs, runs once per config)."""
        return dict(_launch_kwargs(self))


# GemmConfig fields read on the host (the grid, the store path), not kernel constexprs or launch options
_GRID_FIELDS = ("PROGRAMS_PER_SM", "POINTER_STORES")


@functools.lru_cache(maxsize=None)
def _launch_kwargs(cfg: GemmConfig) -> dict:
    return {k: v for k, v in asdict(cfg).items() if k not in _GRID_FIELDS}


@functools.lru_cache(maxsize=None)
def _kernel_kwargs(cfg: GemmConfig, launcher: CachedLaunch) -> dict:
    """cfg's constexprs that launcher's kernel declares, and the launch options (num_warps, num_stages)."""
    return {k: v for k, v in _launch_kwargs(cfg).items() if k in launcher.names or k in ("num_warps", "num_stages")}


# Per shape bucket, from `python -m tilecomm.bench.gemm --sweep` (BENCHMARKS.md, GEMM section):
# 128x256x64, 8 warps, 3 stages was best on every large shape. H200: GROUP_M 16 / 2-way epilogue split 96.3% of
# cuBLAS (geomean, five bar shapes), GROUP_M 8 / no split 96.2%; H100 (8192x7168x8192, 8192x3584x4096):
# GROUP_M 8 / no split 100.0% / 101.1%, GROUP_M 16 / split 96.5% / 102.1%: the table takes GROUP_M 8, no split.
# "narrow" / "small": not swept on their own. "tiny" (matmul only: fewer than TINY_TILES tiles of 128x256, under half
# the SMs busy): tests/small_gemm_probe.py, one H200, 2026-11-28, kernel µs (torch.profiler) against the bucket's
# config before: 1000^3 12.6 against 14.8 ("small", 64x64), 1024^3 8.9 against 15.6 ("mid", 128x256: 32 programs),
# 256x4096x4096 20.6 against 25.5 ("narrow", 128x128); cuBLAS 7.2 / 5.3 / 14.9. 2048^3 (128 tiles) keeps "mid":
# 26.9 against 38.9 with 64x128. At these sizes the call's host time (~40 µs, cuBLAS's ~17) is the larger part.
# "mid" (fewer than 1024 tiles of 128x256, about 8 waves on 132 SMs): H200 sweep of 2026-11-26 (0c86f49),
# 8192x3584x4096: GROUP_M 4 97.6% of cuBLAS, GROUP_M 8 93.8%, 16 94.3%; 2048x8192x7168 and 4096^3: GROUP_M 4
# 101.9 / 103.6%, GROUP_M 8 102.5 / 104.0% (the same within the sweep's spread).
_TABLE = {
    "large": GemmConfig(128, 256, 64, 8, 8, 3, 1, False),  # M >= 1024 and N >= 1024, 1024 tiles or more
    "mid": GemmConfig(128, 256, 64, 4, 8, 3, 1, False),    # M >= 1024 and N >= 1024, fewer tiles
    "narrow": GemmConfig(128, 128, 64, 8, 8, 4, 1, False),  # one of M, N below 1024
    "small": GemmConfig(64, 64, 64, 8, 4, 4, 1, False),     # both below 1024
    "tiny": GemmConfig(64, 128, 64, 8, 4, 4, 1, False),     # matmul with fewer than TINY_TILES tiles of 128x256
    "fp32": GemmConfig(64, 64, 32, 8, 4, 3, 1, False),      # IEEE fp32 FMA path: small tiles, no spills
}
_CPU = GemmConfig(16, 16, 16, 2, 1, 1, 1, False)  # interpreter: small tiles keep CPU ranks fast
CANDIDATES = [GemmConfig(*c) for c in [
    (128, 256, 64, 16, 8, 3, 2, False), (128, 256, 64, 8, 8, 3, 1, False), (128, 256, 64, 16, 8, 4, 2, False),
    (128, 256, 64, 32, 8, 3, 2, False), (128, 256, 64, 16, 8, 3, 2, True), (256, 128, 64, 16, 8, 3, 2, False)]]
# more shapes of tile for the sweep (`python -m tilecomm.bench.gemm --sweep`; not the autotuner's: each costs a
# compile): 4 stages, smaller and deeper tiles, two programs per SM, the unflattened loop
SWEEP_CANDIDATES = CANDIDATES + [GemmConfig(*c) for c in [
    (128, 256, 64, 8, 8, 4, 1, False), (128, 256, 64, 4, 8, 3, 1, False), (256, 128, 64, 8, 8, 3, 1, False),
    (128, 128, 64, 8, 8, 4, 1, False), (128, 128, 64, 8, 4, 4, 1, False, True, 2), (128, 128, 128, 8, 8, 3, 1, False),
    (128, 256, 64, 8, 8, 3, 1, False, False)]]


def bucket(m: int, n: int, dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "fp32"
    if min(m, n) >= 1024:
        return "large" if cdiv(m, 128) * cdiv(n, 256) >= 1024 else "mid"
    return "narrow" if max(m, n) >= 1024 else "small"


TINY_TILES = 64


def matmul_bucket(m: int, n: int, dtype: torch.dtype) -> str:
    """`bucket`, and "tiny" for a 16-bit product of fewer than TINY_TILES 128x256 tiles (matmul's whole output;
    not the grouped kernels', whose m is the rows of one expert)."""
    if dtype != torch.float32 and cdiv(m, 128) * cdiv(n, 256) < TINY_TILES:
        return "tiny"
    return bucket(m, n, dtype)


class GemmTuner:
    """Autotuning behind a flag: pass one as `config=` to matmul / ag_gemm / gemm_rs / grouped_mm. The
    first call of each (op, bucket, dtype) times every candidate (`timer(fn) -> seconds`, default
    triton.testing.do_bench) on that call's operands and keeps the fastest; later calls reuse it."""

    def __init__(self, candidates=None, timer=None):
        self.candidates = list(candidates or CANDIDATES)
        self.timer = timer or (lambda fn: triton.testing.do_bench(fn, warmup=5, rep=20))
        self.chosen: dict = {}

    def pick(self, key, run) -> GemmConfig:
        """The config for `key`; `run(cfg)` launches the op once with cfg (used to time candidates)."""
        if key not in self.chosen:
            timed = []
            for cfg in self.candidates:
                try:
                    timed.append((self.timer(lambda cfg=cfg: run(cfg)), cfg))
                except (RuntimeError, triton.runtime.errors.OutOfResources):
                    continue  # a candidate that does not fit this GPU
            if not timed:
                raise RuntimeError(f"GemmTuner: no candidate config ran for {key}")
            self.chosen[key] = min(timed, key=lambda t: t[0])[1]
        return self.chosen[key]


def resolve_config(config, m: int, n: int, dtype: torch.dtype, device: torch.device, run, table=None,
                   bucket_of=bucket) -> GemmConfig:
    """config: None (the table's entry for an [m, n] output, in the bucket `bucket_of` names; table: _TABLE unless
    given), a GemmConfig, or a GemmTuner (which times `run(cfg)`, a plain tile GEMM of the call's operands, once
    per bucket)."""
    if isinstance(config, GemmConfig):
        return config
    if config is not None and not isinstance(config, GemmTuner):
        raise TypeError(f"config must be None, a GemmConfig or a GemmTuner, got {type(config).__name__}")
    if device.type != "cuda":
        return _CPU
    if isinstance(config, GemmTuner) and dtype != torch.float32:
        return config.pick((bucket_of(m, n, dtype), dtype), run)
    return (table or _TABLE)[bucket_of(m, n, dtype)]


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(num_tiles: int, device: torch.device, per_sm: int = 1) -> int:
    if device.type != "cuda":
        return max(1, min(num_tiles, 4))
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(num_tiles, per_sm * sms))


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.stride(-1) == 1 and (t.stride(-2) * size) % 16 == 0 and t.data_ptr() % 16 == 0


def tma_operand(t: torch.Tensor, allow_trans: bool = False) -> tuple[torch.Tensor, bool]:
    """(u, trans): u has unit last stride and a 16-byte aligned row stride. trans: u is t.mT (a
    column-major t read in place, allowed with allow_trans); else u holds t's values (t itself when
    it is already aligned, otherwise a padded copy whose extra columns are never read)."""
    if _aligned(t):
        return t, False
    if allow_trans and t.dim() >= 2 and _aligned(t.mT):
        return t.mT, True
    pad = 16 // t.element_size()
    cols = t.shape[-1]
    buf = torch.empty(*t.shape[:-1], cdiv(max(cols, 1), pad) * pad, dtype=t.dtype, device=t.device)
    out = buf[..., :cols]
    out.copy_(t)
    return out, False


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 (and fp64) operands multiply in IEEE arithmetic (as torch.matmul does by default), 16-bit ones on
    tensor cores."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


@tilecomm.jit
def tile_position(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of linear tile id `tile`: column-major inside bands of GROUP_M tile rows."""
    per_band = GROUP_M * tiles_n
    first_m = (tile // per_band) * GROUP_M
    band_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_band) % band_m, (tile % per_band) // band_m


@tilecomm.jit
def desc3(ptr, groups, rows, cols, stride_g, stride_r, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """A TMA descriptor of the [groups, rows, cols] view of ptr (unit column stride)."""
    return tl.make_tensor_descriptor(ptr, [groups, rows, cols], [stride_g, stride_r, 1], [1, BLOCK_R, BLOCK_C])


@tilecomm.jit
def clipped_rows_desc(ptr, R, cols, stride_r, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """A TMA descriptor of ptr [R, cols] whose loads (`clipped_rows_load`) start at a row bound given per load:
    rows before it come in as zeros, with no register mask (the tile goes from shared memory straight to the
    MMA).

    The view is [R, BLOCK_R, cols] over ptr with both outer strides one row: element [a, r, c] is row a + r.
    TMA reads only elements inside the view and fills the others with zeros; a negative r is outside it, so
    [a, r, c] with a = the first row kept and r <= 0 zero-fills the rows before a. No address outside ptr's
    rows is formed: the view starts at ptr and every row read lies in [0, R)."""
    return tl.make_tensor_descriptor(ptr, [R, BLOCK_R, cols], [stride_r, stride_r, 1], [1, BLOCK_R, BLOCK_C])


@tilecomm.jit
def clipped_rows_load(desc, row, start, col, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows row .. row + BLOCK_R - 1 of a clipped_rows_desc from column col, those before `start` as 0
    ([BLOCK_R, BLOCK_C]; row may be negative; the rows read, max(row, start) .. row + BLOCK_R - 1, must lie
    in [0, R), or all of them are zeros when start = R)."""
    first = tl.maximum(row, start)
    return desc.load([first, row - first, col]).reshape(BLOCK_R, BLOCK_C)


@tilecomm.jit
def c_desc3(ptr, groups, rows, cols, stride_g, stride_r, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
            C_TMA: tl.constexpr):
    """The output's descriptor when it is TMA-aligned (C_TMA), else None (store_tile then masks)."""
    desc = None
    if C_TMA:
        desc = desc3(ptr, groups, rows, cols, stride_g, stride_r, BLOCK_R, BLOCK_C)
    return desc


@tilecomm.jit
def b_desc3(b_ptr, E, K, N, stride_be, stride_b, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
            B_TRANS: tl.constexpr):
    """B's descriptor: [E, K, N] row-major, or with B_TRANS the [E, N, K] array it is the transpose of."""
    if B_TRANS:
        desc = desc3(b_ptr, E, N, K, stride_be, stride_b, BLOCK_N, BLOCK_K)
    else:
        desc = desc3(b_ptr, E, K, N, stride_be, stride_b, BLOCK_K, BLOCK_N)
    return desc


@tilecomm.jit
def tile_product(a_desc, a_g, off_m, b_desc, b_g, off_n, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, B_TRANS: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] = A[a_g, off_m:+BLOCK_M, :] @ B_(b_g)[:, off_n:+BLOCK_N] (zero past the edges)."""
    return tile_product_acc(a_desc, a_g, off_m, b_desc, b_g, off_n, K, BLOCK_M, BLOCK_N, BLOCK_K, B_TRANS, PRECISION,
                            tl.float32)


@tilecomm.jit
def tile_product_acc(a_desc, a_g, off_m, b_desc, b_g, off_n, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, B_TRANS: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):
    """`tile_product` accumulating in ACC (tl.float32, or tl.float64 for fp64 operands)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([a_g, off_m, k * BLOCK_K]).reshape(BLOCK_M, BLOCK_K)
        if B_TRANS:
            b = b_desc.load([b_g, off_n, k * BLOCK_K]).reshape(BLOCK_N, BLOCK_K).T
        else:
            b = b_desc.load([b_g, k * BLOCK_K, off_n]).reshape(BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
    return acc


@tilecomm.jit
def split_cols(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(left, right): the column halves [BLOCK_M, BLOCK_N // 2] of x [BLOCK_M, BLOCK_N]."""
    return tl.split(x.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1))


@tilecomm.jit
def store_tile(c_desc, c_g, c_ptr, stride_cm, rows, N, acc, off_m, off_n, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr, C_TMA: tl.constexpr):
    """Store acc (fp32) at rows off_m.., columns off_n.. of group c_g, in C's dtype. C_TMA: through c_desc
    in EPILOGUE_SPLIT column slices; else masked stores at c_ptr (group c_g's first row) + r * stride_cm + c."""
    dtype = c_ptr.dtype.element_ty
    if C_TMA:
        if EPILOGUE_SPLIT == 2:
            c0, c1 = split_cols(acc, BLOCK_M, BLOCK_N)
            c_desc.store([c_g, off_m, off_n], c0.to(dtype).reshape(1, BLOCK_M, BLOCK_N // 2))
            c_desc.store([c_g, off_m, off_n + BLOCK_N // 2], c1.to(dtype).reshape(1, BLOCK_M, BLOCK_N // 2))
        else:
            c_desc.store([c_g, off_m, off_n], acc.to(dtype).reshape(1, BLOCK_M, BLOCK_N))
    else:
        r = off_m + tl.arange(0, BLOCK_M)
        c = off_n + tl.arange(0, BLOCK_N)
        tl.store(c_ptr + r[:, None].to(tl.int64) * stride_cm + c[None, :], acc.to(dtype),
                 mask=(r[:, None] < rows) & (c[None, :] < N))


@tilecomm.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_b, stride_cm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   EPILOGUE_SPLIT: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, B_TRANS: tl.constexpr,
                   C_TMA: tl.constexpr, PRECISION: tl.constexpr):
    a_desc = desc3(a_ptr, 1, M, K, tl.cast(M, tl.int64) * stride_am, stride_am, BLOCK_M, BLOCK_K)
    # one group: any aligned group stride will do
    b_desc = b_desc3(b_ptr, 1, K, N, tl.cast(K + N, tl.int64) * stride_b, stride_b, BLOCK_K, BLOCK_N, B_TRANS)
    c_desc = c_desc3(c_ptr, 1, M, N, tl.cast(M, tl.int64) * stride_cm, stride_cm, BLOCK_M, BLOCK_N // EPILOGUE_SPLIT,
                     C_TMA)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=not WARP_SPECIALIZE,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = tile_position(tile, tiles_m, tiles_n, GROUP_M)
        acc = tile_product(a_desc, 0, pid_m * BLOCK_M, b_desc, 0, pid_n * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                           B_TRANS, PRECISION)
        store_tile(c_desc, 0, c_ptr, stride_cm, M, N, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, BLOCK_M, BLOCK_N,
                   EPILOGUE_SPLIT, C_TMA)


def check_operands(what: str, a: torch.Tensor, b: torch.Tensor, a_name: str = "a", b_name: str = "b") -> None:
    for name, t in ((a_name, a), (b_name, b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{what}: {name} must be a 2-D tensor, got {getattr(t, 'shape', type(t))}")
    if a.dtype != b.dtype or a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{what}: {a_name} and {b_name} must share a dtype in float16/bfloat16/float32, got {a.dtype}, {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{what}: {a_name} is on {a.device}, {b_name} on {b.device}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{what}: inner dimensions differ: {a_name} {tuple(a.shape)} @ {b_name} {tuple(b.shape)}")
    if not a.is_contiguous():
        raise ValueError(f"{what}: {a_name} must be contiguous (row-major), got strides {tuple(a.stride())}")


def launch_gemm(launcher: CachedLaunch, tiles: int, cfg: GemmConfig, *args, **flags) -> None:
    """Launch a persistent tile-GEMM kernel on min(tiles, SMs) programs through its CachedLaunch: args are the
    kernel's runtime arguments in order (args[0] a tensor on the launch device), flags its constexprs besides
    cfg's fields. Compiled kernels are keyed by (cfg, the tensors' dtypes, flags): the first launch of a key
    compiles (or finds) the kernel the ordinary way, later ones go straight to it (~100 µs of Triton's
    argument binding saved per call on GPUs; CPU ranks take the interpreted launch)."""
    prepare_tma()
    key = (cfg, tuple(a.dtype for a in args if isinstance(a, torch.Tensor)), tuple(flags.items()))
    launcher.launch((num_programs(tiles, args[0].device, cfg.PROGRAMS_PER_SM),), key, *args, **flags,
                    **_kernel_kwargs(cfg, launcher))


# The launcher of each GEMM kernel (its compiled kernels by config; module-level like Triton's own kernel cache).
_MATMUL = CachedLaunch(_matmul_kernel)


def _launch_matmul(a, b, b_trans, c, cfg: GemmConfig) -> None:
    M, K = a.shape
    N = c.shape[1]
    launch_gemm(_MATMUL, cdiv(M, cfg.BLOCK_M) * cdiv(N, cfg.BLOCK_N), cfg, a, b, c, M, N, K,
                a.stride(0), b.stride(0), c.stride(0), B_TRANS=b_trans, C_TMA=_aligned(c),
                PRECISION=dot_precision(a.dtype))


def matmul(a: torch.Tensor, b: torch.Tensor, config=None) -> torch.Tensor:
    """C [M, N] = a [M, K] @ b [K, N] with the persistent TMA tile GEMM (the one the fused ops use).
    b may be row- or column-major (a transposed weight is read in place). config: see resolve_config."""
    check_operands("tilecomm.overlap.matmul", a, b)
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    a, _ = tma_operand(a)
    bt, b_trans = tma_operand(b, allow_trans=True)
    cfg = resolve_config(config, M, N, a.dtype, a.device, lambda cfg: _launch_matmul(a, bt, b_trans, c, cfg),
                         bucket_of=matmul_bucket)
    _launch_matmul(a, bt, b_trans, c, cfg)
    return c
