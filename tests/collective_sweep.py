"""The collectives' tuning knobs at world W, beside NCCL (a diagnostic, not a test):

    torchrun --nproc-per-node 4 tests/collective_sweep.py [--configs "1/128/32,2/64/32"]

Each config is programs per SM / ring chunk KiB / load-store step KiB [/ ring depth [/ 0: reduce_scatter
unstaggered (default 1, CollectiveState.rs_stagger) [/ 1: L2 eviction hints on the staged pairs (default 0,
CollectiveState.ring_hints) [/ 1: equal chunks per program (default 0, CollectiveState.balanced_chunks) [/ 1: ring chunks
dropped from L2 once read (default 0, CollectiveState.ring_discard)]]]]]: the runtime's CollectiveState is replaced by one made with those knobs (and a workspace that
holds two rings of that chunk), every case is checked against NCCL's result once, then timed (µs per call, 50
calls back to back, the slowest rank's). --heap adds each case again with input and output on the symmetric heap
(tilecomm.empty: read in place by the peers, no staging ring).
The defaults in comm/collectives/state.py (two per SM / 128 / 32) came from this sweep on 4 H200s
(BENCHMARKS.md, 2026-11-26 afternoon). Rank 0 prints one row per (case, config) and NCCL's time beside it.

--snapshot S: where a config's first call of a case is still running after S seconds (a hang: its waits time out
after TILECOMM_TIMEOUT_S), every rank copies the kernel's state words to the host on a side stream while it
spins and prints what they say: the ticket counter (programs started so far), the slots whose program has not
started (their epoch is still the previous call's), how far each slot's ready and done words got, and the header
rows of slots whose ready word is still below the call's base (zero: the writer never got to its header).
On 4 H100s (2026-11-26 evening), 3 programs per SM: every program had taken its ticket, and 1-2 slots per rank,
all of them late tickets (k = 3), never got their header.
"""
import argparse
import time

import torch
import torch.distributed as dist

import tilecomm
from tilecomm.bench import measure
from tilecomm.collectives.state import DEPTH, CollectiveState

from _probe import collective_tensors, start_rank

CASES = [("all_to_all", (4096, 7168)), ("all_to_all", (128, 7168)), ("all_gather", (8192, 8192)),
         ("reduce_scatter", (8192, 8192))]
DEFAULT_CONFIGS = "2/128/32,2/128/32/2/0,3/128/32,1/256/32,2/256/32"


def _ranges(ids) -> str:
    """[3, 4, 5, 9] -> "3-5,9"."""
    out, ids = [], sorted(ids)
    for i in ids:
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in out) or "none"


def _snapshot(state, op: str, rank: int, running: torch.cuda.Event, after_s: float) -> None:
    """If the call that `running` follows is still spinning after `after_s` s, print this rank's view of it
    (module docstring): words are meta [S, 4], ready, done, epochs [S], then the ticket counter."""
    deadline = time.monotonic() + after_s
    while not running.query() and time.monotonic() < deadline:
        time.sleep(0.01)
    if running.query():
        return
    words = state.rs_words if op == "reduce_scatter" else state.words
    host = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # not ordered after the spinning kernel: the copy engine reads the words now
        host.copy_(words, non_blocking=True)
    side.synchronize()
    S = (host.numel() - 1) // 7
    ready, done, epochs = host[4 * S:5 * S], host[5 * S:6 * S], host[6 * S:7 * S]
    e = int(epochs.max())
    base = e << 32

    def steps(v):
        rel = torch.where(v >= base, v - base, torch.full_like(v, -1))
        vals, counts = rel.unique(return_counts=True)
        return " ".join(f"{'<base' if int(a) < 0 else ('ALL' if int(a) == (1 << 32) - 1 else int(a))}:{int(c)}"
                        for a, c in zip(vals, counts))

    # a slot whose ready word never reached the call's base: its writer either never stored the header (meta
    # row still zero) or stored it and its signal did not land (meta row filled)
    headerless = (ready < base).nonzero().flatten().tolist()
    meta = host[:4 * S].view(S, 4)
    print(f"[snapshot rank {rank}] {op} still running after {after_s} s: ticket counter {int(host[7 * S])} of {S} "
          f"slots; epoch {e}; slots not started: {_ranges((epochs < e).nonzero().flatten().tolist())}; "
          f"ready (step: slots) {steps(ready)}; done {steps(done)}; no header: "
          f"{ {i: meta[i].tolist() for i in headerless} } (meta rows: offset, count, in place, tag); "
          f"done not final: {_ranges((done != base + (1 << 32) - 1).nonzero().flatten().tolist())}", flush=True)


