"""Low-latency dispatch/combine (decode): fixed-capacity symmetric buffers, no host synchronisation.

Shapes: E_l local experts, W ranks, M = max_tokens_per_rank, K = top-k, H = hidden, cap = W * M.
Buffers (allocated once, collectively, by the Dispatcher):

    stage_x [E_l, W, M, H], stage_w [E_l, W, M]   rank s puts its rows for local expert e of rank r at
                                                   stage[e, s, slot] on r (slot = the pair's index among
                                                   s's pairs for that expert, in token order)
    count_sig [E_l, W]   SET by s to epoch*(M+1) + count once its rows for (e, s) are out
    consumed_sig [W]     SET by r to the epoch once it copied everything s staged on it
    back_x [W, E_l, M, H] on the source: r puts y's rows of (e, s) back at [r, e, slot]
    back_sig [W]         SET by r to the epoch once its rows for s are back

Dispatch = send (per token: wait until the destination consumed the previous epoch, put each
(token, expert) row and its weight), count (signal counts), receive (per (expert, source): wait
for the counts of all sources, copy the rows to their packed place: expert-major, then source,
then token), finish (tell every source its stage was consumed; bump the epoch word).
Combine = back (per (expert, source): put the rows of y back), back-signal, reduce (per token:
wait for every rank's rows, sum weight * row in fp32).

The epoch lives in device memory (and each handle keeps its own copy), so nothing here reads a
device value on the host: the calls can be captured in a CUDA graph. Forward-only (decode).
Every kernel only waits for an earlier launch of a peer, so CPU ranks (interpreter) never deadlock.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import tilecomm
import tilecomm.language as tcl

BLOCK_H = 256


@tilecomm.jit
def _send_kernel(x_ptr, idx_ptr, w_ptr, slot_ptr, stage_x_ptr, stage_w_ptr, consumed_ptr, epoch_ptr, err_ptr,
                 K, H, E, E_L, W, M):
    t = tl.program_id(0).to(tl.int64)
    me = tcl.rank()
    epoch = tl.load(epoch_ptr) + 1
    for k in range(0, K):
        e = tl.load(idx_ptr + t * K + k).to(tl.int64)
        if (e < -1) | (e >= E):
            if tl.load(err_ptr, volatile=True) == 0:
                tl.store(err_ptr + 1, me.to(tl.int64))
                tl.store(err_ptr + 2, t)
                tl.store(err_ptr + 3, e)
                tl.store(err_ptr + 4, E)
                tl.store(err_ptr, 3)
        elif e >= 0:
            r = (e // E_L).to(tl.int32)
            row = ((e % E_L) * W + me) * M + tl.load(slot_ptr + t * K + k)
            tok = tcl.wait(consumed_ptr + r, epoch - 1, tcl.CMP_GE)  # r is done with the last epoch
            tcl.put(tcl.consume_token(stage_x_ptr, tok) + row * H, x_ptr + t * H, H, r)
            tcl.put(stage_w_ptr + row, w_ptr + t * K + k, 1, r)


@tilecomm.jit
def _count_kernel(counts_ptr, count_sig_ptr, epoch_ptr, E_L, W, M):
    """counts[e]: this rank's pairs for global expert e."""
    me = tcl.rank()
    epoch = tl.load(epoch_ptr) + 1
    for r in range(0, W):
        for el in range(0, E_L):
            n = tl.load(counts_ptr + r * E_L + el)
            tcl.signal(count_sig_ptr + el * W + me, epoch * (M + 1) + n, r, tcl.SIGNAL_SET)


@tilecomm.jit
def _recv_kernel(stage_x_ptr, stage_w_ptr, count_sig_ptr, out_x_ptr, out_w_ptr, per_expert_ptr, counts_ptr,
                 epoch_ptr, H, W, M, BLOCK_H: tl.constexpr):
    el = tl.program_id(0).to(tl.int64)
    src = tl.program_id(1)
    epoch = tl.load(epoch_ptr) + 1
    base = epoch * (M + 1)
    offset = tl.zeros((), tl.int64)
    count = tl.zeros((), tl.int64)
    total = tl.zeros((), tl.int64)
    for s in range(0, W):
        n = tcl.wait(count_sig_ptr + el * W + s, base, tcl.CMP_GE) - base
        total += n
        if s < src:
            offset += n
        if s == src:
            count = n
    tl.store(counts_ptr + el * W + src, count)
    if src == 0:
        tl.store(per_expert_ptr + el, total)
    cols = tl.arange(0, BLOCK_H)
    for i in range(0, count):
        stage_row = (el * W + src) * M + i
        out_row = el * W * M + offset + i
        for h in range(0, H, BLOCK_H):
            m = h + cols < H
            tl.store(out_x_ptr + out_row * H + h + cols, tl.load(stage_x_ptr + stage_row * H + h + cols, mask=m), mask=m)
        tl.store(out_w_ptr + out_row, tl.load(stage_w_ptr + stage_row))


