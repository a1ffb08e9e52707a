"""A small decoder-only transformer with MoE blocks: RMSNorm, RoPE, SDPA attention, SwiGLU MLPs.

Model math only: the MoE block gets its layer from `moe_layer(layer_index)` (see moe/layer.py), so
how tokens reach experts (one process, or expert parallel over tilecomm/NCCL) is decided outside.

    tokens [B, S] int64 -> logits [B, S, V], aux_loss (sum of the MoE layers' router losses)

Parallelism is applied afterwards by `tilecomm.moe.parallelize` (moe/parallelize.py): context
parallelism (each of the C ranks of a group holds S/C consecutive positions of every sequence;
attention all-gathers K and V inside the group, autograd-aware, and masks causally by global
position) and tensor parallelism with sequence parallelism (tensor_parallel.py: attention heads and
the dense MLP's width split over T ranks; between blocks each rank holds its 1/T slice of the
flattened (B, S) tokens as x [N, H], N = B*S/T, and the model returns logits [N, V] for that slice).
MoE layers then get the rank's slice: as [N/S, S, H] when it holds whole sequences (T divides B),
else as [N, H]. Their aux losses are computed per slice: the z-loss (a token mean) and the
sequence-level aux loss (a mean over sequences, whole sequences per rank) averaged over the TP ranks
equal the T = 1 values; the Switch aux loss (E * sum_e f_e * P_e, a product of two token means)
does not: per slice it balances each rank's tokens (Megatron all-reduces f_e over TP instead). The
sequence-level aux loss needs T to divide B (else the router raises: it gets no seq_len).

Precision: the model computes in its parameters' dtype (the Trainer casts them to bf16 on GPUs and
keeps fp32 masters in the optimizer; see moe/optim.py); norms, RoPE, the loss and the router work
in fp32 inside. The memory-bound steps are fused ops (moe/ops/: RMSNorm, RoPE on the fused qkv,
SwiGLU, LM head + cross-entropy in row chunks): Triton kernels on GPUs, the torch reference
elsewhere and under torch.compile (`compile_blocks`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .ops.cross_entropy import linear_cross_entropy
from .ops.rms_norm import rms_norm
from .ops.rope import rope_qkv
from .ops.swiglu import swiglu
from .tensor_parallel import sequence_shard


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    ffn_hidden: int          # dense MLP width (dense-prefix layers)
    num_dense_layers: int = 1  # the first layers use a dense MLP, the rest MoE
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    recompute: bool = False  # activation recompute per block

    def __post_init__(self):
        if self.hidden % self.num_heads:
            raise ValueError(f"ModelConfig: hidden={self.hidden} must divide by num_heads={self.num_heads}")
        if (self.hidden // self.num_heads) % 2:
            raise ValueError("ModelConfig: the head dimension (hidden / num_heads) must be even for RoPE")
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ValueError(f"ModelConfig: num_dense_layers={self.num_dense_layers} must be in [0, num_layers]")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_tables(seq_len: int, head_dim: int, theta: float):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)  # (S, D/2)
    return angles.cos(), angles.sin()


class _GatherSequence(torch.autograd.Function):
    """(..., S_local, D) from every rank of the CP group -> (..., C * S_local, D), in rank order.
    Backward: this rank's chunk of the gradient summed over the group. (torch.distributed.nn's
    all_gather backward treats group ranks as global ones on gloo, which breaks groups like [1, 3].)"""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous()
        dist.all_reduce(total, group=ctx.group)  # gloo has no reduce-scatter; NCCL would move 1/C of this
        return total.chunk(dist.get_world_size(ctx.group), dim=-2)[dist.get_rank(ctx.group)].contiguous(), None


def _gather_sequence(t, group):
    return _GatherSequence.apply(t, group)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.nh, self.hd = cfg.num_heads, cfg.hidden // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.cp_group = None  # set by parallelize(cp_group=...)

    def forward(self, x, cos, sin, offset: int = 0, seq_shape=None):
        """x (B, S, H) -> (B, S, H); tensor parallel: x [N, H] (this rank's tokens, seq_shape = (B, S))
        -> [N, H], attending with this rank's heads over all B*S tokens."""
        B, S = seq_shape or x.shape[:2]
        qkv = self.qkv(x)  # (B, S, 3H), or [B*S, 3H/T] under TP
        nh = qkv.shape[-1] // (3 * self.hd)  # heads on this rank
        q, k, v = rope_qkv(qkv.view(B, S, 3, nh, self.hd), cos, sin, offset)  # each (B, nh, S, D)
        if self.cp_group is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # one collective for K and V together: separate ones could pair up in a different order on
            # different ranks during backward (same shapes, so silently wrong)
            k, v = _gather_sequence(torch.stack((k, v)), self.cp_group).unbind(0)
            q_pos = torch.arange(offset, offset + S, device=x.device)
            mask = q_pos[:, None] >= torch.arange(k.shape[2], device=x.device)[None, :]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(B, S, nh * self.hd)
        return self.proj(y if seq_shape is None else y.reshape(B * S, -1))


class DenseMLP(nn.Module):
    """x (..., H) -> (y like x, 0); tensor parallel: x [N, H] (this rank's tokens) -> [N, H]."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * ffn_hidden, bias=False)
        self.down = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x):
        return self.down(swiglu(self.gate_up(x))), x.new_zeros(())


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: nn.Module):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(cfg.hidden), RMSNorm(cfg.hidden)
        self.attn, self.mlp = Attention(cfg), mlp

    def forward(self, x, cos, sin, offset: int = 0, seq_shape=None):
        """x (B, S, H); tensor parallel: x [N, H], this rank's tokens of seq_shape = (B, S)."""
        x = x + self.attn(self.norm1(x), cos, sin, offset, seq_shape)
        h = self.norm2(x)
        S = None if seq_shape is None else seq_shape[1]
        if S is not None and not isinstance(self.mlp, DenseMLP) and h.shape[0] % S == 0:
            h = h.view(h.shape[0] // S, S, h.shape[1])  # whole sequences: the router sees them as such
        y, aux = self.mlp(h)
        return x + y.view_as(x), aux


class Transformer(nn.Module):
    """moe_layer(i) -> a module mapping x (B, S, H) (or [N, H], see the module docstring) to (y, aux_loss),
    for layers i >= num_dense_layers. Built for one rank; `parallelize` splits it afterwards."""

    def __init__(self, cfg: ModelConfig, moe_layer: Optional[Callable[[int], nn.Module]] = None):
        super().__init__()
        self.cfg = cfg
        self.cp_group = self.tp_group = None  # set by parallelize
        self.tp_rank, self.tp_size = 0, 1
        self.tp_workspaces = None  # set by parallelize: the TP layers' shared workspaces
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        mlps = [DenseMLP(cfg.hidden, cfg.ffn_hidden) if i < cfg.num_dense_layers or moe_layer is None else moe_layer(i)
                for i in range(cfg.num_layers)]
        self.blocks = nn.ModuleList(Block(cfg, m) for m in mlps)
        self.norm = RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.max_seq_len, cfg.hidden // cfg.num_heads, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # GPT-2 style init, residual projections scaled down; drawn from the CPU generator whatever device a
        # parameter is on (an MoE layer with a GPU dispatcher builds its router on the GPU), so the model is the
        # same on CPU and GPU ranks and with any dispatcher
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2 and "experts" not in name:
                    std = 0.02 / math.sqrt(2 * cfg.num_layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                    p.copy_(torch.empty(p.shape, dtype=p.dtype).normal_(0.0, std))

    def sequence_shard(self, t: torch.Tensor, name: str = "tokens") -> torch.Tensor:
        """This rank's rows of t [B*S, ...] under tensor parallelism (t itself without it)."""
        return t if self.tp_group is None else sequence_shard(t, self.tp_rank, self.tp_size, name)

    def forward(self, tokens, targets=None):
        """tokens [B, S] int64 -> (logits, aux_loss); logits [B, S, V], or [B*S/T, V] for this rank's
        token slice under tensor parallelism. With targets ([B*S] int64, or this rank's [B*S/T] slice
        under TP): (mean cross-entropy over this rank's tokens, aux_loss), the logits never materialised."""
        offset, total = 0, tokens.shape[1]
        if self.cp_group is not None:
            offset = dist.get_rank(self.cp_group) * tokens.shape[1]
            total = dist.get_world_size(self.cp_group) * tokens.shape[1]
        if total > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {total} > max_seq_len={self.cfg.max_seq_len}")
        seq_shape = None
        if self.tp_group is None:
            x = self.embed(tokens)
        else:
            seq_shape = tuple(tokens.shape)
            x = self.embed(self.sequence_shard(tokens.reshape(-1)))  # [N, H]
        aux = torch.zeros((), dtype=torch.float32, device=x.device)
        for block in self.blocks:
            if self.cfg.recompute and self.training:
                x, a = checkpoint(block, x, self.cos, self.sin, offset, seq_shape, use_reentrant=False)
            else:
                x, a = block(x, self.cos, self.sin, offset, seq_shape)
            aux = aux + a.float()
        h = self.norm(x)
        if targets is None:
            return self.head(h), aux
        h = h.reshape(-1, h.shape[-1])
        if targets.shape != (h.shape[0],):
            raise ValueError(f"Transformer: targets must be [{h.shape[0]}] (this rank's tokens, flattened), got "
                             f"{tuple(targets.shape)}")
        return linear_cross_entropy(h, self.head.weight, targets), aux


def compile_blocks(model: Transformer, **options) -> Transformer:
    """torch.compile each block in place (state-dict names unchanged); repeated blocks share one
    compiled graph. Dispatchers other than the local one stay outside the graphs (moe/layer.py)."""
    from .experts import GroupedSwiGLUExperts

    for m in model.modules():  # decide grouped vs loop GEMMs eagerly, before tracing
        if isinstance(m, GroupedSwiGLUExperts):
            m.use_grouped()
    for block in model.blocks:
        block.compile(**options)
    return model
