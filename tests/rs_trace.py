"""Where reduce_scatter's time goes, program by program (a diagnostic, not a test; GPUs):

    torchrun --nproc-per-node 4 tests/rs_trace.py [--config 2/128/32] [--size 8192] [--heap] [--calls 20]

A CollectiveState with the config's knobs (tests/collective_sweep.py's --configs format) and trace=True replaces the
runtime's. reduce_scatter_tensor of size x size bf16 (ordinary tensors; --heap: on the symmetric heap, read in place)
is checked once against NCCL's, then runs --calls times back to back after a barrier; each rank reads the trace of
the last call (CollectiveState.reduce_scatter_trace: every program's start, end, chunks, and the time its reduce steps
waited for the writers' ready signals, its push steps waited for ring slots, and its push and reduce steps took).
Rank by rank: the call's span on the GPU (first program start to last program end), the µs per call back to back,
and over the programs the median and max of: the headers (start to headers read), the push and reduce steps and their
waits, and what is left (end - headers - push - reduce: the final signals, and for heap inputs the wait for the
readers). ncu cannot tell this for a kernel that waits on its peers: it replays the kernel alone.
"""
import argparse

import torch
import torch.distributed as dist

import tilecomm
from tilecomm.bench import measure

from _probe import collective_tensors, start_rank
from collective_sweep import state_for

PARTS = ("headers", "push", "wait_slot", "reduce", "wait_ready", "rest")


def _parts_us(tr: dict) -> dict:
    """{part: float64 tensor [programs] of µs} from a trace (module docstring)."""
    us = {k: v.double() / 1e3 for k, v in tr.items()}
    return {"headers": us["headers"] - us["start"], "push": us["push"], "wait_slot": us["wait_slot"],
            "reduce": us["reduce"], "wait_ready": us["wait_ready"],
            "rest": us["end"] - us["headers"] - us["push"] - us["reduce"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="2/128/32")
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--heap", action="store_true")
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    ctx, world, rank, local = start_rank(2 << 30)
    x, out = collective_tensors("reduce_scatter", (args.size, args.size), world, args.heap, args.heap)
    default = ctx.collectives
    ctx.collectives = state = state_for(ctx, args.config, torch.cuda.get_device_properties(local).multi_processor_count,
                                        trace=True)
    torch.cuda.synchronize()
    dist.barrier()  # every rank's words are zeroed before a peer signals them
    try:
        ref = torch.empty_like(out)
        dist.reduce_scatter_tensor(ref, x)
        tilecomm.reduce_scatter_tensor(out, x)
        torch.cuda.synchronize()
        tilecomm.check_errors()
        ok = torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=5e-2)
        dist.barrier()
        per_call = measure.per_call_us(lambda: tilecomm.reduce_scatter_tensor(out, x), iters=args.calls, warmup=2)
        tr = state.reduce_scatter_trace()
        span = (tr["end"].max() - tr["start"].min()).item() / 1e3
        parts = _parts_us(tr)
        line = "  ".join(f"{k} {v.median().item():6.1f}/{v.max().item():6.1f}" for k, v in parts.items())
        chunks = tr["chunks"]
        rows = [None] * world
        dist.all_gather_object(rows, f"rank {rank}: {'ok' if ok else 'WRONG'}  {per_call:7.1f} µs/call  span "
                                     f"{span:7.1f}  programs {chunks.numel()}, chunks {chunks.min().item()}-"
                                     f"{chunks.max().item()}  µs median/max: {line}")
        if rank == 0:
            print(f"reduce_scatter {args.size}x{args.size} bf16{' heap' if args.heap else ''}, world {world}, config "
                  f"{args.config} ({state.programs_per_peer} programs per peer, ring chunk "
                  f"{state.chunk_bytes >> 10} KiB)", flush=True)
            print("\n".join(rows), flush=True)
    finally:
        torch.cuda.synchronize()
        state.free()
        ctx.collectives = default
    tilecomm.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
