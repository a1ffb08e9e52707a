"""CPU implementations of the `tilecomm.language` primitives, run by the Triton interpreter.

The interpreter executes a kernel as Python, one program after another, with `triton.language`
patched to act on raw addresses. These functions use those same `tl` operations on the
shared-memory heap: a peer's copy of a symmetric object is at `ptr + delta[pe]` in this process
(every rank maps every segment), and the interpreter's atomics are real atomics on that memory.
A wait that runs past the timeout raises `WaitTimeoutError` right here.
"""
from __future__ import annotations

import time

import numpy as np
import triton.language as tl
from triton.runtime.interpreter import _implicit_cvt

from .. import runtime
from ..errors import WaitTimeoutError
from ._constants import CMP_GE, CMP_NAMES, SIGNAL_ADD, SIGNAL_SET, compare_numpy

_COPY_BLOCK = 1 << 14


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


def symm_at(ptr, pe):
    """Address of the same symmetric object on rank `pe` (scalar or block of pointers / pes)."""
    _, state = _state()
    delta_bytes = tl.load(_implicit_cvt(state.deltas) + pe)
    elem = ptr.dtype.element_ty.primitive_bitwidth // 8
    return ptr + delta_bytes // elem


def _copy(dst, src, nelems):
    n = int(_py(nelems))
    for start in range(0, n, _COPY_BLOCK):
        offs = start + tl.arange(0, _COPY_BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def put(dst, src, nelems, pe):
    _copy(symm_at(dst, pe), src, nelems)


def get(dst, src, nelems, pe):
    _copy(dst, symm_at(src, pe), nelems)


def signal(sig, value, pe, op):
    op = _py(op)
    target = symm_at(sig, pe)
    value = tl.cast(value, sig.dtype.element_ty) if isinstance(value, tl.tensor) else value
    if op == SIGNAL_SET:
        tl.atomic_xchg(target, value, sem="release", scope="sys")
    elif op == SIGNAL_ADD:
        tl.atomic_add(target, value, sem="release", scope="sys")
    else:
        raise ValueError(f"tcl.signal: op={op!r}; expected tcl.SIGNAL_SET or tcl.SIGNAL_ADD")


def wait(sig, value, cmp):
    """Spin (with back-off) until every word at `sig` compares `cmp` to `value`; return the words."""
    ctx, _ = _state()
    cmp = _py(cmp)
    if cmp not in CMP_NAMES:
        raise ValueError(f"tcl.wait: cmp={cmp!r}; expected one of tcl.CMP_EQ/NE/GT/GE/LT/LE")
    expected = _py(value)
    deadline = time.monotonic() + ctx.timeout_s
    pause = 0.0
    while True:
        seen = tl.atomic_add(sig, tl.zeros(sig.shape, sig.dtype.element_ty) if sig.shape else 0, sem="acquire", scope="sys")
        words = np.asarray(_py(seen))
        if np.all(compare_numpy(words, expected, cmp)):
            return seen
        if time.monotonic() > deadline:
            addr = int(np.asarray(_py(sig)).reshape(-1)[0])
            raise WaitTimeoutError(ctx.rank, addr, int(np.asarray(expected).reshape(-1)[0]), CMP_NAMES[cmp],
                                   int(words.reshape(-1)[0]), ctx.timeout_s, where=ctx.heap.describe(addr))
        time.sleep(pause)
        pause = min(1e-3, pause * 2 + 1e-6)


def consume_token(x, token):
    return x


def fence():
    pass


def quiet():
    pass


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
