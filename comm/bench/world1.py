"""`python -m tilecomm.bench self`: the data path on one GPU at world size 1, beside a copy floor.

World size 1 runs the very kernels a multi-GPU run uses (the chunk a rank sends itself takes the
peer path), with local memory in place of NVLink, so this measures everything but the link: launch
count, host overhead, host syncs, the parallelism of the copy loops. Each row prints, from one run:

    µs/call   runs of N / 5 calls back to back, one synchronize each: wall time per call, the median
              run's (measure.per_call_us)
    floor     torch.Tensor.copy_ of the same bytes timed the same way (dispatch and combine: a copy of
              the output rows [R, H])
    ratio     µs/call / floor
    host µs   host time per call (measure.host_us); kernels: GPU kernels of one call; syncs: host
              synchronisations of one call; graph: a CUDA-graph replay gives the eager result

Rows: all_to_all_single 4096×7168 and 128×7168 bf16 (ordinary tensors, and 4096×7168 with input and
output from tilecomm.empty), all_gather_into_tensor / reduce_scatter_tensor 8192×8192 bf16 (ordinary and
tilecomm.empty), tcl.put / tcl.get from a grid of programs (64 and 128 MiB; launched by Triton's `kernel[grid]`,
and again through tilecomm.jit.CachedLaunch, the compiled kernel's launcher tilecomm's own calls use: the same
kernel with less host time per launch), the ordinary-tensor collectives again under the ring's knobs
(RING_CONFIGS: L2 hints, ring discards), normal-mode dispatch / combine
(4096 tokens × 7168, top-8 of 256 experts) and low-latency dispatch / combine (128 tokens). On CPU
(--backend cpu) every row runs at toy sizes: a smoke test, not a measurement.
"""
from __future__ import annotations

import json
from typing import Callable, List, Optional

import torch
import triton.language as tl

import tilecomm
import tilecomm.language as tcl
from tilecomm.jit import CachedLaunch

from . import dispatch as dispatch_bench
from . import measure

_GPU = dict(rows=4096, small=128, hidden=7168, square=8192, tokens=4096, ll_tokens=128, experts=256, topk=8,
            put_mib=(64, 128))
_CPU = dict(rows=64, small=8, hidden=128, square=128, tokens=64, ll_tokens=8, experts=8, topk=2, put_mib=(1,))
# elements per program in the put/get rows: 32 KiB of float32 (tests/put_probe.py, one H200, 2026-11-28, through
# CachedLaunch: 1.05-1.07x a copy per call with 16-32 KiB per program, 1.07-1.11x with 64 KiB, 1.10-1.12x with 256 KiB,
# 1.25-1.76x with 1 MiB; a plain Triton copy loop of the same grid is no faster than tcl.put)
PUT_SLICE = 1 << 13


@tilecomm.jit
def _put_grid_kernel(dst_ptr, src_ptr, SLICE: tl.constexpr):
    me = tcl.rank()
    start = tl.program_id(0).to(tl.int64) * SLICE
    tcl.put(dst_ptr + start, src_ptr + start, SLICE, me)


@tilecomm.jit
def _get_grid_kernel(dst_ptr, src_ptr, SLICE: tl.constexpr):
    me = tcl.rank()
    start = tl.program_id(0).to(tl.int64) * SLICE
    tcl.get(dst_ptr + start, src_ptr + start, SLICE, me)


