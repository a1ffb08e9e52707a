"""Apply parallelism to a model built for one rank, and record what each parameter is.

    model = parallelize(Transformer(cfg, moe_layer=...), tp_group=groups.tp, cp_group=groups.cp,
                        max_tokens=batch_size * seq_len // cp)
    model.param_roles["blocks.0.attn.qkv.weight"]    # "tensor_parallel"

One step after construction, in a fixed order: context parallelism (attention all-gathers K/V over
cp_group), then tensor parallelism with sequence parallelism (tensor_parallel.py swaps attention and
dense-MLP linears for this rank's shards, cut from the full weights so TP and non-TP models built
from the same seed agree). Every TP linear gathers and reduces [tokens / TP, hidden] rows, so they share
one set of symmetric workspaces (`model.tp_workspaces`, tilecomm.overlap.TensorParallelWorkspaces) made
here for `max_tokens` (batch x sequence tokens of one forward on this rank, after context parallelism);
`model.to(dtype)` re-makes the set in the new dtype. Expert parallelism is not applied here: it is the MoE
layers' dispatcher.

Parameter roles decide how the Trainer reduces gradients, sums norms and names checkpoint entries;
they come from the modules that hold the parameters, recorded here (`model.param_roles`):
  "expert"           this rank's experts (GroupedSwiGLUExperts): gradients over the expert-data-parallel
                     group, norm squares summed over the EP group, checkpoint key name@ep<rank>
  "tensor_parallel"  TP shards (tilecomm.overlap's Column/RowParallelLinear): gradients over the
                     data-parallel group, norm squares summed over the TP group, key name@tp<rank>
  "replicated"       everything else: gradients over the data-parallel and TP groups
"""
from __future__ import annotations

from typing import Dict

import torch.distributed as dist
from torch import nn

from .experts import GroupedSwiGLUExperts
from .tensor_parallel import TensorParallelWorkspaces, apply_tensor_parallel, tp_rank_and_size

EXPERT, TENSOR_PARALLEL, REPLICATED = "expert", "tensor_parallel", "replicated"
ROLES = (REPLICATED, TENSOR_PARALLEL, EXPERT)


def _is_tp_module(module: nn.Module) -> bool:
    from tilecomm.overlap import ColumnParallelLinear, RowParallelLinear

    return isinstance(module, (ColumnParallelLinear, RowParallelLinear))


def param_roles(model: nn.Module) -> Dict[str, str]:
    """{parameter name: role} from the modules holding the parameters (see the module docstring)."""
    roles: Dict[str, str] = {}
    for prefix, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            if isinstance(module, GroupedSwiGLUExperts):
                role = EXPERT
            elif _is_tp_module(module):
                role = TENSOR_PARALLEL
            else:
                role = REPLICATED
            roles[f"{prefix}.{name}" if prefix else name] = role
    return roles


def roles_of(model: nn.Module) -> Dict[str, str]:
    """The roles `parallelize` recorded, or those of a model it never saw (one rank's plain model)."""
    recorded = getattr(model, "param_roles", None)
    return recorded if recorded is not None else param_roles(model)


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def parallelize(model: nn.Module, *, tp_group=None, cp_group=None, max_tokens=None) -> nn.Module:
    """Apply context and tensor parallelism to `model` (a Transformer) in place; returns it. Groups of
    one rank (or None) leave that dimension off. max_tokens (needed with a tp_group of several ranks): the
    most tokens (batch x sequence, after context parallelism) one forward on this rank sees; the TP
    layers' shared workspaces are made for it here (collective over the world). Call once, before the
    optimizer is made."""
    if getattr(model, "param_roles", None) is not None:
        raise ValueError("parallelize: this model was already parallelized")
    cfg = model.cfg
    tp_rank, tp_size = tp_rank_and_size(tp_group)
    if cp_group is not None and not isinstance(cp_group, dist.ProcessGroup):
        raise ValueError(f"parallelize: cp_group must be None or a torch.distributed ProcessGroup, got {cp_group!r}")
    if tp_size > 1:
        for name, value in (("num_heads", cfg.num_heads), ("ffn_hidden", cfg.ffn_hidden)):
            if value % tp_size:
                raise ValueError(f"parallelize: ModelConfig.{name}={value} must divide by the tensor-parallel size "
                                 f"{tp_size} (tp_group)")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0 or max_tokens % tp_size:
            raise ValueError(f"parallelize: max_tokens must be a positive multiple of the tensor-parallel size "
                             f"{tp_size} (the batch x sequence tokens of one forward on this rank, after context "
                             f"parallelism: the TP layers' workspaces are made for them), got {max_tokens!r}")
    if _group_size(cp_group) > 1:
        model.cp_group = cp_group
        for block in model.blocks:
            block.attn.cp_group = cp_group
    if tp_size > 1:  # after init: the shards are cut from the weights a T = 1 model gets
        dtype = next(model.parameters()).dtype
        model.tp_workspaces = TensorParallelWorkspaces(cfg.hidden, dtype, max_tokens, tp_group)
        apply_tensor_parallel(model.blocks, cfg.num_heads, cfg.hidden // cfg.num_heads, tp_group, model.tp_workspaces)
        model.tp_group, model.tp_rank, model.tp_size = tp_group, tp_rank, tp_size
    model.param_roles = param_roles(model)
    return model
