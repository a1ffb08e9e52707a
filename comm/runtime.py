"""The runtime context: which backend, which rank, the symmetric heap, the device state words.

One `Context` per process, made by `tilecomm.init()` and dropped by `tilecomm.finalize()`.
"""
from __future__ import annotations

import atexit
import itertools
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from . import _env
from .bootstrap import Bootstrap, make_bootstrap
from .errors import NotInitializedError
from .heap import SymmetricHeap


@dataclass
class Context:
    """State of an initialised runtime.

    rank / world_size: this process's PE and the number of PEs (world group).
    backend: "cpu" or "cuda"; device: where heap tensors live.
    heap: the symmetric heap; timeout_s: limit of every device-side wait.
    device_state: backend object behind `tilecomm.language` (peer table, error record).
    """

    rank: int
    world_size: int
    backend: str
    device: torch.device
    heap: SymmetricHeap
    boot: Bootstrap
    timeout_s: float
    device_state: object = None
    collectives: object = None  # tilecomm.collectives.state.CollectiveState, made by init
    epoch: int = 0
    caches: dict = field(default_factory=dict)
    allocations: dict = field(default_factory=dict)  # heap offset -> (offset, id) of live `empty` tensors
    alloc_ids: "itertools.count" = field(default_factory=itertools.count)

    def next_epoch(self) -> int:
        self.epoch += 1
        return self.epoch


_CTX: Optional[Context] = None


def current() -> Context:
    if _CTX is None:
        raise NotInitializedError("tilecomm is not initialised: call tilecomm.init() first (and not after finalize())")
    return _CTX


def is_initialized() -> bool:
    return _CTX is not None


def _choose_backend(requested: str) -> str:
    if requested == "auto":
        requested = _env.backend()
    if requested not in ("auto", "cuda", "cpu"):
        raise ValueError(f"tilecomm.init: backend={requested!r}; expected 'auto', 'cuda' or 'cpu'")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("tilecomm.init(backend='cuda'): torch sees no CUDA device; use backend='cpu'")
    return requested


def heap_bytes_for(symmetric_bytes: int, slack: int = 64 << 20) -> int:
    """A heap (for init(heap_bytes=)) that leaves `symmetric_bytes` plus `slack` for the program's own symmetric
    buffers beside the quarter the runtime keeps for its collectives (TILECOMM_WORKSPACE_BYTES), in whole 2 MiB."""
    return -(-(symmetric_bytes + slack) * 4 // 3 // (2 << 20)) * (2 << 20)


def init(backend: str = "auto", heap_bytes: Optional[int] = None, timeout_s: Optional[float] = None) -> Context:
    """Start the runtime (collective over all ranks) and return its context.

    backend: "auto" (cuda when torch sees a GPU, else cpu), "cuda" or "cpu"; default from TILECOMM_BACKEND.
    Ranks come from an initialised torch.distributed world, else MPI (mpirun), else RANK/WORLD_SIZE
    (torchrun-style env), else a single rank. heap_bytes defaults to TILECOMM_HEAP_BYTES,
    timeout_s to TILECOMM_TIMEOUT_S. Calling init twice returns the existing context.
    """
    global _CTX
    if _CTX is not None:
        return _CTX
    chosen = _choose_backend(backend)
    nbytes = heap_bytes if heap_bytes is not None else _env.heap_bytes(chosen == "cuda")
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"tilecomm.init: heap_bytes={heap_bytes!r}; expected a positive int")
    limit = _env.check_timeout(timeout_s, "tilecomm.init: timeout_s") if timeout_s is not None else _env.timeout_s()
    boot = make_bootstrap(chosen, limit)
    try:
        if chosen == "cpu":
            from . import backend_cpu as impl
        else:
            from . import backend_cuda as impl
        heap = impl.create_heap(boot, nbytes)
        ctx = Context(boot.rank, boot.world_size, chosen, heap.local.device, heap, boot, limit)
        ctx.device_state = impl.create_device_state(ctx)
        from .collectives.state import CollectiveState

        ctx.collectives = CollectiveState.create(ctx, _env.workspace_bytes(nbytes))
        if chosen == "cuda":
            torch.cuda.synchronize()
        boot.barrier()  # every rank's signal words are zeroed before any peer signals them
    except BaseException:
        boot.close()
        raise
    _CTX = ctx
    atexit.register(_finalize_at_exit)
    return ctx


