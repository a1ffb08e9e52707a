"""Low-latency dispatch/combine, host side: the LowLatencyEngine that owns the buffers and launches the two kernels of
low_latency.py (their protocol is described there), the handle combine needs, and the device errors the kernels
record, raised on the host."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

import tilecomm
from tilecomm.jit import CachedLaunch, next_pow2
from tilecomm.language.abi import ERROR_WORDS, ErrorCode

from .buffers import SymmetricState, low_latency_specs, row_bytes
from .low_latency import (_COMBINE_COUNTERS, _DISPATCH_COUNTERS, _SIG_BACK_CONSUMED, _SIG_BACK_READY, _SIG_CONSUMED,
                          TRACE_FIELDS, LowLatencyConfig, _combine_kernel, _dispatch_kernel)


@dataclass
class LowLatencyHandle:
    """What combine needs (this rank). weights [E_l, cap] float32: res.weights (the weight of each
    received row); maps int32, written by the kernels: pair_row [W, M, K] (the row of res.x holding
    source s's pair (t, k), -1: not here), then token_ranks [M, W] (1 where this rank's token t went to
    rank r; first T rows used): one allocation, views below; tokens_per_expert [E_l] int64 (on the
    device); capacity = W * M; num_tokens = T; received: whether the receive half ran (see recv_hook)."""

    weights: torch.Tensor
    maps: torch.Tensor
    tokens_per_expert: torch.Tensor
    capacity: int
    world: int
    num_tokens: int
    received: bool = True

    @property
    def pair_row(self) -> torch.Tensor:
        return self.maps[: self.maps.numel() - self.capacity].view(self.world, self.capacity // self.world, -1)

    @property
    def token_ranks(self) -> torch.Tensor:
        return self.maps[self.maps.numel() - self.capacity:].view(-1, self.world)


def raise_device_error(words) -> None:
    """Turn the Dispatcher's device error words [code, rank, a, b, c] into an exception (code 0: none)."""
    code, rank, a, b, c = (int(v) for v in words[:5])
    if code == ErrorCode.BAD_EXPERT:
        raise ValueError(f"rank {rank}: token {a} has expert id {b}; expected -1 <= id < {c} (found on the device)")
    if code == ErrorCode.CAPACITY:
        raise ValueError(f"rank {rank}: low-latency dispatch sent {b} rows to expert {a}, more than its capacity of "
                         f"{c} rows per (expert, source rank) (max_tokens_per_rank; a token naming the same expert "
                         "twice counts twice); the rows past the capacity were not sent (found on the device)")
    if code:
        raise RuntimeError(f"rank {rank}: unknown dispatch device error {code} ({a}, {b}, {c})")


