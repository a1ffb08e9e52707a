"""Where a collective's time goes at world W, beside NCCL's (a diagnostic for issue 14's missed bars):

    torchrun --nproc-per-node 4 tests/comm_profile.py

For each case, tilecomm's call and torch.distributed's (NCCL) on the same tensors: wall µs per call (N
calls back to back, one synchronize), host µs per call (the same calls without the wait), and the GPU time
of one call: torch.profiler over 6 calls back to back, the median of calls 2-6's summed kernel time (the
first absorbs the ranks' profiler start skew; a collective kernel's time includes its waits for peers),
with the kernel names. Rank 0 prints; every rank runs. Not a test (no assertions: the bench checks
results); its output is the profile a note cites. (On 4 H200s, 2026-11-26, the kernel column was one
profiled call's, skew up to 87 ms; now it is the steady calls'.)
"""
import os

import torch
import torch.distributed as dist

import tilecomm
from tilecomm.bench import measure

CASES = [("all_to_all", (128, 7168), False), ("all_to_all", (128, 7168), True),
         ("all_to_all", (4096, 7168), False), ("all_to_all", (4096, 7168), True),
         ("all_gather", (8192, 8192), False), ("reduce_scatter", (8192, 8192), False),
         ("reduce_scatter", (8192, 8192), True)]


def _tensors(op, shape, symmetric, world):
    rows, cols = shape
    part = (rows // world, cols)
    in_shape, out_shape = {"all_to_all": (shape, shape), "all_gather": (part, shape),
                           "reduce_scatter": (shape, part)}[op]
    x = torch.randn(in_shape, device="cuda").to(torch.bfloat16)
    if symmetric:
        heap = tilecomm.empty(in_shape, torch.bfloat16)
        heap.copy_(x)
        x = heap
    return x, torch.empty(out_shape, dtype=torch.bfloat16, device="cuda")


def main():
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    tilecomm.init(heap_bytes=1 << 30)
    world, rank = dist.get_world_size(), dist.get_rank()
    ours = {"all_to_all": tilecomm.all_to_all_single, "all_gather": tilecomm.all_gather_into_tensor,
            "reduce_scatter": tilecomm.reduce_scatter_tensor}
    theirs = {"all_to_all": dist.all_to_all_single, "all_gather": dist.all_gather_into_tensor,
              "reduce_scatter": dist.reduce_scatter_tensor}
    if rank == 0:
        print(f"world {world}: wall / host / kernel µs per call, kernels per call (rank 0; 50 calls back to back)")
    for op, shape, symmetric in CASES:
        x, out = _tensors(op, shape, symmetric, world)
        for lib, fn in (("tilecomm", ours[op]), ("nccl", theirs[op])):
            call = lambda: fn(out, x)  # noqa: E731
            dist.barrier()
            wall = measure.per_call_us(call)
            dist.barrier()
            host = measure.host_us(call)
            dist.barrier()
            n, kern, names = measure.kernel_profile(call, 6, settle=dist.barrier)
            if rank == 0:
                label = f"{op} {shape[0]}x{shape[1]}{' sym' if symmetric else ''}"
                print(f"{label:<28} {lib:<8} wall {wall:8.1f}  host {host:7.1f}  kernel {kern:8.1f}  "
                      f"kernels {n}  [{names}]", flush=True)
        if symmetric:
            tilecomm.free(x)
    tilecomm.check_errors()
    tilecomm.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
