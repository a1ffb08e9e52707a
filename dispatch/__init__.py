"""tilecomm.dispatch: MoE token dispatch and combine that replace NCCL all-to-all.

`Dispatcher` (dispatcher.py) is the API; `compute_layout` / `layout_reference` (layout.py) the routing
layout; `DispatchResult` / `DispatchHandle` (handle.py) what calls return. backend="nccl" is the torch
reference (permute + torch.distributed.all_to_all_single + unpermute) and a drop-in fallback.
"""
from .dispatcher import Dispatcher
from .handle import DispatchHandle, DispatchResult
from .layout import Layout, compute_layout, layout_reference
from .low_latency import LowLatencyHandle

__all__ = ["Dispatcher", "DispatchHandle", "DispatchResult", "Layout", "LowLatencyHandle", "compute_layout",
           "layout_reference"]
