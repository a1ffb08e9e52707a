"""Low-latency dispatch/combine tuning sweep: 128 x 7168 bf16 per rank, top-8 of 256 experts.

    python tests/ll_probe.py [--once]                              # one GPU, world 1
    torchrun --nproc-per-node 4 tests/ll_probe.py [--default]      # one rank per GPU (rank 0 prints its times)
    torchrun --nproc-per-node 4 tests/ll_probe.py --trace          # the default config's dispatch traced

For each LowLatencyConfig: µs per call back to back, each kernel's device time (torch.profiler), and the
send and receive roles timed apart (return_recv_hook: two launches of the dispatch kernel); results
checked against the default config's. --once: the default config only, a few calls (for ncu); --default: the
default config only, timed. At world W > 1 the send role's time is this rank's sends and count publication, the
receive role's includes waiting for every peer's counts: the two apart say whether a call's time beyond world 1's
is waiting or copying. --trace: the default config with LowLatencyConfig.trace, every rank's last dispatch launch
program by program (µs from the launch's first program start on this rank's clock): when the senders started, could
send (their tokens' owners had consumed the previous call) and ended, when the last sender had published the counts,
when the receivers got their counts and ended; then the combine's expert-side reducers and summers alike. Not a test (no assertions beyond equality)."""
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import tilecomm
from tilecomm.dispatch import Dispatcher
from tilecomm.dispatch import low_latency as ll

from _probe import routed_tokens, sweep_configs

CONFIGS = [dict(), dict(col_programs=2), dict(block_h=4096, col_programs=2), dict(col_programs=1),
           dict(block_h=1024, col_programs=4), dict(block_rows=4), dict(block_rows=4, col_programs=2),
           dict(block_rows=8, col_programs=2, num_warps=8)]


def line_up(fn, warm=3):
    """A few calls of fn, then every rank waits for the others: a timed region starts with the ranks together (at
    world 4, without this, a rank's first profiled kernel waited up to ~1 s for peers still in the previous
    measurement, and torch.profiler's mean reported kernels of 10-96 ms: 2026-11-27 from 06:19 UTC)."""
    for _ in range(warm):
        fn()
    tilecomm.barrier()  # (waits for this rank's kernels first)


def per_call(fn, n=200):
    line_up(fn, 10)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def _gpu_events(prof):
    return [e for e in prof.events() if e.device_type == DeviceType.CUDA and e.device_time_total > 0]


def _median(times):
    return round(sorted(times)[len(times) // 2], 1) if times else 0.0


def kernels(fn, n=20):
    """Median device µs per call of each kernel (medians: a call that waited for a late peer does not count)."""
    line_up(fn)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in _gpu_events(p):
        times.setdefault(e.name.strip("_")[:12], []).append(e.device_time_total)
    return {k: _median(v) for k, v in times.items()}


def roles(fn, name, n=20):
    """Median device µs of the first and second launch of kernel `name` in each call of fn (two roles)."""
    line_up(fn)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    times = [e.device_time_total for e in _gpu_events(p) if name in e.name]
    return _median(times[0::2]), _median(times[1::2])


def _spread(us) -> str:
    """median / max of a tensor of µs."""
    return f"{us.median().item():6.1f} / {us.max().item():6.1f}" if us.numel() else "  none"


def trace_line(d, kernel: str) -> str:
    """The last `kernel` launch's trace of Dispatcher d, in µs from its first program start (--trace): dispatch's
    senders and receivers, or combine's expert-side reducers and summers."""
    tr = d._engine.trace(kernel)
    t0 = tr["start"].min()
    us = {k: (v - t0).double() / 1e3 for k, v in tr.items() if k != "role"}
    send, pub, recv = (tr["role"] == ll.SENT) | (tr["role"] == ll.PUBLISHED), tr["role"] == ll.PUBLISHED, \
        tr["role"] == ll.RECEIVED
    first, last, signal = ("senders", "receivers", "counts") if kernel == "dispatch" else \
        ("reducers", "summers", "partial rows")
    return (f"rank {tilecomm.rank()} {kernel}: {int(send.sum())} {first} start {_spread(us['start'][send])}, ready "
            f"{_spread(us['ready'][send])}, end {_spread(us['end'][send])}; {signal} announced at "
            f"{us['end'][pub].max().item():6.1f}; {int(recv.sum())} {last} start {_spread(us['start'][recv])}, "
            f"ready {_spread(us['ready'][recv])}, end {_spread(us['end'][recv])}, working "
            f"{_spread(us['end'][recv] - us['ready'][recv])} (µs, median / max)")


def main():
    once, only_default, traced = "--once" in sys.argv, "--default" in sys.argv, "--trace" in sys.argv
    tilecomm.init(backend="cuda", heap_bytes=4 << 30)
    rank = tilecomm.rank()
    T, H, E, K = 128, 7168, 256, 8
    x, idx, w = routed_tokens(T, H, E, K, seed=rank)
    if rank == 0:
        print(f"world {tilecomm.world_size()}: {T} x {H} bf16 per rank, top-{K} of {E} experts; rank 0's times", flush=True)
    want = []

    def run(over):
        d = Dispatcher(E, H, T, K, torch.bfloat16, mode="low_latency")
        with torch.no_grad():
            res = d.dispatch(x, idx, w)
            out = d.combine(res.x, res.handle)
            got = (res.tokens_per_expert.clone(), out.clone())  # combine's result depends on every row
            if not want:
                want.append(got)
            same = all(torch.equal(a, b) for a, b in zip(got, want[0]))
            if traced:
                line_up(lambda: d.combine(d.dispatch(x, idx, w).x, res.handle), 10)
                d.dispatch(x, idx, w)
                print(trace_line(d, "dispatch"), flush=True)
                tilecomm.barrier()
                d.combine(res.x, res.handle)
                print(trace_line(d, "combine"), flush=True)
                d.free()
                return ""
            if once:
                for _ in range(3):
                    d.combine(d.dispatch(x, idx, w).x, res.handle)
                torch.cuda.synchronize()
                print("once: done", flush=True)
                d.free()
                return False
            disp = per_call(lambda: d.dispatch(x, idx, w))
            comb = per_call(lambda: d.combine(res.x, res.handle))
            kd = kernels(lambda: d.dispatch(x, idx, w))
            kc = kernels(lambda: d.combine(res.x, res.handle))
            send_us, recv_us = roles(lambda: d.dispatch(x, idx, w, return_recv_hook=True).recv_hook(), "dispatch_kernel")
        d.free()
        line = (f"{str(over):55s} dispatch {disp:6.1f} µs {kd} (send {send_us} + receive {recv_us} apart)  "
                f"combine {comb:6.1f} µs {kc}  same={same}")
        return line if rank == 0 else ""  # (False would stop this rank's sweep alone)

    configs = [dict(trace=True)] if traced else CONFIGS[:1] if once or only_default else CONFIGS
    sweep_configs(ll.LowLatencyConfig, configs, H, run, tilecomm.world_size())
    tilecomm.finalize()


if __name__ == "__main__":
    main()
