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
Workspaces: `TensorParallelWorkspaces(cols, dtype, max_tokens, group)` is one AgGemmWorkspace and one
GemmRsWorkspace of `cols` columns, made up front (collective over the world). One set serves every layer
whose gathered input / reduced output is `cols` wide (a transformer's TP layers all gather and reduce
[s/W, hidden] rows): the layers run one after another, and consecutive ag_gemm / gemm_rs calls on one
workspace are safe in any order (their epochs, ag_gemm.py's docstring). Pass it as `workspaces=`; or
`max_tokens` (s, the longest sequence) for a set of the layer's own. `.to(dtype)` on a layer (or on a
module holding them, e.g. the Transformer that `moe.parallelize` built) re-makes the set in the new
dtype, collectively, and so does `follow_parameter_dtype()` after a cast through `param.data`. With
neither, or under autocast in another dtype than the set's, every call makes and frees temporary
workspaces (correct; a collective allocation and a device sync per call).
Under autocast the GEMMs run in the autocast dtype (as nn.Linear's would).
"""
from __future__ import annotations


import torch
from torch import nn

from .ag_gemm import AgGemmWorkspace, ag_gemm
from .gemm_rs import GemmRsWorkspace, gemm_rs
from .team import team_of


class TensorParallelWorkspaces:
    """The symmetric workspaces of sequence-parallel linears over `group` (None: the world) whose gathered
    inputs and reduced outputs are `cols` wide, for sequences of up to `max_tokens` tokens in `dtype`:
    `ag` (AgGemmWorkspace) and `rs` (GemmRsWorkspace), each of max_tokens / W rows. Collective over the
    world (as every symmetric allocation): made here, re-made by `to(dtype)`, returned by `free()`."""

    def __init__(self, cols: int, dtype: torch.dtype, max_tokens: int, group=None):
        team = team_of(group, "TensorParallelWorkspaces")
        for name, v in (("cols", cols), ("max_tokens", max_tokens)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"TensorParallelWorkspaces: {name} must be a positive int, got {v!r}")
        if max_tokens % team.size:
            raise ValueError(f"TensorParallelWorkspaces: max_tokens must be a positive multiple of the group size "
                             f"({team.size}), got {max_tokens}")
        self.cols, self.max_tokens, self.group, self.dtype = cols, max_tokens, group, dtype
        self.ag, self.rs = self._make(dtype)

    def _make(self, dtype: torch.dtype):
        rows = self.max_tokens // team_of(self.group, "TensorParallelWorkspaces").size
        return (AgGemmWorkspace(self.cols, dtype, rows, self.group), GemmRsWorkspace(self.cols, dtype, rows, self.group))

    @staticmethod
    def heap_bytes(cols: int, dtype: torch.dtype, max_tokens: int, group_size: int) -> int:
        """Symmetric heap bytes one set over a group of `group_size` ranks takes on each rank."""
        rows = max_tokens // group_size
        return AgGemmWorkspace.heap_bytes(cols, dtype, rows, group_size) + \
            GemmRsWorkspace.heap_bytes(cols, dtype, rows, group_size)

    def to(self, dtype: torch.dtype) -> "TensorParallelWorkspaces":
        """The set for GEMMs in `dtype` (collective: every rank of the world re-makes it at the same point)."""
        if dtype != self.dtype:
            self.free()
            self.dtype, (self.ag, self.rs) = dtype, self._make(dtype)
        return self

    def free(self) -> None:
        """Collective: return both workspaces to the heap (waits for this rank's kernels)."""
        if self.ag is not None:
            self.ag.free()
            self.rs.free()
        self.ag = self.rs = None


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, layer):
        y, gathered = ag_gemm(x.contiguous(), w, return_gathered=True, group=layer.group,
                             workspace=layer.fitting(layer.ws_ag, x.dtype))
        ctx.save_for_backward(gathered, w)
        ctx.layer = layer
        return y

    @staticmethod
    def backward(ctx, dy):
        gathered, w = ctx.saved_tensors
        dy = dy.contiguous()
        layer = ctx.layer
        return gemm_rs(dy, w.t(), group=layer.group, workspace=layer.fitting(layer.ws_rs, dy.dtype)), gathered.t() @ dy, None


class _RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, layer):
        ctx.save_for_backward(x, w)
        ctx.layer = layer
        return gemm_rs(x.contiguous(), w, group=layer.group, workspace=layer.fitting(layer.ws_rs, x.dtype))

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        layer = ctx.layer
        dx, dy_full = ag_gemm(dy.contiguous(), w.t(), return_gathered=True, group=layer.group,
                              workspace=layer.fitting(layer.ws_ag, dy.dtype))
        return dx, x.t() @ dy_full, None


