"""tilecomm: a symmetric heap and OpenSHMEM-style primitives inside Triton kernels.

    import tilecomm
    import tilecomm.language as tcl

    tilecomm.init()                        # backend "auto" | "cuda" | "cpu"
    x = tilecomm.empty((n,), torch.float32)  # collective; on the symmetric heap
    tilecomm.peer(x, pe)                   # torch view of pe's copy (directly mapped peers)
    tilecomm.all_to_all_single(out, inp, out_splits, in_splits)  # drop-in for torch.distributed's

    @tilecomm.jit
    def kernel(x_ptr, ...):                # tcl.put / get / signal / wait / ... inside
        ...
"""
from torch.distributed import ReduceOp

from .collectives import all_gather_into_tensor, all_to_all_single, reduce_scatter_tensor
from .errors import NotInitializedError, PeerMismatchError, TilecommError, WaitTimeoutError
from .jit import TileKernel, jit
from .runtime import (Context, barrier, check_errors, current, empty, finalize, free, heap_bytes_for, init,
                      is_initialized, is_symmetric, peer, rank, set_timeout, world_size, zeros)
from .spawn import RankPool, launch

__version__ = "0.1.0"

__all__ = [
    "init", "heap_bytes_for", "finalize", "current", "is_initialized", "rank", "world_size", "barrier", "check_errors", "set_timeout",
    "empty", "zeros", "free", "peer", "is_symmetric", "jit", "TileKernel", "Context",
    "all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "ReduceOp",
    "launch", "RankPool", "TilecommError", "NotInitializedError", "WaitTimeoutError", "PeerMismatchError",
]