def finalize() -> None:
    """Tear the runtime down (collective). Heap tensors still referenced stay readable locally,
    but no longer symmetric; the shared memory behind them goes when the last one is dropped."""
    global _CTX
    ctx = _CTX
    if ctx is None:
        return
    try:
        pending = None
        try:
            check_errors()
        except Exception as err:  # raised after the barrier: the peers are not left waiting at it
            pending = err
        ctx.boot.barrier("tilecomm.finalize")
        if pending is not None:
            raise pending
    finally:
        _CTX = None
        ctx.caches.clear()
        if ctx.collectives is not None:
            ctx.collectives.free()
        if hasattr(ctx.device_state, "close"):
            ctx.device_state.close()
        ctx.heap.close()
        ctx.boot.close()


def _finalize_at_exit() -> None:
    global _CTX
    if _CTX is not None:  # no collective barrier at exit: peers may already be gone
        ctx, _CTX = _CTX, None
        if hasattr(ctx.device_state, "close"):
            ctx.device_state.close()
        ctx.heap.close()


def check_errors() -> None:
    """Raise the first device-side error recorded since the last check (GPU waits that timed out).
    Every launch calls it: one read of the error record's first word when there is nothing to raise."""
    ctx = _CTX
    if ctx is not None and ctx.device_state.has_error():
        ctx.device_state.raise_if_error()


def set_timeout(seconds: float) -> None:
    """Change the limit of every later device-side wait of this rank (see `init(timeout_s=...)`)."""
    if not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise ValueError(f"tilecomm.set_timeout: seconds={seconds!r}; expected a positive number of seconds")
    ctx = current()
    ctx.timeout_s = float(seconds)
    ctx.boot.set_timeout(float(seconds))  # host-side waits too
    if hasattr(ctx.device_state, "set_timeout"):
        ctx.device_state.set_timeout(float(seconds))


def rank() -> int:
    return current().rank


def world_size() -> int:
    return current().world_size


def barrier() -> None:
    """Host barrier over all ranks; on GPU it first waits for this rank's queued kernels."""
    ctx = current()
    if ctx.backend == "cuda":
        torch.cuda.synchronize()
    check_errors()
    ctx.boot.barrier("tilecomm.barrier")


_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)


def empty(shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Collective: a tensor on the symmetric heap, same shape/dtype/offset on every rank.

    Every rank must call it with the same shape and dtype, in the same order (checked).
    Contents are undefined. Release with `tilecomm.free(t)` (also collective)."""
    ctx = current()
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ValueError(f"tilecomm.empty: shape={shape!r}; expected a tuple of non-negative ints")
    if dtype not in _DTYPES:
        raise ValueError(f"tilecomm.empty: dtype={dtype}; expected one of {[str(d) for d in _DTYPES]}")
    if ctx.world_size > 1:
        seen = ctx.boot.all_gather_object((shape, str(dtype)), what="tilecomm.empty")
        if any(s != seen[0] for s in seen):
            from .errors import PeerMismatchError

            raise PeerMismatchError(f"tilecomm.empty: ranks asked for different tensors: {seen}")
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    off = ctx.heap.alloc(nbytes)
    t = ctx.heap.view(ctx.heap.local, off, shape, dtype)
    ctx.allocations[off] = t._tilecomm_alloc = (off, next(ctx.alloc_ids))
    return t


def zeros(shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`empty` then zero-filled, with a barrier so no peer writes into it before it is cleared."""
    t = empty(shape, dtype)
    t.zero_()
    barrier()
    return t


def free(t: torch.Tensor) -> None:
    """Collective: return a tensor from `empty` to the heap (call in the same order on every rank)."""
    ctx = current()
    tag = getattr(t, "_tilecomm_alloc", None)
    if tag is None or ctx.allocations.get(tag[0]) != tag:
        raise ValueError("tilecomm.free: pass the tensor returned by tilecomm.empty (not a view), once; "
                         "this one was not allocated by it or was freed already")
    barrier()  # peers may still be reading or writing it
    del ctx.allocations[tag[0]]
    ctx.heap.release(tag[0])


def peer(t: torch.Tensor, pe: int) -> torch.Tensor:
    """A local torch view of rank pe's copy of heap tensor t (pe must be directly reachable)."""
    ctx = current()
    if not isinstance(pe, int) or not 0 <= pe < ctx.world_size:
        raise ValueError(f"tilecomm.peer: pe={pe!r}; expected an int in [0, {ctx.world_size})")
    return ctx.heap.peer_view(t, pe)


def is_symmetric(t: torch.Tensor) -> bool:
    """True when t lies on this rank's symmetric heap."""
    return current().heap.contains(t)
