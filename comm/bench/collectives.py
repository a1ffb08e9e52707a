"""Time tilecomm's collectives and torch.distributed's (NCCL on GPUs, gloo on CPU) on the same tensors.

Sizes (`Config.shapes`, each (R, C)) and, with W ranks, each rank's tensors:

    all_to_all      input (R, C) -> output (R, C)      R = rows per rank, C = hidden; R % W == 0
    all_gather      input (R/W, C) -> output (R, C)    (R, C) = the gathered output
    reduce_scatter  input (R, C) -> output (R/W, C)    (R, C) = the input before scattering

Bytes per rank (what leaves the rank), elem = the dtype's size in bytes:

    all_to_all      R·C·elem × (W-1)/W   (input bytes)
    all_gather      R·C·elem × (W-1)/W   (output bytes)
    reduce_scatter  R·C·elem × (W-1)/W   (input bytes)

all_to_all --uneven: rank s sends n[s][d] = b + ((s + 2d) mod 3 - 1) * (b // 2) rows to rank d, b = R / W
(so every rank sends and receives a different number of rows, some pairs half and some 1.5 times the even
share), through output_split_sizes / input_split_sizes; bytes = the mean over ranks of the rows a rank
sends to other ranks × C·elem.

Timing: `warmup` calls of each side, then `reps` reps; in each rep tilecomm and the baseline take turns,
each after a barrier timing `iters` back-to-back calls (CUDA events on GPU, perf_counter on CPU), so a
drift of the GPU's clock over the run falls on both alike. A rank's time is the median over reps of
(rep time / iters); the reported time is the max of that over ranks. GB/s = bytes / time / 1e9.
Before timing, each size's tilecomm output is checked against the baseline's (see `_verify`).
"""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

import tilecomm

OPS = ("all_to_all", "all_gather", "reduce_scatter")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_MIB = 1 << 20
# torch >= 2.13 names them *_single and deprecates the *_tensor names (same signature)
_DIST_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_DIST_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class BenchMismatch(RuntimeError):
    """tilecomm's result differs from torch.distributed's on the same input."""


@dataclass(kw_only=True)
class RunConfig:
    """Settings every benchmark shares: dtype, timing loop (module docstring), JSON output, seed."""

    dtype: str = "bfloat16"
    warmup: int = 5
    reps: int = 20
    iters: int = 10
    json_path: Optional[str] = None
    seed: int = 0


@dataclass
class Config(RunConfig):
    """What one collectives benchmark run does (picklable: it travels to spawned ranks)."""

    op: str
    shapes: List[Tuple[int, int]]
    symmetric: bool = False
    uneven: bool = False


@dataclass
class Case:
    """One size: the (R, C) given, this rank's input/output shapes, and the bytes counted per rank."""

    op: str
    shape: Tuple[int, int]
    in_shape: Tuple[int, int]
    out_shape: Tuple[int, int]
    dtype: torch.dtype
    nbytes: float

    @property
    def label(self) -> str:
        return "x".join(map(str, self.shape)) + " " + str(self.dtype).replace("torch.", "")


