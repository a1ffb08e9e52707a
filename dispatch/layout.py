"""Routing layout: from `topk_idx` to who sends what where, in one device kernel.

    topk_idx: [T, K] int, expert id per (token, slot), -1 = no expert. Experts are split evenly:
    rank r owns experts r*E_local ... (r+1)*E_local - 1.

Worked example (W=2, E=4, E_local=2, K=2):

    topk_idx = [[0, 3], [1, -1], [2, 3]]      tokens 0, 1, 2
    is_token_in_rank = [[1, 1], [1, 0], [0, 1]]
    num_tokens_per_rank = [2, 2]              a token counts once per rank, not once per expert
    num_tokens_per_expert = [1, 1, 1, 2]
    send_slot = [[0, 0], [1, -1], [-1, 1]]    t's index among the tokens sent to that rank

One program walks the tokens in blocks with running per-rank counts, so `send_slot` is a prefix sum
without a second pass; the send buffer row is `send_slot[t, r] + sum(num_tokens_per_rank[:r])`. `layout_reference` is the same in plain torch (the tests compare them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

import tilecomm
from tilecomm.jit import next_pow2


@dataclass
class Layout:
    """is_token_in_rank: [T, W] bool; send_slot: [T, W] int64, t's index among tokens sent to rank r (-1 = not sent);
    num_tokens_per_rank: [W] int64; num_tokens_per_expert: [E] int64 (global expert ids)."""

    is_token_in_rank: torch.Tensor
    send_slot: torch.Tensor
    num_tokens_per_rank: torch.Tensor
    num_tokens_per_expert: torch.Tensor


@tilecomm.jit
def _layout_kernel(topk_ptr, in_rank_ptr, send_slot_ptr, per_rank_ptr, per_expert_ptr, T, K, E_LOCAL, W,
                   BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr):
    ranks = tl.arange(0, BLOCK_W)
    slots = tl.arange(0, BLOCK_K)
    rank_ok = ranks < W
    carry = tl.zeros((BLOCK_W,), tl.int64)  # tokens already assigned to each rank
    for start in range(0, T, BLOCK_T):
        tok = start + tl.arange(0, BLOCK_T)
        tok_ok = tok < T
        pair_ok = tok_ok[:, None] & (slots[None, :] < K)
        idx = tl.load(topk_ptr + tok[:, None].to(tl.int64) * K + slots[None, :], mask=pair_ok, other=-1).to(tl.int64)
        valid = idx >= 0
        tl.atomic_add(per_expert_ptr + tl.where(valid, idx, 0), tl.where(valid, 1, 0).to(tl.int64), mask=valid)
        owner = tl.where(valid, idx // E_LOCAL, -1)
        # [BLOCK_T, BLOCK_W]: does token t have any slot on rank r
        hit = tl.max((owner[:, :, None] == ranks[None, None, :]).to(tl.int32), axis=1)
        hit = tl.where(tok_ok[:, None] & rank_ok[None, :], hit, 0)
        pos = carry[None, :] + tl.cumsum(hit, axis=0).to(tl.int64) - hit
        out_ok = tok_ok[:, None] & rank_ok[None, :]
        offs = tok[:, None].to(tl.int64) * W + ranks[None, :]
        tl.store(in_rank_ptr + offs, hit.to(tl.int8), mask=out_ok)
        tl.store(send_slot_ptr + offs, tl.where(hit > 0, pos, -1), mask=out_ok)
        carry += tl.sum(hit, axis=0).to(tl.int64)
    tl.store(per_rank_ptr + ranks, carry, mask=rank_ok)


def _check_topk(topk_idx: torch.Tensor, num_experts: int, world: int) -> None:
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be a [num_tokens, num_topk] tensor, got {getattr(topk_idx, 'shape', type(topk_idx))}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
    if num_experts % world:
        raise ValueError(f"num_experts={num_experts} must divide by the number of ranks ({world})")


def compute_layout(topk_idx: torch.Tensor, num_experts: int, world: int) -> Layout:
    """The layout of module docstring, computed by one Triton program (no host sync)."""
    _check_topk(topk_idx, num_experts, world)
    topk_idx = topk_idx.contiguous()
    T, K = topk_idx.shape
    dev = topk_idx.device
    in_rank = torch.empty((T, world), dtype=torch.int8, device=dev)
    send_slot = torch.empty((T, world), dtype=torch.int64, device=dev)
    per_rank = torch.empty(world, dtype=torch.int64, device=dev)
    per_expert = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    _layout_kernel[(1,)](topk_idx, in_rank, send_slot, per_rank, per_expert, T, K, num_experts // world, world,
                         BLOCK_T=64, BLOCK_K=next_pow2(max(K, 1)),
                         BLOCK_W=next_pow2(world))
    return Layout(in_rank.bool(), send_slot, per_rank, per_expert)


def layout_reference(topk_idx: torch.Tensor, num_experts: int, world: int) -> Layout:
    """Plain-torch `compute_layout`."""
    _check_topk(topk_idx, num_experts, world)
    idx = topk_idx.long()
    valid = idx >= 0
    owner = torch.where(valid, idx // (num_experts // world), -1)
    in_rank = (owner[:, :, None] == torch.arange(world, device=idx.device)).any(dim=1)
    per_rank = in_rank.sum(0)
    slot = torch.cumsum(in_rank.long(), 0) - in_rank.long()
    send_slot = torch.where(in_rank, slot, -1)
    per_expert = torch.bincount(idx[valid], minlength=num_experts)
    return Layout(in_rank, send_slot, per_rank, per_expert)
