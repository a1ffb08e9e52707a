"""Time tilecomm.dispatch's Dispatcher: backend="tilecomm" against backend="nccl".

    torchrun --nproc-per-node 8 -m tilecomm.bench dispatch            # 4096 tokens, 7168 hidden, top-8 of 256
    torchrun --nproc-per-node 8 -m tilecomm.bench dispatch --mode low_latency   # 128 tokens (decode)
    python -m tilecomm.bench dispatch --backend cpu --world-size 2     # Triton interpreter vs gloo

--mode low_latency times Dispatcher(mode="low_latency") (tilecomm only: no host sync, expert-major
[E_local, capacity, H] output) against the same nccl path in mode "normal" on the same tokens: what a
decode step would use without tilecomm. Its rows are compared with the reference's after flattening
each local expert's first tokens_per_expert[e] rows (the same expert-major order, bit for bit).

backend="nccl" is the torch reference path (torch ops + torch.distributed.all_to_all_single: NCCL on
GPUs, gloo on CPU): the baseline. Both run on the same inputs in the same run. Every rank draws
x = randn(tokens, hidden) and a uniform routing: each token's top-k of `experts` random scores
(k distinct experts), weights = those scores. Before timing, tilecomm's dispatch must equal the
reference's bit for bit (res.x, res.weights, res.tokens_per_expert) and its combine of the same
y = randn(rows, hidden) must be allclose; otherwise every rank raises BenchMismatch.

Phases: dispatch = Dispatcher.dispatch (layout, count exchange with its host sync, rows and weights);
combine = Dispatcher.combine on that dispatch's handle. Times as in collectives.py: max over ranks
of each rank's median µs per call. Bytes per rank that cross the link, pairs = (token, destination
rank) pairs with destination != own rank (the mean over ranks is reported):

    dispatch  pairs × hidden × elem   (each token goes once to each other rank that owns one of its experts)
    combine   pairs × hidden × elem   (each such rank sends back one partial row per token)

NVLink GB/s = bytes / time / 1e9; the routing weights, counts and expert ids are not counted.

On GPUs, --mode low_latency also times each phase as one call captured in a CUDA graph and replayed (backend
"graphed"): how a decode step runs it (DeepEP's low-latency kernels are built for CUDA graphs), with no host work
per call. Before timing, the replayed dispatch's rows combined eagerly, and the replayed combine, must equal the
eager results (allclose).
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

import tilecomm
from tilecomm.dispatch import Dispatcher

from .collectives import _DTYPES, BenchMismatch, RunConfig, _gather, _sync, _time_us, heap_bytes_needed, make_case

BACKENDS = ("tilecomm", "nccl")
PHASES = ("dispatch", "combine")
# (GPU, CPU) defaults; 24 experts divide by 2, 3, 4, 6 and 8 CPU ranks
LL_TOKENS = (128, 16)  # --mode low_latency default tokens per rank (GPU, CPU)
DEFAULTS = {"tokens": (4096, 64), "hidden": (7168, 128), "experts": (256, 24), "topk": (8, 4),
            "dtype": ("bfloat16", "float32"), "warmup": (5, 1), "reps": (20, 3), "iters": (10, 2)}
_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}  # combine: rtol = atol


@dataclass
class DispatchConfig(RunConfig):
    """What one dispatch benchmark run does (picklable: it travels to spawned ranks)."""

    tokens: int
    hidden: int
    experts: int
    topk: int
    mode: str = "normal"


def config_from_args(args, backend: str, world: int) -> DispatchConfig:
    """Fill unset options with the GPU or CPU default; ValueError on a bad combination."""
    if args.rows or args.shape or args.symmetric:
        raise ValueError("dispatch: --rows, --shape and --symmetric do not apply (use --tokens/--hidden)")
    k = 0 if backend == "cuda" else 1
    vals = {name: pair[k] if getattr(args, name) is None else getattr(args, name) for name, pair in DEFAULTS.items()}
    if args.mode == "low_latency" and args.tokens is None:
        vals["tokens"] = LL_TOKENS[k]
    cfg = DispatchConfig(**vals, mode=args.mode, json_path=args.json_path, seed=args.seed)
    if min(cfg.tokens, cfg.hidden, cfg.experts, cfg.topk, cfg.reps, cfg.iters) < 1 or cfg.warmup < 0:
        raise ValueError("dispatch: --tokens, --hidden, --experts, --topk, --reps, --iters must be >= 1, --warmup >= 0")
    if cfg.experts % world:
        raise ValueError(f"dispatch: --experts {cfg.experts} must divide by the world size ({world})")
    if cfg.topk > cfg.experts:
        raise ValueError(f"dispatch: --topk {cfg.topk} > --experts {cfg.experts}")
    return cfg


def heap_bytes(cfg: DispatchConfig, world: int) -> int:
    """Heap for the largest all-to-all input (at most tokens × world rows of hidden: combine's partials),
    or, in low-latency mode, that plus the low-latency Dispatcher's own buffers."""
    from .. import _env
    from ..dispatch.buffers import low_latency_specs, symmetric_bytes

    case = make_case("all_to_all", (cfg.tokens * world, cfg.hidden), cfg.dtype, world)
    need = heap_bytes_needed([case])
    if cfg.mode == "low_latency":
        need += symmetric_bytes(low_latency_specs(world, cfg.experts, cfg.tokens, cfg.topk, cfg.hidden,
                                                  _DTYPES[cfg.dtype]))
    return max(_env.heap_bytes(torch.cuda.is_available()), need)


def _inputs(cfg: DispatchConfig, device: torch.device):
    """x [T, H]; topk_idx [T, K]: K distinct experts per token, uniform; weights: their random scores."""
    x = torch.randn(cfg.tokens, cfg.hidden, device=device).to(_DTYPES[cfg.dtype])
    weights, idx = torch.rand(cfg.tokens, cfg.experts, device=device).topk(cfg.topk, dim=1)
    return x, idx, weights


def _problem(rank: int, ours, ref, out_ours, out_ref, tol: float) -> Optional[str]:
    """None if tilecomm's results agree with the reference's on this rank, else a description."""
    for name in ("tokens_per_expert", "x", "weights"):
        a, b = getattr(ours, name), getattr(ref, name)
        if a.shape != b.shape:
            return f"rank {rank}: dispatch res.{name} shape: tilecomm {tuple(a.shape)} vs nccl {tuple(b.shape)}"
        if not torch.equal(a, b):
            return f"rank {rank}: dispatch res.{name}: {int((a != b).sum())} of {a.numel()} elements differ (bit-exact)"
    if not torch.allclose(out_ours.float(), out_ref.float(), rtol=tol, atol=tol):
        diff = (out_ours.float() - out_ref.float()).abs().max().item()
        return f"rank {rank}: combine output differs (allclose rtol=atol={tol}): max |diff| {diff:.4g}"
    return None


class _Flat:
    """A low-latency DispatchResult seen as the normal mode's [R, H] rows / [R] weights (expert-major)."""

    def __init__(self, res):
        counts = res.tokens_per_expert.tolist()
        self.tokens_per_expert = res.tokens_per_expert
        self.x = torch.cat([res.x[e, :n] for e, n in enumerate(counts)])
        self.weights = torch.cat([res.weights[e, :n] for e, n in enumerate(counts)])
        self.counts = counts

    def expand(self, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """rows [R, H] (expert-major) placed into a [E_local, capacity, H] tensor shaped like `like`."""
        out = torch.zeros_like(like)
        start = 0
        for e, n in enumerate(self.counts):
            out[e, :n] = rows[start:start + n]
            start += n
        return out


def _verify(ds: Dict[str, Dispatcher], x, idx, w, cuda: bool):
    """Dispatch with both backends, combine the same y; raise BenchMismatch on every rank if any rank
    differs. Returns ({backend: DispatchResult}, {backend: the y its combine takes})."""
    res = {b: d.dispatch(x, idx, w) for b, d in ds.items()}
    low_latency = ds["tilecomm"].mode == "low_latency"
    ours = _Flat(res["tilecomm"]) if low_latency else res["tilecomm"]
    y = torch.randn_like(res["nccl"].x)
    ys = {"nccl": y, "tilecomm": ours.expand(y, res["tilecomm"].x) if low_latency else y}
    same_rows = ours.x.shape == y.shape
    outs = {b: ds[b].combine(ys[b], res[b].handle) for b in BACKENDS} if same_rows else {b: y for b in BACKENDS}
    _sync(cuda)
    tilecomm.check_errors()
    mine = _problem(dist.get_rank(), ours, res["nccl"], outs["tilecomm"], outs["nccl"], _TOL[x.dtype])
    problems = [p for p in _gather(mine) if p]
    if problems:
        raise BenchMismatch("dispatch: Dispatcher(backend='tilecomm') differs from backend='nccl' on the same "
                            "input:\n  " + "\n  ".join(problems))
    return res, ys


def _times(cfg, ds, res, y, x, idx, w, cuda: bool) -> Dict[tuple, float]:
    """{(backend, phase): max over ranks of this rank's median µs per call}."""
    fns = {}
    for b, d in ds.items():
        fns[(b, "dispatch")] = lambda d=d: d.dispatch(x, idx, w)
        fns[(b, "combine")] = lambda d=d, h=res[b].handle, yb=y[b]: d.combine(yb, h)
    return {key: max(_gather(_time_us(fns[key], cfg, cuda))) for key in [(b, p) for p in PHASES for b in BACKENDS]}


def _captured(fn):
    """(graph, fn's result inside it): fn warmed up on a side stream, then captured once (torch's recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        fn()
        with torch.cuda.graph(graph, stream=side):
            out = fn()
    torch.cuda.current_stream().wait_stream(side)
    return graph, out


def _graph_times(cfg: DispatchConfig, d: Dispatcher, x, idx, w) -> Dict[tuple, float]:
    """{("graphed", phase): max over ranks of this rank's median µs per replay} for low-latency dispatch and
    combine, each checked against the eager call first (BenchMismatch on every rank otherwise)."""
    with torch.no_grad():
        eager = d.dispatch(x, idx, w)
        expect = d.combine(eager.x, eager.handle)
        dispatch_graph, res = _captured(lambda: d.dispatch(x, idx, w))
        combine_graph, out = _captured(lambda: d.combine(eager.x, eager.handle))
        dispatch_graph.replay()
        got = d.combine(res.x, res.handle)  # the replayed rows, combined eagerly
        combine_graph.replay()
        torch.cuda.synchronize()
        tilecomm.check_errors()
        tol = _TOL[x.dtype]
        bad = [name for name, a in (("dispatch", got), ("combine", out))
               if not torch.allclose(a.float(), expect.float(), rtol=tol, atol=tol)]
        mine = f"rank {dist.get_rank()}: replayed {bad} differ from eager" if bad else None
        problems = [p for p in _gather(mine) if p]
        if problems:
            raise BenchMismatch("dispatch: CUDA-graph replay differs from the eager call:\n  " + "\n  ".join(problems))
        return {("graphed", "dispatch"): max(_gather(_time_us(dispatch_graph.replay, cfg, True))),
                ("graphed", "combine"): max(_gather(_time_us(combine_graph.replay, cfg, True)))}


def _rows(cfg: DispatchConfig, times: Dict[tuple, float], pairs: float, base: str, backend: str) -> List[dict]:
    nbytes = pairs * cfg.hidden * _DTYPES[cfg.dtype].itemsize
    rows = []
    for (b, phase), us in times.items():
        t_ours, t_base = times[(b if b == "graphed" else "tilecomm", phase)], times[("nccl", phase)]
        rows.append({"op": "dispatch", "phase": phase, "backend": b, "us": us, "gbps": nbytes / us / 1e3,
                     "ratio": t_base / t_ours, "tilecomm_us": t_ours, "baseline_us": t_base, "bytes": nbytes,
                     "pairs": pairs, "tokens": cfg.tokens, "hidden": cfg.hidden, "experts": cfg.experts,
                     "topk": cfg.topk, "dtype": cfg.dtype, "world": dist.get_world_size(), "mode": cfg.mode,
                     "baseline": f"Dispatcher(backend='nccl') over torch.distributed/{base}", "device": backend})
    return rows


_COLS = "{:<9} {:<9} {:>14} {:>9} {:>11} {:>12} {:>15}"


def _header(cfg: DispatchConfig, pairs: float, base: str, backend: str) -> str:
    world = dist.get_world_size()
    lines = [f"tilecomm.bench dispatch: Dispatcher(mode='{cfg.mode}'), world={world}, backend={backend}, "
             f"baseline=Dispatcher(backend='nccl', mode='normal') (torch ops + torch.distributed.all_to_all_single over {base})",
             f"inputs per rank: x = randn({cfg.tokens}, {cfg.hidden}) {cfg.dtype}; routing = uniform random top-{cfg.topk} "
             f"of {cfg.experts} experts (distinct), {cfg.experts // world} experts per rank",
             "NVLink GB/s = pairs x hidden x elem / time / 1e9, pairs = (token, destination rank) pairs with "
             f"destination != own rank (mean over ranks: {pairs:.1f}); dispatch: the token's row, combine: its partial row back",
             f"time = max over ranks of each rank's median µs per call ({cfg.reps} reps x {cfg.iters} calls, "
             f"{cfg.warmup} warm-up, barrier between reps); ratio = nccl / tilecomm (> 1: tilecomm faster)"]
    if backend == "cpu":
        lines.append("NOTE: cpu backend (Triton interpreter vs gloo): these timings check that the benchmark runs; "
                     "they are NOT meaningful performance numbers.")
    lines.append(_COLS.format("phase", "backend", "tokens x hid", "dtype", "median µs", "NVLink GB/s", "nccl/tilecomm"))
    return "\n".join(lines)


def _row(r: dict) -> str:
    ratio = f"{r['ratio']:.3g}" if r["backend"] != "nccl" else "(base)"
    return _COLS.format(r["phase"], r["backend"], f"{r['tokens']}x{r['hidden']}", r["dtype"], f"{r['us']:.1f}",
                        f"{r['gbps']:.4g}", ratio)


def run_rank(cfg: DispatchConfig) -> List[dict]:
    """Every rank's body (torch.distributed and tilecomm initialised): verify, time, print on rank 0.

    Returns the rows (same on every rank); rank 0 also writes them to cfg.json_path as a JSON list."""
    rank, ctx = dist.get_rank(), tilecomm.current()
    cuda, base = ctx.backend == "cuda", dist.get_backend()
    torch.manual_seed(cfg.seed * 1000 + rank)  # different data on every rank
    x, idx, w = _inputs(cfg, ctx.device)
    ds = {b: Dispatcher(cfg.experts, cfg.hidden, cfg.tokens, cfg.topk, _DTYPES[cfg.dtype],
                        mode=cfg.mode if b == "tilecomm" else "normal", backend=b) for b in BACKENDS}
    res, y = _verify(ds, x, idx, w, cuda)
    splits = res["nccl"].handle.plan.send_splits
    pairs = statistics.mean(_gather(sum(splits) - splits[rank]))
    if rank == 0:
        print(_header(cfg, pairs, base, ctx.backend), flush=True)
    times = _times(cfg, ds, res, y, x, idx, w, cuda)
    if cuda and cfg.mode == "low_latency":
        times.update(_graph_times(cfg, ds["tilecomm"], x, idx, w))
    rows = _rows(cfg, times, pairs, base, ctx.backend)
    if rank == 0:
        print("\n".join(_row(r) for r in rows), flush=True)
        if cfg.json_path:
            with open(cfg.json_path, "w") as f:
                json.dump(rows, f, indent=2)
            print(f"wrote {len(rows)} rows to {cfg.json_path}", flush=True)
    return rows


# ---- world 1 on one device: `python -m tilecomm.bench self` calls self_rows ------------------------
SELF_SIZES = {True: dict(tokens=4096, ll_tokens=128, hidden=7168, experts=256, topk=8, dtype=torch.bfloat16),
              False: dict(tokens=16, ll_tokens=8, hidden=128, experts=8, topk=2, dtype=torch.float32)}
SELF_BARS = {"normal dispatch": (1.5, None, 1), "normal combine": (1.5, None, 0),
             "low_latency dispatch": (None, 20.0, 0), "low_latency combine": (None, 20.0, 0)}  # ratio, µs, syncs


def self_heap_bytes(on_gpu: bool) -> int:
    """Symmetric heap bytes the Dispatchers of self_rows take (both modes at once)."""
    from tilecomm.dispatch.buffers import low_latency_specs, normal_specs, symmetric_bytes

    s = SELF_SIZES[on_gpu]
    return (symmetric_bytes(normal_specs(1, s["experts"], s["tokens"], s["topk"], s["hidden"], s["dtype"]))
            + symmetric_bytes(low_latency_specs(1, s["experts"], s["ll_tokens"], s["topk"], s["hidden"], s["dtype"])))


def _world1_expected(x, idx, w):
    """At world 1: rows [R, H] expert-major (expert, token, k) and their weights, in torch ops."""
    T, K = idx.shape
    flat = idx.reshape(-1).long()
    pairs = torch.nonzero(flat >= 0).flatten()
    order = torch.argsort(flat[pairs] * (T * K) + pairs, stable=True)
    pairs = pairs[order]
    return x[pairs // K], w.float().reshape(-1)[pairs]


def _self_row(name: str, fn, floor_fn, iters: int, on_gpu: bool) -> dict:
    from . import measure

    us = measure.per_call_us(fn, iters, on_gpu=on_gpu)
    floor = measure.per_call_us(floor_fn, iters, on_gpu=on_gpu)
    kernels, gpu_us = measure.kernels_per_call(fn, on_gpu)
    row = dict(op=name, us=us, floor_us=floor, ratio=us / floor, host_us=measure.host_us(fn, iters, on_gpu=on_gpu),
               kernels=kernels, gpu_us=gpu_us, syncs=measure.host_syncs(fn, on_gpu))
    ratio_bar, us_bar, sync_bar = SELF_BARS[name]
    row["bar"] = f"<= {ratio_bar}x floor" if ratio_bar else f"<= {us_bar} us"
    row["meets_bar"] = bool((row["ratio"] <= ratio_bar if ratio_bar else us <= us_bar) and row["syncs"] <= sync_bar)
    return row


def self_rows(iters: int = 50) -> List[dict]:
    """The Dispatcher rows of the world-1 benchmark (tilecomm initialised with ONE rank and a heap of at
    least self_heap_bytes()): normal dispatch / combine of 4096 x 7168 bf16 tokens, top-8 of 256 experts,
    and low-latency dispatch / combine of 128 tokens (CPU: toy sizes, a smoke test). Each row: tilecomm
    µs per call back to back (`iters` calls, one synchronize), floor = copy_ of the output rows [T * K, H]
    in the same run, ratio, host µs per call, GPU kernels and memcpys of one call and their device µs, host syncs of one call
    (sync debug mode + Event.synchronize), the issue's bar and whether it is met; the low-latency combine
    row also says whether a CUDA graph of dispatch + combine replays the eager result. Results are
    checked against a torch computation before timing (AssertionError otherwise)."""
    from tilecomm.dispatch import Dispatcher

    from . import measure

    ctx = tilecomm.current()
    if ctx.world_size != 1:
        raise ValueError(f"self_rows measures world size 1; this runtime has {ctx.world_size} ranks")
    on_gpu = ctx.backend == "cuda"
    s = SELF_SIZES[on_gpu]
    H, E, K, dtype, dev = s["hidden"], s["experts"], s["topk"], s["dtype"], ctx.device
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for mode, T in (("normal", s["tokens"]), ("low_latency", s["ll_tokens"])):
        d = Dispatcher(E, H, T, K, dtype, mode=mode)
        x = torch.randn(T, H, device=dev, generator=gen).to(dtype)
        idx = torch.rand(T, E, device=dev, generator=gen).topk(K, dim=1).indices
        w = torch.softmax(torch.randn(T, K, device=dev, generator=gen), dim=1)
        with torch.no_grad():
            res = d.dispatch(x, idx, w)
            want_x, _ = _world1_expected(x, idx, w)
            got_x = res.x if mode == "normal" else torch.cat([res.x[e, :n] for e, n in
                                                              enumerate(res.tokens_per_expert.tolist())])
            assert torch.equal(got_x, want_x), f"self_rows: {mode} dispatch rows differ from torch"
            y = res.x.clone()  # experts = identity: combine gives x[t] * sum_k w[t, k]
            out = d.combine(y, res.handle)
            torch.testing.assert_close(out.float(), x.float() * w.sum(1)[:, None], rtol=2e-2, atol=2e-2)
            floor_src = torch.randn(T * K, H, device=dev).to(dtype)  # the output rows of one dispatch
            floor_dst = torch.empty_like(floor_src)
            phases = (("dispatch", lambda: d.dispatch(x, idx, w)), ("combine", lambda: d.combine(y, res.handle)))
            for phase, fn in phases:
                rows.append(_self_row(f"{mode} {phase}", fn, lambda: floor_dst.copy_(floor_src), iters, on_gpu))
            if mode == "low_latency":
                rows[-1]["graph"] = measure.graph_replays(
                    lambda: out.copy_(d.combine(y, d.dispatch(x, idx, w).handle)), out, on_gpu)
                # the decode path is host-bound (issue 9's ≤ 20 µs): where its host time goes (CPU: one call)
                for phase, fn in phases:
                    measure.host_profile(fn, f"low-latency {phase}", *((200, 14, 5) if on_gpu else (1, 5, 0)))
        d.free()
    return rows