_P2 = next_pow2


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
        counters = torch.zeros(6, dtype=torch.int32, device=ctx.device)  # reset by the kernels after each launch
        self._dispatch_ctr, self._combine_ctr = counters[_DISPATCH_COUNTERS:], counters[_COMBINE_COUNTERS:]
        self._sig = [self.state.sig[i] for i in range(3)]
        self._err = torch.zeros(ERROR_WORDS, dtype=torch.int64, pin_memory=self.cuda)  # written by the kernels
        self._pairs = torch.zeros(num_experts, dtype=torch.int32, device=ctx.device)  # per expert, cleared after use
        self._err_words = self._err.numpy()
        self._dummies, self._typed_views = {}, {}
        # hot path: launch through the compiled kernels (no per-call Triton binding), each call site bound to
        # this engine's buffers and sizes per dtype (_bound: a decode step converts only its own arguments)
        self._dispatch, self._combine = CachedLaunch(_dispatch_kernel), CachedLaunch(_combine_kernel)
        self._bound: dict = {}
        # read on every call: the state's views (attribute lookups through NamedViews cost µs) and each
        # kernel's constexprs, made once per Dispatcher (ALIGN / ACC depend on the dtype)
        st, cfg, K, cp = self.state, self.cfg, topk, self.cfg.col_programs
        self._bufs = (st.recv_w, st.recv_src, st.count, st.epoch)
        self._n_recv = self.E_L * W * cp
        self._n_back = W * max_tokens * cp
        self._map_words = W * max_tokens * topk + max_tokens * W  # LowLatencyHandle.maps: pair_row, token_ranks
        common = dict(K=K, BLOCK_K=_P2(K), BLOCK_W=_P2(W), BLOCK_H=cfg.block_h, num_warps=cfg.num_warps)
        self._dispatch_consts = dict(common, BLOCK_C=min(1024, _P2(max_tokens * K)), BLOCK_EL=_P2(self.E_L),
                                     BLOCK_R=cfg.block_rows, TRACE=cfg.trace)
        self._combine_consts = dict(common, enable_fp_fusion=False, TRACE=cfg.trace)
        # LowLatencyConfig.trace: a row per program of each kernel's largest launch (one row when off: never written),
        # and the programs of the last launch
        self._traces = [torch.zeros((rows if cfg.trace else 1, len(TRACE_FIELDS)), dtype=torch.int64, device=ctx.device)
                        for rows in (max_tokens * cp + self._n_recv, self._n_back + max_tokens * cp)]
        self._traced = [0, 0]  # (dispatch, combine)

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
        role is queued; the outputs are filled once recv_hook() has queued the receive role."""
        self.state.check_live()
        self.check_errors()
        E_L, H, cap = self.E_L, self.H, self.W * self.M
        T, dev = x.shape[0], x.device
        topk, weights, x_arg = topk_idx.contiguous(), topk_weights.float().contiguous(), x
        if not T:  # (empty tensors have no pointer a kernel may take)
            topk, weights, x_arg = self._or_dummy(topk), self._or_dummy(weights), self._or_dummy(x)
        out_x = torch.empty((E_L, cap, H), dtype=x.dtype, device=dev)
        out_w = torch.empty((E_L, cap), dtype=torch.float32, device=dev)
        per_expert = torch.empty(E_L, dtype=torch.int64, device=dev)
        maps = torch.empty(self._map_words, dtype=torch.int32, device=dev)
        handle = LowLatencyHandle(out_w, maps, per_expert, cap, self.W, T, received=not defer_recv)
        bound = self._bound.get(("dispatch", x.dtype, topk.dtype))
        if bound is None:
            W, M = self.W, self.M
            cp = self.cfg.col_programs
            recv, row = self._staging("recv", x.dtype)
            recv_w, recv_src, count, epoch = self._bufs
            # varying: x, topk, weights, the four outputs, N_SEND, N_RECV, T (positions below)
            bound = self._bound[("dispatch", x.dtype, topk.dtype)] = self._dispatch.bind(
                (x.dtype, topk.dtype), [x_arg, topk, weights, recv, recv_w, recv_src, count, self._sig[_SIG_CONSUMED],
                                        epoch, self._err, self._pairs, self._dispatch_ctr, out_x, out_w, maps,
                                        per_expert, 0, 0, cp, T, self.E, E_L, W, M, H, row, self._traces[0]],
                (0, 1, 2, 12, 13, 14, 15, 16, 17, 19), ALIGN=16 // x.element_size(), **self._dispatch_consts)

        n_send = max(T, 1) * self.cfg.col_programs
        if not defer_recv:  # the decode hot path: both roles in one launch
            n_recv = self._n_recv
            bound.launch((n_send + n_recv,), x_arg, topk, weights, out_x, out_w, maps, per_expert, n_send, n_recv, T)
            self._traced[0] = n_send + n_recv
            return out_x, out_w, per_expert, handle, None
        bound.launch((n_send,), x_arg, topk, weights, out_x, out_w, maps, per_expert, n_send, 0, T)
        self._traced[0] = n_send

        def recv_hook() -> None:
            if handle.received:
                raise ValueError("recv_hook: this dispatch's receive half already ran (call each hook once)")
            bound.launch((self._n_recv,), x_arg, topk, weights, out_x, out_w, maps, per_expert, 0, self._n_recv, T)
            self._traced[0] = self._n_recv
            handle.received = True

        return out_x, out_w, per_expert, handle, recv_hook

    def trace(self, kernel: str) -> dict:
        """With LowLatencyConfig.trace: what the programs of the last "dispatch" or "combine" launch recorded,
        {field: int64 tensor [programs]} on the host, by ticket (TRACE_FIELDS: senders or reducers first, then
        receivers or summers; a launch of recv_hook holds receivers only, a deferred send senders only). Waits for
        the launch."""
        if not self.cfg.trace:
            raise ValueError("trace: this Dispatcher's LowLatencyConfig has trace=False")
        if kernel not in ("dispatch", "combine"):
            raise ValueError(f"trace: kernel={kernel!r}; expected 'dispatch' or 'combine'")
        i = kernel == "combine"
        words = self._traces[i][:self._traced[i]].cpu()
        return {name: words[:, j] for j, name in enumerate(TRACE_FIELDS)}

    def combine(self, y: torch.Tensor, h: LowLatencyHandle) -> torch.Tensor:
        """y [E_l, cap, H] (rows in the dispatch's order) -> out [T, H] = sum_k w[t, k] * y[row(t, k)]."""
        self.state.check_live()
        self.check_errors()
        if not h.received:
            raise ValueError("combine: call res.recv_hook() first; the receive half of this low-latency dispatch "
                             "has not run, so its rows are not there yet")
        T, cp = h.num_tokens, self.cfg.col_programs
        out = torch.empty((T, self.H), dtype=y.dtype, device=y.device)
        out_arg, n_sum = (out, T * cp) if T else (self._or_dummy(out), cp)
        bound = self._bound.get(("combine", y.dtype))
        if bound is None:
            back, row = self._staging("back", y.dtype)
            # varying: y, the handle's weights and maps, out, N_SUM, T (positions below)
            bound = self._bound[("combine", y.dtype)] = self._combine.bind(
                y.dtype, [y, h.weights, h.maps, back, out_arg, self._sig[_SIG_BACK_READY],
                          self._sig[_SIG_BACK_CONSUMED], self._bufs[3], self._combine_ctr, self._n_back, n_sum, cp, T,
                          self.W, self.M, self.H, row, self._traces[1]], (0, 1, 2, 4, 10, 12),
                ALIGN=16 // y.element_size(),
                ACC=tl.float64 if y.dtype == torch.float64 else tl.float32, **self._combine_consts)
        bound.launch((self._n_back + n_sum,), y, h.weights, h.maps, out_arg, n_sum, T)
        self._traced[1] = self._n_back + n_sum
        return out
