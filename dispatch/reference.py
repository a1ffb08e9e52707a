"""The torch reference of normal-mode dispatch/combine: backend="nccl", and what the tests compare with.

Plain torch ops and torch.distributed.all_to_all_single on `group` (NCCL on GPUs, gloo on CPU); usable
as a drop-in fallback. Every token crosses to each destination rank once, however many of that rank's
experts it picked, and is expanded to expert-major rows there (local expert, then source rank, then
source token, then k). Combine reduces a token's rows on each expert rank, sends one partial row per
(token, rank) back, and the source sums the partial rows.

Float sums are written as left-to-right loops of a multiply then an add, in float32 (float64 for
float64 data): a token's pairs in k order on each rank (cast to the data's dtype), then the ranks'
partial rows in rank order. The fused kernels (normal.py) do exactly these operations, so both
backends agree bit for bit; `weighted_sum` is that loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from .layout import layout_reference


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 data, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_rows(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """src [N, ...], idx [M] int -> [M, ...]; rows with idx -1 are zero."""
    padded = torch.cat([src, src.new_zeros((1,) + tuple(src.shape[1:]))])
    return padded[torch.where(idx >= 0, idx, src.shape[0])]


def weighted_sum(src: torch.Tensor, idx: torch.Tensor, coef: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """src [N, H], idx [M, J] (-1 = none), coef [M, J] or None (= 1) -> out [M, H]:
    acc = 0; for j: acc = acc + src[idx[:, j]] * coef[:, j] (0 where idx is -1); out = acc cast."""
    acc_t = accumulator(src.dtype)
    acc = torch.zeros((idx.shape[0], src.shape[1]), dtype=acc_t, device=src.device)
    for j in range(idx.shape[1]):
        vals = gather_rows(src, idx[:, j]).to(acc_t)
        weight = (idx[:, j] >= 0).to(acc_t) if coef is None else torch.where(idx[:, j] >= 0, coef[:, j].to(acc_t), 0.0)
        acc = acc + vals * weight[:, None]
    return acc.to(out_dtype)


@dataclass
class ReferencePlan:
    """Index maps of one dispatch (int64 on the tokens' device). T tokens here, K top-k, W ranks,
    S rows sent (a token once per destination rank), N token rows received, R (token, local expert) rows.

    send_rows [S] token of each send row (by rank, then token); token_pos [T, W] send row of token t for
    rank r (-1: not sent); pair_send_row [T, K] send row carrying pair (t, k); send_splits / recv_splits:
    W ints; pair_row [N, K] output row of received pair (j, k) (-1: expert not here); row_src [R] received
    row behind each output row; row_pair [R] its flat pair j * K + k; tokens_per_expert [E_local]."""

    num_tokens: int
    topk: int
    send_rows: torch.Tensor
    token_pos: torch.Tensor
    pair_send_row: torch.Tensor
    send_splits: List[int]
    recv_splits: List[int]
    pair_row: torch.Tensor
    row_src: torch.Tensor
    row_pair: torch.Tensor
    tokens_per_expert: torch.Tensor

    @property
    def num_recv_rows(self) -> int:
        return int(self.row_src.shape[0])


class ReferenceEngine:
    """The engine interface of normal_engine.FusedEngine, in torch ops over `group`."""

    def __init__(self, num_experts: int, rank: int, world: int, group=None):
        self.num_experts, self.rank, self.world, self.group = num_experts, rank, world, group

    def _exchange(self, src: torch.Tensor, out_splits: List[int], in_splits: List[int]) -> torch.Tensor:
        out = torch.empty((sum(out_splits),) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
        dist.all_to_all_single(out, src.contiguous(), out_splits, in_splits, group=self.group)
        return out

    def plan(self, topk_idx: torch.Tensor) -> ReferencePlan:
        if topk_idx.numel():
            lo, hi = int(topk_idx.min()), int(topk_idx.max())
            if lo < -1 or hi >= self.num_experts:
                raise ValueError(f"dispatch: topk_idx values must be in [-1, {self.num_experts}), got min {lo}, max {hi}")
        T, K = topk_idx.shape
        dev, W, rank = topk_idx.device, self.world, self.rank
        lay = layout_reference(topk_idx, self.num_experts, W)
        per_rank = lay.num_tokens_per_rank
        token_pos = torch.where(lay.send_slot >= 0, lay.send_slot + torch.cumsum(per_rank, 0) - per_rank, -1)
        send_splits = per_rank.tolist()
        send_rows = torch.empty(sum(send_splits), dtype=torch.int64, device=dev)
        sent = token_pos >= 0
        send_rows[token_pos[sent]] = torch.arange(T, device=dev)[:, None].expand(T, W)[sent]
        recv_splits = self._exchange(per_rank, [1] * W, [1] * W).tolist()
        N = sum(recv_splits)
        topk64 = topk_idx.long()
        recv_topk = self._exchange(topk64[send_rows], recv_splits, send_splits)
        e_local = self.num_experts // W
        owner = torch.where(topk64 >= 0, topk64 // e_local, 0)
        pair_send_row = torch.where(topk64 >= 0, token_pos.gather(1, owner), -1)
        local = (recv_topk >= 0) & (recv_topk // e_local == rank)
        expert = torch.where(local, recv_topk - rank * e_local, 0)
        j_idx = torch.arange(N, device=dev)[:, None].expand(N, K)
        k_idx = torch.arange(K, device=dev)[None, :].expand(N, K)
        key = (expert * max(N, 1) + j_idx) * K + k_idx  # expert, then source (receive order), then token, k
        row_pair = (j_idx * K + k_idx)[local][torch.argsort(key[local], stable=True)]
        pair_row = torch.full((N * K,), -1, dtype=torch.int64, device=dev)
        pair_row[row_pair] = torch.arange(row_pair.shape[0], device=dev)
        return ReferencePlan(T, K, send_rows, token_pos, pair_send_row, send_splits, recv_splits, pair_row.view(N, K),
                             row_pair // K, row_pair, torch.bincount(expert[local], minlength=e_local))

    def dispatch(self, x, topk_idx, topk_weights, x2=None):
        """x [T, H], topk_idx [T, K], topk_weights [T, K] (, x2 [T, H2]) -> (rows [R, H], weights [R]
        float32, rows2 [R, H2] or None, plan)."""
        p = self.plan(topk_idx)
        rows = self.redispatch(p, x)
        recv_w = self._exchange(topk_weights.float()[p.send_rows], p.recv_splits, p.send_splits)
        return rows, recv_w.reshape(-1)[p.row_pair], None if x2 is None else self.redispatch(p, x2), p

    def redispatch(self, p: ReferencePlan, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [R, H] with the routing of plan p."""
        recv = self._exchange(gather_rows(x, p.send_rows), p.recv_splits, p.send_splits)
        return gather_rows(recv, p.row_src)

    def combine(self, p: ReferencePlan, y: Optional[torch.Tensor], coef: Optional[torch.Tensor] = None,
                values: Optional[torch.Tensor] = None):
        """y [R, H] (or None), coef [R] or None, values [R] float (or None) -> (out [T, H] = sum_k coef * y
        of each token's rows, values back at each pair [T, K] float32 (0 where no expert))."""
        out = vals = None
        if y is not None:
            pair_coef = None if coef is None else torch.where(p.pair_row >= 0, coef[p.pair_row.clamp(min=0)], 0.0)
            partial = weighted_sum(y, p.pair_row, pair_coef, y.dtype)
            back = self._exchange(partial, p.send_splits, p.recv_splits)
            out = weighted_sum(back, p.token_pos, None, y.dtype)
        if values is not None:
            per_pair = torch.where(p.pair_row >= 0, values.float()[p.pair_row.clamp(min=0)], 0.0)
            back = self._exchange(per_pair, p.send_splits, p.recv_splits)
            k_idx = torch.arange(p.topk, device=values.device)[None, :]
            vals = torch.where(p.pair_send_row >= 0, back[p.pair_send_row.clamp(min=0), k_idx], 0.0)
        return out, vals

