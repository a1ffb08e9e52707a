"""What `dispatch` computes once and `combine` (and both backwards) reuse."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional

import torch

if TYPE_CHECKING:
    from .low_latency import LowLatencyHandle


@dataclass
class DispatchHandle:
    """Index maps of one dispatch. T = tokens here, K = top-k, W = ranks, S = rows this rank sends
    (a token once per destination rank), N = token rows it receives, R = (token, local expert)
    rows it holds after dispatch. All tensors are int64 on the tokens' device.

    send_rows:        [S]    token index of each send-buffer row (grouped by rank, then token)
    token_pos:        [T, W] send-buffer row of token t for rank r, -1 if t does not go to r
    pair_send_row:    [T, K] send-buffer row that carries pair (t, k), -1 for no expert
    send_splits:      W ints, rows sent to each rank; recv_splits: W ints, rows received from each
    recv_topk:        [N, K] global expert ids of the received rows
    pair_row:         [N, K] output row of received pair (j, k), -1 if that expert is not local
    row_src:          [R]    received row behind each output row
    row_pair:         [R]    flat pair index j * K + k behind each output row
    tokens_per_expert: [E_local]
    row_weights:      [R] float32 routing weight of each row (combine uses it; gradients reach topk_weights)
    """

    num_tokens: int
    hidden: int
    topk: int
    send_rows: torch.Tensor
    token_pos: torch.Tensor
    pair_send_row: torch.Tensor
    send_splits: List[int]
    recv_splits: List[int]
    recv_topk: torch.Tensor
    pair_row: torch.Tensor
    row_src: torch.Tensor
    row_pair: torch.Tensor
    tokens_per_expert: torch.Tensor
    backend: str
    row_weights: Optional[torch.Tensor] = None  # [R] float32, set by dispatch (autograd-connected)

    @property
    def num_recv_rows(self) -> int:
        return int(self.row_src.shape[0])


@dataclass
class DispatchResult:
    """x: [R, H] rows, expert-major (local expert, then source rank, then source token index);
    weights: [R] float32 routing weight of each row's (token, expert) pair;
    tokens_per_expert: [E_local] int64 on the device; handle: what combine needs.
    Low-latency mode: x [E_local, capacity, H], weights [E_local, capacity]; recv_hook is set when
    dispatch was asked to defer its receive half (call it before reading the outputs)."""

    x: torch.Tensor
    weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    handle: "DispatchHandle | LowLatencyHandle"
    recv_hook: Optional[Callable[[], None]] = None
    work: Optional[object] = None  # with async_op=True: wait() before reading the outputs
    x_scales: Optional[torch.Tensor] = None  # with use_fp8=True: [R, H / 128] float32 scales of x