@tilecomm.jit
def _finish_kernel(consumed_ptr, epoch_ptr, handle_epoch_ptr, W):
    me = tcl.rank()
    epoch = tl.load(epoch_ptr) + 1
    for s in range(0, W):
        tcl.signal(consumed_ptr + me, epoch, s, tcl.SIGNAL_SET)
    tl.store(epoch_ptr, epoch)
    tl.store(handle_epoch_ptr, epoch)


@tilecomm.jit
def _back_kernel(y_ptr, counts_ptr, back_x_ptr, H, E_L, W, M):
    el = tl.program_id(0).to(tl.int64)
    src = tl.program_id(1)
    me = tcl.rank()
    offset = tl.zeros((), tl.int64)
    for s in range(0, src):
        offset += tl.load(counts_ptr + el * W + s)
    n = tl.load(counts_ptr + el * W + src)
    tcl.put(back_x_ptr + ((me * E_L + el) * M) * H, y_ptr + (el * W * M + offset) * H, n * H, src)


@tilecomm.jit
def _back_signal_kernel(back_sig_ptr, handle_epoch_ptr, W):
    me = tcl.rank()
    epoch = tl.load(handle_epoch_ptr)
    for s in range(0, W):
        tcl.signal(back_sig_ptr + me, epoch, s, tcl.SIGNAL_SET)


