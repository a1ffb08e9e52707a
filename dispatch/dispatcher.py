"""`Dispatcher`: MoE token dispatch and combine across the ranks of a group (autograd-aware).

    d = Dispatcher(num_experts=8, hidden=1024, max_tokens_per_rank=4096, topk=2, dtype=torch.bfloat16)
    res = d.dispatch(x, topk_idx, topk_weights)   # x [T, H]; topk_idx [T, K] (-1 = none); weights [T, K]
    y = experts(res.x, res.tokens_per_expert)     # res.x [R, H], expert-major
    out = d.combine(y, res.handle)                # out[t] = sum_k topk_weights[t, k] * y[row(t, k)]
    d.free()                                      # collective; or let tilecomm.finalize() take the buffers

Experts are split evenly: rank r owns experts r*E/W ... (r+1)*E/W - 1. `res.x` rows are ordered by
local expert, then source rank, then source token index, then k (a token naming an expert twice gets two
rows): bit-for-bit deterministic. Both calls are differentiable: dispatch's backward is a combine of the
gradients (and returns each row's weight gradient to its token), combine's backward is a dispatch;
`topk_weights` gets its gradient through `res.weights`, which combine uses.

State: the Dispatcher allocates its symmetric buffers and signal words once, here (collective:
construct it on every rank in the same order with the same arguments; a mismatch raises
PeerMismatchError naming both ranks), sized from (num_experts, hidden, max_tokens_per_rank, topk,
dtype, world size) -- see buffers.py for the sizes -- or shares another Dispatcher's (`buffers=`). No call
allocates symmetric memory. `free()` gives the buffers back (collective); `tilecomm.finalize()` releases
them too (later calls raise).

Streams: every call runs on the current stream and returns after queuing its kernels; normal-mode
dispatch synchronises the host once (the received row count sizes res.x), combine never. With
`async_op=True`, dispatch and combine run on the Dispatcher's own communication stream (which first
waits for the current stream) and the result carries `work`: `work.wait()` makes the current stream
wait for the call; read the outputs only after it. Calls are collective: every rank makes the same
sequence of dispatch / combine calls (backward passes included).

backend: "tilecomm" (fused device kernels: normal.py, low_latency.py; the world group) or "nccl" (torch
ops and torch.distributed.all_to_all_single on `group`: reference.py, the reference implementation and
a drop-in fallback). Both give bit-identical rows and combines.

mode="low_latency" (decode; backend "tilecomm"): no host synchronisation, CUDA-graph capturable,
`res.x` is [E_local, W * max_tokens_per_rank, H] with `res.tokens_per_expert` valid rows per expert
(same order inside each expert; rows past the count undefined), `res.weights` [E_local, capacity].
More than max_tokens_per_rank rows for one (expert, source rank), or an expert id out of range, is
found on the device: nothing is written out of bounds and the next call raises. Forward-only.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import tilecomm
from tilecomm.collectives import Work
from tilecomm.errors import PeerMismatchError

from . import fp8
from .handle import DispatchHandle, DispatchResult
from .low_latency_engine import LowLatencyEngine, LowLatencyHandle
from .normal_engine import FusedEngine
from .reference import ReferenceEngine


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, engine, topk_idx, box):
        rows, weights, _, plan = engine.dispatch(x, topk_idx, topk_weights)
        box.append(plan)
        ctx.engine, ctx.plan = engine, plan
        return rows, weights

    @staticmethod
    def backward(ctx, grad_rows, grad_weights):
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x, grad_w = ctx.engine.combine(ctx.plan, grad_rows.contiguous() if need_x else None, None,
                                            grad_weights.float().contiguous() if need_w else None)
        return grad_x, grad_w, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, row_weights, engine, plan):
        ctx.engine, ctx.plan = engine, plan
        ctx.save_for_backward(y, row_weights)
        return engine.combine(plan, y, row_weights)[0]

    @staticmethod
    def backward(ctx, grad_out):
        y, row_weights = ctx.saved_tensors
        grad_rows = ctx.engine.redispatch(ctx.plan, grad_out.contiguous())
        acc = torch.promote_types(y.dtype, torch.float32)
        grad_y = (grad_rows.to(acc) * row_weights.to(acc)[:, None]).to(y.dtype) if ctx.needs_input_grad[0] else None
        grad_w = (grad_rows.to(acc) * y.to(acc)).sum(-1).float() if ctx.needs_input_grad[1] else None
        return grad_y, grad_w, None, None


_ARGS = ("num_experts", "hidden", "max_tokens_per_rank", "topk", "dtype", "mode", "backend")


class Dispatcher:
    """See the module docstring. Arguments are checked on every call, before any kernel runs."""

    def __init__(self, num_experts: int, hidden: int, max_tokens_per_rank: int, topk: int,
                 dtype: torch.dtype = torch.bfloat16, group=None, mode: str = "normal", backend: str = "tilecomm",
                 buffers=None):
        if backend not in ("tilecomm", "nccl"):
            raise ValueError(f"Dispatcher: backend={backend!r}; expected 'tilecomm' or 'nccl'")
        if backend == "tilecomm":
            ctx = tilecomm.current()
            if group is not None and dist.get_process_group_ranks(group) != list(range(ctx.world_size)):
                raise ValueError("Dispatcher(backend='tilecomm'): group must be None or the world group")
            self.rank, self.world_size, self.device = ctx.rank, ctx.world_size, ctx.device
        else:
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
            self.device = None
        self._on_cuda = None if self.device is None else self.device.type == "cuda"  # read on every call
        args = (num_experts, hidden, max_tokens_per_rank, topk, str(dtype), mode, backend)
        self._agree(args, group if backend == "nccl" else None)
        if mode not in ("normal", "low_latency"):
            raise ValueError(f"Dispatcher: mode={mode!r}; expected 'normal' or 'low_latency'")
        if mode == "low_latency" and backend != "tilecomm":
            raise ValueError("Dispatcher: mode='low_latency' needs backend='tilecomm' (symmetric buffers)")
        for name, value in zip(_ARGS[:4], args[:4]):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Dispatcher: {name}={value!r}; expected a positive int")
        if num_experts % self.world_size:
            raise ValueError(f"Dispatcher: num_experts={num_experts} must divide by the group size ({self.world_size})")
        if topk > num_experts:
            raise ValueError(f"Dispatcher: topk={topk} > num_experts={num_experts}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"Dispatcher: dtype={dtype!r}; expected a floating-point torch.dtype")
        self.num_experts, self.hidden, self.max_tokens, self.topk, self.dtype = num_experts, hidden, max_tokens_per_rank, topk, dtype
        self.num_local_experts = num_experts // self.world_size
        self.mode, self.backend = mode, backend
        self._stream = None
        shape = (num_experts, hidden, max_tokens_per_rank, topk, dtype)
        if buffers is not None:
            kind = LowLatencyEngine if mode == "low_latency" else FusedEngine
            if not isinstance(buffers, kind) or (buffers.E, buffers.H, buffers.M, buffers.K, buffers.dtype) != shape:
                raise ValueError("Dispatcher: buffers= must be the .buffers of a Dispatcher with the same num_experts, "
                                 "hidden, max_tokens_per_rank, topk, dtype and mode (backend 'tilecomm')")
            self._engine = buffers
        elif mode == "low_latency":
            self._engine = LowLatencyEngine(*shape)
        elif backend == "tilecomm":
            self._engine = FusedEngine(*shape)
        else:
            self._engine = ReferenceEngine(num_experts, self.rank, self.world_size, group)

    def _agree(self, args: tuple, group) -> None:
        """PeerMismatchError naming both ranks unless every rank passed the same arguments (one host gather)."""
        if self.world_size == 1:
            return
        if group is None:
            seen = tilecomm.current().boot.all_gather_object(args)
        else:
            seen = [None] * self.world_size
            dist.all_gather_object(seen, args, group=group)
        for r, theirs in enumerate(seen):
            for name, a, b in zip(_ARGS, args, theirs):
                if a != b:
                    raise PeerMismatchError(f"Dispatcher: rank {self.rank} has {name}={a!r}, rank {r} has {name}={b!r}; "
                                            "every rank must construct it with the same arguments")

    @property
    def buffers(self):
        """The symmetric state this Dispatcher uses (normal_engine.FusedEngine / low_latency_engine.LowLatencyEngine; None
        for backend 'nccl'). Pass it as `buffers=` to another Dispatcher of the same shape to share it: the
        MoE layers of a model dispatch one after another, so one set of buffers serves them all (calls of
        Dispatchers sharing buffers must not overlap, e.g. on two async_op streams)."""
        return self._engine if self.backend == "tilecomm" else None

    def free(self) -> None:
        """Collective: return the symmetric buffers (waits for this rank's kernels). Later calls raise, also
        those of Dispatchers sharing them."""
        if hasattr(self._engine, "free"):
            self._engine.free()

    @contextlib.contextmanager
    def _on_comm_stream(self, async_op: bool, inputs):
        """Run the body on this Dispatcher's stream when async_op (CUDA); yields a list to put outputs in."""
        outputs: list = []
        if not (async_op and inputs[0].is_cuda):
            if self._stream is not None and inputs[0].is_cuda:  # calls share buffers: keep them in order
                torch.cuda.current_stream().wait_stream(self._stream)
            yield outputs
            return
        if self._stream is None:
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
        # (fused_moe runs it on a FusedMoEWorkspace: it reads hidden, dtype, device, _on_cuda, max_tokens, topk)
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"dispatch: x must be [num_tokens, hidden={self.hidden}], got {getattr(x, 'shape', type(x))}")
        if x.dtype != self.dtype:
            raise TypeError(f"dispatch: x dtype {x.dtype}; this Dispatcher was made for {self.dtype}")
        if self._on_cuda is not None and x.is_cuda != self._on_cuda:
            raise ValueError(f"dispatch: x is on {x.device}; the tilecomm runtime's tensors are on {self.device}")
        T = x.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"dispatch: {T} tokens > max_tokens_per_rank={self.max_tokens}")
        shape = (T, self.topk)  # (a torch.Size equals the tuple of its sizes: no tuple() per call)
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.shape != shape:
            raise ValueError(f"dispatch: topk_idx must be [num_tokens={T}, topk={self.topk}], got {getattr(topk_idx, 'shape', None)}")
        if topk_idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"dispatch: topk_idx must be int32 or int64, got {topk_idx.dtype}")
        if not isinstance(topk_weights, torch.Tensor) or topk_weights.shape != shape:
            raise ValueError(f"dispatch: topk_weights must be [num_tokens={T}, topk={self.topk}], got {getattr(topk_weights, 'shape', None)}")
        if not topk_weights.is_floating_point():
            raise TypeError(f"dispatch: topk_weights must be floating point, got {topk_weights.dtype}")
        on = x.get_device()  # -1 on CPU: cheaper than comparing torch.device objects
        if topk_idx.get_device() != on or topk_weights.get_device() != on:
            name, t = ("topk_idx", topk_idx) if topk_idx.get_device() != on else ("topk_weights", topk_weights)
            raise ValueError(f"dispatch: {name} is on {t.device}, x on {x.device}")
        # expert ids are checked on the device (one host read at most): ValueError at the end of the call

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 return_recv_hook: bool = False, async_op: bool = False, use_fp8: bool = False) -> DispatchResult:
        """x [T, H] (dtype), topk_idx [T, K] int (-1 = none), topk_weights [T, K] float -> DispatchResult.

        return_recv_hook (low-latency mode): queue only the send half now; `res.recv_hook()` queues the
        receive half, after which res.x / res.weights / res.tokens_per_expert are filled (combine raises
        before it). async_op=True runs the call on the communication stream and sets `res.work`.
        use_fp8 (normal mode, forward only): send e4m3 values + per-128-column scales (dispatch/fp8.py);
        res.x is float8_e4m3fn [R, H] and res.x_scales float32 [R, H / 128]. Combine stays in `dtype`."""
        self._check(x, topk_idx, topk_weights)
        if return_recv_hook and self.mode != "low_latency":
            raise ValueError("dispatch: return_recv_hook=True needs mode='low_latency'")
        if (use_fp8 or self.mode == "low_latency") and torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad):
            what = "use_fp8=True" if use_fp8 else "mode='low_latency'"
            raise ValueError(f"dispatch: {what} is forward-only; use mode='normal' for training (or run under torch.no_grad())")
        if use_fp8 and self.mode != "normal":
            raise ValueError("dispatch: use_fp8=True is available in mode='normal'")
        if self.mode == "low_latency" and not async_op:  # the decode hot path: no stream switch to set up
            if self._stream is not None and x.is_cuda:  # calls share buffers: keep them in order
                torch.cuda.current_stream().wait_stream(self._stream)
            return self._dispatch_low_latency(x, topk_idx, topk_weights, return_recv_hook)
        with self._on_comm_stream(async_op, [x, topk_idx, topk_weights]) as outputs:
            if self.mode == "low_latency":
                res = self._dispatch_low_latency(x, topk_idx, topk_weights, return_recv_hook)
            elif use_fp8:
                res = self._dispatch_fp8(x, topk_idx, topk_weights)
            else:
                box: list = []
                rows, weights = _Dispatch.apply(x.contiguous(), topk_weights, self._engine, topk_idx, box)
                res = DispatchResult(rows, weights, box[0].tokens_per_expert, self._handle(box[0], weights))
            outputs += [res.x, res.weights, res.tokens_per_expert]
        if async_op:  # (made here, outside the stream block: it marks the communication stream's work)
            res.work = Work(res.x, self._stream)
        return res

    def _dispatch_low_latency(self, x, topk_idx, topk_weights, return_recv_hook) -> DispatchResult:
        rows, weights, per_expert, handle, hook = self._engine.dispatch(x.contiguous(), topk_idx, topk_weights,
                                                                        defer_recv=return_recv_hook)
        return DispatchResult(rows, weights, per_expert, handle, hook)

    def _handle(self, plan, weights) -> DispatchHandle:
        return DispatchHandle(plan.num_tokens, self.hidden, self.topk, plan.num_recv_rows, plan.tokens_per_expert,
                              self.backend, plan, weights)

    def _dispatch_fp8(self, x, topk_idx, topk_weights) -> DispatchResult:
        x_fp8, scales = fp8.quantize(x)
        rows, weights, row_scales, plan = self._engine.dispatch(x_fp8.view(torch.uint8), topk_idx, topk_weights, x2=scales)
        res = DispatchResult(rows.view(torch.float8_e4m3fn), weights, plan.tokens_per_expert, self._handle(plan, weights))
        res.x_scales = row_scales
        return res

    def combine(self, y: torch.Tensor, handle: DispatchHandle, async_op: bool = False):
        """y [R, H] (rows in res.x's order) -> out [T, H] = sum_k topk_weights[t, k] * y[row(t, k)].
        async_op=True: runs on the communication stream and returns (out, work); wait before reading out."""
        self._check_combine(y, handle)
        if self.mode == "low_latency" and not async_op:  # the decode hot path
            if self._stream is not None and y.is_cuda:
                torch.cuda.current_stream().wait_stream(self._stream)
            return self._engine.combine(y.contiguous(), handle)
        with self._on_comm_stream(async_op, [y]) as outputs:
            if self.mode == "low_latency":
                out = self._engine.combine(y.contiguous(), handle)
            else:
                out = _Combine.apply(y.contiguous(), handle.row_weights, self._engine, handle.plan)
            outputs.append(out)
        return (out, Work(out, self._stream)) if async_op else out

    def _check_combine(self, y, handle) -> None:
        if self.mode == "low_latency":
            if not isinstance(handle, LowLatencyHandle):
                raise ValueError("combine: handle must be the LowLatencyHandle this Dispatcher's dispatch returned")
            shape = (self.num_local_experts, handle.capacity, self.hidden)
        else:
            if not isinstance(handle, DispatchHandle) or handle.backend != self.backend:
                raise ValueError("combine: handle must be the DispatchHandle this Dispatcher's dispatch returned")
            shape = (handle.num_recv_rows, handle.hidden)
        if not isinstance(y, torch.Tensor) or y.shape != shape:
            raise ValueError(f"combine: y must be {list(shape)} (res.x's shape), got {getattr(y, 'shape', type(y))}")
        if not y.is_floating_point() or y.element_size() > self.dtype.itemsize:
            raise TypeError(f"combine: y dtype {y.dtype}; expected a floating dtype no wider than {self.dtype}")
