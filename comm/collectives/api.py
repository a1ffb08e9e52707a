"""Argument checks, split bookkeeping and autograd for the collectives (kernels in _exchange.py and _reduce.py)."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .. import runtime
from ..errors import require
from .ops import _AVG, _SUM

# A ReduceOp travels as its code (the custom op's argument, ops.py); the reduce kernel's OP of each code
_OPS = ((ReduceOp.SUM, 0), (ReduceOp.MAX, 1), (ReduceOp.MIN, 2), (ReduceOp.PRODUCT, 3), (ReduceOp.AVG, 4))
_OP_CODES = dict(_OPS)
_KERNEL_OP = (0, 1, 2, 3, 0)  # AVG: a sum, then divided by the world size


def _op_code(what: str, op) -> int:
    """The code of a ReduceOp; ValueError for anything else. While torch.compile traces, by identity: Dynamo
    (torch 2.11) cannot hash a ReduceOp, and ReduceOp.SUM etc. are singletons."""
    code = None
    if torch.compiler.is_compiling():
        for known, c in _OPS:
            if op is known:
                code = c
    else:
        code = _OP_CODES.get(op)
    if code is None:
        raise ValueError(f"{what}: op={op}; expected ReduceOp.SUM, AVG, MAX, MIN or PRODUCT")
    return code


def _compiling(what: str, async_op: bool) -> bool:
    """Under torch.compile the calls go through the custom ops of ops.py (one graph node each)."""
    if not torch.compiler.is_compiling():
        return False
    if async_op:
        raise ValueError(f"{what}: async_op=True is not available under torch.compile (the compiled graph orders "
                         "the collective on its stream already)")
    return True


class Work:
    """Returned by `async_op=True` calls. `wait()` orders the current stream after the call: after what was
    queued on `stream` (the stream the call ran on; default: the current one) when the Work was made."""

    def __init__(self, tensor: torch.Tensor, stream: "torch.cuda.Stream | None" = None):
        self._event = None
        if tensor.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def wait(self, timeout=None) -> bool:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        runtime.check_errors()
        return True

    def is_completed(self) -> bool:
        return self._event is None or self._event.query()


def _check_group(what: str, group, world: int) -> None:
    if group is None or group is dist.GroupMember.WORLD:
        return
    ranks = dist.get_process_group_ranks(group)
    require(list(ranks) == list(range(world)),
            f"{what}: group={ranks}; tilecomm collectives run on the world group only (None or all {world} ranks)")


# The checks below run on every call: messages are formatted only when a check fails.
def _check_tensor(what: str, name: str, t, on_gpu: bool) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_cuda != on_gpu:
        raise ValueError(f"{what}: {name} is on {t.device}, the runtime's tensors are on {runtime.current().device}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: {name} must be contiguous (got strides {tuple(t.stride())})")
    if t.dtype not in _MOVABLE:
        raise TypeError(f"{what}: {name} has dtype {t.dtype}; expected one of {sorted(str(d) for d in _MOVABLE)}")


_COMPLEX = (torch.complex64, torch.complex128)
_MOVABLE = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
            torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64,
            torch.complex128}


def _check_call(what: str, group, out_name: str, out, in_name: str, inp):
    """The checks every collective shares; returns the runtime context."""
    ctx = runtime.current()
    if group is not None:
        _check_group(what, group, ctx.world_size)
    on_gpu = ctx.backend == "cuda"
    _check_tensor(what, out_name, out, on_gpu)
    _check_tensor(what, in_name, inp, on_gpu)
    if out.dtype != inp.dtype:
        raise TypeError(f"{what}: {out_name} dtype {out.dtype} != {in_name} dtype {inp.dtype}")
    return ctx


def _splits(what: str, name: str, splits: Optional[Sequence[int]], dim0: int, world: int) -> List[int]:
    if splits is None or len(splits) == 0:
        if dim0 % world:
            raise ValueError(f"{what}: {name} is None, so dim 0 ({dim0}) must divide by the world size ({world})")
        return [dim0 // world] * world
    splits = [int(s) for s in splits]
    if len(splits) != world:
        raise ValueError(f"{what}: {name} has {len(splits)} entries; expected one per rank ({world})")
    if min(splits) < 0:
        raise ValueError(f"{what}: {name}={splits} has a negative entry")
    if sum(splits) != dim0:
        raise ValueError(f"{what}: {name}={splits} sums to {sum(splits)}, but the tensor's dim 0 is {dim0}")
    return splits


def _words(t: torch.Tensor):
    """t (contiguous), and how many moved elements make one of t's: complex numbers move as int64 words
    (complex128 as two), which Triton can type."""
    if t.dtype in _COMPLEX:
        return t.reshape(-1).view(torch.int64), t.element_size() // 8
    return t, 1


def _a2a(output: torch.Tensor, input: torch.Tensor, out_splits: List[int], in_splits: List[int]) -> None:
    if in_splits == out_splits and in_splits.count(in_splits[0]) == len(in_splits):
        _a2a_even(output, input, in_splits[0])
        return
    src, row = _moved_rows(input)
    runtime.current().collectives.exchange(src, _words(output)[0], (in_splits, out_splits, row), 0, gather=False)


def _a2a_even(output: torch.Tensor, input: torch.Tensor, rows_per_peer: int) -> None:
    """all_to_all of rows_per_peer rows to (and from) every rank."""
    src, row = _moved_rows(input)
    runtime.current().collectives.exchange(src, _words(output)[0], None, rows_per_peer * row, gather=False)


def _moved_rows(input: torch.Tensor):
    """(input as moved elements, moved elements per row of input)."""
    src, scale = _words(input)
    rows = input.shape[0]
    return src, (src.numel() // rows if rows else math.prod(input.shape[1:]) * scale)


def _same_past_dim0(a: torch.Size, b: torch.Size) -> bool:
    """a[1:] == b[1:] for sizes of at least one dimension (2-D without slicing a torch.Size, ~0.4 µs a call)."""
    n = len(a)
    if n != len(b) or n == 0:
        return False
    return a[1] == b[1] if n == 2 else a[1:] == b[1:]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(fn_ctx, input, out_splits, in_splits, out_shape):
        fn_ctx.splits = (out_splits, in_splits, tuple(input.shape))
        output = input.new_empty(out_shape)
        _a2a(output, input.contiguous(), out_splits, in_splits)
        return output

    @staticmethod
    def backward(fn_ctx, grad):
        out_splits, in_splits, in_shape = fn_ctx.splits
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, in_shape), None, None, None


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    """torch.distributed.all_to_all_single on the tilecomm runtime (see the package docstring)."""
    what = "tilecomm.all_to_all_single"
    ctx = _check_call(what, group, "output", output, "input", input)
    in_shape, out_shape = input.shape, output.shape
    if not _same_past_dim0(out_shape, in_shape):
        raise ValueError(f"{what}: output {tuple(output.shape)} and input {tuple(input.shape)} must agree past dim 0")
    if ((input_split_sizes is None or len(input_split_sizes) == 0)
            and (output_split_sizes is None or len(output_split_sizes) == 0) and in_shape[0] == out_shape[0]
            and in_shape[0] % ctx.world_size == 0 and not (input.requires_grad and torch.is_grad_enabled())
            and not torch.compiler.is_compiling()):  # the common call, eager: no split lists to build and compare
        _a2a_even(output, input, in_shape[0] // ctx.world_size)
        return Work(output) if async_op else None
    in_splits = _splits(what, "input_split_sizes", input_split_sizes, input.shape[0], ctx.world_size)
    out_splits = _splits(what, "output_split_sizes", output_split_sizes, output.shape[0], ctx.world_size)
    if _compiling(what, async_op):
        output.copy_(torch.ops.tilecomm.all_to_all_single(input, out_splits, in_splits, output.shape[0]))
        return None
    if input.requires_grad and torch.is_grad_enabled():
        result = _AllToAll.apply(input, out_splits, in_splits, tuple(output.shape))
        output.copy_(result)
    else:
        _a2a(output, input, out_splits, in_splits)
    return Work(output) if async_op else None


def _all_gather(output: torch.Tensor, input: torch.Tensor) -> None:
    src, _ = _words(input)
    out, _ = _words(output)
    runtime.current().collectives.exchange(src, out, None, src.numel(), gather=True)


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, code: int) -> None:
    src, out = input, output
    if src.is_complex():  # a complex sum is the sum of its real and imaginary parts
        src, out = torch.view_as_real(src).reshape(-1), torch.view_as_real(out).reshape(-1)
    runtime.current().collectives.reduce_scatter(src, out, _KERNEL_OP[code], average=code == _AVG)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(fn_ctx, input, out_shape):
        output = input.new_empty(out_shape)
        _all_gather(output, input.contiguous())
        fn_ctx.in_shape = tuple(input.shape)
        return output

    @staticmethod
    def backward(fn_ctx, grad):
        return _ReduceScatter.apply(grad.contiguous(), fn_ctx.in_shape), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(fn_ctx, input, out_shape):
        output = input.new_empty(out_shape)
        _reduce_scatter(output, input.contiguous(), _SUM)
        fn_ctx.in_shape = tuple(input.shape)
        return output

    @staticmethod
    def backward(fn_ctx, grad):
        return _AllGather.apply(grad.contiguous(), fn_ctx.in_shape), None


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """torch.distributed.all_gather_into_tensor: output is world× input along dim 0 (or flat), rank order."""
    what = "tilecomm.all_gather_into_tensor"
    ctx = _check_call(what, group, "output_tensor", output_tensor, "input_tensor", input_tensor)
    if output_tensor.numel() != ctx.world_size * input_tensor.numel():
        raise ValueError(f"{what}: output_tensor has {output_tensor.numel()} elements; expected world_size "
                         f"({ctx.world_size}) × input_tensor's {input_tensor.numel()}")
    if _compiling(what, async_op):
        output_tensor.copy_(torch.ops.tilecomm.all_gather_into_tensor(input_tensor, output_tensor.numel())
                            .view(output_tensor.shape))
        return None
    if input_tensor.requires_grad and torch.is_grad_enabled():
        output_tensor.copy_(_AllGather.apply(input_tensor, tuple(output_tensor.shape)))
    else:
        _all_gather(output_tensor, input_tensor)
    return Work(output_tensor) if async_op else None


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """torch.distributed.reduce_scatter_tensor: rank r gets op over ranks of input's r-th chunk.

    op: SUM, AVG, MAX, MIN or PRODUCT; floating inputs accumulate in fp32 (fp64 stays fp64)."""
    what = "tilecomm.reduce_scatter_tensor"
    ctx = _check_call(what, group, "output", output, "input", input)
    code = _op_code(what, op)
    if output.dtype in (torch.bool, torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{what}: dtype {output.dtype} cannot be reduced; use a floating or integer dtype")
    if code == _AVG and not (output.dtype.is_floating_point or output.dtype.is_complex):
        raise TypeError(f"{what}: op=AVG needs a floating dtype (got {output.dtype}): an integer average would round; use SUM and divide")
    if output.is_complex() and code not in (_SUM, _AVG):
        raise TypeError(f"{what}: complex tensors reduce with SUM or AVG only (got {op})")
    if input.numel() != ctx.world_size * output.numel():
        raise ValueError(f"{what}: input has {input.numel()} elements; expected world_size ({ctx.world_size}) × "
                         f"output's {output.numel()}")
    if _compiling(what, async_op):
        output.copy_(torch.ops.tilecomm.reduce_scatter_tensor(input, code, output.numel()).view(output.shape))
        return None
    if input.requires_grad and torch.is_grad_enabled():
        if code != _SUM:
            raise ValueError(f"{what}: autograd is defined for op=SUM only, got {op}")
        output.copy_(_ReduceScatter.apply(input, tuple(output.shape)))
    else:
        _reduce_scatter(output, input, code)
    return Work(output) if async_op else None
