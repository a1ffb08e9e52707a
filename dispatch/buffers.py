"""The state a Dispatcher owns: symmetric buffers and signal words, allocated once, freed explicitly.

`SymmetricState` is one flat symmetric allocation (collective: every rank makes the same one, in the
same order) carved into named, 256-byte aligned views, plus the Dispatcher's local scratch. Signal
words start at zero on every rank before any peer can write into them. Nothing is allocated on the
heap after construction: every call reuses these buffers (epochs/sequence numbers say which call a
word belongs to).

Lifetime: `free()` (collective, waits for this rank's kernels) gives the heap bytes back;
`tilecomm.finalize()` frees the whole heap, after which any use raises a clear error instead of
touching freed memory (the state remembers the runtime context it was made in).

Sizes (W ranks, E experts, E_l = E / W, M = max_tokens_per_rank, K = topk, H = hidden, ROW = H
elements of dtype rounded up to 16 bytes) -- see `normal_specs` / `low_latency_specs`.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, Tuple

import torch

import tilecomm
from tilecomm.heap import NamedViews

ALIGN = 256  # bytes between views: every dtype, 16-byte vector access
Spec = Tuple[Tuple[int, ...], torch.dtype]


def row_bytes(hidden: int, dtype: torch.dtype) -> int:
    """Bytes of one staged row: hidden elements of dtype, rounded up to 16 (vector stores)."""
    return -(-hidden * _itemsize(dtype) // 16) * 16


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def normal_specs(W: int, E: int, M: int, K: int, H: int, dtype: torch.dtype) -> Dict[str, Spec]:
    """Normal mode. rows/back_rows: [W, M, ROW bytes] (source s's token t at [s, t]); route/slot/weight:
    [W, M, K] (local expert id or -1, index of the pair among s's pairs for that expert, routing weight);
    back_w: [W, M, K] per-pair values returned to the source; notify: [W, E_l + 1] (s's token count and
    pair counts for each local expert); blocks: [W, M] int64 (the call whose send block b of source s has
    landed here, at [s, b]); back_blocks: [W, M] int64 on the source (the call whose combine rows of my block b
    from rank r have landed, at [r, b]); sig: [3, W] int64 (notify, fwd consumed, bwd consumed)."""
    rb, e_local = row_bytes(H, dtype), E // W
    return {"rows": ((W, M, rb), torch.uint8), "back_rows": ((W, M, rb), torch.uint8),
            "route": ((W, M, K), torch.int32), "slot": ((W, M, K), torch.int32),
            "weight": ((W, M, K), torch.float32), "back_w": ((W, M, K), torch.float32),
            "notify": ((W, e_local + 1), torch.int64), "blocks": ((W, M), torch.int64),
            "back_blocks": ((W, M), torch.int64), "sig": ((3, W), torch.int64)}


def low_latency_specs(W: int, E: int, M: int, K: int, H: int, dtype: torch.dtype) -> Dict[str, Spec]:
    """Low-latency mode. recv: [W, M, ROW bytes] (source s's token t at [s, t], once per destination
    rank); recv_w: [E_l, W, M] weights of s's pairs for local expert e at [e, s, slot]; recv_src:
    [E_l, W, M] int32 t * K + k of each; back: [M, W, ROW bytes] on the source (rank r's partial row of
    token t at [t, r]); count: [E_l, W] int64 (epoch * (M + 1) + pairs staged by s for e); sig: [3, W]
    int64 (recv consumed, back ready, back consumed); epoch: [2] int64 (dispatch, combine counters)."""
    rb, e_local = row_bytes(H, dtype), E // W
    return {"recv": ((W, M, rb), torch.uint8), "recv_w": ((e_local, W, M), torch.float32),
            "recv_src": ((e_local, W, M), torch.int32), "back": ((M, W, rb), torch.uint8),
            "count": ((e_local, W), torch.int64), "sig": ((3, W), torch.int64), "epoch": ((2,), torch.int64)}


def symmetric_bytes(specs: Dict[str, Spec]) -> int:
    """Heap bytes `SymmetricState(specs)` takes (for sizing TILECOMM_HEAP_BYTES / init(heap_bytes=))."""
    return sum(_padded(shape, dtype) for shape, dtype in specs.values())


def _padded(shape, dtype) -> int:
    return -(-math.prod(shape) * _itemsize(dtype) // ALIGN) * ALIGN


class SymmetricState(NamedViews):
    """Named symmetric views (attributes, e.g. `state.rows`) over one heap allocation.

    what: owner's name for messages; specs: name -> (shape, dtype); zeroed: names cleared before use
    (signal words). Collective: construct on every rank in the same order with the same specs."""

    def __init__(self, what: str, specs: Dict[str, Spec], zeroed: Iterable[str]):
        self._what, self._ctx = what, tilecomm.current()
        self._flat = tilecomm.empty((symmetric_bytes(specs),), torch.uint8)
        self.views: Dict[str, torch.Tensor] = {}
        off = 0
        for name, (shape, dtype) in specs.items():
            n = math.prod(shape) * _itemsize(dtype)
            self.views[name] = self._flat[off: off + n].view(dtype).view(shape)
            off += _padded(shape, dtype)
        for name in zeroed:
            self.views[name].zero_()
        tilecomm.barrier()  # zeroed words are zero everywhere before a peer signals into them

    @property
    def nbytes(self) -> int:
        return 0 if self._flat is None else self._flat.numel()

    def check_live(self) -> None:
        """Raise unless the buffers are still allocated on the runtime they were made on."""
        if self._flat is None:
            raise RuntimeError(f"{self._what}: its buffers were freed (free()); make a new one")
        if not tilecomm.is_initialized() or tilecomm.current() is not self._ctx:
            raise RuntimeError(f"{self._what}: its symmetric buffers went with tilecomm.finalize(); "
                               "make a new one after tilecomm.init()")

    def free(self) -> None:
        """Collective: wait for this rank's kernels, then return the bytes to the heap (idempotent;
        a no-op after tilecomm.finalize(), which already released the heap)."""
        if self._flat is None:
            return
        live = tilecomm.is_initialized() and tilecomm.current() is self._ctx
        flat, self._flat, self.views = self._flat, None, {}
        if live:
            tilecomm.free(flat)  # barrier inside: peers are done with it too
