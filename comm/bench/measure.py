"""What the one-GPU benchmarks measure of a call, each beside a floor timed the same way in the same run.

    per_call_us(fn)     N / 5 calls back to back, one synchronize at the end: wall time per call (launch and
                        Python included; what a training step pays), the median of 5 such runs
    per_call_runs_us(fn) per_call_us's runs one by one (whether a slow figure is every run or one)
    host_us(fn)         the same runs without the final wait: host time per call
    kernels_per_call(fn) GPU kernels and memcpys of one call and their device time (torch.profiler)
    kernel_profile(fn, calls) the same per call over calls back to back (median of calls 2..), with names
    host_profile(fn, what) cProfile of calls back to back: where a call's host time goes (printed)
    host_syncs(fn)      synchronising CUDA calls the host makes in one call
                        (torch.cuda.set_sync_debug_mode("warn") warnings, plus Event.synchronize calls)
    graph_replays(fn, out) capture one call in a CUDA graph, replay it, True if the replay rewrote `out`
                        with the eager result

On CPU ranks every function still runs (kernels and syncs count 0), so the benchmark's code is
exercised by the CPU tests; the numbers there are not performance figures.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable, List, Optional

import torch

REPS = 5  # per_call_us / host_us: runs whose median is the figure


def _sync(on_gpu: bool) -> None:
    if on_gpu:
        torch.cuda.synchronize()


def _seconds_per_call(fn: Callable[[], object], iters: int, warmup: int, on_gpu: bool, wait: bool,
                      reps: int = REPS) -> float:
    """The median over `reps` runs of iters / reps calls back to back (a synchronize between runs): one
    hiccup of a shared host (a 540 µs run among 320 µs ones, 2026-11-26) does not become the figure."""
    times = _run_times(fn, iters, warmup, on_gpu, wait, reps)
    return sorted(times)[len(times) // 2]


def _run_times(fn: Callable[[], object], iters: int, warmup: int, on_gpu: bool, wait: bool,
               reps: int = REPS) -> List[float]:
    """Seconds per call of each of `reps` runs of iters / reps calls back to back, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    _sync(on_gpu)
    reps = max(1, min(reps, iters))
    per_rep = max(1, iters // reps)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(per_rep):
            fn()
        if wait:
            _sync(on_gpu)
        times.append((time.perf_counter() - start) / per_rep)
        _sync(on_gpu)
    return times


def per_call_us(fn: Callable[[], object], iters: int = 50, warmup: int = 5, on_gpu: bool = True) -> float:
    return _seconds_per_call(fn, iters, warmup, on_gpu, wait=True) * 1e6


def per_call_runs_us(fn: Callable[[], object], iters: int = 50, warmup: int = 5, on_gpu: bool = True) -> List[float]:
    """per_call_us's runs, each (µs per call of one run), in the order they ran."""
    return [s * 1e6 for s in _run_times(fn, iters, warmup, on_gpu, wait=True)]


def host_us(fn: Callable[[], object], iters: int = 50, warmup: int = 5, on_gpu: bool = True) -> float:
    return _seconds_per_call(fn, iters, warmup, on_gpu, wait=False) * 1e6


def host_profile(fn: Callable[[], object], what: str, calls: int = 200, top: int = 14, warmup: int = 5) -> None:
    """Print where the host time of fn goes: cProfile over `calls` calls after `warmup` calls, the `top`
    functions by their own time."""
    import cProfile
    import pstats

    for _ in range(warmup):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    print(f"host profile of {what}, {calls} calls:", flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def kernels_per_call(fn: Callable[[], object], on_gpu: bool = True):
    """(GPU kernels and memcpys of one call, their summed device time in µs)."""
    count, us, _ = kernel_profile(fn, 1, on_gpu)
    return count, us


def gpu_events(fn: Callable[[], object], calls: int, settle: Optional[Callable[[], object]] = None) -> list:
    """The GPU kernels and memcpys (torch.profiler events, in start order) of `calls` calls of fn back to back,
    after one warm-up call and `settle` (e.g. a barrier between ranks)."""
    fn()
    torch.cuda.synchronize()
    if settle is not None:
        settle()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def kernel_profile(fn: Callable[[], object], calls: int = 1, on_gpu: bool = True,
                   settle: Optional[Callable[[], object]] = None):
    """(GPU kernels and memcpys per call, a call's summed device time in µs, the kernels' names), from
    torch.profiler over `calls` calls back to back after one warm-up call. With calls > 1 the time is the
    median over calls 2.. (the first absorbs start-up skew, e.g. ranks starting their profilers apart).
    settle: run after the warm-up, before profiling (e.g. a barrier between ranks)."""
    if not on_gpu:
        return 0, 0.0, ""
    events = gpu_events(fn, calls, settle)
    names = ", ".join(sorted({e.name[:40] for e in events}))
    if calls == 1:
        return len(events), sum(e.device_time_total for e in events), names
    per_call = max(1, len(events) // calls)
    sums = sorted(sum(e.device_time_total for e in events[i:i + per_call])
                  for i in range(per_call, per_call * calls, per_call))
    return per_call, (sums[len(sums) // 2] if sums else 0.0), names


def host_syncs(fn: Callable[[], object], on_gpu: bool = True) -> int:
    """Synchronising calls of one call: what sync debug mode reports, plus torch.cuda.Event.synchronize
    calls (which it does not see; counted by wrapping the method for the call)."""
    if not on_gpu:
        return 0
    fn()
    torch.cuda.synchronize()
    events, original = [0], torch.cuda.Event.synchronize

    def counted(event):
        events[0] += 1
        return original(event)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.Event.synchronize = counted
        try:
            fn()
        finally:
            torch.cuda.Event.synchronize = original
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower()) + events[0]


def graph_replays(fn: Callable[[], object], out: torch.Tensor, on_gpu: bool = True) -> Optional[bool]:
    """None on CPU; else whether a captured call, replayed, writes the eager result into out."""
    if not on_gpu:
        return None
    fn()
    torch.cuda.synchronize()
    expect = out.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            fn()  # a warm-up on the capture stream, as torch recommends
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=side):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        out.fill_(0) if out.dtype != torch.bool else out.fill_(False)
        graph.replay()
        torch.cuda.synchronize()
        ok = torch.equal(out, expect)
        graph.replay()
        torch.cuda.synchronize()
        return ok and torch.equal(out, expect)
    except Exception as err:  # report, don't abort the table
        print(f"graph capture failed: {type(err).__name__}: {err}", flush=True)
        return False