class Table:
    def __init__(self, on_gpu: bool, iters: int):
        self.on_gpu, self.iters, self.rows = on_gpu, iters, []
        if on_gpu:  # the first use of the sync debug mode reports a synchronisation of its own
            x = torch.ones(4, device="cuda")
            measure.host_syncs(lambda: x.add_(1), on_gpu)

    def add(self, name: str, fn: Callable[[], object], floor_fn: Callable[[], object],
            out: Optional[torch.Tensor] = None, check_graph: bool = False, iters: Optional[int] = None) -> None:
        n = iters or self.iters
        g = self.on_gpu
        warm = min(5, n)
        us = measure.per_call_us(fn, n, warm, on_gpu=g)
        floor = measure.per_call_us(floor_fn, n, warm, on_gpu=g)
        kernels, gpu_us = measure.kernels_per_call(fn, g)
        row = dict(op=name, us=us, floor_us=floor, ratio=us / floor, host_us=measure.host_us(fn, n, warm, on_gpu=g),
                   gpu_us=gpu_us, kernels=kernels, syncs=measure.host_syncs(fn, g),
                   graph=measure.graph_replays(fn, out, g) if (check_graph and out is not None) else None)
        self.rows.append(row)
        print(f"{name:52s} {us:9.1f} {floor:9.1f} {row['ratio']:6.2f} {row['host_us']:7.1f} {gpu_us:8.1f} {kernels:4d} "
              f"{row['syncs']:3d} {row['graph']!s:>5}", flush=True)


