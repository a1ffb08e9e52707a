"""Tensor-parallel linear layers with sequence parallelism, on ag_gemm and gemm_rs.

Shapes (W ranks of the TP group, s tokens in the sequence, each rank holding s/W of them between layers):

    ColumnParallelLinear(in_features, out_features):  x [s/W, in] -> y [s, out/W]
        forward  y = ag_gemm(x, w)                  w = this rank's [in, out/W] column block
        backward dx = gemm_rs(dy, w^T) [s/W, in];   dw = all_gather(x)^T @ dy
    RowParallelLinear(in_features, out_features):     x [s, in/W] -> y [s/W, out]
        forward  y = gemm_rs(x, w)                  w = this rank's [in/W, out] row block
        backward dx = ag_gemm(dy, w^T) [s, in/W];   dw = x^T @ all_gather(dy)

A Column layer followed by a Row layer is the Megatron MLP/attention pattern: no communication
between them, one all-gather before and one reduce-scatter after, both fused into the GEMMs.
`group`: the TP group (a torch.distributed ProcessGroup; None = the world). Every TP group of the
job must build and call the same layers with the same shapes (SPMD; see team.py). Sharded
parameters carry `tensor_parallel = True` (trainers reduce and checkpoint them per TP rank).
`from_linear` shards a single-device nn.Linear, so results can be compared with it.
Under autocast the GEMMs run in the autocast dtype (as nn.Linear's would).
"""
from __future__ import annotations


import torch
from torch import nn

from .ag_gemm import ag_gemm
from .gemm_rs import gemm_rs
from .team import team_of


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group):
        y, gathered = ag_gemm(x.contiguous(), w, return_gathered=True, group=group)
        ctx.save_for_backward(gathered, w)
        ctx.group = group
        return y

    @staticmethod
    def backward(ctx, dy):
        gathered, w = ctx.saved_tensors
        dy = dy.contiguous()
        return gemm_rs(dy, w.t(), group=ctx.group), gathered.t() @ dy, None


class _RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group):
        ctx.save_for_backward(x, w)
        ctx.group = group
        return gemm_rs(x.contiguous(), w, group=group)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx, dy_full = ag_gemm(dy.contiguous(), w.t(), return_gathered=True, group=ctx.group)
        return dx, x.t() @ dy_full, None


def _autocast(x: torch.Tensor, w: torch.Tensor):
    """x, w in the autocast dtype when autocast is on for x's device (the kernels need one dtype)."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        return x.to(dtype), w.to(dtype)
    return x, w


class _ParallelLinear(nn.Module):
    SPLIT_DIM = 0  # which dimension of the [in, out] weight is split over the ranks

    def __init__(self, in_features: int, out_features: int, bias: bool, split_dim: int, dtype, device, group):
        super().__init__()
        team = team_of(group, type(self).__name__)
        self.group, self.world, self.rank = group, team.size, team.index
        split = (in_features, out_features)[split_dim]
        if split % self.world:
            raise ValueError(f"{type(self).__name__}: {('in', 'out')[split_dim]}_features={split} must divide by "
                             f"the group size ({self.world})")
        shape = [in_features, out_features]
        shape[split_dim] //= self.world
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))  # [in(/W), out(/W)]
        bias_len = out_features // self.world if split_dim == 1 else out_features
        self.bias = nn.Parameter(torch.zeros(bias_len, dtype=dtype, device=device)) if bias else None
        nn.init.kaiming_uniform_(self.weight.t(), a=5 ** 0.5)
        self.weight.tensor_parallel = True
        if self.bias is not None and split_dim == 1:
            self.bias.tensor_parallel = True

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None):
        """This rank's shard of a single-device nn.Linear (weight [out, in]), contiguous blocks."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype,
                    linear.weight.device, group=group)
        layer.load_from_linear(linear, cls.SPLIT_DIM)
        return layer

    def load_from_linear(self, linear: nn.Linear, split_dim: int) -> None:
        """Copy this rank's block of a full nn.Linear (weight [out, in]) into the shard."""
        full = linear.weight.detach().t()  # [in, out]
        size = full.shape[split_dim] // self.world
        block = full.narrow(split_dim, self.rank * size, size)
        with torch.no_grad():
            self.weight.copy_(block)
            if self.bias is not None:
                b = linear.bias.detach()
                self.bias.copy_(b.narrow(0, self.rank * size, size) if split_dim == 1 else b)


class ColumnParallelLinear(_ParallelLinear):
    """x [s/W, in] (this rank's sequence shard) -> y [s, out/W] (all tokens, this rank's columns).
    weight [in, out/W] and bias [out/W] are sharded."""

    SPLIT_DIM = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=None, device=None, group=None):
        super().__init__(in_features, out_features, bias, 1, dtype, device, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ColumnParallel.apply(*_autocast(x, self.weight), self.group)
        return y + self.bias.to(y.dtype) if self.bias is not None else y


class RowParallelLinear(_ParallelLinear):
    """x [s, in/W] (all tokens, this rank's input columns) -> y [s/W, out] (this rank's sequence shard).
    weight [in/W, out] is sharded; bias [out] is replicated (its gradient is this rank's tokens' share)."""

    SPLIT_DIM = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=None, device=None, group=None):
        super().__init__(in_features, out_features, bias, 0, dtype, device, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _RowParallel.apply(*_autocast(x, self.weight), self.group)
        return y + self.bias.to(y.dtype) if self.bias is not None else y
