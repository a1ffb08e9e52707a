"""Where a collective's time goes at world W, beside NCCL's (a diagnostic for issue 14's missed bars):

    torchrun --nproc-per-node 4 tests/comm_profile.py

For each case, tilecomm's call and torch.distributed's (NCCL) on the same tensors: wall µs per call (N
calls back to back, one synchronize), host µs per call (the same calls without the wait), and the GPU time
of one call: torch.profiler over 6 calls back to back, the median of calls 2-6's summed kernel time (the
first absorbs the ranks' profiler start skew; a collective kernel's time includes its waits for peers),
with the kernel names; for normal dispatch / combine also each kernel's time and a call's span (first
kernel start to last kernel end) and the idle GPU time to the next call's first kernel; for the uneven 128-row
all_to_all a cProfile of its host path. Runs at world 1 too (`--nproc-per-node 1`). Rank 0 prints; every rank runs. Not a test (no assertions: the bench checks
results); its output is the profile a note cites. (On 4 H200s, 2026-11-26, the kernel column was one
profiled call's, skew up to 87 ms; now it is the steady calls'.)
"""
import os

import torch
import torch.distributed as dist

import tilecomm
from tilecomm.bench import measure
from tilecomm.bench.collectives import uneven_splits
from tilecomm.dispatch import Dispatcher

from _probe import collective_tensors

CASES = [("all_to_all", (128, 7168), False), ("all_to_all", (128, 7168), True),
         ("all_to_all", (4096, 7168), False), ("all_to_all", (4096, 7168), True),
         ("all_gather", (8192, 8192), False), ("reduce_scatter", (8192, 8192), False),
         ("reduce_scatter", (8192, 8192), True)]
UNEVEN = [(128, 7168), (4096, 7168)]  # all_to_all with the bench's --uneven splits
LOW_LATENCY = dict(tokens=128, hidden=7168, experts=256, topk=8)  # the bench's low-latency dispatch
NORMAL = dict(tokens=4096, hidden=7168, experts=256, topk=8)  # the bench's normal dispatch (DeepSeek-V3 shape)


def _uneven_calls(shape, world, rank):
    """(ours, theirs): an all_to_all of the bench's uneven splits (bench/collectives.py) of shape's rows."""
    n = uneven_splits(shape[0], world)
    send, recv = n[rank], [n[p][rank] for p in range(world)]
    x = torch.randn(sum(send), shape[1], device="cuda").to(torch.bfloat16)
    out = torch.empty(sum(recv), shape[1], dtype=torch.bfloat16, device="cuda")
    return (lambda: tilecomm.all_to_all_single(out, x, recv, send),
            lambda: dist.all_to_all_single(out, x, recv, send))


def _low_latency_calls():
    """[(label, call)]: low-latency dispatch and combine (tilecomm only; the bench times NCCL's normal path)."""
    c = LOW_LATENCY
    d = Dispatcher(c["experts"], c["hidden"], c["tokens"], c["topk"], torch.bfloat16, mode="low_latency")
    x = torch.randn(c["tokens"], c["hidden"], device="cuda").to(torch.bfloat16)
    w, idx = torch.rand(c["tokens"], c["experts"], device="cuda").topk(c["topk"], dim=1)
    res = d.dispatch(x, idx, w)
    y = res.x.clone()
    return [("low_latency dispatch 128x7168", lambda: d.dispatch(x, idx, w)),
            ("low_latency combine 128x7168", lambda: d.combine(y, res.handle))]


def _normal_calls():
    """[(label, call)]: normal-mode dispatch and combine (the bench's shape)."""
    c = NORMAL
    d = Dispatcher(c["experts"], c["hidden"], c["tokens"], c["topk"], torch.bfloat16)
    x = torch.randn(c["tokens"], c["hidden"], device="cuda").to(torch.bfloat16)
    w, idx = torch.rand(c["tokens"], c["experts"], device="cuda").topk(c["topk"], dim=1)
    res = d.dispatch(x, idx, w)
    y = torch.randn_like(res.x)
    return [("normal dispatch 4096x7168", lambda: d.dispatch(x, idx, w)),
            ("normal combine 4096x7168", lambda: d.combine(y, res.handle))]


