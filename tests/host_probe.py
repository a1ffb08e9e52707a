"""Where the host time of a small collective goes, stage by stage (one GPU, world 1):

    python tests/host_probe.py

Each line is host µs per call of N calls back to back (no wait), for: the whole public call, the
argument checks alone, the CollectiveState call alone, the bound launch (jit.BoundLaunch) with the call's own
arguments, the compiled kernel's run() with the values it is handed, and floors: torch's copy_, a
Triton kernel of 1 and of 20 arguments launched through run(); then the GPU time of reading a split table from
pinned host memory against device memory (table_read_probe) (the uneven all_to_all's kernels read theirs from pinned
memory: copying it to the device first cost more, BENCHMARKS.md 2026-11-26). Not a test (no assertions)."""
import time

import torch
import triton
import triton.language as tl

import tilecomm
from tilecomm.collectives import api
from tilecomm.jit import BoundLaunch


def host_us(fn, n=2000, busy=False):
    """busy: the GPU is kept busy meanwhile (a sleep kernel queued first), so launches queue up."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    if busy:
        torch.cuda._sleep(200_000_000)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


@triton.jit
def one_arg(x):
    pass


@triton.jit
def twenty_args(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t):
    pass


@triton.jit
def table_reader(table_ptr, out_ptr, W):
    """What the uneven all_to_all's programs do first: load the 4 split-table entries of their peer."""
    pid = tl.program_id(0)
    p = pid % W
    total = tl.load(table_ptr + 2 * p) + tl.load(table_ptr + 2 * p + 1)
    total += tl.load(table_ptr + 2 * W + 2 * p) + tl.load(table_ptr + 2 * W + 2 * p + 1)
    tl.store(out_ptr + pid, total)


def table_read_probe():
    """GPU µs per launch of table_reader over 2 programs per SM, the table in pinned host memory (the uneven
    all_to_all's, read over PCIe) against the same table in device memory: is the 89 µs uneven 128-row kernel at
    world 4 (2026-11-26 evening, 4 x H100) the table's host reads?"""
    W = 4
    grid = (2 * torch.cuda.get_device_properties(0).multi_processor_count,)
    out = torch.empty(grid[0], dtype=torch.int64, device="cuda")
    host = torch.arange(4 * W, dtype=torch.int64).pin_memory()
    for name, table in (("pinned host", host), ("device", host.cuda())):
        table_reader[grid](table, out, W)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000_000)  # the launches queue up meanwhile: the events time the GPU, not the host
        start.record()
        for _ in range(200):
            table_reader[grid](table, out, W)
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / 200
        print(f"split table in {name} memory: {us:.1f} GPU µs per launch of {grid[0]} programs (queued behind a "
              f"sleep kernel, so back to back on the GPU)")


