"""Low-latency dispatch/combine (decode): fixed capacity, no host synchronisation, CUDA-graph capturable.

E_l local experts, W ranks, M = max_tokens_per_rank = the capacity per (expert, source rank), K top-k,
H hidden, cap = W * M. Buffers: buffers.low_latency_specs (made once by the Dispatcher).

dispatch = send kernel + receive kernel (the receive half can be deferred: `recv_hook`):
- send (programs: token x column chunk): the slot of pair (t, k) = its index among this rank's pairs for
  that expert (token order, then k); the row goes to its owner r's recv[e_l, me, slot], with its weight
  and t * K + k (stores through symm_at(., r), r == me included). A slot >= M is never written: the error
  is recorded (raised at the next call) and the source zeroes that pair's back row. Pairs per expert are
  counted with integer atomics; the last program SETs count[e_l, me] = epoch * (M + 1) + count on every
  r (release).
- receive (programs: local expert x source x column chunk): waits for the counts of its expert from all
  sources, copies the (expert, source) rows to out[e_l, (rows of lower sources) + slot]: expert-major,
  then source rank, then token, then k. The last program SETs consumed[me] on every source (a sender
  waits for it before it overwrites a peer's staging rows) and advances the epoch word.

combine = back kernel + reduce kernel:
- back (programs: local expert x column chunk): row i of expert e goes to its source's back[t, k].
  The last program SETs back_ready[me] on every rank.
- reduce (programs: token x column chunk): out[t] = sum over k (in order) of w[t, k] * back[t, k],
  fp32, mul then add: combine_pairs_reference's operations. The last program SETs back_consumed[me].

Epochs live in device words (dispatch: epoch[0], combine: epoch[1]) and are advanced by the kernels,
so nothing reads a device value on the host and the calls can be captured in a CUDA graph. Every kernel
waits only for earlier launches of peers: CPU ranks (the interpreter) never deadlock.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

import tilecomm
import tilecomm.language as tcl
from tilecomm.jit import CachedLaunch

from ._device import ERR_BAD_EXPERT, ERR_CAPACITY, last_program, peer_offset, record_error, signal_all, wait_all
from .buffers import SymmetricState, low_latency_specs, row_bytes

_SIG_CONSUMED, _SIG_BACK_READY, _SIG_BACK_CONSUMED = range(3)


@dataclass(frozen=True)
class LowLatencyConfig:
    """block_h: columns per step; col_programs: column chunks per row (programs per token in send and
    reduce, per expert in receive and back); block_rows: rows per step in receive / back."""

    block_h: int = 2048
    col_programs: int = 4
    block_rows: int = 2
    num_warps: int = 4

    @staticmethod
    def for_device(device: torch.device, hidden: int) -> "LowLatencyConfig":
        # GPU: from tests/ll_probe.py (one H100, 128 x 7168, top-8 of 256): 2048 columns per step and at most
        # 4 column programs per row gave 18/18 µs (send/receive) and 18/11 µs (back/reduce), against 27/20
        # and 22/14 µs for 1024 columns and 7 programs; 8 warps or more programs were slower
        if device.type == "cuda":
            return LowLatencyConfig(col_programs=max(1, min(4, triton.cdiv(hidden, 2048))))
        return LowLatencyConfig(block_h=min(256, triton.next_power_of_2(hidden)), col_programs=1, block_rows=8,
                                num_warps=1)


@tilecomm.jit(do_not_specialize=["T"])
def _send_kernel(x_ptr, topk_ptr, w_ptr, recv_ptr, recv_w_ptr, recv_src_ptr, count_ptr, consumed_ptr, epoch_ptr,
                 back_ptr, err_ptr, pairs_ptr, counter_ptr, T, E, E_L, W, M, H, ROW, K: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_EL: tl.constexpr, BLOCK_H: tl.constexpr,
                 ALIGN: tl.constexpr):
    t = tl.program_id(0)
    me = tcl.rank()
    epoch = tl.load(epoch_ptr) + 1
    wait_all(consumed_ptr, epoch - 1, W)  # every rank has copied out my previous rows
    kk = tl.arange(0, BLOCK_K)
    km = tl.where(t < T, kk < K, False)  # (scalar & vector masks break the interpreter)
    f = t.to(tl.int64) * K + kk
    ids = tl.load(topk_ptr + f, mask=km, other=-1).to(tl.int64)
    valid = km & (ids >= 0) & (ids < E)
    slot = tl.zeros((BLOCK_K,), tl.int32)  # pairs before (t, k), in (token, k) order, with the same expert
    for c0 in range(0, t * K + K, BLOCK_C):
        fc = c0 + tl.arange(0, BLOCK_C)
        ids_c = tl.load(topk_ptr + fc, mask=fc < T * K, other=-1).to(tl.int64)
        slot += tl.sum(((ids_c[None, :] == ids[:, None]) & (fc[None, :] < f[:, None])).to(tl.int32), axis=1)
    bad = km & ((ids < -1) | (ids >= E))
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        record_error(err_ptr, ERR_BAD_EXPERT, me, t, tl.max(tl.where(bad, ids, -2 ** 62), axis=0), E)
    ok = valid & (slot < M)
    owner = tl.where(ok, ids // E_L, 0)
    dst = ((ids % E_L) * W + me) * M + slot  # [e_l, me, slot]
    if tl.program_id(1) == 0:
        tl.atomic_add(pairs_ptr + tl.where(valid, ids, 0), 1, mask=valid)  # pairs per expert (integer: exact)
        tl.store(recv_w_ptr + peer_offset(recv_w_ptr, owner, 1) + dst, tl.load(w_ptr + f, mask=ok), mask=ok)
        tl.store(recv_src_ptr + peer_offset(recv_src_ptr, owner, 1) + dst, f.to(tl.int32), mask=ok)
    to_pe = peer_offset(recv_ptr, owner, ALIGN)
    over = valid & (slot >= M)
    for h in range(tl.program_id(1) * BLOCK_H, H, tl.num_programs(1) * BLOCK_H):
        cols = h + tl.arange(0, BLOCK_H)
        cm = cols < H
        v = tl.load(x_ptr + t.to(tl.int64) * H + cols, mask=tl.where(t < T, cm, False))
        for k in tl.static_range(K):
            sel = kk == k
            ok_k = tl.max((sel & ok).to(tl.int32), axis=0) > 0
            at = tl.multiple_of(tl.sum(tl.where(sel, to_pe + dst * ROW, 0), axis=0), ALIGN)
            tl.store(recv_ptr + at + cols, v, mask=tl.where(ok_k, cm, False))
            over_k = tl.max((sel & over).to(tl.int32), axis=0) > 0  # dropped: combine adds w * 0
            tl.store(back_ptr + (t.to(tl.int64) * K + k) * ROW + cols, tl.zeros((BLOCK_H,), v.dtype), mask=tl.where(over_k, cm, False))
    if last_program(counter_ptr):
        _publish_counts(pairs_ptr, count_ptr, err_ptr, me, epoch, E_L, W, M, BLOCK_EL)


@triton.jit
def _publish_counts(pairs_ptr, count_ptr, err_ptr, me, epoch, E_L, W, M, BLOCK_EL: tl.constexpr):
    """SET count[e_l, me] = epoch * (M + 1) + min(rows, M) on every rank r, for r's experts; clear pairs."""
    el = tl.arange(0, BLOCK_EL)
    for r in range(0, W):
        n = tl.load(pairs_ptr + r * E_L + el, mask=el < E_L, other=0)
        tl.store(pairs_ptr + r * E_L + el, tl.zeros((BLOCK_EL,), tl.int32), mask=el < E_L)
        if tl.max(n, axis=0) > M:
            worst = tl.argmax(n, axis=0)
            record_error(err_ptr, ERR_CAPACITY, me, r * E_L + worst, tl.max(n, axis=0), M)
        tagged = epoch * (M + 1) + tl.minimum(n, M).to(tl.int64)
        last = tl.sum(tl.where(el == E_L - 1, tagged, 0), axis=0)  # padding lanes repeat the last word
        tcl.signal(count_ptr + tl.minimum(el, E_L - 1) * W + me, tl.where(el < E_L, tagged, last), r,
                   tcl.SIGNAL_SET)