def _kernel_timeline(rank, label, call, calls=6):
    """Each kernel's (and memcpy's) mean µs per call, in launch order, and a call's span from its first
    kernel's start to its last one's end (calls 2.. of `calls` back to back): which kernel holds the time, and
    how much of the span no kernel covers."""
    events = measure.gpu_events(call, calls, settle=dist.barrier)
    per_call = max(1, len(events) // calls)
    steady = events[per_call:]
    names = [e.name[:32] for e in events[:per_call]]
    means = [sum(e.device_time_total for e in steady[i::per_call]) / max(1, calls - 1) for i in range(per_call)]
    spans = [steady[i + per_call - 1].time_range.end - steady[i].time_range.start
             for i in range(0, len(steady) - per_call + 1, per_call)]
    # idle GPU time between one call's last kernel and the next call's first (back to back: host-bound if large)
    gaps = [steady[i].time_range.start - steady[i - 1].time_range.end for i in range(per_call, len(steady), per_call)]
    if rank == 0:
        parts = "  ".join(f"{n} {m:.1f}" for n, m in zip(names, means))
        gap = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
        print(f"{label:<28} timeline: span {sorted(spans)[len(spans) // 2]:.1f} µs, kernels {sum(means):.1f}, gap to the "
              f"next call {gap:.1f}: {parts}", flush=True)


def _host_cprofile(rank, label, call, calls=200):
    """Own host time per function over `calls` calls (every rank runs them; rank 0 prints the top 12)."""
    import cProfile
    import pstats

    dist.barrier()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    if rank == 0:
        print(f"== {label}: cProfile of {calls} calls (own time)", flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def _report(rank, label, lib, call):
    dist.barrier()
    wall = measure.per_call_us(call)
    dist.barrier()
    host = measure.host_us(call)
    dist.barrier()
    n, kern, names = measure.kernel_profile(call, 6, settle=dist.barrier)
    if rank == 0:
        print(f"{label:<28} {lib:<8} wall {wall:8.1f}  host {host:7.1f}  kernel {kern:8.1f}  "
              f"kernels {n}  [{names}]", flush=True)


def main():
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    tilecomm.init(heap_bytes=2 << 30)  # the normal Dispatcher takes 450 MiB at 4 ranks
    world, rank = dist.get_world_size(), dist.get_rank()
    ours = {"all_to_all": tilecomm.all_to_all_single, "all_gather": tilecomm.all_gather_into_tensor,
            "reduce_scatter": tilecomm.reduce_scatter_tensor}
    theirs = {"all_to_all": dist.all_to_all_single, "all_gather": dist.all_gather_into_tensor,
              "reduce_scatter": dist.reduce_scatter_tensor}
    if rank == 0:
        print(f"world {world}: wall / host / kernel µs per call, kernels per call (rank 0; median of 5 runs of 10 calls back to back)")
    for op, shape, symmetric in CASES:
        x, out = collective_tensors(op, shape, world, heap_input=symmetric)
        for lib, fn in (("tilecomm", ours[op]), ("nccl", theirs[op])):
            _report(rank, f"{op} {shape[0]}x{shape[1]}{' sym' if symmetric else ''}", lib, lambda fn=fn: fn(out, x))
        if symmetric:
            tilecomm.free(x)
    for shape in UNEVEN:
        calls = _uneven_calls(shape, world, rank)
        for lib, call in zip(("tilecomm", "nccl"), calls):
            _report(rank, f"all_to_all {shape[0]}x{shape[1]} uneven", lib, call)
        if shape == UNEVEN[0]:  # host-bound at world 2 (72 µs of host time against 27 even, 2026-11-26): where
            _host_cprofile(rank, f"all_to_all {shape[0]}x{shape[1]} uneven", calls[0])
    for label, call in _low_latency_calls():
        _report(rank, label, "tilecomm", call)
    for label, call in _normal_calls():
        _report(rank, label, "tilecomm", call)
        _kernel_timeline(rank, label, call)
    tilecomm.check_errors()
    tilecomm.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
