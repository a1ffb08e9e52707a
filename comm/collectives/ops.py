"""The collectives as `torch.library` custom ops, so `torch.compile` (fullgraph too) calls them.

    torch.ops.tilecomm.all_to_all_single(input, output_split_sizes, input_split_sizes, out_rows) -> Tensor
    torch.ops.tilecomm.all_gather_into_tensor(input, out_numel) -> Tensor      (flat)
    torch.ops.tilecomm.reduce_scatter_tensor(input, op, out_numel) -> Tensor    (flat; op: api._OPS code)

Functional forms (they return a new tensor): the public in-place API (api.py) calls them while
`torch.compiler.is_compiling()` and copies the result into the caller's output, so a compiled graph holds
one opaque node per collective. Fake implementations give compiled code the output's shape and dtype
without running anything; autograd is registered as the adjoint collective (the same rules as the eager
autograd functions in api.py). Split sizes are plain ints: with fixed splits a compiled function
specialises on them.
"""
from __future__ import annotations

from typing import List

import torch

_SUM, _AVG = 0, 4  # op codes of the custom op (api._OPS maps every ReduceOp to its code)


@torch.library.custom_op("tilecomm::all_to_all_single", mutates_args=())
def all_to_all_single(input: torch.Tensor, output_split_sizes: List[int], input_split_sizes: List[int],
                      out_rows: int) -> torch.Tensor:
    from . import api

    output = input.new_empty((out_rows,) + tuple(input.shape[1:]))
    api._a2a(output, input.contiguous(), list(output_split_sizes), list(input_split_sizes))
    return output


@all_to_all_single.register_fake
def _(input, output_split_sizes, input_split_sizes, out_rows):
    return input.new_empty((out_rows,) + tuple(input.shape[1:]))


def _a2a_backward(ctx, grad):
    return (torch.ops.tilecomm.all_to_all_single(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.in_rows),
            None, None, None)


def _a2a_setup(ctx, inputs, output):
    input, out_splits, in_splits, _ = inputs
    ctx.in_splits, ctx.out_splits, ctx.in_rows = list(in_splits), list(out_splits), input.shape[0]


all_to_all_single.register_autograd(_a2a_backward, setup_context=_a2a_setup)


@torch.library.custom_op("tilecomm::all_gather_into_tensor", mutates_args=())
def all_gather_into_tensor(input: torch.Tensor, out_numel: int) -> torch.Tensor:
    from . import api

    output = input.new_empty(out_numel)
    api._all_gather(output, input.contiguous())
    return output


@all_gather_into_tensor.register_fake
def _(input, out_numel):
    return input.new_empty(out_numel)


def _ag_backward(ctx, grad):
    return torch.ops.tilecomm.reduce_scatter_tensor(grad.contiguous(), _SUM, ctx.in_numel).view(ctx.in_shape), None


def _ag_setup(ctx, inputs, output):
    ctx.in_numel, ctx.in_shape = inputs[0].numel(), tuple(inputs[0].shape)


all_gather_into_tensor.register_autograd(_ag_backward, setup_context=_ag_setup)


@torch.library.custom_op("tilecomm::reduce_scatter_tensor", mutates_args=())
def reduce_scatter_tensor(input: torch.Tensor, op: int, out_numel: int) -> torch.Tensor:
    from . import api

    output = input.new_empty(out_numel)
    api._reduce_scatter(output, input.contiguous(), op)
    return output


@reduce_scatter_tensor.register_fake
def _(input, op, out_numel):
    return input.new_empty(out_numel)


def _rs_backward(ctx, grad):
    if ctx.op != _SUM:
        raise RuntimeError("tilecomm.reduce_scatter_tensor: autograd is defined for op=SUM only")
    out = torch.ops.tilecomm.all_gather_into_tensor(grad.contiguous(), ctx.in_numel)
    return out.view(ctx.in_shape), None, None


def _rs_setup(ctx, inputs, output):
    ctx.op, ctx.in_numel, ctx.in_shape = inputs[1], inputs[0].numel(), tuple(inputs[0].shape)


reduce_scatter_tensor.register_autograd(_rs_backward, setup_context=_rs_setup)
