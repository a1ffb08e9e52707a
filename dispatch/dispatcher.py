"""`Dispatcher`: MoE token dispatch and combine across the ranks of a group (autograd-aware).

    d = Dispatcher(num_experts=8, hidden=1024, max_tokens_per_rank=4096, topk=2, dtype=torch.bfloat16)
    res = d.dispatch(x, topk_idx, topk_weights)   # x [T, H]; topk_idx [T, K] (-1 = none); weights [T, K]
    y = experts(res.x, res.tokens_per_expert)     # res.x [R, H], expert-major
    out = d.combine(y, res.handle)                # out[t] = sum_k topk_weights[t, k] * y[row(t, k)]

Experts are split evenly: rank r owns experts r*E/W ... (r+1)*E/W - 1. `res.x` rows are ordered by
local expert, then source rank, then source token index (bit-for-bit deterministic). Both calls are
differentiable: dispatch's backward is a combine of the gradients (and returns each row's weight
gradient to its token), combine's backward is a dispatch; `topk_weights` gets its gradient
through `res.weights`, which combine uses.

Streams: by default every call runs on the current stream and returns after queuing its kernels, except
for one host synchronisation in normal-mode dispatch (the per-rank token counts decide the buffer sizes).
With `async_op=True`, dispatch and combine run on the Dispatcher's own communication stream (which first
waits for the current stream) and the result carries `work`, an event-like object: `work.wait()` makes
the current stream wait for the call; read the outputs only after it. The handle may be used by any
number of combines (normal mode); output buffers are per call.

backend: "tilecomm" (the runtime's kernels and collectives; the world group) or "nccl" (torch ops and
torch.distributed.all_to_all_single on `group`: the reference implementation, and a drop-in
fallback).

mode="low_latency" (decode; backend "tilecomm"): fixed-capacity symmetric buffers allocated once here
(collective: construct the Dispatcher on every rank in the same order), no host synchronisation,
`res.x` is [E_local, W * max_tokens_per_rank, H] with `res.tokens_per_expert` valid rows per expert
(same order inside each expert; rows past the count undefined), `res.weights` [E_local, capacity].
Forward-only; one combine per dispatch, before the next dispatch. See low_latency.py.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import tilecomm
from tilecomm.collectives import Work

from . import engine, fp8
from . import low_latency as ll
from .handle import DispatchHandle, DispatchResult


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, be, handle):
        ctx.be, ctx.handle = be, handle
        return engine.dispatch_rows(be, handle, x), engine.dispatch_pairs(be, handle, topk_weights)

    @staticmethod
    def backward(ctx, grad_rows, grad_weights):
        be, h = ctx.be, ctx.handle
        grad_x = engine.combine_rows(be, h, grad_rows.contiguous(), None) if ctx.needs_input_grad[0] else None
        grad_w = engine.return_pairs(be, h, grad_weights) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, row_weights, be, handle):
        ctx.be, ctx.handle = be, handle
        ctx.save_for_backward(y, row_weights)
        return engine.combine_rows(be, handle, y, row_weights)

    @staticmethod
    def backward(ctx, grad_out):
        be, h = ctx.be, ctx.handle
        y, row_weights = ctx.saved_tensors
        grad_rows = engine.dispatch_rows(be, h, grad_out.contiguous())
        acc = torch.promote_types(y.dtype, torch.float32)
        grad_y = (grad_rows.to(acc) * row_weights.to(acc)[:, None]).to(y.dtype) if ctx.needs_input_grad[0] else None
        grad_w = (grad_rows.to(acc) * y.to(acc)).sum(-1).float() if ctx.needs_input_grad[1] else None
        return grad_y, grad_w, None, None


class Dispatcher:
    """See the module docstring. Arguments are checked on every call, before any kernel runs."""

    def __init__(self, num_experts: int, hidden: int, max_tokens_per_rank: int, topk: int,
                 dtype: torch.dtype = torch.bfloat16, group=None, mode: str = "normal", backend: str = "tilecomm"):
        if mode not in ("normal", "low_latency"):
            raise ValueError(f"Dispatcher: mode={mode!r}; expected 'normal' or 'low_latency'")
        if mode == "low_latency" and backend != "tilecomm":
            raise ValueError("Dispatcher: mode='low_latency' needs backend='tilecomm' (symmetric buffers)")
        for name, value in (("num_experts", num_experts), ("hidden", hidden),
                            ("max_tokens_per_rank", max_tokens_per_rank), ("topk", topk)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Dispatcher: {name}={value!r}; expected a positive int")
        if backend == "tilecomm":
            ctx = tilecomm.current()
            if group is not None and dist.get_process_group_ranks(group) != list(range(ctx.world_size)):
                raise ValueError("Dispatcher(backend='tilecomm'): group must be None or the world group")
            self.rank, self.world_size, self.device = ctx.rank, ctx.world_size, ctx.device
        else:
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
            self.device = None
        if num_experts % self.world_size:
            raise ValueError(f"Dispatcher: num_experts={num_experts} must divide by the group size ({self.world_size})")
        if topk > num_experts:
            raise ValueError(f"Dispatcher: topk={topk} > num_experts={num_experts}")
        self.num_experts, self.hidden, self.max_tokens, self.topk, self.dtype = num_experts, hidden, max_tokens_per_rank, topk, dtype
        self.num_local_experts = num_experts // self.world_size
        self.mode, self.backend = mode, backend
        self._be = engine.make_backend(backend, group)
        self._ll = None
        if mode == "low_latency":
            self._ll = ll.LowLatencyBuffers.allocate(self.num_local_experts, self.world_size, max_tokens_per_rank,
                                                     hidden, dtype)

    @contextlib.contextmanager
    def _on_comm_stream(self, async_op: bool, inputs):
        """Run the body on this Dispatcher's stream when async_op (CUDA); yields a list to put outputs in."""
        outputs: list = []
        if not (async_op and inputs[0].is_cuda):
            yield outputs
            return
        if getattr(self, "_stream", None) is None:
            self._stream = torch.cuda.Stream()
        caller = torch.cuda.current_stream()
        self._stream.wait_stream(caller)
        with torch.cuda.stream(self._stream):
            yield outputs
        # the caching allocator must not recycle these under the other stream (by identity: `in` would
        # compare tensors elementwise)
        for tensors, stream in ((inputs, self._stream), (outputs, caller)):
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(stream)

    def _check(self, x, topk_idx, topk_weights) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"dispatch: x must be [num_tokens, hidden={self.hidden}], got {getattr(x, 'shape', type(x))}")
        if x.dtype != self.dtype:
            raise TypeError(f"dispatch: x dtype {x.dtype}; this Dispatcher was made for {self.dtype}")
        if self.device is not None and x.device.type != self.device.type:
            raise ValueError(f"dispatch: x is on {x.device}; the tilecomm runtime's tensors are on {self.device}")
        T = x.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"dispatch: {T} tokens > max_tokens_per_rank={self.max_tokens}")
        if not isinstance(topk_idx, torch.Tensor) or tuple(topk_idx.shape) != (T, self.topk):
            raise ValueError(f"dispatch: topk_idx must be [num_tokens={T}, topk={self.topk}], got {getattr(topk_idx, 'shape', None)}")
        if topk_idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"dispatch: topk_idx must be int32 or int64, got {topk_idx.dtype}")
        if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != (T, self.topk):
            raise ValueError(f"dispatch: topk_weights must be [num_tokens={T}, topk={self.topk}], got {getattr(topk_weights, 'shape', None)}")
        if not topk_weights.is_floating_point():
            raise TypeError(f"dispatch: topk_weights must be floating point, got {topk_weights.dtype}")
        if topk_idx.numel() and self.mode == "normal":  # low-latency: checked on the device, no host sync
            lo, hi = int(topk_idx.min()), int(topk_idx.max())
            if lo < -1 or hi >= self.num_experts:
                raise ValueError(f"dispatch: topk_idx values must be in [-1, {self.num_experts}), got min {lo}, max {hi}")

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 return_recv_hook: bool = False, async_op: bool = False, use_fp8: bool = False) -> DispatchResult:
        """See `_dispatch`; async_op=True runs it on the communication stream and sets `res.work`.

        use_fp8 (normal mode, forward only): send e4m3 values + per-128-column scales (dispatch/fp8.py);
        res.x is float8_e4m3fn [R, H] and res.x_scales float32 [R, H / 128]. Combine stays in `dtype`."""
        with self._on_comm_stream(async_op, [x, topk_idx, topk_weights]) as outputs:
            if use_fp8:
                res = self._dispatch_fp8(x, topk_idx, topk_weights)
            else:
                res = self._dispatch(x, topk_idx, topk_weights, return_recv_hook)
            outputs += [res.x, res.weights, res.tokens_per_expert]
        if async_op:
            res.work = Work(res.x)
        return res

    def _dispatch_fp8(self, x, topk_idx, topk_weights) -> DispatchResult:
        self._check(x, topk_idx, topk_weights)
        if self.mode != "normal":
            raise ValueError("dispatch: use_fp8=True is available in mode='normal'")
        if torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad):
            raise ValueError("dispatch: use_fp8=True is forward-only; run it under torch.no_grad()")
        x_fp8, scales = fp8.quantize(x)
        handle = engine.plan(self._be, topk_idx, self.num_experts, self.rank, self.world_size, self.hidden)
        rows = engine.dispatch_rows(self._be, handle, x_fp8.view(torch.uint8)).view(torch.float8_e4m3fn)
        handle.row_weights = engine.dispatch_pairs(self._be, handle, topk_weights)
        res = DispatchResult(rows, handle.row_weights, handle.tokens_per_expert, handle)
        res.x_scales = engine.dispatch_rows(self._be, handle, scales)
        return res

    def _dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                  return_recv_hook: bool = False) -> DispatchResult:
        """x [T, H] (dtype), topk_idx [T, K] int (-1 = none), topk_weights [T, K] float -> DispatchResult.

        return_recv_hook (low-latency mode): queue only the send half now; `res.recv_hook()` queues the
        receive half, after which res.x / res.weights / res.tokens_per_expert are filled."""
        self._check(x, topk_idx, topk_weights)
        if return_recv_hook and self.mode != "low_latency":
            raise ValueError("dispatch: return_recv_hook=True needs mode='low_latency'")
        if self.mode == "low_latency":
            if torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad):
                raise ValueError("dispatch: mode='low_latency' is forward-only; use mode='normal' for training "
                                 "(or run under torch.no_grad())")
            rows, weights, per_expert, handle, hook = ll.dispatch(self._ll, x.contiguous(), topk_idx.contiguous(),
                                                                  topk_weights, self.num_experts, self.max_tokens,
                                                                  defer_recv=return_recv_hook)
            return DispatchResult(rows, weights, per_expert, handle, hook)
        handle = engine.plan(self._be, topk_idx, self.num_experts, self.rank, self.world_size, self.hidden)
        rows, weights = _Dispatch.apply(x, topk_weights, self._be, handle)
        handle.row_weights = weights
        return DispatchResult(rows, weights, handle.tokens_per_expert, handle)

    def combine(self, y: torch.Tensor, handle: DispatchHandle, async_op: bool = False):
        """y [R, H] (rows in res.x's order) -> out [T, H] = sum_k topk_weights[t, k] * y[row(t, k)].
        async_op=True: runs on the communication stream and returns (out, work); wait before reading out."""
        with self._on_comm_stream(async_op, [y]) as outputs:
            out = self._combine(y, handle)
            outputs.append(out)
        return (out, Work(out)) if async_op else out

    def _combine(self, y: torch.Tensor, handle) -> torch.Tensor:
        if self.mode == "low_latency":
            if not isinstance(handle, ll.LowLatencyHandle):
                raise ValueError("combine: handle must be the LowLatencyHandle this Dispatcher's dispatch returned")
            shape = (self.num_local_experts, handle.capacity, self.hidden)
            if not isinstance(y, torch.Tensor) or tuple(y.shape) != shape:
                raise ValueError(f"combine: y must be {list(shape)} (res.x's shape), got {getattr(y, 'shape', type(y))}")
            return ll.combine(self._ll, y, handle, self.max_tokens)
        if not isinstance(handle, DispatchHandle) or handle.backend != self.backend:
            raise ValueError("combine: handle must be the DispatchHandle this Dispatcher's dispatch returned")
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != (handle.num_recv_rows, handle.hidden):
            raise ValueError(f"combine: y must be [{handle.num_recv_rows}, {handle.hidden}] (the rows of this "
                             f"dispatch), got {getattr(y, 'shape', type(y))}")
        return _Combine.apply(y, handle.row_weights, self._be, handle)
