"""The one protocol behind tilecomm's collectives: stage, signal, pull, acknowledge.

Every rank r holds, on the symmetric heap, a send buffer and a table `meta[p] = (element offset
on the heap, element count)` of what it offers rank p. For call number e (the epoch; every rank
counts the same calls):

1. stage      copy the input into the send buffer (skipped when the input is already on the heap)
              and write `meta`;
2. announce   one program SETs `ready[r] = e` on every rank;
3. pull       program (p, c) waits for `ready[p] >= e`, reads p's `meta[r]`, checks the count against
              what this rank expects from p, and copies chunk c of it (or reduces it, for
              reduce-scatter, over all p in rank order);
4. finish     one program SETs `done[r] = e` on every rank, then waits for `done[p] >= e` for all p,
              so no rank's send buffer is reused while a peer still reads it.

Waits only ever wait for an earlier step of a peer, so the Triton interpreter (which runs a launch's
programs one by one) never deadlocks, and on GPUs every wait has the runtime's timeout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from .. import language as tcl
from .. import runtime
from ..errors import PeerMismatchError, require
from ..jit import jit

CHUNK = 1 << 16  # elements one pull program copies
BLOCK = 1024  # elements per load/store step inside a program
ERR_COUNT_MISMATCH = 2

# Element types moved as themselves; others are moved bit-for-bit as an integer of the same width.
_AS_BITS = {torch.bool: torch.uint8, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


@jit
def _stage_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


@jit
def _announce_kernel(ready_ptr, epoch, world):
    me = tcl.rank()
    for pe in range(0, world):
        tcl.signal(ready_ptr + me, epoch, pe, tcl.SIGNAL_SET)


@jit
def _finish_kernel(done_ptr, epoch, world):
    me = tcl.rank()
    for pe in range(0, world):
        tcl.signal(done_ptr + me, epoch, pe, tcl.SIGNAL_SET)
    for pe in range(0, world):
        tcl.wait(done_ptr + pe, epoch, tcl.CMP_GE)


@jit
def _record_error(err_ptr, code, a, b, c):
    """Fill the error record unless one is there (plain stores: on GPUs it is pinned host memory)."""
    if tl.load(err_ptr, volatile=True) == 0:
        tl.store(err_ptr + 1, tcl.rank().to(tl.int64))
        tl.store(err_ptr + 2, tl.cast(a, tl.int64))
        tl.store(err_ptr + 3, tl.cast(b, tl.int64))
        tl.store(err_ptr + 4, tl.cast(c, tl.int64))
        tl.store(err_ptr, code)


@jit
def _peer_chunk(heap_ptr, meta_ptr, ready_ptr, err_ptr, p, me, expected, epoch):
    """Wait for p's announcement; return (address of p's chunk for me, its length), checked."""
    tok = tcl.wait(ready_ptr + p, epoch, tcl.CMP_GE)
    remote_meta = tcl.consume_token(tcl.symm_at(meta_ptr, p), tok)
    src_off = tl.load(remote_meta + 2 * me)
    count = tl.load(remote_meta + 2 * me + 1)
    if count != expected:
        _record_error(err_ptr, 2, p, expected, count)
    return tcl.symm_at(heap_ptr, p) + src_off, tl.minimum(count, expected)


@jit
def _pull_kernel(out_ptr, heap_ptr, meta_ptr, recv_ptr, ready_ptr, err_ptr, epoch,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    c = tl.program_id(1)
    me = tcl.rank()
    dst_off = tl.load(recv_ptr + 2 * p)
    expected = tl.load(recv_ptr + 2 * p + 1)
    start = c.to(tl.int64) * CHUNK
    if start < tl.maximum(expected, 1):
        src, count = _peer_chunk(heap_ptr, meta_ptr, ready_ptr, err_ptr, p, me, expected, epoch)
        end = tl.minimum(start + CHUNK, count)
        for s in range(start, end, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            mask = offs < end
            tl.store(out_ptr + dst_off + offs, tl.load(src + offs, mask=mask), mask=mask)


@jit
def _pull_reduce_kernel(out_ptr, heap_ptr, meta_ptr, ready_ptr, err_ptr, epoch, n, world,
                        OP: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = op over p in rank order of p's chunk for me, accumulated in ACC."""
    me = tcl.rank()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    src, count = _peer_chunk(heap_ptr, meta_ptr, ready_ptr, err_ptr, 0, me, n, epoch)
    acc = tl.load(src + offs, mask=mask & (offs < count)).to(ACC)
    for p in range(1, world):
        src, count = _peer_chunk(heap_ptr, meta_ptr, ready_ptr, err_ptr, p, me, n, epoch)
        x = tl.load(src + offs, mask=mask & (offs < count)).to(acc.dtype)
        if OP == 0:
            acc = acc + x
        elif OP == 1:
            acc = tl.maximum(acc, x)
        elif OP == 2:
            acc = tl.minimum(acc, x)
        else:
            acc = acc * x
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _accumulator(dtype: torch.dtype):
    if dtype == torch.float64:
        return tl.float64
    if dtype.is_floating_point:
        return tl.float32
    return tl.int64


