"""
Custom overlapped kernel: ring all-gather + matmul with tilecomm.language
========================================================================

Every rank r holds a row shard A_r [m, K] on the symmetric heap and the same B [K, n]. We want

    C = all_gather(A) @ B = cat(A_0, ..., A_{W-1}) @ B        # [W*m, n] on every rank

without first waiting for the whole all-gather. Two kernels per call, with epoch e = 1, 2, ...:

1. push    program p puts A_r into slot r of the gather buffer of peer (r - 1 - p) mod W, then
           raises that peer's signal word sig[r] to e (tcl.signal with SIGNAL_SET). A signal is a
           release: the put lands before the signal does. Peers are served in the order they
           need A_r: rank r-1 uses it second (right after its own shard), r-2 third, and so on.
2. gemm    program (step, i, j) computes the output tile of row block i, column block j for the
           shard of source s = (r + step) mod W: step 0 is rank r's own shard (no waiting), for
           later steps the program waits on its local sig[s] >= e (tcl.wait, CMP_GE) and then
           reads A_s from its gather buffer. A peer's tiles start as soon as that peer's signal lands.

Why it cannot deadlock: push never waits, and gemm only waits for a peer's push, which that peer
launches before its own gemm. On GPUs both kernels of all ranks run concurrently; the Triton
interpreter (CPU ranks) runs a launch's programs one after another, and since rank s's push is
finished before rank s starts its gemm, every wait is eventually satisfied. Because signals carry
the epoch, they never need resetting; a host barrier after each call keeps a fast rank from
overwriting a gather slot that a slow peer is still reading.

Run:  python examples/custom_overlap_kernel.py [--world-size 3] [--m 32 --k 32 --n 32] [--backend cpu]
"""
import argparse
import time

import torch
import triton
import triton.language as tl

import tilecomm
import tilecomm.language as tcl


@tilecomm.jit
def push_kernel(a_ptr, gather_ptr, sig_ptr, epoch, world, shard_numel):
    me = tcl.rank()
    peer = (me + 2 * world - 1 - tl.program_id(0)) % world  # r-1, r-2, ...: the order peers need A_r
    if peer != me:
        # A_r -> slot `me` of the peer's gather buffer, then tell the peer that slot is ready.
        tcl.put(gather_ptr + me.to(tl.int64) * shard_numel, a_ptr, shard_numel, peer)
        tcl.signal(sig_ptr + me, epoch, peer, tcl.SIGNAL_SET)


@tilecomm.jit
def gemm_kernel(a_ptr, gather_ptr, sig_ptr, b_ptr, c_ptr, epoch, world, M, N, K,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    step = tl.program_id(0)  # ring order: own shard first, then r+1, r+2, ...
    me = tcl.rank()
    src = (me + step) % world
    if src == me:
        a_src = a_ptr  # own shard: compute straight away
    else:
        token = tcl.wait(sig_ptr + src, epoch, tcl.CMP_GE)  # spin until src's put has landed
        a_src = tcl.consume_token(gather_ptr + src.to(tl.int64) * M * K, token)  # loads stay after the wait

    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # (tl.zeros is a jit helper the CPU path can't call)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_src + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_ptr + ks[:, None] * N + cols[None, :], mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
    # Source s's shard fills rows [s*M, (s+1)*M) of C.
    out = c_ptr + (src.to(tl.int64) * M + rows[:, None]) * N + cols[None, :]
    tl.store(out, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


def all_gather_matmul(a, gather, sig, b, epoch, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16):
    """C = all_gather(a) @ b. a, gather [W, m, K] and sig [W] int64 live on the symmetric heap."""
    world = tilecomm.world_size()
    (m, k), n = a.shape, b.shape[1]
    c = torch.empty((world * m, n), dtype=torch.float32, device=a.device)
    push_kernel[(world,)](a, gather, sig, epoch, world, m * k)
    grid = (world, triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    gemm_kernel[grid](a, gather, sig, b, c, epoch, world, m, n, k,
                      BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    tilecomm.barrier()  # nobody pushes the next call's shard into a slot a peer still reads
    return c


def make_inputs(rank, m, k, n, call):
    """Seeded inputs any rank can regenerate: rank `rank`'s shard and the shared B."""
    a = torch.randn(m, k, generator=torch.Generator().manual_seed(1000 * call + rank))
    b = torch.randn(k, n, generator=torch.Generator().manual_seed(1000 * call + 999))
    return a, b


def run_rank(m, k, n, calls=2):
    """Runs on every rank (module-level, so tilecomm.launch can pickle it)."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    dev = tilecomm.current().device
    a = tilecomm.empty((m, k), torch.float32)          # this rank's shard, on the symmetric heap
    gather = tilecomm.empty((world, m, k), torch.float32)  # slot s receives A_s
    sig = tilecomm.zeros((world,), torch.int64)         # sig[s] = last epoch whose A_s has landed
    tol = 1e-5 if dev.type == "cpu" else 1e-2           # fp32 tl.dot uses tf32 on GPUs
    start, worst = time.perf_counter(), 0.0
    for call in range(1, calls + 1):                    # call number = epoch: signals never reset
        a_cpu, b_cpu = make_inputs(rank, m, k, n, call)
        a.copy_(a_cpu)
        c = all_gather_matmul(a, gather, sig, b_cpu.to(dev), epoch=call)
        shards = [make_inputs(r, m, k, n, call)[0] for r in range(world)]
        ref = torch.cat(shards).double() @ b_cpu.double()
        err = ((c.cpu().double() - ref).norm() / ref.norm()).item()
        assert err < tol, f"rank {rank}, call {call}: relative error {err:.3e} >= {tol:g}"
        worst = max(worst, err)
    return (f"rank {rank}/{world}: C = all_gather(A) @ B, {world * m}x{k} @ {k}x{n}, {calls} calls, "
            f"max rel err {worst:.2e}, {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--m", type=int, default=32, help="rows of A per rank")
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    for line in tilecomm.launch(run_rank, args.world_size, args.m, args.k, args.n, backend=args.backend):
        print(line)
