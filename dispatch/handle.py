"""What `dispatch` computes once and `combine` (and both backwards) reuse."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch

if TYPE_CHECKING:
    from .low_latency_engine import LowLatencyHandle


@dataclass
class DispatchHandle:
    """What combine and the backward passes need from one normal-mode dispatch (this rank).

    num_tokens: T tokens dispatched here; hidden: H; topk: K; num_recv_rows: R, the rows of res.x;
    tokens_per_expert: [E_local] int64 on the device; backend: "tilecomm" or "nccl";
    plan: the backend's index maps (normal_engine.FusedPlan for "tilecomm", reference.ReferencePlan for "nccl");
    row_weights: [R] float32 routing weight of each row (set by dispatch; gradients reach topk_weights).
    A handle may be combined any number of times, in the same order on every rank."""

    num_tokens: int
    hidden: int
    topk: int
    num_recv_rows: int
    tokens_per_expert: torch.Tensor
    backend: str
    plan: object
    row_weights: Optional[torch.Tensor] = None


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
