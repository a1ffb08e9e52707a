"""How fast can one all_to_all's bytes cross NVLink, by which engine (a diagnostic for issue 14's all_to_all bar):

    torchrun --nproc-per-node 4 tests/a2a_engine_probe.py

Every rank sends rows/W rows of `cols` bf16 to every rank (itself included) at once, N calls back to back, one
synchronize; the slowest rank's µs per call. Inputs and outputs are symmetric-heap tensors, so every way below
writes straight into the reader's output and none stages (no handshake either: these are link rates, not
collectives; the reader's data is not checked beyond the first call):
- `ce 1 stream`: the W chunks as W cuMemcpyDtoDAsync (the copy engine), one after another on one stream;
- `ce W streams`: one stream per destination (the copy engines side by side);
- `sm all peers`: one kernel of W x P programs (P = 2 per SM / W), P of them per destination, each tcl.put of
  its slice (SM stores over NVLink): every GPU writes to every peer at once, as tilecomm's all_to_all does;
- `sm tma RxC [P/2]`: one kernel of W x P programs (or half as many), P per destination, each moving R x C tiles by
  TMA: a tensor-descriptor load from its src, a store through a descriptor on the destination's heap address (the
  bulk-copy unit writing over NVLink, as DeepEP's intranode kernels do), every peer at once;
- `tilecomm heap` / `tilecomm`: tilecomm.all_to_all_single on the heap tensors (each reader copies from its
  writers' inputs in place) / on ordinary tensors (staged through the readers' rings); handshakes included;
- `tilecomm tma push` / `tilecomm tma both` / `tilecomm heap tma`: the same on a CollectiveState with TMA for the
  writers' pushes / the pushes and the readers' copies (tma_push, tma_read; comm/collectives/_copy.py);
- `tilecomm heap direct` / `tilecomm heap direct tma`: the heap tensors on a CollectiveState with `direct` on (each
  writer stores into its readers' outputs, by vector stores / by TMA with one completion wait a program);
- `nccl`: torch.distributed.all_to_all_single on ordinary tensors.
The first call of every copy-engine way is checked against NCCL's result (a wrong address would show).
"""
import os

import torch
import torch.distributed as dist
import triton.language as tl

import tilecomm
import tilecomm.language as tcl
from tilecomm.collectives.state import CollectiveState
from tilecomm.jit import prepare_tma
from tilecomm.stream_ops import StreamIssuer

SHAPES = [(4096, 7168), (128, 7168)]


@tilecomm.jit
def _put_kernel(out_ptr, src_ptr, part, me, W, FIRST_K):
    """Program (i, q): my chunk for destination d = (me + FIRST_K + i) % W, slice q of num_programs(1), into d's
    out at row block me."""
    d = (me + FIRST_K + tl.program_id(0)) % W
    per = tl.cdiv(part, tl.num_programs(1))
    lo = tl.program_id(1) * per
    n = tl.minimum(per, part - lo)
    if n > 0:
        tcl.put(out_ptr + tl.cast(me, tl.int64) * part + lo, src_ptr + tl.cast(d, tl.int64) * part + lo, n, d)


