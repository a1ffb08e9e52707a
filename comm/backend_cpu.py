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
from typing import Optional

import torch

from .bootstrap import Bootstrap
from .error_record import ErrorRecord
from .heap import SymmetricHeap
from .language import abi

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


def shm_shortfall(nbytes: int, world_size: int) -> Optional[str]:
    """Why `world_size` segments of `nbytes` do not fit the free space of the shared-memory folder
    (None when they do). Segments are sparse until touched: without this check a heap larger than
    /dev/shm is accepted and a rank dies of SIGBUS when a write first reaches the missing pages."""
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError:
        return None
    free, need = st.f_bavail * st.f_frsize, nbytes * world_size
    if need <= free:
        return None
    gib = 1 << 30
    return (f"tilecomm.init: the symmetric heap needs {world_size} x {nbytes} B = {need / gib:.2f} GiB of shared memory, "
            f"but {_SHM_DIR} has {free / gib:.2f} GiB free; lower TILECOMM_HEAP_BYTES (or init(heap_bytes=...)) or "
            f"enlarge {_SHM_DIR} (docker: --shm-size)")


def create_heap(boot: Bootstrap, nbytes: int) -> SymmetricHeap:
    """Collective: every rank gets a SymmetricHeap whose peers[pe] is pe's segment in this process."""
    # rank 0 decides for all (free space changes between ranks' looks), so every rank raises alike
    first = (uuid.uuid4().hex[:16], shm_shortfall(nbytes, boot.world_size)) if boot.rank == 0 else None
    token, shortfall = boot.broadcast_object(first, what="tilecomm.init (heap)")
    if shortfall:
        raise MemoryError(shortfall)
    own = segment_path(token, boot.rank)
    maps = [None] * boot.world_size
    try:
        maps[boot.rank] = _map(own, nbytes, create=True)
        boot.barrier("tilecomm.init (heap)")
        for pe in range(boot.world_size):
            if pe != boot.rank:
                maps[pe] = _map(segment_path(token, pe), nbytes, create=False)
        boot.barrier("tilecomm.init (heap)")
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
        super().__init__(torch.zeros(abi.ERROR_WORDS, dtype=torch.int64))
        ctx.boot.barrier("tilecomm.init")


def create_device_state(ctx) -> CpuDeviceState:
    return CpuDeviceState(ctx)

