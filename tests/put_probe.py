"""Where tcl.put / tcl.get from a grid of programs lose to a device copy at world 1 (a diagnostic, not a test):

    python tests/put_probe.py [--mib 64,128] [--slices 14,16,18] [--warps 4,8] [--no-loops]

Issue 9's bar is ≥ 90% of a copy per call back to back (`bench self` read 1.11-1.16x with 256 KiB per program and the
kernel's profiled time within 1-3% of the copy's; this probe found the finer grid it uses since, 2026-11-28). For each
size, interleaved rounds of: `copy_`, tcl.put / tcl.get launched through CachedLaunch with other grids (bytes per
program) and warp counts, and plain Triton copy loops of the same bytes that keep one or two steps of loads in flight
(what tcl's `_copy` could become). Each row: µs per call back to back (median of the rounds), and from torch.profiler
over 10 calls the kernel's mean time and the GPU's idle time before each kernel (the gap between back-to-back calls).
Every variant's output is checked against its source.
"""
import argparse

import torch
import triton
import triton.language as tl

import tilecomm
from tilecomm.bench import measure
from tilecomm.bench.world1 import _get_grid_kernel, _put_grid_kernel  # the kernels of bench self's put/get rows
from tilecomm.jit import CachedLaunch


@triton.jit
def _loop_kernel(dst_ptr, src_ptr, SLICE: tl.constexpr, STEP: tl.constexpr, UNROLL: tl.constexpr):
    """SLICE elements per program, STEP per load, UNROLL steps' loads issued before their stores."""
    base = tl.program_id(0).to(tl.int64) * SLICE
    for start in range(0, SLICE, STEP * UNROLL):
        offs = base + start + tl.arange(0, STEP)
        a = tl.load(src_ptr + offs)
        if UNROLL == 2:
            b = tl.load(src_ptr + offs + STEP)
            tl.store(dst_ptr + offs, a)
            tl.store(dst_ptr + offs + STEP, b)
        else:
            tl.store(dst_ptr + offs, a)


def timeline(fn, calls=10):
    """(mean kernel µs, mean GPU idle µs before a kernel) over calls 2.. of `calls` back to back."""
    events = measure.gpu_events(fn, calls)
    steady = list(zip(events, events[1:]))
    busy = sum(e.device_time_total for _, e in steady) / len(steady)
    idle = sum(max(0.0, e.time_range.start - p.time_range.end) for p, e in steady) / len(steady)
    return busy, idle


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", default="64,128")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slices", default="14,16,18", help="log2 of the float32 elements per program")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--no-loops", action="store_true", help="leave out the plain Triton loops")
    args = parser.parse_args()
    tilecomm.init()
    dev = torch.device("cuda", torch.cuda.current_device())
    print(f"tcl.put / get at world 1 on {torch.cuda.get_device_name()}; µs per call back to back (median of "
          f"{args.rounds} interleaved rounds), kernel and idle µs from the profiler")
    for mib in (int(m) for m in args.mib.split(",")):
        n = mib << 18  # float32 elements
        src, dst = tilecomm.empty((n,), torch.float32), tilecomm.empty((n,), torch.float32)
        src.copy_(torch.randn(n, device=dev))
        plain = torch.empty_like(src)
        variants = {"copy_": (lambda: plain.copy_(src), plain)}
        for name, kernel in (("put", _put_grid_kernel), ("get", _get_grid_kernel)):
            cached = CachedLaunch(kernel)
            for slice_log2 in (int(v) for v in args.slices.split(",")):
                for warps in (int(v) for v in args.warps.split(",")):
                    grid = (n >> slice_log2,)
                    variants[f"tcl.{name} {grid[0]} programs x {4 << slice_log2 >> 10} KiB, {warps} warps"] = (
                        lambda c=cached, g=grid, s=1 << slice_log2, w=warps: c.launch_keyed(g, dst, src, SLICE=s,
                                                                                           num_warps=w), dst)
        for slice_log2 in () if args.no_loops else (14, 16):
            for step, unroll in ((4096, 1), (4096, 2), (8192, 1), (2048, 2)):
                grid = (n >> slice_log2,)
                variants[f"loop {grid[0]} x {4 << slice_log2 >> 10} KiB, step {step} x{unroll}"] = (
                    lambda g=grid, s=1 << slice_log2, st=step, u=unroll: _loop_kernel[g](dst, src, SLICE=s, STEP=st,
                                                                                         UNROLL=u), dst)
        per_call = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, (fn, out) in variants.items():
                out.zero_()
                per_call[name].append(measure.per_call_us(fn, 50, 5))
                assert torch.equal(out, src), name
        base = sorted(per_call["copy_"])[args.rounds // 2]
        print(f"== {mib} MiB")
        for name, (fn, _) in variants.items():
            us = sorted(per_call[name])[args.rounds // 2]
            busy, idle = timeline(fn)
            print(f"{name:52s} {us:8.1f} µs/call  ratio {us / base:5.3f}  kernel {busy:7.1f}  idle {idle:5.1f}",
                  flush=True)
        tilecomm.free(dst)
        tilecomm.free(src)
    tilecomm.finalize()


if __name__ == "__main__":
    main()
