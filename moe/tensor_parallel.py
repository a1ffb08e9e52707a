"""Tensor parallelism with sequence parallelism for the transformer (applied after the model is built).

T ranks of a TP group share each attention and dense-MLP block; between blocks every rank holds
its 1/T slice of the flattened tokens (`sequence_shard`): rank t holds rows t*N ... (t+1)*N - 1
of the (B*S) tokens, N = B*S/T, as a 2-D [N, H] tensor. Megatron's pattern, one all-gather in
front of and one reduce-scatter behind each block, both fused into the GEMMs (tilecomm.overlap):

    attention  qkv  ColumnParallelLinear [N, H] -> [B*S, 3H/T]   rank t: heads t*nh/T ... (q, k, v each)
               SDPA on the local heads, full sequences (K/V all-gathered over CP as without TP)
               proj RowParallelLinear    [B*S, H/T] -> [N, H]
    dense MLP  gate_up Column [N, H] -> [B*S, 2F/T] (rank t: gate and up columns t*F/T ...)
               down    Row    [B*S, F/T] -> [N, H]

Embedding, norms, the LM head and MoE routers stay replicated and run on the rank's slice only.
`apply_tensor_parallel` shards a model built for one rank, so TP and non-TP models built from the
same seed start from the same weights (it briefly holds the full dense weights on every rank).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tilecomm.overlap import ColumnParallelLinear, RowParallelLinear, TensorParallelWorkspaces


def tp_rank_and_size(tp_group) -> tuple:
    """(rank in the TP group, its size); (0, 1) for None."""
    if tp_group is None:
        return 0, 1
    if not isinstance(tp_group, dist.ProcessGroup) or dist.get_rank(tp_group) < 0:
        raise ValueError(f"tensor parallel: tp_group must be None or a torch.distributed ProcessGroup containing "
                         f"this rank, got {tp_group!r}")
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def sequence_shard(t: torch.Tensor, tp_rank: int, tp_size: int, name: str = "tokens") -> torch.Tensor:
    """This TP rank's rows of t [B*S, ...] (the flattened tokens): [B*S/T, ...]."""
    if t.shape[0] % tp_size:
        raise ValueError(f"tensor parallel: {name} hold {t.shape[0]} tokens (batch x sequence on this rank), which "
                         f"must divide by the tensor-parallel size {tp_size} (sequence parallelism splits them)")
    n = t.shape[0] // tp_size
    return t[tp_rank * n:(tp_rank + 1) * n]


def qkv_rows(num_heads: int, head_dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Indices of the fused qkv projection's output features [3 * nh * hd] (q heads, k heads, v heads)
    that rank tp_rank owns: q, k and v of heads tp_rank*nh/T ... in that order."""
    local = num_heads // tp_size
    grid = torch.arange(3 * num_heads * head_dim).view(3, num_heads, head_dim)
    return grid[:, tp_rank * local:(tp_rank + 1) * local].reshape(-1)


def halves_rows(features: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Indices of a fused [gate | up] output of 2F features owned by tp_rank: its F/T of each half."""
    local = features // tp_size
    grid = torch.arange(2 * features).view(2, features)
    return grid[:, tp_rank * local:(tp_rank + 1) * local].reshape(-1)


def _column(linear: nn.Linear, rows: torch.Tensor, group, workspaces) -> ColumnParallelLinear:
    """A ColumnParallelLinear holding output features `rows` of a full nn.Linear (weight [out, in])."""
    layer = ColumnParallelLinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                 dtype=linear.weight.dtype, device=linear.weight.device, group=group,
                                 workspaces=workspaces)
    with torch.no_grad():
        layer.weight.copy_(linear.weight[rows].t())
        if linear.bias is not None:
            layer.bias.copy_(linear.bias[rows])
    return layer


def apply_tensor_parallel(blocks: nn.ModuleList, num_heads: int, head_dim: int, tp_group,
                          workspaces: TensorParallelWorkspaces) -> None:
    """Swap each block's attention qkv/proj (and dense MLP gate_up/down) nn.Linear for this rank's
    Column/Row shards over tp_group, in place, all on one set of `workspaces` (each gathers and reduces
    [N, hidden] rows: the set's columns). MoE MLPs (no gate_up) are left as they are."""
    rank, size = tp_rank_and_size(tp_group)
    for block in blocks:
        attn = block.attn
        attn.qkv = _column(attn.qkv, qkv_rows(num_heads, head_dim, rank, size), tp_group, workspaces)
        attn.proj = RowParallelLinear.from_linear(attn.proj, group=tp_group, workspaces=workspaces)
        mlp = block.mlp
        if isinstance(getattr(mlp, "gate_up", None), nn.Linear):
            ffn = mlp.down.in_features
            mlp.gate_up = _column(mlp.gate_up, halves_rows(ffn, rank, size), tp_group, workspaces)
            mlp.down = RowParallelLinear.from_linear(mlp.down, group=tp_group, workspaces=workspaces)
