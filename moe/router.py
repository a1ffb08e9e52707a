"""Top-k router: a linear gate (fp32, no bias), scores, optional group limit, load-balancing losses,
aux-loss-free expert bias and capacity dropping. Pure model math: nothing here communicates.

    router = Router(RouterConfig(num_experts=8, topk=2, aux_loss_coeff=1e-2), hidden=64)
    out = router(x)                 # x [T, H] -> RouterOutput
    out.topk_idx [T, K] int64 (-1 = dropped by capacity), out.topk_weights [T, K] float32,
    out.aux_loss (scalar, sum of the enabled losses), out.tokens_per_expert [E] int64 (after dropping)

Scores s [T, E]: softmax(logits) or sigmoid(logits). Selection uses s + expert_bias (the bias only
picks; it never scales). With num_groups/group_topk the experts are split into num_groups contiguous
groups, a group's score is the sum of its top-2 selection scores (DeepSeek-V3), and top-k runs inside
the group_topk best groups. Weights are s at the chosen experts; with pre_softmax=False they are then
renormalised to sum to 1 per token (for softmax that is the softmax over the top-k logits), with
pre_softmax=True they are the scores normalised before top-k (softmax over all E; raw sigmoid).
Finally they are multiplied by scaling_factor.

Losses (each times its coeff, all computed on this call's tokens, fp32):
  aux (Switch/GShard):  E * sum_e f_e * P_e, f_e = selections of e / (T*K) (before capacity dropping),
                        P_e = mean over tokens of p[t, e], p = the scores normalised over the E experts
  seq_aux (DeepSeek-V3): the same per sequence of seq_len tokens, averaged over the sequences
  z (ST-MoE):           mean_t logsumexp(logits[t])^2
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    num_experts: int
    topk: int
    score: str = "softmax"  # "softmax" | "sigmoid"
    pre_softmax: bool = False  # True: normalise before top-k (no renormalisation); False: after
    scaling_factor: float = 1.0  # weights *= this (DeepSeek-V3's routed_scaling_factor)
    num_groups: Optional[int] = None  # group-limited top-k: experts split into num_groups groups ...
    group_topk: Optional[int] = None  # ... of which the best group_topk may be chosen from
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0  # needs forward(..., seq_len=S)
    z_loss_coeff: float = 0.0
    expert_bias: bool = False  # aux-loss-free balancing (non-gradient selection bias)
    bias_update_rate: float = 1e-3
    capacity_factor: Optional[float] = None  # None = dropless
    drop_policy: str = "probs"  # "probs": keep the highest weights per expert; "position": earliest tokens

    def __post_init__(self):
        E, K = self.num_experts, self.topk
        if not (isinstance(E, int) and isinstance(K, int) and 1 <= K <= E):
            raise ValueError(f"RouterConfig: need ints 1 <= topk ({K}) <= num_experts ({E})")
        if self.score not in ("softmax", "sigmoid"):
            raise ValueError(f"RouterConfig: score={self.score!r}; expected 'softmax' or 'sigmoid'")
        if self.drop_policy not in ("probs", "position"):
            raise ValueError(f"RouterConfig: drop_policy={self.drop_policy!r}; expected 'probs' or 'position'")
        if (self.num_groups is None) != (self.group_topk is None):
            raise ValueError("RouterConfig: set both num_groups and group_topk, or neither")
        if self.num_groups is not None:
            G, g = self.num_groups, self.group_topk
            if E % G or not 1 <= g <= G or g * (E // G) < K:
                raise ValueError(f"RouterConfig: num_groups={G} must divide num_experts={E}, "
                                 f"1 <= group_topk={g} <= num_groups and group_topk * E/num_groups >= topk")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"RouterConfig: capacity_factor={self.capacity_factor}; expected > 0 or None")


@dataclass
class RouterOutput:
    topk_idx: torch.Tensor  # [T, K] int64, -1 where capacity dropped the pair
    topk_weights: torch.Tensor  # [T, K] float32, 0 where dropped (differentiable)
    aux_loss: torch.Tensor  # scalar float32, sum of the enabled losses (differentiable)
    tokens_per_expert: torch.Tensor  # [E] int64, pairs kept per expert
    logits: Optional[torch.Tensor] = None  # [T, E] float32


def count_per_expert(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64 pairs per expert (-1 ignored), without a host sync (unlike torch.bincount on CUDA)."""
    idx = topk_idx.reshape(-1)
    idx = torch.where(idx >= 0, idx, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=idx.device)
    return counts.scatter_add_(0, idx, torch.ones_like(idx))[:num_experts]


