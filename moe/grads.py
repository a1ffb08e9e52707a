"""Gradient reduction in flattened buckets, and the global norm for clipping, by parameter role.

The objective is the mean of the W ranks' losses (W = dp(-cp) size x tp size, see trainer.py). Every
gradient is summed over the ranks holding a copy of its parameter (`GradReducer`: one all_reduce per
bucket of up to bucket_bytes, per role and dtype, over the role's groups):
  - "tensor_parallel" shards: over the dp(-cp) group (the TP backward already brought every TP rank's
    tokens' contribution to the shard);
  - "replicated" parameters (norms, embedding, head, routers): over the dp(-cp) group and the TP group
    (each TP rank saw only its slice of the tokens, as Megatron's sequence-parallel norms);
  - "expert" parameters: over the expert-data-parallel group (combine's backward already brought
    every EP rank's tokens' gradients to the expert).
The division by W is not a pass of its own: it is part of the optimizer's gradient scale
(`clip_scale`), together with clipping. The norm counts every distinct value once: squares of TP
shards are summed over the TP group, of experts over the EP group, replicated ones counted locally.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .parallelize import ROLES


def _size(group) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


class GradReducer:
    """named_params: [(name, p)]; roles: {name: role}; groups: {role: [groups to sum over]}."""

    def __init__(self, named_params: Sequence[Tuple[str, nn.Parameter]], roles: Dict[str, str],
                 groups: Dict[str, list], bucket_bytes: int = 64 << 20):
        self.params = [p for _, p in named_params]
        self.buckets: List[Tuple[List[nn.Parameter], list]] = []
        for role in ROLES:
            live = [g for g in groups.get(role, []) if _size(g) > 1]
            if not live:
                continue
            mine = [p for n, p in named_params if roles[n] == role]
            for dtype in sorted({p.dtype for p in mine}, key=str):
                bucket, size = [], 0
                for p in (q for q in mine if q.dtype == dtype):
                    if bucket and size + p.numel() * p.element_size() > bucket_bytes:
                        self.buckets.append((bucket, live))
                        bucket, size = [], 0
                    bucket.append(p)
                    size += p.numel() * p.element_size()
                if bucket:
                    self.buckets.append((bucket, live))

    def reduce(self) -> None:
        """Sum every gradient over its role's groups, in place (p.grad becomes a view of its bucket).
        Under torch.distributed, parameters without a gradient get zeros (every rank takes part)."""
        if dist.is_initialized():
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        for params, groups in self.buckets:
            grads = [p.grad for p in params]
            if len({g.dtype for g in grads}) > 1:
                raise TypeError("GradReducer: one bucket holds gradients of several dtypes "
                                f"({sorted({str(g.dtype) for g in grads})}); make the reducer after casting the parameters")
            flat = torch._utils._flatten_dense_tensors(grads)
            for group in groups:
                dist.all_reduce(flat, group=group)
            for p, g in zip(params, torch._utils._unflatten_dense_tensors(flat, grads)):
                p.grad = g


def _squares(grads: List[torch.Tensor], device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    try:
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)  # one launch for all (torch >= 2.4)
    except (TypeError, RuntimeError):
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
    return torch.stack(norms).square().sum()


def clip_scale(named_params: Sequence[Tuple[str, nn.Parameter]], roles: Dict[str, str], sum_groups: Dict[str, object],
               num_terms: int, max_norm: Optional[float], device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(norm, scale), device scalars: norm of the averaged gradient (summed ones / num_terms), and the
    factor for the summed gradients, 1 / num_terms times the clip factor max_norm / (norm + 1e-6)
    where norm > max_norm. sum_groups: {role: group whose ranks hold different parts of that role}."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for role in ROLES:
        sq = _squares([p.grad for n, p in named_params if roles[n] == role and p.grad is not None], device)
        group = sum_groups.get(role)
        if _size(group) > 1:
            dist.all_reduce(sq, group=group)
        total = total + sq
    norm = total.sqrt() / num_terms
    scale = torch.full((), 1.0 / num_terms, dtype=torch.float32, device=device)
    if max_norm:
        scale = torch.where(norm > max_norm, scale * (max_norm / (norm + 1e-6)), scale)
    return norm, scale
