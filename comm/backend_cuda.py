"""`cuda` backend: the symmetric heap is one NVSHMEM allocation (nvshmem4py), peers on NVLink are
mapped into this process, and kernels link NVSHMEM's device library.

Bootstrap: rank 0 makes an NVSHMEM unique id, the host bootstrap (torch.distributed or MPI)
broadcasts it, every rank calls `nvshmem.core.init(initializer_method="uid")`.

Per process (never freed, so its address can be compiled into kernels): the device-state block
read by `tilecomm.language` on the GPU, and a pinned host error record that kernels fill when a
wait times out (the host raises it at the next launch, barrier, collective or `check_errors()`).
"""
from __future__ import annotations

import os

import torch
import triton

from . import _env
from .error_record import ErrorRecord
from .heap import SymmetricHeap
from .language import _gpu, abi

MAX_RANKS = 1024
_PROCESS_BLOCKS = {}  # device index -> (state tensor, pinned error words); live for the process


def _nvshmem():
    try:
        import importlib

        nvshmem = importlib.import_module("nvshmem.core")
        importlib.import_module("nvshmem.core.interop.torch")  # a plain `import a.b.c` would rebind the name
    except ImportError as err:
        raise RuntimeError("tilecomm cuda backend needs nvshmem4py: pip install 'tilecomm[gpu]' "
                           f"(nvshmem4py-cu13, cuda-python); import failed: {err}") from None
    return nvshmem


def _register_module_hook(*, key, fn, compile, **_):
    """Triton post-compile hook: kernels that link libnvshmem_device need their CUmodule registered."""
    libs = dict(compile.get("extern_libs") or ())
    if "libnvshmem_device" not in libs:
        return None
    from nvshmem import bindings

    kernel = fn.jit_function.device_caches[compile["device"]][0][key]
    kernel._init_handles()
    bindings.cumodule_init(kernel.module)
    return None


def create_heap(boot, nbytes: int) -> SymmetricHeap:
    nvshmem = _nvshmem()
    try:
        from cuda.core import Device
    except ImportError:  # cuda-core < 0.5 keeps it under .experimental
        from cuda.core.experimental import Device

    dev_index = torch.cuda.current_device()
    Device(dev_index).set_current()
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(nbytes + (64 << 20)))
    _env.require_nvls_off()
    uid = nvshmem.get_unique_id(empty=boot.rank != 0)
    uid = boot.broadcast_object(uid if boot.rank == 0 else None)
    nvshmem.init(device=Device(dev_index), uid=uid, rank=boot.rank, nranks=boot.world_size, initializer_method="uid")
    local = nvshmem.interop.torch.bytetensor((nbytes,), dtype=torch.uint8)
    local.zero_()
    peers = []
    for pe in range(boot.world_size):
        try:
            view = nvshmem.interop.torch.get_peer_tensor(local, pe)
        except Exception:  # no load/store mapping to pe (another node): NVSHMEM calls reach it
            view = None
        peers.append(view if view is not None and view.data_ptr() != 0 else None)
    torch.cuda.synchronize()
    boot.barrier()
    heap = SymmetricHeap(local, peers, boot.rank)
    heap._nvshmem_local = local
    return heap


class CudaDeviceState(ErrorRecord):
    """The device-state block (its words: abi.STATE_*) plus the pinned error record (abi.ERROR_WORDS)."""

    FLAGS_OFFSET = 8

    def __init__(self, ctx):
        if ctx.world_size > MAX_RANKS:
            raise ValueError(f"tilecomm cuda backend: world size {ctx.world_size} > {MAX_RANKS}")
        dev = torch.cuda.current_device()
        if dev not in _PROCESS_BLOCKS:
            _PROCESS_BLOCKS[dev] = (torch.zeros(abi.StateWord.PEER_BASES + MAX_RANKS, dtype=torch.int64, device="cuda"),
                                    torch.zeros(abi.ERROR_WORDS, dtype=torch.int64, pin_memory=True))
        self.state, words = _PROCESS_BLOCKS[dev]
        super().__init__(words)
        heap = ctx.heap
        self.ctrl = heap.view(heap.local, heap.alloc(8 * (self.FLAGS_OFFSET + ctx.world_size)),
                              (self.FLAGS_OFFSET + ctx.world_size,), torch.int64)
        self.ctrl.zero_()
        bases = [0 if p is None else p.data_ptr() for p in heap.peers]
        if _env.transport() == "nvshmem":
            bases = [0] * len(bases)  # every peer through NVSHMEM device calls
        self.timeout_s = ctx.timeout_s
        self.heap = heap
        word = abi.StateWord
        words = {word.RANK: ctx.rank, word.WORLD: ctx.world_size, word.TIMEOUT_NS: int(ctx.timeout_s * 1e9),
                 word.CONTROL: self.ctrl.data_ptr(), word.ERROR: self.error.data_ptr(), word.HEAP_BASE: heap.base,
                 word.HEAP_BYTES: heap.nbytes}
        host = [words.get(i, 0) for i in range(word.PEER_BASES)]
        self.state.zero_()
        self.state[: word.PEER_BASES + len(bases)].copy_(torch.tensor(host + bases, dtype=torch.int64))
        _gpu.set_state_address(self.state.data_ptr())
        triton.knobs.runtime.jit_post_compile_hook = _register_module_hook
        torch.cuda.synchronize()
        ctx.boot.barrier()

    def set_timeout(self, seconds: float) -> None:
        """The wait limit kernels read from the device-state block (word 2, ns)."""
        self.timeout_s = seconds
        self.state[abi.StateWord.TIMEOUT_NS].fill_(int(seconds * 1e9))

    def close(self) -> None:
        """Free the NVSHMEM heap and finalize NVSHMEM (the process blocks stay for a later init)."""
        nvshmem = _nvshmem()
        torch.cuda.synchronize()
        local = getattr(self.heap, "_nvshmem_local", None)
        self.heap = None
        if local is not None:
            nvshmem.interop.torch.free_tensor(local)
        nvshmem.finalize()


def create_device_state(ctx) -> CudaDeviceState:
    return CudaDeviceState(ctx)