def _collective_rows(t: Table, s: dict, dtype: torch.dtype, dev: torch.device) -> None:
    def rand(shape, symmetric=False):
        x = tilecomm.empty(shape, dtype) if symmetric else torch.empty(shape, dtype=dtype, device=dev)
        return x.copy_(torch.randn(shape, device=dev).to(dtype))

    H = s["hidden"]
    for rows, symmetric in ((s["rows"], False), (s["rows"], True), (s["small"], False)):
        x, out = rand((rows, H), symmetric), rand((rows, H), symmetric)
        floor_out = torch.empty_like(x)
        tilecomm.all_to_all_single(out, x)
        assert torch.equal(out, x), "all_to_all_single at world 1 must return its input"
        t.add(f"all_to_all_single {rows}x{H}{' symmetric' if symmetric else ''}", lambda: tilecomm.all_to_all_single(out, x),
              lambda: floor_out.copy_(x), out, check_graph=True)
        if symmetric:
            tilecomm.free(out)
            tilecomm.free(x)
    S = s["square"]
    for symmetric in (False, True):
        x, out = rand((S, S), symmetric), rand((S, S), symmetric)
        floor_out = torch.empty_like(x)
        tag = " symmetric" if symmetric else ""
        t.add(f"all_gather_into_tensor {S}x{S}{tag}", lambda: tilecomm.all_gather_into_tensor(out, x),
              lambda: floor_out.copy_(x), out, check_graph=True)
        t.add(f"reduce_scatter_tensor {S}x{S}{tag}", lambda: tilecomm.reduce_scatter_tensor(out, x),
              lambda: floor_out.copy_(x), out, check_graph=True)
        torch.testing.assert_close(out, x)
        if symmetric:
            tilecomm.free(out)
            tilecomm.free(x)
    for mib in s["put_mib"]:  # 64 MiB: the copy takes about as long as Triton's launch of the grid; 128: twice that
        n = mib * (1 << 20) // 4
        n -= n % PUT_SLICE
        src, dst = tilecomm.empty((n,), torch.float32), tilecomm.empty((n,), torch.float32)
        src.copy_(torch.randn(n, device=dev))
        floor_out = torch.empty_like(src)
        grid = (n // PUT_SLICE,)
        for kernel, name in ((_put_grid_kernel, "put"), (_get_grid_kernel, "get")):
            cached = CachedLaunch(kernel)
            for how, call in (("", lambda kernel=kernel: kernel[grid](dst, src, SLICE=PUT_SLICE)),
                              (", CachedLaunch", lambda cached=cached: cached.launch_keyed(grid, dst, src,
                                                                                           SLICE=PUT_SLICE))):
                dst.zero_()
                t.add(f"tcl.{name} grid of {grid[0]} programs, {n * 4 >> 20} MiB{how}", call,
                      lambda: floor_out.copy_(src))
                assert torch.equal(dst, src), f"tcl.{name}{how}"
        tilecomm.free(dst)
        tilecomm.free(src)


def _host_profile(s: dict, dtype: torch.dtype, dev: torch.device) -> None:
    """Where the host time of a small all_to_all_single goes (measure.host_profile)."""
    x = torch.randn(s["small"], s["hidden"], device=dev).to(dtype)
    out = torch.empty_like(x)
    measure.host_profile(lambda: tilecomm.all_to_all_single(out, x), f"all_to_all_single {s['small']}x{s['hidden']}")


def _direct_rows(t: Table, s: dict, dtype: torch.dtype, tma: bool) -> None:
    """The symmetric all_to_all and all_gather rows again on CollectiveStates with `direct` on (vector stores; with
    tma, TMA stores and one completion wait a program): DIRECT pairs beside the in-place rows above, in one run."""
    from tilecomm.collectives.state import CollectiveState

    ctx = tilecomm.current()
    default = ctx.collectives
    H, S = s["hidden"], s["square"]
    for shape, op, name in (((s["rows"], H), tilecomm.all_to_all_single, "a2a"),
                            ((S, S), tilecomm.all_gather_into_tensor, "all_gather")):
        x, out = tilecomm.empty(shape, dtype), tilecomm.empty(shape, dtype)
        x.copy_(torch.randn(shape, device=x.device).to(dtype))
        floor_out = torch.empty_like(x)
        for push_by_tma in (False, True) if tma else (False,):
            ctx.collectives = CollectiveState.create(ctx, 2 * default.ring.numel(), tma_push=push_by_tma, direct=True)
            try:
                out.fill_(-7)
                op(out, x)
                assert torch.equal(out, x), f"{name} on a direct state at world 1 must return its input"
                t.add(f"{name} {shape[0]}x{shape[1]} symmetric [direct{', TMA' if push_by_tma else ''}]",
                      lambda: op(out, x), lambda: floor_out.copy_(x), out, check_graph=True)
            finally:
                ctx.collectives.free()
                ctx.collectives = default
        tilecomm.free(out)
        tilecomm.free(x)


def _print_registers(state) -> None:
    """The collectives' kernels as compiled: registers a thread, spilled bytes, and the programs an SM holds at
    once by registers (by default the state launches two programs of 256 threads per SM; fewer resident ones run in
    waves)."""
    for name, launcher in (("pairs", state._pairs), ("reduce", state._reduce)):
        seen = sorted({v for v in launcher.registers.values() if v[0] is not None})
        fit = [65536 // (regs * 32 * state.num_warps) for regs, _ in seen]
        print(f"{name} kernel: (registers, spilled bytes) {seen}; programs an SM holds by registers {fit}", flush=True)


def _sweep(t: Table, s: dict, dtype: torch.dtype, dev: torch.device, configs) -> None:
    """The same rows under other CollectiveState tunings: (programs per SM, chunk bytes, block bytes, other knobs
    by name), each collective's result checked before it is timed (at world 1 every one returns its input)."""
    from tilecomm.collectives.state import CollectiveState

    ctx = tilecomm.current()
    default = ctx.collectives
    H, S = s["hidden"], s["square"]
    a, a_out = torch.randn(s["rows"], H, device=dev).to(dtype), torch.empty(s["rows"], H, device=dev, dtype=dtype)
    g, g_out = torch.randn(S, S, device=dev).to(dtype), torch.empty(S, S, device=dev, dtype=dtype)
    a_floor, g_floor = torch.empty_like(a), torch.empty_like(g)
    cases = ((f"a2a {s['rows']}x{H}", tilecomm.all_to_all_single, a, a_out, a_floor),
             (f"all_gather {S}x{S}", tilecomm.all_gather_into_tensor, g, g_out, g_floor),
             (f"reduce_scatter {S}x{S}", tilecomm.reduce_scatter_tensor, g, g_out, g_floor))
    for per_sm, chunk, block, knobs in configs:
        ctx.collectives = CollectiveState.create(ctx, 1 << 30, per_sm, chunk, block, **knobs)
        named = "".join(", " + k.replace("ring_", "") for k in knobs)
        tag = f"[{per_sm}/SM chunk {chunk >> 10}K block {block >> 10}K{named}]"
        try:
            for name, op, x, out, floor in cases:
                out.fill_(-7)
                op(out, x)
                assert torch.equal(out, x), f"{name} {tag} at world 1 must return its input"
                t.add(f"{name} {tag}", lambda op=op, out=out, x=x: op(out, x), lambda floor=floor, x=x: floor.copy_(x))
        finally:
            ctx.collectives.free()
            ctx.collectives = default


# the ring's knobs (staged, ordinary tensors: two copies at world 1): a 16.5 MiB ring (fits L2) with L2 eviction hints,
# the default ring with each chunk's L2 lines dropped once read (tcl.discard), and both
RING_CONFIGS = [(2, 32 << 10, 32 << 10, dict(ring_hints=True)), (2, 128 << 10, 32 << 10, dict(ring_discard=True)),
                (2, 32 << 10, 32 << 10, dict(ring_hints=True, ring_discard=True))]


def run(backend: str, json_path: Optional[str], iters: int) -> List[dict]:
    """Initialise a one-rank runtime with a heap large enough for the symmetric rows, print the table."""
    on_gpu = backend == "cuda" or (backend == "auto" and torch.cuda.is_available())
    tilecomm.init(backend=backend, heap_bytes=(768 << 20 if on_gpu else 32 << 20) + dispatch_bench.self_heap_bytes(on_gpu))
    ctx = tilecomm.current()
    on_gpu = ctx.backend == "cuda"
    s = _GPU if on_gpu else _CPU
    dtype = torch.bfloat16 if on_gpu else torch.float32
    torch.manual_seed(0)
    print(f"world 1 on {torch.cuda.get_device_name() if on_gpu else 'CPU'}; µs per call back to back")
    print(f"{'op':52s} {'µs/call':>9s} {'floor':>9s} {'ratio':>6s} {'host µs':>7s} {'GPU µs':>8s} {'krn':>4s} {'syn':>3s} "
          f"{'graph':>5s}")
    t = Table(on_gpu, iters)
    _collective_rows(t, s, dtype, ctx.device)
    if on_gpu:
        _print_registers(ctx.collectives)
    _direct_rows(t, s, dtype, tma=on_gpu and torch.cuda.get_device_capability(ctx.device)[0] >= 9)
    if on_gpu:
        CachedLaunch.enabled = False  # Triton's ordinary launch path, for comparison
        x = torch.randn(s["small"], s["hidden"], device=ctx.device).to(dtype)
        out, floor_out = torch.empty_like(x), torch.empty_like(x)
        t.add(f"all_to_all_single {s['small']}x{s['hidden']} [Triton launch path]",
              lambda: tilecomm.all_to_all_single(out, x), lambda: floor_out.copy_(x))
        CachedLaunch.enabled = True
        # the defaults came from a sweep of (programs per SM, chunk, block) on 4 H200s (tests/collective_sweep.py);
        # one program per SM, the world-1 sweep's choice (H100, 2026-11-25), stays in the table beside them
        _sweep(t, s, dtype, ctx.device, [(1, 128 << 10, 32 << 10, {})])
        _host_profile(s, dtype, ctx.device)
    _sweep(t, s, dtype, ctx.device, RING_CONFIGS)
    try:
        for row in dispatch_bench.self_rows(iters):  # checked against torch first, then timed like the rows above
            t.rows.append(row)
            print(f"{row['op']:52s} {row['us']:9.1f} {row['floor_us']:9.1f} {row['ratio']:6.2f} {row['host_us']:7.1f} "
                  f"{row['gpu_us']:8.1f} {row['kernels']:4d} {row['syncs']:3d} {row.get('graph')!s:>5}", flush=True)
    except Exception as err:  # keep the collective rows of a run whose dispatch path failed
        print(f"dispatch rows failed: {type(err).__name__}: {err}", flush=True)
        t.rows.append(dict(op="dispatch", error=f"{type(err).__name__}: {err}"))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(t.rows, f, indent=1)
    tilecomm.finalize()
    return t.rows

