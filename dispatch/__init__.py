"""tilecomm.dispatch: MoE token dispatch and combine that replace NCCL all-to-all.

`Dispatcher` (dispatcher.py) is the API; `DispatchResult` / `DispatchHandle` (handle.py) what calls return.
backend="tilecomm" runs fused device kernels (normal.py; low_latency.py for mode="low_latency") over
buffers the Dispatcher owns (buffers.py); backend="nccl" is the torch reference (reference.py: permute +
torch.distributed.all_to_all_single + unpermute), bit-identical, and a drop-in fallback.
`compute_layout` / `layout_reference` (layout.py) give the routing layout of a topk_idx.
"""
from .dispatcher import Dispatcher
from .handle import DispatchHandle, DispatchResult
from .layout import Layout, compute_layout, layout_reference
from .low_latency_engine import LowLatencyHandle

__all__ = ["Dispatcher", "DispatchHandle", "DispatchResult", "Layout", "LowLatencyHandle", "compute_layout",
           "layout_reference"]
