"""The GPU timeline of one fused ag_gemm / gemm_rs call at world W (a diagnostic for issue 14's bar):

    torchrun --nproc-per-node 4 tests/overlap_profile.py [--out DIR] [--shown N] [--ops gemm_rs] [--tp 4]

For each op and bar shape (tilecomm.bench.overlap's, at TP = --tp), rank 0 prints every kernel and copy of the last
--shown fused calls (of --shown + 2 back to back, after warm-up), as start and end µs from the first one's first GPU
event, its stream and its name, then the same for tilecomm's GEMM alone (`matmul`) for comparison. With --out, each
rank's Chrome trace is saved there. Not a test (no assertions: the bench checks the results).
"""
import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import tilecomm
from tilecomm.bench.overlap import _gpu_shapes, _problem


def _timeline(fn, trace_path, shown=1):
    """The GPU events of the last `shown` of shown + 2 calls issued back to back (CUDA activity only: with the
    profiler's CPU side on, the host fell behind the GPU and the traced call showed gaps the bench does not have,
    2026-11-27). Several calls show what lies between them: back to back, the small gemm_rs cost 44 µs per call
    more than one call's timeline (2 H200s, 2026-11-28)."""
    calls = shown + 2
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                 key=lambda e: e["ts"])
    gpu = gpu[len(gpu) - len(gpu) // calls * shown:]  # every call queues the same events: the last ones, by start
    t0 = min((e["ts"] for e in gpu), default=0)
    return [(e["ts"] - t0, e["ts"] - t0 + e["dur"], e.get("args", {}).get("stream", "?"), e["name"][:70]) for e in gpu]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="directory for each rank's Chrome traces")
    p.add_argument("--shown", type=int, default=1, help="back-to-back calls shown in each timeline (the last ones)")
    p.add_argument("--ops", default="ag_gemm,gemm_rs", help="comma-separated: ag_gemm, gemm_rs")
    p.add_argument("--tp", type=int, default=None, help="the bar shapes at this TP (default: the world size)")
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, rank = dist.get_world_size(), dist.get_rank()
    tilecomm.init(heap_bytes=1 << 30)
    torch.manual_seed(rank)
    out_dir = args.out or tempfile.mkdtemp()
    for op in args.ops.split(","):
        for shape in _gpu_shapes(op, args.tp or world):
            fns = _problem(op, shape, torch.bfloat16, torch.device("cuda", local))
            try:
                for what in ("fused", "tc_gemm"):
                    path = os.path.join(out_dir, f"{op}_{'x'.join(map(str, shape))}_{what}_rank{rank}.json")
                    rows = _timeline(fns[what], path, args.shown)
                    if rank == 0:
                        end = max((r[1] for r in rows), default=0)
                        print(f"== {op} {'x'.join(map(str, shape))} {what}, world {world}: {end:.1f} µs from first "
                              f"to last GPU event, {len(rows)} events of {args.shown} call(s)", flush=True)
                        for start, stop, stream, name in rows:
                            print(f"  {start:8.1f} {stop:8.1f}  stream {stream:<4} {name}", flush=True)
            finally:
                fns["workspace"].free()
    tilecomm.check_errors()
    tilecomm.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