@tilecomm.jit
def _recv_kernel(recv_ptr, recv_w_ptr, recv_src_ptr, count_ptr, consumed_ptr, epoch_ptr, out_ptr, out_w_ptr,
                 row_src_ptr, per_expert_ptr, counter_ptr, W, M, H, ROW, K: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_H: tl.constexpr):
    el = tl.program_id(0)
    src = tl.program_id(1)
    j = tl.program_id(2)
    me = tcl.rank()
    epoch = tl.load(epoch_ptr) + 1
    base = epoch * (M + 1)
    offset = tl.zeros((), tl.int64)
    count = tl.zeros((), tl.int64)
    total = tl.zeros((), tl.int64)
    for r in range(0, W):
        n = tcl.wait(count_ptr + el * W + r, base, tcl.CMP_GE) - base
        total += n
        offset += tl.where(r < src, n, 0)
        count = tl.where(r == src, n, count)
    if (src == 0) & (j == 0):
        tl.store(per_expert_ptr + el, total)
    cap = W * M
    first = el.to(tl.int64) * cap + offset  # output row of slot 0
    for i0 in range(0, count, BLOCK_R):
        ii = i0 + tl.arange(0, BLOCK_R)
        im = ii < count
        staged = (el.to(tl.int64) * W + src) * M + ii
        if j == 0:
            tl.store(out_w_ptr + first + ii, tl.load(recv_w_ptr + staged, mask=im), mask=im)
            tl.store(row_src_ptr + first + ii, src * (M * K) + tl.load(recv_src_ptr + staged, mask=im), mask=im)
        for h in range(j * BLOCK_H, H, tl.num_programs(2) * BLOCK_H):
            cols = h + tl.arange(0, BLOCK_H)
            m = im[:, None] & (cols < H)[None, :]
            v = tl.load(recv_ptr + staged[:, None] * ROW + cols[None, :], mask=m)
            tl.store(out_ptr + (first + ii)[:, None] * H + cols[None, :], v, mask=m)
    if last_program(counter_ptr):
        signal_all(consumed_ptr + me, epoch, W)
        tl.store(epoch_ptr, epoch)