def _slowest(us: float) -> float:
    t = torch.tensor([us], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def state_for(ctx, config: str, sms: int, trace: bool = False) -> CollectiveState:
    """A CollectiveState made with the knobs of one --configs entry (see the docstring), with a workspace that holds
    two rings of its chunk (collective); trace: reduce_scatter's step timings (tests/rs_trace.py)."""
    per_sm, chunk_k, block_k, *rest = [int(v) for v in config.split("/")]
    depth, stagger, hints, balanced, discard = (rest + [DEPTH, 1, 0, 0, 0][len(rest):])[:5]
    world = ctx.world_size
    slots = world * max(1, per_sm * sms // world)
    workspace = 2 * slots * depth * (chunk_k << 10)
    return CollectiveState.create(ctx, workspace, per_sm, chunk_k << 10, block_k << 10, depth, rs_stagger=bool(stagger),
                                  ring_hints=bool(hints), balanced_chunks=bool(balanced), ring_discard=bool(discard),
                                  trace=trace)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--snapshot", type=float, default=0.0, help="seconds; 0: off (module docstring)")
    p.add_argument("--heap", action="store_true", help="each case also on symmetric-heap tensors (module docstring)")
    args = p.parse_args()
    ctx, world, rank, local = start_rank(2 << 30)
    ours = {"all_to_all": tilecomm.all_to_all_single, "all_gather": tilecomm.all_gather_into_tensor,
            "reduce_scatter": tilecomm.reduce_scatter_tensor}
    theirs = {"all_to_all": dist.all_to_all_single, "all_gather": dist.all_gather_into_tensor,
              "reduce_scatter": dist.reduce_scatter_tensor}
    cases = CASES + ([(op, shape, "heap") for op, shape in CASES] if args.heap else [])
    tensors = {case: collective_tensors(case[0], case[1], world, len(case) > 2, len(case) > 2) for case in cases}
    nccl = {}
    for case in cases:
        x, out = tensors[case]
        dist.barrier()
        nccl[case] = _slowest(measure.per_call_us(lambda: theirs[case[0]](out, x)))
    if rank == 0:
        print(f"world {world}: µs per call (slowest rank; median of 5 runs of 10 calls back to back); config = programs per SM / "
              f"chunk KiB / step KiB", flush=True)
    default = ctx.collectives
    sms = torch.cuda.get_device_properties(local).multi_processor_count
    for config in args.configs.split(","):
        ctx.collectives = state_for(ctx, config, sms)
        torch.cuda.synchronize()
        dist.barrier()  # every rank's words are zeroed before a peer signals them
        try:
            for case in cases:
                x, out = tensors[case]
                ref = torch.empty_like(out)
                theirs[case[0]](ref, x)
                ours[case[0]](out, x)
                if args.snapshot:
                    running = torch.cuda.Event()
                    running.record()
                    _snapshot(ctx.collectives, case[0], rank, running, args.snapshot)
                torch.cuda.synchronize()
                tilecomm.check_errors()
                bad = int(not torch.equal(out, ref)) if case[0] != "reduce_scatter" else \
                    int(not torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=5e-2))
                t = torch.tensor([bad], device="cuda")
                dist.all_reduce(t)
                dist.barrier()
                us = _slowest(measure.per_call_us(lambda: ours[case[0]](out, x)))
                if rank == 0:
                    label = f"{case[0]} {case[1][0]}x{case[1][1]}{' heap' if len(case) > 2 else ''}"
                    print(f"{label:<28} {config:<10} chunk {ctx.collectives.chunk_bytes >> 10:4d}K  tilecomm {us:8.1f}  "
                          f"nccl {nccl[case]:8.1f}  ratio {nccl[case] / us:5.2f}{'  WRONG on %d ranks' % t.item() if t.item() else ''}",
                          flush=True)
        finally:
            ctx.collectives.free()
            ctx.collectives = default
    tilecomm.check_errors()
    tilecomm.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