@tilecomm.jit
def _reduce_kernel(back_x_ptr, idx_ptr, w_ptr, slot_ptr, back_sig_ptr, handle_epoch_ptr, out_ptr, K, H, E_L, W, M,
                   BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    epoch = tl.load(handle_epoch_ptr)
    for r in range(0, W):
        tcl.wait(back_sig_ptr + r, epoch, tcl.CMP_GE)
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for k in range(0, K):
        e = tl.load(idx_ptr + t * K + k).to(tl.int64)
        if e >= 0:
            row = ((e // E_L) * E_L + e % E_L) * M + tl.load(slot_ptr + t * K + k)
            vals = tl.load(back_x_ptr + row * H + cols, mask=cols < H, other=0).to(tl.float32)
            acc += vals * tl.load(w_ptr + t * K + k).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)


@dataclass
class LowLatencyBuffers:
    """Symmetric buffers of one low-latency Dispatcher (see the module docstring for shapes)."""

    stage_x: torch.Tensor
    stage_w: torch.Tensor
    count_sig: torch.Tensor
    consumed_sig: torch.Tensor
    back_x: torch.Tensor
    back_sig: torch.Tensor
    epoch: torch.Tensor

    @classmethod
    def allocate(cls, e_local: int, world: int, max_tokens: int, hidden: int, dtype: torch.dtype) -> "LowLatencyBuffers":
        stage_x = tilecomm.empty((e_local, world, max_tokens, hidden), dtype)
        stage_w = tilecomm.empty((e_local, world, max_tokens), torch.float32)
        back_x = tilecomm.empty((world, e_local, max_tokens, hidden), dtype)
        words = tilecomm.zeros((e_local * world + 2 * world + 1,), torch.int64)
        count_sig = words[: e_local * world].view(e_local, world)
        consumed_sig = words[e_local * world: e_local * world + world]
        back_sig = words[e_local * world + world: e_local * world + 2 * world]
        return cls(stage_x, stage_w, count_sig, consumed_sig, back_x, back_sig, words[-1:])


@dataclass
class LowLatencyHandle:
    """What combine needs: topk_idx [T, K], topk_weights [T, K] float32, slot [T, K] int64 (the pair's
    index among this rank's pairs for its expert), counts [E_l, W] rows per (expert, source) here,
    epoch [1] int64 (this dispatch's epoch, on the device), capacity = W * M."""

    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    slot: torch.Tensor
    counts: torch.Tensor
    epoch: torch.Tensor
    capacity: int


def pair_slots(topk_idx: torch.Tensor, num_experts: int):
    """slot [T, K] (index of each pair among this rank's pairs for its expert, token order; -1 for none)
    and counts [E] (pairs per expert), by device ops only."""
    flat = topk_idx.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    onehot = F.one_hot(flat.clamp(0, num_experts - 1), num_experts) * valid[:, None]
    before = torch.cumsum(onehot, 0) - onehot
    slot = torch.where(valid, before.gather(1, flat.clamp(0, num_experts - 1)[:, None]).squeeze(1), -1)
    return slot.view(topk_idx.shape), onehot.sum(0)


def dispatch(bufs: LowLatencyBuffers, x, topk_idx, topk_weights, num_experts: int, max_tokens: int,
             defer_recv: bool = False):
    """Returns (x [E_l, cap, H], weights [E_l, cap] float32, tokens_per_expert [E_l], handle, recv_hook).

    The send half (send + count kernels) is queued now; the receive half (receive + finish) too, unless
    defer_recv: then the outputs are filled only once `recv_hook()` is called, so a caller can queue
    other work (e.g. another micro-batch's compute) between the two halves."""
    ctx = tilecomm.current()
    W, (T, K), H = ctx.world_size, topk_idx.shape, x.shape[1]
    e_local = num_experts // W
    cap = W * max_tokens
    slot, counts = pair_slots(topk_idx, num_experts)
    weights = topk_weights.float().contiguous()
    out_x = torch.empty((e_local, cap, H), dtype=x.dtype, device=x.device)
    out_w = torch.empty((e_local, cap), dtype=torch.float32, device=x.device)
    per_expert = torch.empty(e_local, dtype=torch.int64, device=x.device)
    recv_counts = torch.empty((e_local, W), dtype=torch.int64, device=x.device)
    handle_epoch = torch.empty(1, dtype=torch.int64, device=x.device)
    if T:
        _send_kernel[(T,)](x, topk_idx, weights, slot, bufs.stage_x, bufs.stage_w, bufs.consumed_sig, bufs.epoch,
                           ctx.device_state.error, K, H, num_experts, e_local, W, max_tokens)
    _count_kernel[(1,)](counts, bufs.count_sig, bufs.epoch, e_local, W, max_tokens)

    def recv_hook() -> None:
        _recv_kernel[(e_local, W)](bufs.stage_x, bufs.stage_w, bufs.count_sig, out_x, out_w, per_expert, recv_counts,
                                   bufs.epoch, H, W, max_tokens, BLOCK_H=BLOCK_H)
        _finish_kernel[(1,)](bufs.consumed_sig, bufs.epoch, handle_epoch, W)
        if ctx.backend == "cpu":
            tilecomm.check_errors()

    if not defer_recv:
        recv_hook()
    handle = LowLatencyHandle(topk_idx, weights, slot, recv_counts, handle_epoch, cap)
    return out_x, out_w, per_expert, handle, (recv_hook if defer_recv else None)


def combine(bufs: LowLatencyBuffers, y: torch.Tensor, h: LowLatencyHandle, max_tokens: int) -> torch.Tensor:
    """y [E_l, cap, H] -> out [T, H] = sum_k w[t, k] * y[row(t, k)] (fp32 accumulation)."""
    ctx = tilecomm.current()
    W = ctx.world_size
    e_local, _, H = y.shape
    T, K = h.topk_idx.shape
    y = y.contiguous()
    _back_kernel[(e_local, W)](y, h.counts, bufs.back_x, H, e_local, W, max_tokens)
    _back_signal_kernel[(1,)](bufs.back_sig, h.epoch, W)
    out = torch.empty((T, H), dtype=y.dtype, device=y.device)
    if T:
        _reduce_kernel[(T, triton.cdiv(H, BLOCK_H))](bufs.back_x, h.topk_idx, h.topk_weights, h.slot, bufs.back_sig,
                                                     h.epoch, out, K, H, e_local, W, max_tokens, BLOCK_H=BLOCK_H)
    return out
