"""A small decoder-only transformer with MoE blocks: RMSNorm, RoPE, SDPA attention, SwiGLU MLPs.

Model math only: the MoE block gets its layer from `moe_layer(layer_index)` (see moe/layer.py), so
how tokens reach experts (one process, or expert parallel over tilecomm/NCCL) is decided outside.

    tokens [B, S] int64 -> logits [B, S, V], aux_loss (sum of the MoE layers' router losses)

Context parallelism (`cp_group`): each of the C ranks of the group holds S/C consecutive positions
of every sequence (rank c: positions c*S/C ...); attention all-gathers K and V inside the group
(autograd-aware: the backward sums their gradients over the group) and masks causally by global position.

Tensor parallelism with sequence parallelism (`tp_group` of T > 1 ranks, see tensor_parallel.py):
attention heads and the dense MLP's width are split over the T ranks; between blocks each rank holds
its 1/T slice of the flattened (B, S) tokens as x [N, H], N = B*S/T, and the model returns logits
[N, V] for that slice (`sequence_shard` of the flattened targets matches them). MoE layers get the
rank's slice: as [N/S, S, H] when it holds whole sequences (T divides B), else as [N, H]. Their aux
losses are therefore computed per slice: the z-loss (a token mean) and the sequence-level aux loss
(a mean over sequences, whole sequences per rank) averaged over the TP ranks equal the T = 1 values;
the Switch aux loss (E * sum_e f_e * P_e, a product of two token means) does not: per slice it
balances each rank's tokens (Megatron all-reduces f_e over TP instead). The sequence-level aux loss
needs T to divide B (else the router raises: it gets no seq_len). With tp_group None or of size 1
the model is the plain one (same parameters, names and shapes).
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

from .tensor_parallel import apply_tensor_parallel, sequence_shard, tp_rank_and_size


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
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)  # (S, D/2)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x (B, nh, S, D): rotate pairs (x[2i], x[2i+1]) by position-dependent angles."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[: x.shape[2]].to(x.dtype), sin[: x.shape[2]].to(x.dtype)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


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
    def __init__(self, cfg: ModelConfig, cp_group=None):
        super().__init__()
        self.nh, self.hd = cfg.num_heads, cfg.hidden // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.cp_group = cp_group

    def forward(self, x, cos, sin, offset: int = 0, seq_shape=None):
        """x (B, S, H) -> (B, S, H); tensor parallel: x [N, H] (this rank's tokens, seq_shape = (B, S))
        -> [N, H], attending with this rank's heads over all B*S tokens."""
        B, S = seq_shape or x.shape[:2]
        qkv = self.qkv(x)  # (B, S, 3H), or [B*S, 3H/T] under TP
        nh = qkv.shape[-1] // (3 * self.hd)  # heads on this rank
        q, k, v = qkv.view(B, S, 3, nh, self.hd).permute(2, 0, 3, 1, 4)  # each (B, nh, S, D)
        q, k = apply_rope(q, cos[offset:], sin[offset:]), apply_rope(k, cos[offset:], sin[offset:])
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
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up), x.new_zeros(())


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: nn.Module, cp_group=None):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(cfg.hidden), RMSNorm(cfg.hidden)
        self.attn, self.mlp = Attention(cfg, cp_group), mlp

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
    for layers i >= num_dense_layers. cp_group: context-parallel group; tokens are then this rank's
    chunk. tp_group: tensor-parallel group (sequence parallel); every rank of it gets the same tokens."""

    def __init__(self, cfg: ModelConfig, moe_layer: Optional[Callable[[int], nn.Module]] = None, cp_group=None,
                 tp_group=None):
        super().__init__()
        self.cfg = cfg
        self.cp_group = cp_group
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_group)
        if self.tp_size > 1:
            for name, value in (("num_heads", cfg.num_heads), ("ffn_hidden", cfg.ffn_hidden)):
                if value % self.tp_size:
                    raise ValueError(f"Transformer: ModelConfig.{name}={value} must divide by the tensor-parallel "
                                     f"size {self.tp_size} (tp_group)")
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        mlps = [DenseMLP(cfg.hidden, cfg.ffn_hidden) if i < cfg.num_dense_layers or moe_layer is None else moe_layer(i)
                for i in range(cfg.num_layers)]
        self.blocks = nn.ModuleList(Block(cfg, m, cp_group) for m in mlps)
        self.norm = RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.max_seq_len, cfg.hidden // cfg.num_heads, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for name, p in self.named_parameters():  # GPT-2 style init; residual projections scaled down
            if p.dim() >= 2 and "experts" not in name:
                std = 0.02 / math.sqrt(2 * cfg.num_layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)
        self.tp_group = tp_group if self.tp_size > 1 else None
        if self.tp_group is not None:  # after init: the shards are cut from the weights a T = 1 model gets
            apply_tensor_parallel(self.blocks, cfg.num_heads, cfg.hidden // cfg.num_heads, tp_group)

    def sequence_shard(self, t: torch.Tensor, name: str = "tokens") -> torch.Tensor:
        """This rank's rows of t [B*S, ...] under tensor parallelism (t itself without it)."""
        return t if self.tp_group is None else sequence_shard(t, self.tp_rank, self.tp_size, name)

    def forward(self, tokens):
        """tokens [B, S] int64 -> (logits, aux_loss); logits [B, S, V], or [B*S/T, V] for this rank's
        token slice under tensor parallelism."""
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
        aux = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            if self.cfg.recompute and self.training:
                x, a = checkpoint(block, x, self.cos, self.sin, offset, seq_shape, use_reentrant=False)
            else:
                x, a = block(x, self.cos, self.sin, offset, seq_shape)
            aux = aux + a.float()
        return self.head(self.norm(x)), aux