@tilecomm.jit
def _tma_put_kernel(out_ptr, src_ptr, part_rows, cols, me, W, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (i, q): tiles q, q + P, ... of my chunk for destination d = (me + i) % W, each a TMA load from my src
    and a TMA store through a descriptor on d's out (its heap address as mapped here), at row block me."""
    d = (me + tl.program_id(0)) % W
    dst = tcl.symm_at(out_ptr, d) + tl.cast(me, tl.int64) * part_rows * cols
    src = src_ptr + tl.cast(d, tl.int64) * part_rows * cols
    src_desc = tl.make_tensor_descriptor(src, [part_rows, cols], [cols, 1], [BLOCK_R, BLOCK_C])
    dst_desc = tl.make_tensor_descriptor(dst, [part_rows, cols], [cols, 1], [BLOCK_R, BLOCK_C])
    tiles_c = tl.cdiv(cols, BLOCK_C)
    for t in range(tl.program_id(1), tl.cdiv(part_rows, BLOCK_R) * tiles_c, tl.num_programs(1)):
        r = (t // tiles_c) * BLOCK_R
        c = (t % tiles_c) * BLOCK_C
        dst_desc.store([r, c], src_desc.load([r, c]))


CALLS, RUNS = 10, 5


def _time(call) -> float:
    """The slowest rank's median over RUNS of (CALLS calls back to back) in µs per call."""
    for _ in range(3):
        call()
    samples = []
    for _ in range(RUNS):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            call()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / CALLS)
    mine = torch.tensor([sorted(samples)[RUNS // 2]], device="cuda")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return mine.item()


def main():
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    tilecomm.init(heap_bytes=1 << 30)
    prepare_tma()  # the scratch the TMA rows' in-kernel descriptors need
    world, me = dist.get_world_size(), dist.get_rank()
    streams = [torch.cuda.Stream() for _ in range(world)]
    ctx = tilecomm.current()
    workspace = ctx.collectives.ring.numel() * 2  # (as the runtime's: two rings)
    push = CollectiveState.create(ctx, workspace, tma_push=True)
    both = CollectiveState.create(ctx, workspace, tma_push=True, tma_read=True)
    direct = CollectiveState.create(ctx, workspace, direct=True)
    direct_tma = CollectiveState.create(ctx, workspace, tma_push=True, direct=True)

    def on(state, call):
        """call, with the runtime's collectives on `state`."""
        def swapped():
            default, ctx.collectives = ctx.collectives, state
            try:
                call()
            finally:
                ctx.collectives = default
        return swapped

    for rows, cols in SHAPES:
        x = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
        src, out = tilecomm.empty((rows, cols), torch.bfloat16), tilecomm.empty((rows, cols), torch.bfloat16)
        src.copy_(x)
        ordinary_out = torch.empty_like(x)
        expect = torch.empty_like(x)
        dist.all_to_all_single(expect, x)
        part = rows // world
        nbytes = part * cols * 2
        # destination d gets my chunk d at its row block `me`
        dst_addr = [tilecomm.peer(out, d)[me * part].data_ptr() for d in range(world)]
        src_addr = [src[d * part].data_ptr() for d in range(world)]
        order = [(me + k) % world for k in range(world)]
        one = StreamIssuer(out.device)

        def ce_one_stream():
            for d in order:
                one.copy(dst_addr[d], src_addr[d], nbytes)

        issuers = [StreamIssuer(out.device, s) for s in streams]

        def ce_streams():
            main_stream = torch.cuda.current_stream()
            for s in streams:
                s.wait_stream(main_stream)
            for k, d in enumerate(order):
                issuers[k].copy(dst_addr[d], src_addr[d], nbytes)
            for s in streams:
                main_stream.wait_stream(s)

        programs = 2 * torch.cuda.get_device_properties(out.device).multi_processor_count

        def sm_all_peers():
            _put_kernel[(world, programs // world)](out, src, part * cols, me, world, 0)

        def sm_tma(block_r, programs_per_peer):
            def call():
                _tma_put_kernel[(world, programs_per_peer)](out, src, part, cols, me, world, BLOCK_R=block_r,
                                                            BLOCK_C=128)
            return call

        ways = [("sm all peers", sm_all_peers, True),
                ("sm tma 32x128", sm_tma(32, programs // world), True),
                ("sm tma 64x128", sm_tma(64, programs // world), True),
                ("sm tma 32x128 P/2", sm_tma(32, programs // world // 2), True),
                ("ce 1 stream", ce_one_stream, True), ("ce W streams", ce_streams, True),
                ("tilecomm heap", lambda: tilecomm.all_to_all_single(out, src), True),
                ("tilecomm heap tma", on(both, lambda: tilecomm.all_to_all_single(out, src)), True),
                ("tilecomm heap direct", on(direct, lambda: tilecomm.all_to_all_single(out, src)), True),
                ("tilecomm heap direct tma", on(direct_tma, lambda: tilecomm.all_to_all_single(out, src)), True),
                ("tilecomm", lambda: tilecomm.all_to_all_single(ordinary_out, x), False),
                ("tilecomm tma push", on(push, lambda: tilecomm.all_to_all_single(ordinary_out, x)), False),
                ("tilecomm tma both", on(both, lambda: tilecomm.all_to_all_single(ordinary_out, x)), False),
                ("nccl", lambda: dist.all_to_all_single(ordinary_out, x), False)]
        peer_bytes = (world - 1) * nbytes
        for name, call, into_heap in ways:
            (out if into_heap else ordinary_out).fill_(float("nan"))
            dist.barrier()
            call()
            torch.cuda.synchronize()
            dist.barrier()
            ok = torch.equal(out if into_heap else ordinary_out, expect)
            us = _time(call)
            if me == 0:
                print(f"world {world} {rows}x{cols}  {name:22s} {us:8.1f} µs  {peer_bytes / us / 1e3:6.1f} GB/s over "
                      f"NVLink per GPU  {'ok' if ok else 'WRONG'}", flush=True)
    for state in (push, both, direct, direct_tma):
        state.free()
    tilecomm.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
