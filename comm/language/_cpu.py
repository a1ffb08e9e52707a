"""CPU implementations of the `tilecomm.language` primitives, run by the Triton interpreter.

The interpreter executes a kernel as Python, one program after another, with `triton.language`
patched to act on raw addresses. These functions use those same `tl` operations on the
shared-memory heap: a peer's copy of a symmetric object is at `ptr + delta[pe]` in this process
(every rank maps every segment), and the interpreter's atomics are real atomics on that memory.
A wait that runs past the timeout raises `WaitTimeoutError` right here.

Bounds are always checked here (they cost nothing next to the interpreter): every PE must be in
[0, num_ranks()), and every symmetric address (put's destination, get's source, symm_at's pointer,
signal and wait words, the whole nelems range of a put/get) must lie inside the symmetric heap;
otherwise `OutOfBoundsError` names the primitive, the rank and the bad value instead of a write
to unknown memory or a segfault. put's source and get's destination are local and not checked.
"""
from __future__ import annotations

import os
import random
import time

import numpy as np
import triton.language as tl
from triton.runtime.interpreter import _implicit_cvt

from .. import _env, runtime
from ..errors import OutOfBoundsError, WaitTimeoutError
from .abi import CMP_GE, CMP_NAMES, SIGNAL_ADD, SIGNAL_SET, compare_numpy

_COPY_BLOCK = 1 << 14
# TILECOMM_CPU_JITTER_MS (tests): a random pause after every signal and wait. Programs run one after another
# in the interpreter, so a protocol that lets a peer overwrite data too early rarely shows it; pauses here
# let peers run ahead by milliseconds, as they can by microseconds on GPUs.
_JITTER_S = _env.cpu_jitter_s()
_JITTER = random.Random(os.getpid())


def _pause() -> None:
    if _JITTER_S:
        time.sleep(_JITTER.random() * _JITTER_S)


def _py(value):
    """Python value of a constexpr, an interpreter scalar tensor, or a plain number."""
    if isinstance(value, tl.constexpr):
        return _py(value.value)
    if isinstance(value, tl.tensor):
        data = value.handle.data
        return data.item() if data.size == 1 else data
    return value


def _state():
    ctx = runtime.current()
    return ctx, ctx.device_state


def rank():
    return tl.full((), runtime.current().rank, tl.int32)


def num_ranks():
    return tl.full((), runtime.current().world_size, tl.int32)


def clock(ENABLED=True):
    """Nanoseconds of the host's monotonic clock (one clock for every rank of the machine); 0 where ENABLED is
    False."""
    return tl.full((), time.monotonic_ns() if _py(ENABLED) else 0, tl.int64)


def _elem_bytes(ptr) -> int:
    return ptr.dtype.element_ty.primitive_bitwidth // 8


def _check_pe(pe, what: str) -> None:
    ctx = runtime.current()
    pes = np.asarray(_py(pe)).reshape(-1)
    bad = pes[(pes < 0) | (pes >= ctx.world_size)]
    if bad.size:
        raise OutOfBoundsError(f"rank {ctx.rank}: tcl.{what}: pe={int(bad[0])} is out of range; "
                               f"expected 0 <= pe < num_ranks() = {ctx.world_size}")


def _check_heap(ptr, nelems: int, what: str, arg: str) -> None:
    """Every address of `ptr` (and the nelems elements from it) inside this rank's symmetric heap."""
    ctx = runtime.current()
    heap = ctx.heap
    addrs = np.asarray(_py(ptr)).astype(np.uint64).reshape(-1)
    if not addrs.size:
        return
    lo, hi = int(addrs.min()), int(addrs.max()) + max(nelems, 1) * _elem_bytes(ptr)
    if lo < heap.base or hi > heap.base + heap.nbytes:
        bad = lo if lo < heap.base or lo >= heap.base + heap.nbytes else int(addrs.max())
        raise OutOfBoundsError(
            f"rank {ctx.rank}: tcl.{what}: {arg} spans [0x{lo:x}, 0x{hi:x}), outside the symmetric heap "
            f"[0x{heap.base:x}, 0x{heap.base + heap.nbytes:x}) ({heap.describe(bad)}); pass a pointer into a "
            f"tensor from tilecomm.empty/zeros, with the whole range inside it")


def _nelems(nelems, what: str) -> int:
    n = int(_py(nelems))
    if n < 0:
        raise OutOfBoundsError(f"rank {runtime.current().rank}: tcl.{what}: nelems={n}; expected >= 0")
    return n


def _symm_at(ptr, pe):
    _, state = _state()
    delta_bytes = tl.load(_implicit_cvt(state.deltas) + pe)
    return ptr + delta_bytes // _elem_bytes(ptr)