def group_limited_topk(sel: torch.Tensor, k: int, num_groups: int, group_topk: int) -> torch.Tensor:
    """sel [T, E] selection scores -> [T, k] expert ids, chosen only inside the group_topk groups
    with the largest sum of their top-2 scores (ties: lower index first, as torch.topk)."""
    T, E = sel.shape
    grouped = sel.view(T, num_groups, E // num_groups)
    group_score = grouped.topk(min(2, E // num_groups), dim=-1).values.sum(-1)  # [T, G]
    chosen = group_score.topk(group_topk, dim=-1).indices
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, chosen, True)
    masked = sel.masked_fill(~keep.repeat_interleave(E // num_groups, dim=1), float("-inf"))
    return masked.topk(k, dim=-1).indices


def capacity_mask(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, capacity: int,
                  policy: str) -> torch.Tensor:
    """[T, K] bool: which pairs fit their expert's capacity. "probs" keeps the highest weights (ties:
    earlier token), "position" the earliest tokens."""
    T, K = topk_idx.shape
    routed = torch.zeros(T, num_experts, dtype=torch.bool, device=topk_idx.device)
    routed.scatter_(1, topk_idx, True)
    if policy == "position":
        rank = routed.long().cumsum(0) - 1  # [T, E] position of each token in its expert's queue
    else:
        dense = torch.full((T, num_experts), float("-inf"), device=topk_idx.device)
        dense.scatter_(1, topk_idx, topk_weights.detach().float())
        order = torch.sort(dense, dim=0, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(T, device=order.device)[:, None].expand_as(order))
    keep = routed & (rank < capacity)
    return keep.gather(1, topk_idx)


class Router(nn.Module):
    """Linear gate [E, H] (fp32) + the routing of RouterConfig. Buffers: expert_bias [E] (when enabled)
    and tokens_since_update [E] (kept-pair counts accumulated by training forwards). The gate stays
    fp32 when a model is cast to a lower compute dtype (keep_fp32_params, see moe/optim.py)."""

    keep_fp32_params = True

    def __init__(self, config: RouterConfig, hidden: int, device=None, generator: Optional[torch.Generator] = None,
                 init_std: float = 0.02):
        super().__init__()
        self.config, self.hidden = config, hidden
        E = config.num_experts
        w = torch.randn(E, hidden, generator=generator) * init_std
        self.weight = nn.Parameter(w.to(device=device, dtype=torch.float32))
        self.register_buffer("expert_bias", torch.zeros(E, device=device) if config.expert_bias else None)
        self.register_buffer("tokens_since_update", torch.zeros(E, dtype=torch.int64, device=device),
                             persistent=False)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, -1) if self.config.score == "softmax" else torch.sigmoid(logits)

    def forward(self, x: torch.Tensor, seq_len: Optional[int] = None) -> RouterOutput:
        """x [T, H] (any float dtype) -> RouterOutput. seq_len: tokens per sequence (x is
        [T / seq_len sequences, seq_len] flattened); needed by the sequence-level aux loss."""
        c, E, K = self.config, self.config.num_experts, self.config.topk
        T = x.shape[0]
        logits = x.float() @ self.weight.t()  # [T, E] fp32
        s = self.scores(logits)
        with torch.no_grad():
            sel = s if self.expert_bias is None else s + self.expert_bias
            if c.num_groups is not None:
                idx = group_limited_topk(sel, K, c.num_groups, c.group_topk)
            else:
                idx = sel.topk(K, dim=-1).indices
        w = s.gather(1, idx)
        if not c.pre_softmax:
            w = w / w.sum(-1, keepdim=True).clamp_min(1e-20)
        w = w * c.scaling_factor
        selected = count_per_expert(idx, E)
        aux = self._losses(logits, s, idx, selected, T, seq_len)
        if c.capacity_factor is not None and T:
            keep = capacity_mask(idx, w, E, math.ceil(c.capacity_factor * T * K / E), c.drop_policy)
            idx = torch.where(keep, idx, -1)
            w = torch.where(keep, w, 0.0)
            counts = count_per_expert(idx, E)
        else:
            counts = selected
        if self.training:
            self.tokens_since_update += counts.detach()
        return RouterOutput(idx, w, aux, counts, logits)

    def _losses(self, logits, s, idx, selected, T, seq_len) -> torch.Tensor:
        c, E, K = self.config, self.config.num_experts, self.config.topk
        aux = logits.new_zeros(())
        if T == 0:
            return aux
        p = s if c.score == "softmax" else s / s.sum(-1, keepdim=True).clamp_min(1e-20)
        if c.aux_loss_coeff:
            f = selected.float() / (T * K)
            aux = aux + c.aux_loss_coeff * E * (f * p.mean(0)).sum()
        if c.seq_aux_loss_coeff:
            if not seq_len or T % seq_len:
                raise ValueError(f"Router: seq_aux_loss needs seq_len dividing the {T} tokens, got {seq_len}")
            B = T // seq_len
            hits = torch.zeros(T, E, device=s.device).scatter_(1, idx, 1.0).view(B, seq_len, E)
            f = hits.sum(1) / (seq_len * K)  # [B, E]
            aux = aux + c.seq_aux_loss_coeff * E * (f * p.view(B, seq_len, E).mean(1)).sum(-1).mean()
        if c.z_loss_coeff:
            aux = aux + c.z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
        return aux

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: Optional[torch.Tensor] = None) -> None:
        """bias += rate * sign(mean count - count): underloaded experts get picked more. Call after the
        optimizer step. tokens_per_expert [E]: defaults to the counts accumulated since the last update
        (under EP, all-reduce them over the ranks first: pass the reduced tensor)."""
        if self.expert_bias is None:
            raise RuntimeError("Router.update_expert_bias: RouterConfig(expert_bias=True) is needed")
        counts = (self.tokens_since_update if tokens_per_expert is None else tokens_per_expert).float()
        self.expert_bias += self.config.bias_update_rate * torch.sign(counts.mean() - counts).to(self.expert_bias.device)
        self.tokens_since_update.zero_()