@tilecomm.jit
def _back_kernel(y_ptr, row_src_ptr, per_expert_ptr, back_ptr, ready_ptr, consumed_ptr, epoch_ptr, counter_ptr,
                 W, M, H, ROW, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, ALIGN: tl.constexpr):
    el = tl.program_id(0)
    j = tl.program_id(1)
    me = tcl.rank()
    epoch = tl.load(epoch_ptr + 1) + 1
    wait_all(consumed_ptr, epoch - 1, W)  # every source has reduced my previous rows
    n = tl.load(per_expert_ptr + el)
    row0 = el.to(tl.int64) * W * M
    for i0 in range(0, n, BLOCK_R):
        ii = i0 + tl.arange(0, BLOCK_R)
        im = ii < n
        src = tl.load(row_src_ptr + row0 + ii, mask=im, other=0)
        at = peer_offset(back_ptr, src // (M * K), ALIGN) + (src % (M * K)).to(tl.int64) * ROW
        for h in range(j * BLOCK_H, H, tl.num_programs(1) * BLOCK_H):
            cols = h + tl.arange(0, BLOCK_H)
            m = im[:, None] & (cols < H)[None, :]
            v = tl.load(y_ptr + (row0 + ii)[:, None] * H + cols[None, :], mask=m)
            tl.store(back_ptr + at[:, None] + cols[None, :], v, mask=m)
    if last_program(counter_ptr):
        signal_all(ready_ptr + me, epoch, W)


@tilecomm.jit(do_not_specialize=["T"])
def _reduce_kernel(back_ptr, topk_ptr, w_ptr, out_ptr, ready_ptr, consumed_ptr, epoch_ptr, counter_ptr, T, E, W, H,
                   ROW, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, ACC: tl.constexpr):
    t = tl.program_id(0)
    me = tcl.rank()
    epoch = tl.load(epoch_ptr + 1) + 1
    wait_all(ready_ptr, epoch, W)
    kk = tl.arange(0, BLOCK_K)
    km = tl.where(t < T, kk < K, False)  # (scalar & vector masks break the interpreter)
    ids = tl.load(topk_ptr + t.to(tl.int64) * K + kk, mask=km, other=-1)
    valid = km & (ids >= 0) & (ids < E)
    w = tl.load(w_ptr + t.to(tl.int64) * K + kk, mask=valid, other=0.0).to(ACC)
    for h in range(tl.program_id(1) * BLOCK_H, H, tl.num_programs(1) * BLOCK_H):
        cols = h + tl.arange(0, BLOCK_H)
        cm = cols < H
        acc = tl.zeros((BLOCK_H,), ACC)
        for k in tl.static_range(K):
            sel = kk == k
            ok_k = tl.max((sel & valid).to(tl.int32), axis=0) > 0
            w_k = tl.sum(tl.where(sel, w, 0.0), axis=0)
            v = tl.load(back_ptr + (t.to(tl.int64) * K + k) * ROW + cols, mask=tl.where(ok_k, cm, False), other=0.0).to(ACC)
            acc = acc + v * w_k
        tl.store(out_ptr + t.to(tl.int64) * H + cols, acc.to(out_ptr.dtype.element_ty), mask=tl.where(t < T, cm, False))
    if last_program(counter_ptr):
        signal_all(consumed_ptr + me, epoch, W)
        tl.store(epoch_ptr + 1, epoch)


# ---- host side -------------------------------------------------------------------------------------
@dataclass
class LowLatencyHandle:
    """What combine needs (this rank). topk_idx [T, K] and topk_weights [T, K] float32 (kept); row_src
    [E_l, cap] int32: source rank * M * K + t * K + k of each received row; tokens_per_expert [E_l] int64
    (on the device); capacity = W * M; received: whether the receive half ran (see recv_hook)."""

    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    row_src: torch.Tensor
    tokens_per_expert: torch.Tensor
    capacity: int
    received: bool = True


def raise_device_error(words) -> None:
    """Turn the Dispatcher's device error words [code, rank, a, b, c] into an exception (code 0: none)."""
    code, rank, a, b, c = (int(v) for v in words[:5])
    if code == ERR_BAD_EXPERT.value:
        raise ValueError(f"rank {rank}: token {a} has expert id {b}; expected -1 <= id < {c} (found on the device)")
    if code == ERR_CAPACITY.value:
        raise ValueError(f"rank {rank}: low-latency dispatch sent {b} rows to expert {a}, more than its capacity of "
                         f"{c} rows per (expert, source rank) (max_tokens_per_rank; a token naming the same expert "
                         "twice counts twice); the rows past the capacity were not sent (found on the device)")
    if code:
        raise RuntimeError(f"rank {rank}: unknown dispatch device error {code} ({a}, {b}, {c})")


_P2 = triton.next_power_of_2


class LowLatencyEngine:
    """Low-latency dispatch/combine over buffers made once here (collective). Device errors (bad expert
    ids, capacity overflow) are recorded by the kernels and raised by the next call, before its kernels
    (every rank that recorded one raises; ranks that did not go on into the collective call)."""

    def __init__(self, num_experts: int, hidden: int, max_tokens: int, topk: int, dtype: torch.dtype):
        ctx = tilecomm.current()
        W = ctx.world_size
        self.W, self.E, self.E_L, self.M, self.K, self.H, self.dtype = (W, num_experts, num_experts // W, max_tokens,
                                                                        topk, hidden, dtype)
        self.cuda = ctx.device.type == "cuda"
        self.cfg = LowLatencyConfig.for_device(ctx.device, hidden)
        self.state = SymmetricState("Dispatcher(mode='low_latency')",
                                    low_latency_specs(W, num_experts, max_tokens, topk, hidden, dtype),
                                    zeroed=("count", "sig", "epoch"))
        self.row_bytes = row_bytes(hidden, dtype)
        counters = torch.zeros(4, dtype=torch.int32, device=ctx.device)
        self._ctr = [counters[i:i + 1] for i in range(4)]
        self._sig = [self.state.sig[i] for i in range(3)]
        self._err = torch.zeros(8, dtype=torch.int64, pin_memory=self.cuda)  # written by the kernels
        self._pairs = torch.zeros(num_experts, dtype=torch.int32, device=ctx.device)  # per expert, cleared after use
        self._err_words = self._err.numpy()
        self._dummies, self._typed_views = {}, {}
        # hot path: launch through the compiled kernels (no per-call Triton binding); keys below
        self._send, self._recv, self._back, self._reduce = (CachedLaunch(k) for k in (_send_kernel, _recv_kernel,
                                                                                       _back_kernel, _reduce_kernel))
        # read on every call: the state's views (attribute lookups through NamedViews cost µs) and each
        # kernel's constexprs, made once per Dispatcher (ALIGN / ACC depend on the dtype: `_consts`)
        st, cfg, K = self.state, self.cfg, topk
        self._bufs = (st.recv_w, st.recv_src, st.count, st.epoch)
        common = dict(K=K, BLOCK_H=cfg.block_h, num_warps=cfg.num_warps)
        self._send_consts = dict(common, BLOCK_K=_P2(K), BLOCK_C=min(1024, _P2(max_tokens * K)), BLOCK_EL=_P2(self.E_L))
        self._recv_consts = dict(common, BLOCK_R=cfg.block_rows)
        self._reduce_consts = dict(common, BLOCK_K=_P2(K), enable_fp_fusion=False)

    def free(self) -> None:
        self.state.free()

    def check_errors(self) -> None:
        if self._err_words[0]:
            words = self._err.tolist()
            self._err.zero_()
            raise_device_error(words)

    def _or_dummy(self, t: torch.Tensor) -> torch.Tensor:
        if t.numel():
            return t
        if t.dtype not in self._dummies:
            self._dummies[t.dtype] = torch.zeros(16, dtype=t.dtype, device=self.state.epoch.device)
        return self._dummies[t.dtype]

    def _staging(self, name: str, dtype: torch.dtype):
        """(flat view of buffer `name` as dtype, elements per staged row)."""
        size = dtype.itemsize
        if self.H * size > self.row_bytes:
            raise ValueError(f"low-latency dispatch: rows of {self.H} x {dtype} do not fit the staging rows "
                             f"({self.row_bytes} bytes: hidden x {self.dtype})")
        if (name, dtype) not in self._typed_views:
            self._typed_views[(name, dtype)] = self.state.views[name].view(-1).view(dtype)
        return self._typed_views[(name, dtype)], self.row_bytes // size

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, defer_recv: bool = False):
        """x [T, H], topk_idx [T, K], topk_weights [T, K] -> (x [E_l, cap, H], weights [E_l, cap] float32,
        tokens_per_expert [E_l] int64, LowLatencyHandle, recv_hook or None). With defer_recv only the send
        kernel is queued; the outputs are filled once recv_hook() has queued the receive kernel."""
        self.state.check_live()
        self.check_errors()
        W, E_L, M, H = self.W, self.E_L, self.M, self.H
        recv_w, recv_src, count, epoch = self._bufs
        T, cap, dev, cp = x.shape[0], W * M, x.device, self.cfg.col_programs
        topk, weights = topk_idx.contiguous(), topk_weights.float().contiguous()
        recv, row = self._staging("recv", x.dtype)
        back, _ = self._staging("back", x.dtype)
        consumed = self._sig[_SIG_CONSUMED]
        self._send.launch(
            (max(T, 1), cp), (x.dtype, topk.dtype), self._or_dummy(x), self._or_dummy(topk), self._or_dummy(weights),
            recv, recv_w, recv_src, count, consumed, epoch, back, self._err, self._pairs, self._ctr[0], T, self.E, E_L,
            W, M, H, row, ALIGN=16 // x.element_size(), **self._send_consts)
        out_x = torch.empty((E_L, cap, H), dtype=x.dtype, device=dev)
        out_w = torch.empty((E_L, cap), dtype=torch.float32, device=dev)
        per_expert = torch.empty(E_L, dtype=torch.int64, device=dev)
        handle = LowLatencyHandle(topk, weights, torch.empty((E_L, cap), dtype=torch.int32, device=dev), per_expert,
                                  cap, received=False)

        def recv_hook() -> None:
            if handle.received:
                raise ValueError("recv_hook: this dispatch's receive half already ran (call each hook once)")
            self._recv.launch(
                (E_L, W, cp), x.dtype, recv, recv_w, recv_src, count, consumed, epoch, out_x, out_w, handle.row_src,
                per_expert, self._ctr[1], W, M, H, row, **self._recv_consts)
            handle.received = True

        if not defer_recv:
            recv_hook()
        return out_x, out_w, per_expert, handle, (recv_hook if defer_recv else None)

    def combine(self, y: torch.Tensor, h: LowLatencyHandle) -> torch.Tensor:
        """y [E_l, cap, H] (rows in the dispatch's order) -> out [T, H] = sum_k w[t, k] * y[row(t, k)]."""
        self.state.check_live()
        self.check_errors()
        if not h.received:
            raise ValueError("combine: call res.recv_hook() first; the receive half of this low-latency dispatch "
                             "has not run, so its rows are not there yet")
        W, M, H, cp = self.W, self.M, self.H, self.cfg.col_programs
        epoch = self._bufs[3]
        ready, consumed = self._sig[_SIG_BACK_READY], self._sig[_SIG_BACK_CONSUMED]
        back, row = self._staging("back", y.dtype)
        self._back.launch(
            (self.E_L, cp), y.dtype, y, h.row_src, h.tokens_per_expert, back, ready, consumed, epoch, self._ctr[2], W, M,
            H, row, ALIGN=16 // y.element_size(), **self._recv_consts)
        T = h.topk_idx.shape[0]
        out = torch.empty((T, H), dtype=y.dtype, device=y.device)
        self._reduce.launch(
            (max(T, 1), cp), (y.dtype, h.topk_idx.dtype), back, self._or_dummy(h.topk_idx),
            self._or_dummy(h.topk_weights), self._or_dummy(out), ready, consumed, epoch, self._ctr[3], T, self.E, W, H,
            row, ACC=tl.float64 if y.dtype == torch.float64 else tl.float32, **self._reduce_consts)
        return out
