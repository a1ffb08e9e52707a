"""Time tilecomm.overlap's fused ops against NCCL + cuBLAS in sequence (and torch's fused ops).

    torchrun --nproc-per-node 4 -m tilecomm.bench ag_gemm          # or: python -m tilecomm.bench gemm_rs
    python -m tilecomm.bench ag_gemm --backend cpu --world-size 2   # Triton interpreter vs gloo

Shapes (--shapes, comma list of AxBxC), W ranks, per rank:

    ag_gemm  MxKxn: a_shard [M/W, K], b [K, n]; all_gather(a_shard) [M, K] @ b -> [M, n]
    gemm_rs  MxkxN: a [M, k], b [k, N]; reduce_scatter(a @ b) -> [M/W, N]

Columns (the same problem each): gemm = torch.matmul of the full local problem (cuBLAS on GPUs),
coll = torch.distributed all_gather_into_tensor / reduce_scatter_tensor (NCCL on GPUs, gloo on CPU),
seq = coll + gemm in sequence (the baseline), fused = tilecomm.overlap.ag_gemm / gemm_rs with a workspace
made once per shape, as a layer makes it in __init__ (AgGemmWorkspace / GemmRsWorkspace; a call without one
makes and frees a temporary workspace, a collective allocation that costs milliseconds),
tc gemm = tilecomm.overlap.matmul alone, torch = torch.ops.symm_mem.fused_all_gather_matmul /
fused_matmul_reduce_scatter (n/a where unavailable: they need CUDA). speedup = seq / fused,
cap = (gemm + coll) / max(gemm, coll) (the speedup of a perfect overlap), eff = gemm / fused.
Times as in collectives.py: max over ranks of each rank's median µs per call, every rep timing each
column in turn (timed one after another, the column timed first ran 5-7% faster: collectives._times_us).
Before timing, fused (and torch's, and tc gemm against gemm) must match the sequential result: relative
Frobenius error below 2e-2 (bf16), 1e-2 (fp16), 1e-4 (fp32); otherwise every rank raises BenchMismatch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import tilecomm
from tilecomm.overlap import AgGemmWorkspace, GemmRsWorkspace, ag_gemm, gemm_rs, matmul

from .collectives import (_DIST_ALL_GATHER, _DIST_REDUCE_SCATTER, _DTYPES, BenchMismatch, RunConfig, _gather, _sync,
                          _times_us)

OPS = ("ag_gemm", "gemm_rs")
_MIB = 1 << 20
_TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}
# (GPU, CPU) defaults; the CPU shapes' M divides by 2, 3, 4, 6 and 8 ranks
DEFAULTS = {"dtype": ("bfloat16", "float32"), "warmup": (5, 1), "reps": (20, 3), "iters": (10, 2)}
_CPU_SHAPES = [(48, 32, 40), (72, 48, 24)]
_NAMES = ("gemm", "coll", "seq", "fused", "tc_gemm")


@dataclass
class OverlapConfig(RunConfig):
    """What one overlap benchmark run does (picklable: it travels to spawned ranks)."""

    op: str
    shapes: List[Tuple[int, int, int]]


def _gpu_shapes(op: str, world: int) -> List[Tuple[int, int, int]]:
    """TP=W bar shapes: AG+GEMM N = 28672 / 14336 split over W; GEMM+RS k = 7168 / 3584."""
    if op == "ag_gemm":
        return [(8192, 8192, 28672 // world), (8192, 4096, 14336 // world)]
    return [(8192, 7168, 8192), (8192, 3584, 4096)]


def config_from_args(args, backend: str, world: int) -> OverlapConfig:
    """Fill unset options with the GPU or CPU default; ValueError on a bad combination."""
    if args.rows or args.shape or args.symmetric:
        raise ValueError(f"{args.op}: --rows, --shape and --symmetric do not apply (use --shapes MxKxN,...)")
    k = 0 if backend == "cuda" else 1
    vals = {name: pair[k] if getattr(args, name) is None else getattr(args, name) for name, pair in DEFAULTS.items()}
    if args.shapes:
        try:
            shapes = [tuple(int(d) for d in s.lower().split("x")) for s in args.shapes.split(",")]
        except ValueError:
            raise ValueError(f"{args.op}: cannot parse --shapes {args.shapes!r} (e.g. 8192x8192x7168,8192x4096x3584)")
    else:
        shapes = _gpu_shapes(args.op, world) if backend == "cuda" else list(_CPU_SHAPES)
    for s in shapes:
        if len(s) != 3 or min(s) <= 0 or s[0] % world:
            raise ValueError(f"{args.op}: shape {'x'.join(map(str, s))}: need three positive dims, "
                             f"M divisible by the world size ({world})")
    cfg = OverlapConfig(args.op, shapes, **vals, json_path=args.json_path, seed=args.seed)
    if min(cfg.reps, cfg.iters) < 1 or cfg.warmup < 0:
        raise ValueError(f"{args.op}: --reps and --iters must be >= 1, --warmup >= 0")
    return cfg


def heap_bytes(cfg: OverlapConfig, world: int) -> int:
    """Every shape's symmetric workspace stays cached: the workspaces' own heap_bytes summed, twice (the
    collectives keep 1/4 of the heap) plus slack."""
    from .. import _env

    dt = _DTYPES[cfg.dtype]
    need = sum(AgGemmWorkspace.heap_bytes(K, dt, M // world, world) if cfg.op == "ag_gemm"
               else GemmRsWorkspace.heap_bytes(N, dt, M // world, world) for M, K, N in cfg.shapes)
    return max(_env.heap_bytes(torch.cuda.is_available()), 2 * need + 64 * _MIB)


def _problem(op: str, shape, dt: torch.dtype, device: torch.device) -> Dict[str, Callable]:
    """The five timed callables (plus "torch", torch's fused op) on this rank's random operands; "workspace"
    is tilecomm's symmetric workspace for the shape (the caller frees it)."""
    (M, K, N), W = shape, dist.get_world_size()
    group = dist.group.WORLD.group_name
    c = torch.empty((M, N), dtype=dt, device=device)
    if op == "ag_gemm":
        a = torch.randn(M // W, K, device=device).to(dt)
        b = torch.randn(K, N, device=device).to(dt)
        full = torch.empty((M, K), dtype=dt, device=device)
        ws = AgGemmWorkspace(K, dt, M // W)
        fns = {"gemm": lambda: torch.matmul(full, b, out=c), "coll": lambda: _DIST_ALL_GATHER(full, a),
               "fused": lambda: ag_gemm(a, b, workspace=ws), "tc_gemm": lambda: matmul(full, b),
               "torch": lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group, return_A=False)[1][0]}
        fns["seq"] = lambda: (fns["coll"](), fns["gemm"]())[1]
    else:
        a = torch.randn(M, K, device=device).to(dt)
        b = torch.randn(K, N, device=device).to(dt)
        out = torch.empty((M // W, N), dtype=dt, device=device)
        ws = GemmRsWorkspace(N, dt, M // W)
        fns = {"gemm": lambda: torch.matmul(a, b, out=c), "coll": lambda: _DIST_REDUCE_SCATTER(out, c),
               "fused": lambda: gemm_rs(a, b, workspace=ws), "tc_gemm": lambda: matmul(a, b),
               "torch": lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group)}
        fns["seq"] = lambda: (fns["gemm"](), fns["coll"](), out)[2]
    fns["product"] = lambda: c  # the local GEMM's result, as the last gemm/seq call left it
    fns["workspace"] = ws
    return fns


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((x.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _verify(label: str, fns, dt: torch.dtype, cuda: bool) -> None:
    """fused vs seq, tc_gemm vs gemm on every rank; BenchMismatch on every rank if any rank is off."""
    ref = fns["seq"]().clone()
    prod = fns["product"]().clone()
    got = {"fused": fns["fused"](), "tc_gemm": fns["tc_gemm"]()}
    _sync(cuda)
    tilecomm.check_errors()
    errs = {"fused": _rel_err(got["fused"], ref), "tc_gemm": _rel_err(got["tc_gemm"], prod)}
    mine = [f"rank {dist.get_rank()}: {k} rel. Frobenius error {e:.3g} (limit {_TOL[dt]:g})"
            for k, e in errs.items() if not e < _TOL[dt]]
    problems = [p for ps in _gather(mine) for p in ps]
    if problems:
        raise BenchMismatch(f"{label}: tilecomm differs from the sequential torch result:\n  " + "\n  ".join(problems))


def _try_torch_fused(fns, dt: torch.dtype, cuda: bool) -> Optional[str]:
    """None if torch's fused op runs and matches seq on every rank, else why not (then shown n/a)."""
    if not cuda:
        return "needs CUDA"
    why = None
    try:
        from torch.distributed import _symmetric_memory as symm

        if hasattr(symm, "enable_symm_mem_for_group"):
            symm.enable_symm_mem_for_group(dist.group.WORLD.group_name)
        ref = fns["seq"]().clone()
        err = _rel_err(fns["torch"](), ref)
        _sync(cuda)
        why = None if err < _TOL[dt] else f"rel. error {err:.3g}"
    except Exception as exc:  # missing op, no symmetric-memory backend, ...
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    reasons = [r for r in _gather(why) if r]
    return reasons[0] if reasons else None


def _run_case(cfg: OverlapConfig, shape, cuda: bool) -> dict:
    dt = _DTYPES[cfg.dtype]
    label = f"{cfg.op} {'x'.join(map(str, shape))} {cfg.dtype}"
    fns = _problem(cfg.op, shape, dt, tilecomm.current().device)
    try:
        _verify(label, fns, dt, cuda)
        torch_na = _try_torch_fused(fns, dt, cuda)
        names = _NAMES + (() if torch_na else ("torch",))
        mine = _times_us({n: fns[n] for n in names}, cfg, cuda)  # the columns in turn in every rep
        per_rank = {n: _gather(mine[n]) for n in names}
        t = {n: max(us) for n, us in per_rank.items()}
    finally:
        fns["workspace"].free()
    base = dist.get_backend()
    return {"op": cfg.op, "shape": "x".join(map(str, shape)), "dtype": cfg.dtype, "world": dist.get_world_size(),
            "gemm_us": t["gemm"], "coll_us": t["coll"], "baseline_us": t["seq"], "tilecomm_us": t["fused"],
            "tilecomm_gemm_us": t["tc_gemm"], "torch_fused_us": t.get("torch"), "torch_fused_na": torch_na,
            "speedup": t["seq"] / t["fused"], "cap": (t["gemm"] + t["coll"]) / max(t["gemm"], t["coll"]),
            "overlap_eff": t["gemm"] / t["fused"], "baseline": f"torch.distributed/{base} + torch.matmul in sequence",
            "backend": tilecomm.current().backend, "per_rank_us": per_rank}


_COLS = "{:<17} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7} {:>5} {:>5}"


def _header(cfg: OverlapConfig, backend: str) -> str:
    base, what = dist.get_backend(), {"ag_gemm": ("all_gather", "MxKxn"), "gemm_rs": ("reduce_scatter", "MxkxN")}
    coll, dims = what[cfg.op]
    lines = [f"tilecomm.bench {cfg.op}: world={dist.get_world_size()}, backend={backend}, shape = {dims} "
             f"(see tilecomm.bench.overlap); gemm = torch.matmul, coll = torch.distributed {coll} ({base}), "
             "seq = both in sequence, fused = tilecomm, tc gemm = tilecomm.overlap.matmul, torch = torch.ops.symm_mem fused op",
             f"time = max over ranks of each rank's median µs per call ({cfg.reps} reps x {cfg.iters} calls, "
             f"{cfg.warmup} warm-up, the columns in turn in each rep); speedup = seq / fused, "
             "cap = (gemm + coll) / max(gemm, coll), eff = gemm / fused"]
    if backend == "cpu":
        lines.append("NOTE: cpu backend (Triton interpreter vs gloo): these timings check that the benchmark runs; "
                     "they are NOT meaningful performance numbers.")
    lines.append(_COLS.format("shape", "dtype", "gemm µs", "coll µs", "seq µs", "fused µs", "tc gemm", "torch µs",
                              "speedup", "cap", "eff"))
    return "\n".join(lines)


def _row(r: dict) -> str:
    torch_us = "n/a" if r["torch_fused_us"] is None else f"{r['torch_fused_us']:.1f}"
    return _COLS.format(r["shape"], r["dtype"], *(f"{r[k]:.1f}" for k in ("gemm_us", "coll_us", "baseline_us",
                        "tilecomm_us", "tilecomm_gemm_us")), torch_us, f"{r['speedup']:.2f}", f"{r['cap']:.2f}",
                        f"{r['overlap_eff']:.2f}")


def run_rank(cfg: OverlapConfig) -> List[dict]:
    """Every rank's body (torch.distributed and tilecomm initialised): verify, time, print on rank 0.

    Returns the rows (same on every rank); rank 0 also writes them to cfg.json_path as a JSON list."""
    rank, backend = dist.get_rank(), tilecomm.current().backend
    cuda = backend == "cuda"
    torch.manual_seed(cfg.seed * 1000 + rank)  # different data on every rank
    if rank == 0:
        print(_header(cfg, backend), flush=True)
    rows = []
    for shape in cfg.shapes:
        rows.append(_run_case(cfg, shape, cuda))
        if rank == 0:
            print(_row(rows[-1]), flush=True)
            per_rank = rows[-1]["per_rank_us"]  # which rank sets each max (a slow GPU, or a slow op everywhere)
            print("  per rank µs: " + "; ".join(f"{n} " + " ".join(f"{us:.1f}" for us in per_rank[n])
                                             for n in ("gemm", "tc_gemm", "fused")), flush=True)
            if rows[-1]["torch_fused_na"] and cuda:
                print(f"  torch fused op n/a: {rows[-1]['torch_fused_na']}", flush=True)
    if rank == 0 and cfg.json_path:
        with open(cfg.json_path, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {len(rows)} rows to {cfg.json_path}", flush=True)
    return rows