def make_case(op: str, shape: Tuple[int, int], dtype: str, world: int) -> Case:
    """Shapes and byte count of the module docstring; ValueError if R does not divide by W."""
    rows, cols = shape
    if rows % world:
        what = "rows per rank" if op == "all_to_all" else "the first dim"
        raise ValueError(f"{op}: {what} ({rows}) must divide by the world size ({world})")
    dt = _DTYPES[dtype]
    full, part = (rows, cols), (rows // world, cols)
    in_shape, out_shape = {"all_to_all": (full, full), "all_gather": (part, full), "reduce_scatter": (full, part)}[op]
    nbytes = rows * cols * dt.itemsize * (world - 1) / world
    return Case(op, shape, in_shape, out_shape, dt, nbytes)


def uneven_splits(rows: int, world: int) -> List[List[int]]:
    """n[s][d]: rows rank s sends to rank d in an --uneven all_to_all of `rows` rows per rank (module docstring)."""
    b = rows // world
    return [[b + ((s + 2 * d) % 3 - 1) * (b // 2) for d in range(world)] for s in range(world)]


def _make_uneven(case: Case, world: int, rank: int) -> Tuple[Case, dict]:
    """The rank's Case of an uneven all_to_all (its own input/output rows) and the split-size kwargs."""
    n = uneven_splits(case.shape[0], world)
    send = n[rank]
    recv = [n[s][rank] for s in range(world)]
    cols = case.shape[1]
    off_rank = sum(sum(n[s]) - n[s][s] for s in range(world)) / world
    uneven = Case(case.op, case.shape, (sum(send), cols), (sum(recv), cols), case.dtype,
                  off_rank * cols * case.dtype.itemsize)
    return uneven, {"output_split_sizes": recv, "input_split_sizes": send}


def heap_bytes_needed(cases: List[Case]) -> int:
    """Heap for the largest input: with --symmetric the 3/4 of the heap beside the collectives' workspace must hold
    it (staged inputs stream through the workspace, whatever their size), plus slack; callers take at least the
    default heap, whose workspace holds the collectives' tuned rings."""
    biggest = max(math.prod(c.in_shape) * c.dtype.itemsize for c in cases) * 3 // 2  # (--uneven: up to 1.5x)
    return 4 * biggest + 16 * _MIB


def _functions(op: str):
    """(tilecomm's, torch.distributed's) form of the op, both called as fn(output, input)."""
    return {"all_to_all": (tilecomm.all_to_all_single, dist.all_to_all_single),
            "all_gather": (tilecomm.all_gather_into_tensor, _DIST_ALL_GATHER),
            "reduce_scatter": (tilecomm.reduce_scatter_tensor, _DIST_REDUCE_SCATTER)}[op]


def _input(case: Case, symmetric: bool, device: torch.device, heap_rows: int):
    """(input, its heap tensor or None): random normal input (never zeros); with `symmetric`, the leading rows
    of a tilecomm.empty tensor of `heap_rows` rows (the same on every rank: uneven inputs differ in length)."""
    data = torch.randn(case.in_shape, dtype=torch.float32, device=device).to(case.dtype)
    if not symmetric:
        return data, None
    t = tilecomm.empty((heap_rows, case.in_shape[1]), case.dtype)
    t[:case.in_shape[0]].copy_(data)
    return t[:case.in_shape[0]], t


def _sync(cuda: bool, barrier: bool = False) -> None:
    """Wait for this rank's queued GPU work; with `barrier`, then for every rank to get there."""
    if cuda:
        torch.cuda.synchronize()
    if barrier:
        dist.barrier()
        _sync(cuda)


def _gather(value) -> list:
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, value)
    return got


def _mismatch(case: Case, ours: torch.Tensor, theirs: torch.Tensor, inp: torch.Tensor) -> Optional[str]:
    """None if the outputs agree, else a description. all_to_all / all_gather (and integer
    reduce_scatter): bit-exact. Floating reduce_scatter: |tilecomm - baseline| <= 2·W·u·Σ_p|x_p|
    elementwise, u = unit roundoff of the dtype (2^-8 bf16, 2^-11 fp16, 2^-24 fp32): the summation
    error bound of either side, whatever order each sums in (tilecomm accumulates in fp32)."""
    diff = (ours.float() - theirs.float()).abs()
    if case.op == "reduce_scatter" and case.dtype.is_floating_point:
        mag = torch.empty(case.out_shape, dtype=torch.float32, device=inp.device)
        _DIST_REDUCE_SCATTER(mag, inp.float().abs())
        bound = 2 * dist.get_world_size() * (torch.finfo(case.dtype).eps / 2) * mag
        bad = ~(diff <= bound)  # NaN (an output never written) counts as bad
        rule = "2*W*u*sum|x|"
    else:
        bad = ours != theirs
        rule = "bit-exact"
    nbad = int(bad.sum())
    if nbad == 0:
        return None
    i = int(bad.reshape(-1).nonzero()[0])
    return (f"rank {dist.get_rank()}: {nbad} of {bad.numel()} elements differ ({rule}); first at flat index {i}: "
            f"tilecomm {ours.reshape(-1)[i].item()!r} vs baseline {theirs.reshape(-1)[i].item()!r}; "
            f"max |diff| {diff.max().item():.4g}")


def _verify(case: Case, inp: torch.Tensor, out: torch.Tensor, ref: torch.Tensor, cuda: bool, splits: dict) -> None:
    """Run both once on `inp`, compare on every rank, raise BenchMismatch on all ranks if any differ."""
    ours, theirs = _functions(case.op)
    out.fill_(float("nan"))  # so an element tilecomm never writes cannot pass
    ours(out, inp, **splits)
    theirs(ref, inp, **splits)
    _sync(cuda)
    tilecomm.check_errors()
    problems = [p for p in _gather(_mismatch(case, out, ref, inp)) if p]
    if problems:
        raise BenchMismatch(f"{case.op} {case.label}: tilecomm's output differs from "
                            f"torch.distributed's ({dist.get_backend()}) on the same input:\n  " + "\n  ".join(problems))


def _time_us(fn, cfg: Config, cuda: bool) -> float:
    """This rank's median over reps of µs per call (module docstring)."""
    return _times_us({"fn": fn}, cfg, cuda)["fn"]


def _times_us(fns: dict, cfg: Config, cuda: bool) -> dict:
    """{name: this rank's median over reps of µs per call}: every rep times each of fns in turn (module
    docstring), so that a drift over the run (the GPU's clock under a sustained load) weighs on all alike: timed
    one after another, the column timed first ran 5-7% faster (4 H200s, 2026-11-28: cuBLAS's 8192x3584x4096
    GEMM first in the ag_gemm bench 317-321 µs, in turn with tilecomm's GEMM in bench.gemm 338-348)."""
    for fn in fns.values():
        for _ in range(cfg.warmup):
            fn()
    samples = {name: [] for name in fns}
    for _ in range(cfg.reps):
        for name, fn in fns.items():
            _sync(cuda, barrier=True)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(cfg.iters):
                    fn()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) * 1e3 / cfg.iters)
            else:
                t0 = time.perf_counter()
                for _ in range(cfg.iters):
                    fn()
                samples[name].append((time.perf_counter() - t0) * 1e6 / cfg.iters)
    tilecomm.check_errors()
    return {name: statistics.median(v) for name, v in samples.items()}


def _run_case(case: Case, cfg: Config, cuda: bool) -> dict:
    """Verify, then time tilecomm and the baseline; the row (times: max over ranks of medians)."""
    device = tilecomm.current().device
    splits, heap_rows = {}, case.in_shape[0]
    if cfg.uneven:
        heap_rows = max(map(sum, uneven_splits(case.shape[0], dist.get_world_size())))
        case, splits = _make_uneven(case, dist.get_world_size(), dist.get_rank())
    inp, on_heap = _input(case, cfg.symmetric, device, heap_rows)
    out = torch.empty(case.out_shape, dtype=case.dtype, device=device)
    ref = torch.empty_like(out)
    _verify(case, inp, out, ref, cuda, splits)
    ours, theirs = _functions(case.op)
    times = _times_us({"ours": lambda: ours(out, inp, **splits), "base": lambda: theirs(ref, inp, **splits)}, cfg,
                      cuda)
    t_ours, t_base = (max(_gather(times[k])) for k in ("ours", "base"))
    if on_heap is not None:
        tilecomm.free(on_heap)
    gbps = {"tilecomm": case.nbytes / t_ours / 1e3, "baseline": case.nbytes / t_base / 1e3}
    shape, dtype = case.label.split()
    return {"op": case.op, "shape": shape, "dtype": dtype,
            "world": dist.get_world_size(), "tilecomm_us": t_ours, "baseline_us": t_base,
            "ratio": t_base / t_ours, "gbps": gbps, "bytes": case.nbytes,
            "baseline": f"torch.distributed/{dist.get_backend()}", "symmetric": cfg.symmetric, "uneven": cfg.uneven,
            "backend": tilecomm.current().backend}


_BYTES_RULE = {"all_to_all": "input bytes x (W-1)/W, input = rows x hidden per rank",
               "all_gather": "output bytes x (W-1)/W, output = the gathered shape",
               "reduce_scatter": "input bytes x (W-1)/W, input = the shape before scattering"}
_COLS = ("{:<15} {:>14} {:>9} {:>13} {:>13} {:>7} {:>13} {:>13}")


def _header(cfg: Config, backend: str) -> str:
    world, base = dist.get_world_size(), dist.get_backend()
    inputs = "tilecomm.empty (symmetric heap, zero-copy)" if cfg.symmetric else "plain torch tensors (staged)"
    if cfg.uneven:
        inputs += ", uneven splits (module docstring)"
    lines = [f"tilecomm.bench {cfg.op}: world={world}, backend={backend}, baseline=torch.distributed ({base}), "
             f"inputs={inputs}",
             f"bytes per rank = {_BYTES_RULE[cfg.op]}; GB/s = bytes / time / 1e9",
             f"time = max over ranks of each rank's median µs per call ({cfg.reps} reps x {cfg.iters} calls, "
             f"{cfg.warmup} warm-up, the two in turn in each rep, barrier between); "
             "ratio = baseline / tilecomm (> 1: tilecomm faster)"]
    if backend == "cpu":
        lines.append("NOTE: cpu backend (Triton interpreter vs gloo): these timings check that the benchmark runs; "
                     "they are NOT meaningful performance numbers.")
    lines.append(_COLS.format("op", "shape", "dtype", "tilecomm µs", "baseline µs", "ratio", "tilecomm GB/s",
                              "baseline GB/s"))
    return "\n".join(lines)


def _row(r: dict) -> str:
    return _COLS.format(r["op"], r["shape"], r["dtype"], f"{r['tilecomm_us']:.1f}", f"{r['baseline_us']:.1f}",
                        f"{r['ratio']:.2f}", f"{r['gbps']['tilecomm']:.4g}", f"{r['gbps']['baseline']:.4g}")


def run_rank(cfg: Config) -> List[dict]:
    """Every rank's body (torch.distributed and tilecomm initialised): verify, time, print on rank 0.

    Returns the rows (same on every rank); rank 0 also writes them to cfg.json_path as a JSON list."""
    world, rank = dist.get_world_size(), dist.get_rank()
    backend = tilecomm.current().backend
    cuda = backend == "cuda"
    torch.manual_seed(cfg.seed * 1000 + rank)  # different data on every rank
    cases = [make_case(cfg.op, s, cfg.dtype, world) for s in cfg.shapes]
    if rank == 0:
        print(_header(cfg, backend), flush=True)
    rows = []
    for case in cases:
        rows.append(_run_case(case, cfg, cuda))
        if rank == 0:
            print(_row(rows[-1]), flush=True)
    if rank == 0 and cfg.json_path:
        with open(cfg.json_path, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {len(rows)} rows to {cfg.json_path}", flush=True)
    return rows
