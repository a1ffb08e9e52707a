"""Normal-mode dispatch tuning sweep: 4096 x 7168 bf16 per rank, top-8 of 256 experts.

    python tests/dispatch_probe.py [--configs "send_programs=132,send_block_h=1024;..."]     # world 1
    torchrun --nproc-per-node 4 tests/dispatch_probe.py [--configs ...]                     # world 4, rank 0 prints

For each NormalConfig variant (fields over NormalConfig.for_device's): dispatch and combine µs per call back to
back, each kernel's mean device time, the GPU's idle time before each and a call's span (first kernel start to
last kernel end), checked bit for bit against the first config's rows, weights and combine (each rank its own
tokens; at world W the times are rank 0's). On sm_90 the forward expand runs beside the send and combine_recv beside
combine_send (programmatic dependent launch), so their times overlap in the span; `trailing=0` runs each after the
kernel it trails instead. (2026-11-26 it
measured a persistent send that published each block, BENCHMARKS.md: slower than one program per block.)
Not a test (no assertions beyond equality)."""
import argparse

import torch

import tilecomm
from tilecomm.bench import measure
from tilecomm.dispatch import Dispatcher
from tilecomm.dispatch import normal as nm

from _probe import routed_tokens, sweep_configs

DEFAULT = ";send_block_h=512;send_block_h=1024;send_block_h=1024,block_h=2048;pairs_per_program=256,send_block_h=1024"


def timeline(fn, calls=6):
    """(kernel name -> mean device µs, kernel name -> mean idle µs of the GPU just before it, a call's median
    span µs), calls 2.. of `calls` back to back. The idle times say which step of the call the GPU waits for
    the host at (e.g. the expand launch, queued only after the host read of the row count)."""
    events = measure.gpu_events(fn, calls)
    per = max(1, len(events) // calls)
    steady = events[per:]
    means, idle = {}, {}
    for prev, e in zip(events[per - 1:], steady):
        means[e.name[:16]] = means.get(e.name[:16], 0.0) + e.device_time_total / (calls - 1)
        gap = max(0.0, e.time_range.start - prev.time_range.end)
        idle[e.name[:16]] = idle.get(e.name[:16], 0.0) + gap / (calls - 1)
    spans = sorted(steady[i + per - 1].time_range.end - steady[i].time_range.start
                   for i in range(0, len(steady) - per + 1, per))
    return ({k: round(v, 1) for k, v in means.items()}, {k: round(v, 1) for k, v in idle.items()},
            spans[len(spans) // 2])


def parse(text):
    over = {}
    for item in filter(None, text.split(",")):
        k, v = item.split("=")
        over[k.strip()] = int(v)
    return over


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default=DEFAULT, help="';'-separated variants, each 'field=value,...' ('' = default)")
    p.add_argument("--no-timeline", action="store_true",
                   help="skip torch.profiler (kernel times, idle gaps): the per-call times alone, every rank's, each of "
                        "the 5 runs (a ~7.7 ms combine at W = 2 came after the dispatch's profiled calls in some runs)")
    args = p.parse_args()
    tilecomm.init(backend="cuda", heap_bytes=4 << 30)
    rank = tilecomm.rank()
    T, H, E, K = 4096, 7168, 256, 8
    x, idx, w = routed_tokens(T, H, E, K, seed=rank)
    want = []
    if rank == 0:
        print(f"normal dispatch 4096x7168 top-8 of 256, world {tilecomm.world_size()}, {torch.cuda.get_device_name()}",
              flush=True)

    def run(over):
        d = Dispatcher(E, H, T, K, torch.bfloat16)
        with torch.no_grad():
            res = d.dispatch(x, idx, w)
            out = d.combine(res.x, res.handle)
            got = (res.x.clone(), res.weights.clone(), out.clone())
            if not want:
                want.append(got)
            same = all(torch.equal(a, b) for a, b in zip(got, want[0]))
            # every timing starts from a barrier: torch.profiler's start and exit take each rank a different time,
            # and unaligned ranks' skew lands in a call's wait for its peers. Without these the combine read 7.7-7.9
            # ms a call (its span 566 µs) in every Dispatcher at W = 4, never with --no-timeline (BENCHMARKS.md,
            # 2026-11-28 from 14:09 UTC)
            tilecomm.barrier()
            per_call = measure.per_call_us(lambda: d.dispatch(x, idx, w))
            if args.no_timeline:
                tilecomm.barrier()
                runs = measure.per_call_runs_us(lambda: d.combine(res.x, res.handle))
                d.free()
                print(f"rank {rank} {','.join(f'{k}={v}' for k, v in over.items()) or 'default'}: dispatch "
                      f"{per_call:.1f} µs/call, combine runs {[round(r, 1) for r in runs]} µs/call", flush=True)
                return ""
            tilecomm.barrier()
            kernels, idle, span = timeline(lambda: d.dispatch(x, idx, w), calls=12)
            tilecomm.barrier()
            per_combine = measure.per_call_us(lambda: d.combine(res.x, res.handle))
            tilecomm.barrier()
            c_kernels, c_idle, c_span = timeline(lambda: d.combine(res.x, res.handle), calls=12)
        d.free()
        name = ",".join(f"{k}={v}" for k, v in over.items()) or "default"
        return "" if rank else (
            f"{name:62s} dispatch {per_call:7.1f} µs/call  span {span:6.1f}  {kernels}  GPU idle before: {idle}\n"
            f"{'':62s} combine  {per_combine:7.1f} µs/call  span {c_span:6.1f}  {c_kernels}  GPU idle before: {c_idle}  "
            f"same={same}")

    sweep_configs(nm.NormalConfig, [parse(text) for text in args.configs.split(";")], H, run, tilecomm.world_size())
    tilecomm.finalize()


if __name__ == "__main__":
    main()
