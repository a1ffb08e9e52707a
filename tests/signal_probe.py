"""Which signal operations reach which ranks (a diagnostic, not a test): every (op, source, target) pair on
the current transport, each word read back by torch on every rank.

    TILECOMM_TRANSPORT=nvshmem torchrun --nproc-per-node 2 tests/signal_probe.py

Written after `test_signal_add_and_every_compare` failed on 2 H200s with the nvshmem transport only (rank 0's
wait for the sum of both ranks' SIGNAL_ADD timed out), while SIGNAL_SET passed in test_put_signal_wait."""
from __future__ import annotations

import torch
import triton.language as tl

import tilecomm
import tilecomm.language as tcl


@tilecomm.jit
def _signal_kernel(sig_ptr, value, pe, OP: tl.constexpr, TIMES: tl.constexpr):
    for _ in tl.static_range(TIMES):
        tcl.signal(sig_ptr, value, pe, OP)


def main() -> None:
    tilecomm.init()  # GPUs where there are, else CPU ranks
    rank, world = tilecomm.rank(), tilecomm.world_size()
    for name, op, times in (("SET", tcl.SIGNAL_SET, 1), ("ADD", tcl.SIGNAL_ADD, 1), ("ADD twice", tcl.SIGNAL_ADD, 2)):
        for src in range(world):
            for dst in range(world):
                sig = tilecomm.zeros((2,), torch.int64)
                if rank == src:
                    _signal_kernel[(1,)](sig, 5 + src, dst, OP=op, TIMES=times)
                tilecomm.barrier()
                seen = sig.tolist()
                if rank == dst:
                    want = (5 + src) * (times if name.startswith("ADD") else 1)
                    print(f"{name:9s} rank {src} -> rank {dst}: word {seen[0]} (want {want}) "
                          f"{'ok' if seen[0] == want else 'WRONG'}", flush=True)
                tilecomm.barrier()
                tilecomm.free(sig)
    # the failing test's pattern: every rank adds rank + 1 into rank 0's word at once
    sig = tilecomm.zeros((1,), torch.int64)
    _signal_kernel[(1,)](sig, rank + 1, 0, OP=tcl.SIGNAL_ADD, TIMES=1)
    tilecomm.barrier()
    if rank == 0:
        print(f"all ranks ADD into rank 0: {sig.item()} (want {world * (world + 1) // 2})", flush=True)
    tilecomm.barrier()
    tilecomm.free(sig)
    tilecomm.finalize()


if __name__ == "__main__":
    main()