def main():
    tilecomm.init(backend="cuda", heap_bytes=4 << 30)
    x = torch.randn(128, 7168, device="cuda").bfloat16()
    out = torch.empty_like(x)
    rows = []
    rows.append(("all_to_all_single (public)", host_us(lambda: tilecomm.all_to_all_single(out, x))))
    rows.append(("all_to_all_single (public), GPU busy", host_us(lambda: tilecomm.all_to_all_single(out, x), busy=True)))
    rows.append(("all_gather_into_tensor (public)", host_us(lambda: tilecomm.all_gather_into_tensor(out, x))))
    rows.append(("  checks: _check_call", host_us(lambda: api._check_call("w", None, "o", out, "i", x))))
    rows.append(("  _a2a_even (state + launch: the even eager call)", host_us(lambda: api._a2a_even(out, x, 128))))
    rows.append(("  _a2a (split lists compared, then the same)", host_us(lambda: api._a2a(out, x, [128], [128]))))

    captured = {}
    real_launch = BoundLaunch.launch

    def spy(self, grid, *varying):
        captured["launch"] = (self, grid, varying)
        return real_launch(self, grid, *varying)

    BoundLaunch.launch = spy
    tilecomm.all_to_all_single(out, x)
    BoundLaunch.launch = real_launch
    self, grid, varying = captured["launch"]  # the collectives' launch, bound to their state (jit.BoundLaunch)
    rows.append(("  BoundLaunch.launch", host_us(lambda: self.launch(grid, *varying))))
    rows.append(("  of which converting the varying arguments", host_us(lambda: self.values_and_spec(varying))))
    run, function, prefix, consts, _ = next(iter(self.entries.values()))  # (the collectives take no scratch)
    values = self.values_and_spec(varying)[0]
    stream = torch._C._cuda_getCurrentRawStream(0)
    g0 = grid[0]
    rows.append(("  C launch with the call's values" if len(prefix) > 4 else "  kernel.run with the call's values",
                 host_us(lambda: run(g0, 1, 1, stream, function, *prefix, *values, *consts))))
    rows.append(("  data_ptr x4 + stream query", host_us(
        lambda: (x.data_ptr(), out.data_ptr(), x.data_ptr(), out.data_ptr(), torch._C._cuda_getCurrentRawStream(0)))))
    rows.append(("  runtime.check_errors", host_us(tilecomm.runtime.check_errors)))
    words = tilecomm.current().device_state._code
    plain = words.copy()
    rows.append(("  read of the pinned error word", host_us(lambda: words[0])))
    rows.append(("  read of an ordinary NumPy word", host_us(lambda: plain[0])))
    rows.append(("floor: out.copy_(x)", host_us(lambda: out.copy_(x))))
    rows.append(("floor: out.copy_(x), GPU busy", host_us(lambda: out.copy_(x), busy=True)))
    k1 = one_arg[(1,)](x)
    rows.append(("floor: 1-arg Triton kernel, run()", host_us(
        lambda: k1.run(1, 1, 1, stream, k1.function, k1.packed_metadata, None, None, None, x.data_ptr()))))
    ints = [3] * 19
    k20 = twenty_args[(1,)](x, *ints)
    rows.append(("floor: 20-arg Triton kernel, run()", host_us(
        lambda: k20.run(1, 1, 1, stream, k20.function, k20.packed_metadata, None, None, None, x.data_ptr(), *ints))))
    rows.append(("floor: 20-arg Triton kernel, kernel[grid]", host_us(lambda: twenty_args[(1,)](x, *ints), n=300)))
    print("host µs per call (triton", triton.__version__, ")")
    for name, us in rows:
        print(f"  {name:45s} {us:8.2f}")
    table_read_probe()
    low_latency_profile()
    matmul_profile()
    tilecomm.finalize()


def matmul_profile():
    """Host µs and a cProfile (own time) of tilecomm.overlap.matmul at 1000^3 bf16 (kernel ~16 µs)."""
    import cProfile
    import pstats

    from tilecomm.overlap import matmul

    a = torch.randn(1000, 1000, device="cuda").bfloat16()
    b = torch.randn(1000, 1000, device="cuda").bfloat16()
    print(f"matmul 1000^3 host µs {host_us(lambda: matmul(a, b), 300):.1f}, torch a @ b {host_us(lambda: a @ b, 300):.1f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        matmul(a, b)
    prof.disable()
    torch.cuda.synchronize()
    print("== cProfile of 200 matmul calls")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def low_latency_profile():
    """Host µs and a cProfile (own time) of low-latency dispatch and combine, 128 x 7168, top-8 of 256."""
    import cProfile
    import pstats

    from tilecomm.dispatch import Dispatcher

    T, H, E, K = 128, 7168, 256, 8
    d = Dispatcher(E, H, T, K, torch.bfloat16, mode="low_latency")
    x = torch.randn(T, H, device="cuda").bfloat16()
    idx = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    w = torch.softmax(torch.randn(T, K, device="cuda"), dim=1)
    with torch.no_grad():
        res = d.dispatch(x, idx, w)
        y = res.x.clone()
        print(f"low-latency dispatch host µs {host_us(lambda: d.dispatch(x, idx, w), 300):.1f}, "
              f"combine {host_us(lambda: d.combine(y, res.handle), 300):.1f}")
        from torch.profiler import ProfilerActivity, profile

        for name, fn in (("dispatch", lambda: d.dispatch(x, idx, w)), ("combine", lambda: d.combine(y, res.handle))):
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            print(f"low-latency {name} kernels (µs per call):",
                  [(e.key[:30], round(e.device_time_total / 20, 1)) for e in p.key_averages() if e.device_time_total > 0])
        for name, fn in (("dispatch", lambda: d.dispatch(x, idx, w)), ("combine", lambda: d.combine(y, res.handle))):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            print(f"== cProfile of 200 low-latency {name} calls")
            pstats.Stats(prof).sort_stats("tottime").print_stats(16)
    d.free()


if __name__ == "__main__":
    main()
