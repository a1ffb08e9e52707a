"""The symmetric heap: one equal-sized byte region per rank, carved up identically on every rank.

Allocation is collective and deterministic (first fit over a sorted free list), so the same
sequence of `alloc` calls gives the same offsets on every rank: a tensor at offset o on this rank
has its twin at offset o on every peer. Backends supply the bytes (`cpu`: a shared-memory segment
per rank; `cuda`: one NVSHMEM allocation) and, where the peer is directly reachable, a local
view of each peer's region.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

ALIGN = 256  # bytes; covers every dtype and 16-byte vector loads, keeps tiles cache-line aligned


class SymmetricHeap:
    """Byte region of `nbytes` per rank. `local` is this rank's uint8 tensor, `peers[pe]` a view of
    pe's region (None where not directly mapped)."""

    def __init__(self, local: torch.Tensor, peers: Sequence[Optional[torch.Tensor]], rank: int):
        self.local = local
        self.peers: List[Optional[torch.Tensor]] = list(peers)
        self.rank = rank
        self.nbytes = local.numel()
        self.base = local.data_ptr()
        self._free = [(0, self.nbytes)]  # sorted (offset, size)
        self._used = {}  # offset -> size

    # -- allocation -----------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        size = max(ALIGN, math.ceil(nbytes / ALIGN) * ALIGN)
        for i, (off, avail) in enumerate(self._free):
            if avail >= size:
                if avail == size:
                    self._free.pop(i)
                else:
                    self._free[i] = (off + size, avail - size)
                self._used[off] = size
                return off
        raise MemoryError(
            f"symmetric heap exhausted: {nbytes} bytes requested, {self.bytes_free()} of {self.nbytes} free "
            f"(largest block {max((s for _, s in self._free), default=0)}); raise TILECOMM_HEAP_BYTES or init(heap_bytes=...)"
        )

    def release(self, offset: int) -> None:
        size = self._used.pop(offset)
        self._free.append((offset, size))
        self._free.sort()
        merged = []
        for off, sz in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + sz)
            else:
                merged.append((off, sz))
        self._free = merged

    def bytes_free(self) -> int:
        return sum(s for _, s in self._free)

    # -- views ----------------------------------------------------------------------------------
    def view(self, region: torch.Tensor, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return region[offset : offset + nbytes].view(dtype).view(tuple(shape))

    def offset_of(self, t: torch.Tensor) -> Optional[int]:
        """Byte offset of t's first element inside the local region, or None if t is not on the heap."""
        if t.device != self.local.device:
            return None
        off = t.data_ptr() - self.base
        if off < 0 or off >= self.nbytes:
            return None
        if t.numel() > 0:
            last = off + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) * t.element_size() + t.element_size()
            if last > self.nbytes:
                return None
        return off

    def describe(self, addr: int) -> str:
        """Where a device address lies, for error messages."""
        off = addr - self.base
        return f"symmetric heap offset {off}" if 0 <= off < self.nbytes else "not on the symmetric heap"

    def contains(self, t: torch.Tensor) -> bool:
        return self.offset_of(t) is not None

    def peer_view(self, t: torch.Tensor, pe: int) -> torch.Tensor:
        off = self.offset_of(t)
        if off is None:
            raise ValueError("tilecomm.peer: tensor is not on the symmetric heap; allocate it with tilecomm.empty")
        region = self.peers[pe]
        if region is None:
            raise ValueError(f"tilecomm.peer: rank {pe} is not directly reachable from rank {self.rank} (no load/store mapping)")
        if off % t.element_size():
            raise ValueError("tilecomm.peer: tensor offset is not a multiple of its element size")
        flat = region.view(t.dtype)
        return flat.as_strided(t.shape, t.stride(), off // t.element_size())

    def close(self) -> None:
        self.local = None
        self.peers = []
        self._free, self._used = [], {}


class NamedViews:
    """Mixin for objects that own named tensors on the heap: `obj.<name>` reads `obj.<VIEWS>[name]`
    (VIEWS names the dict attribute; the dispatch and overlap workspaces use it)."""

    VIEWS = "views"

    def __getattr__(self, name):
        views = self.__dict__.get(type(self).VIEWS, {})
        if name in views:
            return views[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or buffer {name!r}")
