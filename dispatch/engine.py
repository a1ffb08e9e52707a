"""The normal-mode dispatch/combine algorithm, written once over a pluggable backend.

A backend supplies four things: the routing layout, an all-to-all, and the two row operations
of rows.py. `tilecomm` uses the layout kernel, tilecomm.all_to_all_single and the Triton row
kernels; `nccl` (the torch reference, also usable as a trainer's fallback) uses plain torch ops and
torch.distributed.all_to_all_single. Every token crosses to each destination rank once, however
many of that rank's experts it picked, and is expanded to expert-major rows on arrival.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

import tilecomm

from . import layout as layout_mod
from . import rows
from .handle import DispatchHandle


@dataclass(frozen=True)
class Backend:
    name: str
    layout: Callable
    all_to_all: Callable  # (output, input, output_split_sizes, input_split_sizes) -> None
    gather_rows: Callable
    combine_rows: Callable


def _torch_a2a(group):
    return lambda out, inp, out_splits, in_splits: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)


def make_backend(name: str, group=None) -> Backend:
    if name == "tilecomm":
        return Backend("tilecomm", layout_mod.compute_layout, tilecomm.all_to_all_single, rows.gather_rows,
                       rows.combine_rows)
    if name == "nccl":
        return Backend("nccl", layout_mod.layout_reference, _torch_a2a(group), rows.gather_rows_torch,
                       rows.combine_rows_torch)
    raise ValueError(f"backend={name!r}; expected 'tilecomm' or 'nccl'")


def _exchange(be: Backend, src: torch.Tensor, out_rows: int, out_splits: List[int], in_splits: List[int]) -> torch.Tensor:
    out = torch.empty((out_rows,) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
    be.all_to_all(out, src.contiguous(), out_splits, in_splits)
    return out


def plan(be: Backend, topk_idx: torch.Tensor, num_experts: int, rank: int, world: int, hidden: int) -> DispatchHandle:
    """Layout, count exchange and the index maps of DispatchHandle (one host sync: the counts)."""
    T, K = topk_idx.shape
    dev = topk_idx.device
    lay = be.layout(topk_idx, num_experts, world)
    per_rank = lay.num_tokens_per_rank
    base = torch.cumsum(per_rank, 0) - per_rank
    token_pos = torch.where(lay.send_slot >= 0, lay.send_slot + base, -1)
    send_splits = per_rank.tolist()
    S = sum(send_splits)
    send_rows = torch.empty(S, dtype=torch.int64, device=dev)
    sent = token_pos >= 0
    send_rows[token_pos[sent]] = torch.arange(T, device=dev)[:, None].expand(T, world)[sent]
    recv_counts = _exchange(be, per_rank, world, [1] * world, [1] * world)
    recv_splits = recv_counts.tolist()
    N = sum(recv_splits)
    topk64 = topk_idx.long()
    recv_topk = _exchange(be, topk64[send_rows], N, recv_splits, send_splits)

    e_local = num_experts // world
    owner = torch.where(topk64 >= 0, topk64 // e_local, 0)
    pair_send_row = torch.where(topk64 >= 0, token_pos.gather(1, owner), -1)

    local = (recv_topk >= 0) & (recv_topk // e_local == rank)
    expert = torch.where(local, recv_topk - rank * e_local, 0)
    j_idx = torch.arange(N, device=dev)[:, None].expand(N, K)
    k_idx = torch.arange(K, device=dev)[None, :].expand(N, K)
    key = (expert * max(N, 1) + j_idx) * K + k_idx  # expert, then source (recv order), then token
    pair_flat = (j_idx * K + k_idx)[local]
    order = torch.argsort(key[local], stable=True)
    row_pair = pair_flat[order]
    R = int(row_pair.shape[0])
    pair_row = torch.full((N * K,), -1, dtype=torch.int64, device=dev)
    pair_row[row_pair] = torch.arange(R, device=dev)
    tokens_per_expert = torch.bincount(expert[local], minlength=e_local)
    return DispatchHandle(T, hidden, K, send_rows, token_pos, pair_send_row, send_splits, recv_splits, recv_topk,
                          pair_row.view(N, K), row_pair // K, row_pair, tokens_per_expert, be.name)


def dispatch_rows(be: Backend, h: DispatchHandle, x: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> [R, H]: send each token once per destination rank, expand expert-major there."""
    recv = _exchange(be, be.gather_rows(x, h.send_rows), sum(h.recv_splits), h.recv_splits, h.send_splits)
    return be.gather_rows(recv, h.row_src)


def dispatch_pairs(be: Backend, h: DispatchHandle, values: torch.Tensor) -> torch.Tensor:
    """values [T, K] (float32) -> [R]: each row's (token, expert) value."""
    recv = _exchange(be, values.float()[h.send_rows], sum(h.recv_splits), h.recv_splits, h.send_splits)
    return recv.reshape(-1)[h.row_pair]


def combine_rows(be: Backend, h: DispatchHandle, y: torch.Tensor, coef: Optional[torch.Tensor]) -> torch.Tensor:
    """y [R, H], coef [R] or None -> out [T, H]: out[t] = sum_k coef[row(t,k)] * y[row(t,k)].

    Reduced on the way back: each destination rank sums its experts' rows of a token (fp32), sends one
    row per token back, and the source sums the ranks' partial rows (fp32)."""
    pair_coef = None if coef is None else torch.where(h.pair_row >= 0, coef[h.pair_row.clamp(min=0)], 0.0)
    partial = be.combine_rows(y, h.pair_row, pair_coef, y.dtype)
    back = _exchange(be, partial, sum(h.send_splits), h.send_splits, h.recv_splits)
    return be.combine_rows(back, h.token_pos, None, y.dtype)


def return_pairs(be: Backend, h: DispatchHandle, values: torch.Tensor) -> torch.Tensor:
    """values [R] -> [T, K] float32 at each row's (token, k) slot (0 where no expert)."""
    per_pair = torch.where(h.pair_row >= 0, values.float()[h.pair_row.clamp(min=0)], 0.0)
    back = _exchange(be, per_pair, sum(h.send_splits), h.send_splits, h.recv_splits)
    k_idx = torch.arange(h.topk, device=values.device)[None, :]
    got = back[h.pair_send_row.clamp(min=0), k_idx]
    return torch.where(h.pair_send_row >= 0, got, 0.0)