def symm_at(ptr, pe):
    """Address of the same symmetric object on rank `pe` (scalar or block of pointers / pes)."""
    _check_pe(pe, "symm_at")
    _check_heap(ptr, 1, "symm_at", "ptr")
    return _symm_at(ptr, pe)


def _copy(dst, src, n: int):
    for start in range(0, n, _COPY_BLOCK):
        offs = start + tl.arange(0, _COPY_BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def put(dst, src, nelems, pe):
    n = _nelems(nelems, "put")
    _check_pe(pe, "put")
    _check_heap(dst, n, "put", "dst")
    _copy(_symm_at(dst, pe), src, n)


def get(dst, src, nelems, pe):
    n = _nelems(nelems, "get")
    _check_pe(pe, "get")
    _check_heap(src, n, "get", "src")
    _copy(dst, _symm_at(src, pe), n)


DISCARD_POISON = 0x5A  # what tcl.discard leaves on CPU ranks


def discard(ptr, nelems):
    """CPU ranks: the range's contents become undefined, as on a GPU, here by being overwritten with
    DISCARD_POISON, so that a read the caller's protocol did not expect to find garbage fails its tests (the
    whole range: stronger than the GPU's whole 128-byte lines)."""
    n = _nelems(nelems, "discard")
    for start in range(0, n, _COPY_BLOCK):
        offs = start + tl.arange(0, _COPY_BLOCK)
        tl.store(ptr + offs, tl.full((_COPY_BLOCK,), DISCARD_POISON, ptr.dtype.element_ty), mask=offs < n)


def signal(sig, value, pe, op):
    op = _py(op)
    _check_pe(pe, "signal")
    _check_heap(sig, 1, "signal", "sig")
    target = _symm_at(sig, pe)
    value = tl.cast(value, sig.dtype.element_ty) if isinstance(value, tl.tensor) else value
    if op == SIGNAL_SET:
        tl.atomic_xchg(target, value, sem="release", scope="sys")
    elif op == SIGNAL_ADD:
        tl.atomic_add(target, value, sem="release", scope="sys")
    else:
        raise ValueError(f"tcl.signal: op={op!r}; expected tcl.SIGNAL_SET or tcl.SIGNAL_ADD")
    _pause()


def wait(sig, value, cmp):
    """Spin (with back-off) until every word at `sig` compares `cmp` to `value`; return the words."""
    ctx, _ = _state()
    cmp = _py(cmp)
    if cmp not in CMP_NAMES:
        raise ValueError(f"tcl.wait: cmp={cmp!r}; expected one of tcl.CMP_EQ/NE/GT/GE/LT/LE")
    _check_heap(sig, 1, "wait", "sig")
    expected = _py(value)
    deadline = time.monotonic() + ctx.timeout_s
    pause = 0.0
    while True:
        seen = tl.atomic_add(sig, tl.zeros(sig.shape, sig.dtype.element_ty) if sig.shape else 0, sem="acquire", scope="sys")
        words = np.asarray(_py(seen))
        if np.all(compare_numpy(words, expected, cmp)):
            _pause()
            return seen
        if time.monotonic() > deadline:
            ctx.device_state.raise_if_error()  # a recorded error (e.g. a peer in another collective) is the cause
            held = np.broadcast_to(compare_numpy(words, expected, cmp), words.shape).reshape(-1)
            first = int(np.argmin(held))  # the first word that does not hold (GPUs: the lowest address)
            addr = int(np.asarray(_py(sig)).reshape(-1)[first])
            raise WaitTimeoutError(ctx.rank, addr, int(np.asarray(expected).reshape(-1)[0]), CMP_NAMES[cmp],
                                   int(words.reshape(-1)[first]), ctx.timeout_s, where=ctx.heap.describe(addr))
        time.sleep(pause)
        pause = min(1e-3, pause * 2 + 1e-6)


def consume_token(x, token):
    return x


def fence():
    pass


def quiet():
    pass


def proxy_fence(x):
    return x


def bulk_wait(x):
    return x


def barrier_all():
    """All ranks meet: bump the local barrier count, SET it into slot `me` of every rank, wait for all."""
    ctx, state = _state()
    ctrl = _implicit_cvt(state.ctrl)
    epoch = tl.load(ctrl) + 1
    tl.store(ctrl, epoch)
    flags = ctrl + state.FLAGS_OFFSET
    me = ctx.rank
    for pe in range(ctx.world_size):
        signal(flags + me, epoch, pe, SIGNAL_SET)
    wait(flags + tl.arange(0, _pow2(ctx.world_size)) % ctx.world_size, epoch, CMP_GE)


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p
