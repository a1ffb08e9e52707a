"""`cpu` backend: one POSIX shared-memory segment per rank, mapped by every rank.

Each rank creates its segment, all ranks map all segments, and then each rank unlinks its own
name at once: from then on the memory lives exactly as long as some process maps it, so nothing
is left in /dev/shm after finalize, after an exception or after a rank is killed.
"""
from __future__ import annotations

import mmap
import os
import tempfile
import uuid

import torch

from .bootstrap import Bootstrap
from .error_record import ErrorRecord
from .heap import SymmetricHeap

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def segment_path(token: str, rank: int) -> str:
    return os.path.join(_SHM_DIR, f"tilecomm-{token}-{rank}")


def _map(path: str, nbytes: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def create_heap(boot: Bootstrap, nbytes: int) -> SymmetricHeap:
    """Collective: every rank gets a SymmetricHeap whose peers[pe] is pe's segment in this process."""
    token = boot.broadcast_object(uuid.uuid4().hex[:16] if boot.rank == 0 else None)
    own = segment_path(token, boot.rank)
    maps = [None] * boot.world_size
    try:
        maps[boot.rank] = _map(own, nbytes, create=True)
        boot.barrier()
        for pe in range(boot.world_size):
            if pe != boot.rank:
                maps[pe] = _map(segment_path(token, pe), nbytes, create=False)
        boot.barrier()
    finally:
        if os.path.exists(own):
            os.unlink(own)
    # torch.frombuffer keeps each mmap alive for as long as any tensor views it.
    regions = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
    return SymmetricHeap(regions[boot.rank], regions, boot.rank)


class CpuDeviceState(ErrorRecord):
    """What the interpreted primitives read: the peer deltas and the runtime's control words.

    ctrl: int64 heap words; [0] this rank's barrier_all count, [FLAGS_OFFSET + pe] barrier flags.
    deltas: int64 [world]; byte distance from this rank's heap to pe's heap in this process.
    """

    FLAGS_OFFSET = 8

    def __init__(self, ctx):
        heap = ctx.heap
        self.ctrl = heap.view(heap.local, heap.alloc(8 * (self.FLAGS_OFFSET + ctx.world_size)),
                              (self.FLAGS_OFFSET + ctx.world_size,), torch.int64)
        self.ctrl.zero_()
        self.deltas = torch.tensor([p.data_ptr() - heap.base for p in heap.peers], dtype=torch.int64)
        self.timeout_s = ctx.timeout_s
        super().__init__(torch.zeros(8, dtype=torch.int64))
        ctx.boot.barrier()


def create_device_state(ctx) -> CpuDeviceState:
    return CpuDeviceState(ctx)