def _autocast(x: torch.Tensor, w: torch.Tensor):
    """x, w in the autocast dtype when autocast is on for x's device (the kernels need one dtype)."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        return x.to(dtype), w.to(dtype)
    return x, w


class _ParallelLinear(nn.Module):
    SPLIT_DIM = 0  # which dimension of the [in, out] weight is split over the ranks

    def __init__(self, in_features: int, out_features: int, bias: bool, split_dim: int, dtype, device, group,
                 max_tokens, workspaces):
        super().__init__()
        name = type(self).__name__
        for arg, v in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}: {arg} must be a positive int, got {v!r}")
        team = team_of(group, name)
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
        # Column: forward gathers x [s/W, in], backward reduces dx [s/W, in]; Row: forward reduces y [s/W, out],
        # backward gathers dy [s/W, out]
        cols = in_features if split_dim == 1 else out_features
        if workspaces is not None:
            if not isinstance(workspaces, TensorParallelWorkspaces) or workspaces.cols != cols or \
                    team_of(workspaces.group, name).ranks != team.ranks:
                raise ValueError(f"{name}: workspaces must be TensorParallelWorkspaces of {cols} columns over this "
                                 f"layer's group, got {workspaces!r}")
            if max_tokens is not None:
                raise ValueError(f"{name}: pass max_tokens or workspaces, not both")
        elif max_tokens is not None:  # (TensorParallelWorkspaces checks it)
            workspaces = TensorParallelWorkspaces(cols, dtype or torch.get_default_dtype(), max_tokens, group)
        self.workspaces = workspaces

    @property
    def ws_ag(self):
        return self.workspaces.ag if self.workspaces is not None else None

    @property
    def ws_rs(self):
        return self.workspaces.rs if self.workspaces is not None else None

    def follow_parameter_dtype(self) -> None:
        """Re-make the workspaces in the weight's dtype if it changed (collective, see the module docstring):
        `.to(dtype)` calls it; so does tilecomm.moe's cast_parameters, which sets `param.data`."""
        if self.workspaces is not None:
            self.workspaces.to(self.weight.dtype)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.follow_parameter_dtype()
        return self

    @staticmethod
    def fitting(ws, dtype):
        """ws when it was made for GEMMs in `dtype`, else None (the op makes a temporary one)."""
        return ws if ws is not None and ws.dtype == dtype else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, max_tokens=None, workspaces=None):
        """This rank's shard of a single-device nn.Linear (weight [out, in]), contiguous blocks."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype,
                    linear.weight.device, group=group, max_tokens=max_tokens, workspaces=workspaces)
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

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=None, device=None, group=None,
                 max_tokens=None, workspaces=None):
        super().__init__(in_features, out_features, bias, 1, dtype, device, group, max_tokens, workspaces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ColumnParallel.apply(*_autocast(x, self.weight), self)
        return y + self.bias.to(y.dtype) if self.bias is not None else y


class RowParallelLinear(_ParallelLinear):
    """x [s, in/W] (all tokens, this rank's input columns) -> y [s/W, out] (this rank's sequence shard).
    weight [in/W, out] is sharded; bias [out] is replicated (its gradient is this rank's tokens' share)."""

    SPLIT_DIM = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=None, device=None, group=None,
                 max_tokens=None, workspaces=None):
        super().__init__(in_features, out_features, bias, 0, dtype, device, group, max_tokens, workspaces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _RowParallel.apply(*_autocast(x, self.weight), self)
        return y + self.bias.to(y.dtype) if self.bias is not None else y