@dataclass
class Workspace:
    """Heap objects the collectives share, allocated once per context (collectively).

    send: uint8 [workspace bytes]; meta: int64 [world, 2]; ready, done: int64 [world] signal words.
    """

    send: torch.Tensor
    meta: torch.Tensor
    ready: torch.Tensor
    done: torch.Tensor


def workspace(ctx) -> Workspace:
    ws = ctx.caches.get("exchange")
    if ws is None:
        from .. import _env

        w = ctx.world_size
        nbytes = _env.workspace_bytes(ctx.heap.nbytes)
        require(nbytes < ctx.heap.bytes_free(), f"TILECOMM_WORKSPACE_BYTES={nbytes} does not fit in the heap "
                f"({ctx.heap.bytes_free()} bytes free)", MemoryError)
        heap = ctx.heap
        views = []
        for shape, dtype in (((nbytes,), torch.uint8), ((w, 2), torch.int64), ((w,), torch.int64), ((w,), torch.int64)):
            off = heap.alloc(shape[0] * (shape[1] if len(shape) > 1 else 1) * torch.empty((), dtype=dtype).element_size())
            views.append(heap.view(heap.local, off, shape, dtype))
        ws = Workspace(*views)
        ws.ready.zero_()
        ws.done.zero_()
        runtime.barrier()
        ctx.caches["exchange"] = ws
    return ws


def _raise_mismatch(ctx, what: str) -> None:
    err = ctx.device_state.take_error(code=ERR_COUNT_MISMATCH)
    if err is not None:
        _, rank, peer, expected, got = err
        raise PeerMismatchError(
            f"{what}: rank {rank} expected {expected} elements from rank {peer}, but rank {peer} offers {got} "
            f"(output_split_sizes on rank {rank} and input_split_sizes on rank {peer} disagree)")


def exchange(ctx, what: str, src: torch.Tensor, send_table: Sequence[Tuple[int, int]], out: torch.Tensor,
             recv_table: Sequence[Tuple[int, int]], reduce_op: Optional[int] = None) -> None:
    """Run steps 1-4 of the module docstring.

    src: contiguous 1-D tensor; send_table[p] = (element offset in src, element count) offered to p.
    out: contiguous 1-D tensor; recv_table[p] = (element offset in out, element count) expected from p.
    reduce_op: None to copy each peer's chunk to its recv_table place; else 0 sum, 1 max, 2 min, 3 prod,
    and every peer's chunk (all of recv_table[p] count, same for all p) is reduced into out.
    """
    ws = workspace(ctx)
    heap = ctx.heap
    move = _AS_BITS.get(src.dtype, src.dtype)
    src, out = src.view(move), out.view(move)
    elem = src.element_size()
    base = heap.offset_of(src) if src.numel() else 0  # nothing to offer: any offset will do
    if base is None:
        require(src.numel() * elem <= ws.send.numel(), f"{what}: input is {src.numel() * elem} bytes, more than the "
                f"{ws.send.numel()}-byte staging workspace; raise TILECOMM_WORKSPACE_BYTES (or TILECOMM_HEAP_BYTES), "
                "or pass an input allocated with tilecomm.empty (used in place)", MemoryError)
        staged = ws.send[: src.numel() * elem].view(move)
        if src.numel():
            _stage_kernel[(triton.cdiv(src.numel(), 4096),)](src, staged, src.numel(), BLOCK=4096)
        base = heap.offset_of(staged)
    meta = torch.tensor([[base // elem + off, cnt] for off, cnt in send_table], dtype=torch.int64)
    ws.meta.copy_(meta, non_blocking=False)
    epoch = ctx.next_epoch()
    world = ctx.world_size
    heap_view = heap.local.view(move)
    _announce_kernel[(1,)](ws.ready, epoch, world)
    if reduce_op is None:
        recv = torch.tensor(list(recv_table), dtype=torch.int64, device=out.device)
        most = max((cnt for _, cnt in recv_table), default=0)
        grid = (world, max(1, triton.cdiv(most, CHUNK)))
        _pull_kernel[grid](out, heap_view, ws.meta, recv, ws.ready, ctx.device_state.error, epoch,
                           CHUNK=CHUNK, BLOCK=BLOCK)
    else:
        n = recv_table[0][1]
        _pull_reduce_kernel[(max(1, triton.cdiv(n, BLOCK)),)](out, heap_view, ws.meta, ws.ready,
                                                              ctx.device_state.error, epoch, n, world,
                                                              OP=reduce_op, ACC=_accumulator(out.dtype), BLOCK=BLOCK)
    _finish_kernel[(1,)](ws.done, epoch, world)
    if ctx.backend == "cpu":
        _raise_mismatch(ctx, what)
