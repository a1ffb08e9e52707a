"""GPU implementations of the `tilecomm.language` primitives (compiled by Triton).

Device state: an int64 array in device memory, one per process, its address compiled in as the
constexpr STATE_ADDR; its words are the device ABI's STATE_* (abi.py).

With TILECOMM_CHECK=1 (read at import: kernels compile it in) put/get/symm_at/signal check that the
PE is in [0, world) and that the symmetric address range lies inside the heap; a bad one is recorded
(error codes 7 and 8) and skipped (symm_at returns the local address), and the host raises
OutOfBoundsError at the next launch or check. CPU ranks always check (_cpu.py).

Transports: with TRANSPORT_NVSHMEM false (default) a peer with a mapping is reached by plain
loads/stores and sys-scope acquire/release atomics on its mapped address; a peer without one
through NVSHMEM device calls from libnvshmem_device.bc. TILECOMM_TRANSPORT=nvshmem forces the
NVSHMEM calls for every peer (so that path is tested on one node too).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language import core

from .. import _env
from .abi import (ERR_BAD_PE, ERR_OFF_HEAP, ERR_WAIT_TIMEOUT, STATE_CONTROL, STATE_ERROR, STATE_HEAP_BASE,
                  STATE_HEAP_BYTES, STATE_PEER_BASES, STATE_RANK, STATE_TIMEOUT_NS, STATE_WORLD, record_error)

STATE_ADDR = tl.constexpr(0)
TRANSPORT_NVSHMEM = tl.constexpr(_env.transport() == "nvshmem")
CHECK = tl.constexpr(_env.check())  # TILECOMM_CHECK=1: bounds checks in put/get/symm_at/signal (debug)
COPY_BLOCK = tl.constexpr(4096)  # elements per step of one program: 32 per thread at 4 warps
DISCARD_LINES = tl.constexpr(1024)  # 128-byte L2 lines per step of `discard`: 4 per thread at 8 warps
WAIT_CHECKS_ERRORS_NS = tl.constexpr(1_000_000)  # a wait this long also watches the error record (`wait`)

_NVSHMEM_BC: dict = {}


def nvshmem_bitcode(arch: int | None = None) -> str:
    """Path of NVSHMEM's device bitcode: `libnvshmem_device.bc` (NVSHMEM 3.4) or, in later wheels,
    `libnvshmem_device_sm_<arch>.bc`; from the nvidia-nvshmem wheel or $NVSHMEM_HOME/lib.
    arch: compute capability as 90 for sm_90; default: the current GPU's, else 90."""
    if arch is None:
        import torch

        major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
        arch = 10 * major + minor
    if arch not in _NVSHMEM_BC:
        roots = []
        if os.environ.get("NVSHMEM_HOME"):
            roots.append(os.path.join(os.environ["NVSHMEM_HOME"], "lib"))
        try:
            import nvidia.nvshmem as pkg

            roots += [os.path.join(root, "lib") for root in pkg.__path__]
        except ImportError:
            pass
        names = ("libnvshmem_device.bc", f"libnvshmem_device_sm_{arch}.bc")
        candidates = [os.path.join(root, name) for root in roots for name in names]
        found = [c for c in candidates if os.path.exists(c)]
        if not found:
            raise RuntimeError(f"NVSHMEM device bitcode not found (looked for {names} in {roots or 'no NVSHMEM install'}); "
                               "pip install nvidia-nvshmem-cu13")
        _NVSHMEM_BC[arch] = found[0]
    return _NVSHMEM_BC[arch]


def set_state_address(addr: int) -> None:
    """Called once per process by the cuda backend, before any kernel compiles."""
    global STATE_ADDR
    if STATE_ADDR.value not in (0, addr):
        raise RuntimeError("tilecomm: the GPU device-state block moved; it must live for the whole process")
    STATE_ADDR = tl.constexpr(addr)


_LIBS: dict = {}


def prepare_launch(kwargs: dict) -> dict:
    """Launch options of a tilecomm kernel: NVSHMEM's device library linked (found once per process)."""
    if "extern_libs" in kwargs:
        kwargs = dict(kwargs)
        libs = dict(kwargs["extern_libs"] or {})
        libs.setdefault("libnvshmem_device", nvshmem_bitcode())
        kwargs["extern_libs"] = libs
        return kwargs
    if not _LIBS:
        _LIBS["libnvshmem_device"] = nvshmem_bitcode()
    kwargs["extern_libs"] = _LIBS
    return kwargs


# ---- NVSHMEM device calls (int64 pointers and sizes, as in the C signatures) --------------------
@core.extern
def _nvshmem_ptr(ptr, pe, _semantic=None):
    return core.extern_elementwise("libnvshmem_device", "", [ptr, pe],
                                   {(core.dtype("int64"), core.dtype("int32")): ("nvshmem_ptr", core.dtype("int64"))},
                                   is_pure=False, _semantic=_semantic)


def _rma_block(symbol: str):
    """Declare NVSHMEM's block-scoped RMA call `symbol(dst, src, nbytes, pe)` (int64 pointers/sizes)."""

    @core.extern
    def call(dst, src, nbytes, pe, _semantic=None):
        return core.extern_elementwise(
            "libnvshmem_device", "", [dst, src, nbytes, pe],
            {(core.dtype("int64"), core.dtype("int64"), core.dtype("int64"), core.dtype("int32")):
             (symbol, core.dtype("int32"))}, is_pure=False, _semantic=_semantic)

    return call


_nvshmem_putmem_block = _rma_block("nvshmemx_putmem_block")
_nvshmem_getmem_block = _rma_block("nvshmemx_getmem_block")


@core.extern
def _nvshmem_signal_op(sig, value, op, pe, _semantic=None):
    return core.extern_elementwise(
        "libnvshmem_device", "", [sig, value, op, pe],
        {(core.dtype("int64"), core.dtype("int64"), core.dtype("int32"), core.dtype("int32")):
         ("nvshmemx_signal_op", core.dtype("int32"))}, is_pure=False, _semantic=_semantic)


@core.extern
def _nvshmem_fence(_semantic=None):
    return core.extern_elementwise("libnvshmem_device", "", [], {(): ("nvshmem_fence", core.dtype("int32"))},
                                   is_pure=False, _semantic=_semantic)


@core.extern
def _nvshmem_quiet(_semantic=None):
    return core.extern_elementwise("libnvshmem_device", "", [], {(): ("nvshmem_quiet", core.dtype("int32"))},
                                   is_pure=False, _semantic=_semantic)


# ---- helpers -------------------------------------------------------------------------------------
@triton.jit
def _state_ptr():
    return tl.full((), STATE_ADDR, tl.int64).to(tl.pointer_type(tl.int64))


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _load_acquire(sig):
    """The word at sig, loaded with acquire semantics at system scope: a plain load, so many programs
    polling one word do not queue at the memory's atomic unit as read-modify-writes would."""
    if sig.dtype.element_ty.primitive_bitwidth == 64:
        word = tl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [sig.to(tl.int64)],
                                         dtype=tl.int64, is_pure=False, pack=1)
    else:
        word = tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [sig.to(tl.int64)],
                                         dtype=tl.int32, is_pure=False, pack=1)
    return word.to(sig.dtype.element_ty, bitcast=True)


@triton.jit
def _fence_sys():
    tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _delta(pe):
    """Byte distance from this rank's heap to pe's mapped heap; 0 where pe is not mapped."""
    state = _state_ptr()
    peer_base = tl.load(state + STATE_PEER_BASES + pe)
    return tl.where(peer_base == 0, 0, peer_base - tl.load(state + STATE_HEAP_BASE))


@triton.jit
def _via_nvshmem(pe):
    """True where pe must be reached by NVSHMEM calls: no mapping, or TILECOMM_TRANSPORT=nvshmem."""
    return (tl.load(_state_ptr() + 8 + pe) == 0) | TRANSPORT_NVSHMEM


@triton.jit
def _compare(cur, value, cmp: tl.constexpr):
    if cmp == 0:
        ok = cur == value
    elif cmp == 1:
        ok = cur != value
    elif cmp == 2:
        ok = cur > value
    elif cmp == 3:
        ok = cur <= value
    elif cmp == 4:
        ok = cur < value
    else:
        ok = cur >= value
    return ok


@triton.jit
def _copy(dst, src, nelems, CACHE: tl.constexpr):
    """One program copies nelems elements, COPY_BLOCK per step (16-byte vectors where the compiler can
    prove both pointers aligned, as for heap tensors indexed by multiples of 16 bytes). Whole steps go
    unmasked: a mask `offs < nelems` of unknown divisibility makes every access scalar; only the last step
    is masked."""
    full = nelems // COPY_BLOCK * COPY_BLOCK
    for start in range(0, full, COPY_BLOCK):
        offs = tl.multiple_of(start, COPY_BLOCK) + tl.arange(0, COPY_BLOCK)
        tl.store(dst + offs, tl.load(src + offs, cache_modifier=CACHE))
    if full < nelems:
        offs = full + tl.arange(0, COPY_BLOCK)
        mask = offs < nelems
        tl.store(dst + offs, tl.load(src + offs, mask=mask, cache_modifier=CACHE), mask=mask)


@triton.jit
def _delta_elems(ptr, pe):
    """Element distance from ptr to its twin on pe, written as a product with 4096 / element size so
    that `ptr + delta` keeps the alignment the compiler knows of ptr (heaps are page aligned)."""
    elem = ptr.dtype.element_ty.primitive_bitwidth // 8
    if TRANSPORT_NVSHMEM:
        here = ptr.to(tl.int64)
        delta = _nvshmem_ptr(here, tl.cast(pe, tl.int32)) - here
    else:
        delta = _delta(pe)
    return delta // 4096 * (4096 // elem)


@triton.jit
def _record(code, a, b, c, d):
    state = _state_ptr()
    record_error(tl.load(state + STATE_ERROR).to(tl.pointer_type(tl.int64)), code, tl.load(state + STATE_RANK), a, b, c,
                 d)


@triton.jit
def _in_bounds(ptr, nelems, pe):
    """TILECOMM_CHECK: pe in [0, world) and [ptr, ptr + nelems) inside this rank's heap, for every element of
    a block of pointers or PEs (one answer for the block); a violation is recorded (code 7 bad PE, else 8)."""
    state = _state_ptr()
    world = tl.load(state + STATE_WORLD)
    ok_pe = (pe >= 0) & (pe < world)
    off = ptr.to(tl.int64) - tl.load(state + STATE_HEAP_BASE)
    end = off + tl.cast(nelems, tl.int64) * (ptr.dtype.element_ty.primitive_bitwidth // 8)
    ok = ok_pe & (off >= 0) & (end <= tl.load(state + STATE_HEAP_BYTES))
    one = tl.full((1,), 1, tl.int32)  # any shape -> at least one dimension, for the reductions
    all_ok = tl.min(ok.to(tl.int32) & one, axis=0) != 0
    if tl.min(ok_pe.to(tl.int32) & one, axis=0) == 0:
        _record(ERR_BAD_PE, tl.min(tl.where(ok_pe, 2147483647, pe) + 0 * one, axis=0), world, 0, 0)
    elif not all_ok:
        _record(ERR_OFF_HEAP, tl.min(tl.where(ok, 9223372036854775807, ptr.to(tl.int64)) + 0 * one, axis=0),
                tl.max(pe + 0 * one, axis=0), 0, 0)
    return all_ok


# ---- primitives ------------------------------------------------------------------------------------
@triton.jit
def rank():
    return tl.load(_state_ptr() + STATE_RANK).to(tl.int32)


@triton.jit
def num_ranks():
    return tl.load(_state_ptr() + STATE_WORLD).to(tl.int32)


@triton.jit
def clock(ENABLED: tl.constexpr = True):
    """Nanoseconds from the GPU's global timer (%globaltimer: its ticks may be coarser than 1 ns), int64; 0 where
    ENABLED is False (no read compiled)."""
    if ENABLED:
        return _globaltimer()
    else:
        return tl.zeros((), tl.int64)


@triton.jit
def symm_at(ptr, pe):
    return ptr + tl.where(_allowed(ptr, 1, pe), _delta_elems(ptr, pe), 0)


@triton.jit
def _nbytes(ptr, nelems):
    return tl.cast(nelems, tl.int64) * (ptr.dtype.element_ty.primitive_bitwidth // 8)


@triton.jit
def _allowed(ptr, nelems, pe):
    """True, or under TILECOMM_CHECK=1 whether pe and the symmetric range pass the bounds check."""
    ok = tl.full((), 1, tl.int1)
    if CHECK:
        ok = _in_bounds(ptr, nelems, pe)
    return ok


@triton.jit
def put(dst, src, nelems, pe):
    if _allowed(dst, nelems, pe):
        if _via_nvshmem(pe):
            _nvshmem_putmem_block(dst.to(tl.int64), src.to(tl.int64), _nbytes(dst, nelems), tl.cast(pe, tl.int32))
        else:
            _copy(dst + _delta_elems(dst, pe), src, nelems, "")


@triton.jit
def get(dst, src, nelems, pe):
    if _allowed(src, nelems, pe):
        if _via_nvshmem(pe):
            _nvshmem_getmem_block(dst.to(tl.int64), src.to(tl.int64), _nbytes(dst, nelems), tl.cast(pe, tl.int32))
        else:
            _copy(dst, src + _delta_elems(src, pe), nelems, ".cg")


@triton.jit
def _thread_index():
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _signal_nvshmem(sig, value, pe, op: tl.constexpr):
    """nvshmemx_signal_op is a thread-level call: every thread that runs it performs the operation. Every
    thread fences its own puts and meets the others at a barrier; then, for one word, one thread signals (an
    ADD by each of the program's threads added the value num_warps * 32 times: found on 2 H200s,
    tests/signal_probe.py). Words of a block: elementwise, which Triton may replicate over threads, so
    only SET (idempotent)."""
    _nvshmem_fence()
    tl.debug_barrier()  # every thread's fence before any thread's signal
    if sig.type.is_block():
        tl.static_assert(op == 9, "tcl.signal with a block of words under the nvshmem transport: SIGNAL_SET only "
                                  "(signal each word on its own for SIGNAL_ADD)")
        _nvshmem_signal_op(sig.to(tl.int64), tl.cast(value, tl.int64), op, tl.cast(pe, tl.int32))
    else:
        if _thread_index() == 0:
            _nvshmem_signal_op(sig.to(tl.int64), tl.cast(value, tl.int64), op, tl.cast(pe, tl.int32))


@triton.jit
def signal(sig, value, pe, op: tl.constexpr):
    tl.debug_barrier()  # every thread of the program has issued its stores
    if _allowed(sig, 1, pe):
        _signal(sig, value, pe, op)


@triton.jit
def _signal(sig, value, pe, op: tl.constexpr):
    if _via_nvshmem(pe):
        _signal_nvshmem(sig, value, pe, op)
    else:
        target = sig + _delta_elems(sig, pe)
        if op == 9:
            tl.atomic_xchg(target, tl.cast(value, sig.dtype.element_ty), sem="release", scope="sys")
        else:
            tl.atomic_add(target, tl.cast(value, sig.dtype.element_ty), sem="release", scope="sys")


@triton.jit
def wait(sig, value, cmp: tl.constexpr):
    """Spin on the local word at sig, or on a block of words until every one holds (their acquire loads
    issued together: one round trip per poll, however many words); past the timeout, record the error
    (the lowest failing word's address and value) and return. From WAIT_CHECKS_ERRORS_NS on, a wait also reads
    the error record once per WAIT_CHECKS_ERRORS_NS and returns once an error is recorded (e.g. an earlier
    wait of this rank timed out: a peer is gone, and the kernels queued behind the first timeout give up in a
    millisecond each instead of a timeout each; the host raises the recorded error at its next launch or check)."""
    state = _state_ptr()
    timeout = tl.load(state + STATE_TIMEOUT_NS)
    err = tl.load(state + STATE_ERROR).to(tl.pointer_type(tl.int64))  # the record (pinned host memory)
    start = _globaltimer()
    one = tl.full((1,), 1, tl.int32)  # any shape -> at least one dimension, for the reductions
    cur = _load_acquire(sig)
    ok = tl.min(_compare(cur, value, cmp).to(tl.int32) & one, axis=0)
    check_at = tl.full((), WAIT_CHECKS_ERRORS_NS, tl.int64)
    while ok == 0:
        waited = _globaltimer() - start
        if waited > check_at:  # once a millisecond: the record is host memory, a read crosses the bus
            check_at = waited + WAIT_CHECKS_ERRORS_NS
            if tl.load(err, volatile=True) != 0:
                ok = tl.full((), 3, tl.int32)  # (not recorded again: the first error stands)
        if ok == 0:
            if waited > timeout:
                bad = _compare(cur, value, cmp) == 0
                addr = tl.min(tl.where(bad, sig.to(tl.int64), 9223372036854775807) + 0 * one, axis=0)
                seen = tl.max(tl.where(sig.to(tl.int64) == addr, cur.to(tl.int64), -9223372036854775807) + 0 * one,
                              axis=0)
                _record(ERR_WAIT_TIMEOUT, addr, value, seen, cmp)
                ok = tl.full((), 2, tl.int32)
            else:
                cur = _load_acquire(sig)
                ok = tl.min(_compare(cur, value, cmp).to(tl.int32) & one, axis=0)
    tl.debug_barrier()
    return cur


@triton.jit
def consume_token(x, token):
    dep = tl.inline_asm_elementwise("and.b64 $0, $1, 0;", "=l,l", [token.to(tl.int64)], dtype=tl.int64,
                                    is_pure=False, pack=1)
    return x + dep


@triton.jit
def fence():
    if TRANSPORT_NVSHMEM:
        _nvshmem_fence()
    else:
        _fence_sys()


@triton.jit
def quiet():
    tl.debug_barrier()
    if TRANSPORT_NVSHMEM:
        _nvshmem_quiet()
    else:
        _fence_sys()


@triton.jit
def proxy_fence(x):
    return tl.inline_asm_elementwise("fence.proxy.async.global; mov.b32 $0, $1;", "=r,r", [x.to(tl.int32)],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def discard(ptr, nelems):
    """The program has read ptr[0 : nelems] (this GPU's memory) and nothing reads it before it is written again:
    after a barrier of the program (every thread's loads of the range are done), drop the whole 128-byte L2 lines
    inside the range without writing them back to memory (PTX discard.global.L2, sm_80+). Lines the range covers
    only in part are left alone. To the memory model a discard is a weak write, so a later signal's release orders
    it before whatever the signalled peer writes there next."""
    tl.debug_barrier()
    elem = ptr.dtype.element_ty.primitive_bitwidth // 8
    start = ptr.to(tl.int64)
    first = (start + 127) // 128
    end = (start + tl.cast(nelems, tl.int64) * elem) // 128
    for line in range(first, end, DISCARD_LINES):
        lines = line + tl.arange(0, DISCARD_LINES)
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $1, 0; @p discard.global.L2 [$2], 128; "
                                  "mov.u32 $0, 0; }", "=r,r,l", [(lines < end).to(tl.int32), lines * 128],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def bulk_wait(x):
    # cp.async.bulk groups belong to the thread that issued them (Triton's elected thread): every thread
    # runs the wait, so that one completes its writes; the fence then orders them before generic accesses
    done = tl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.b32 $0, $1;",
                                     "=r,r", [x.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()
    return done


@triton.jit
def barrier_all():
    state = _state_ptr()
    ctrl = tl.load(state + STATE_CONTROL).to(tl.pointer_type(tl.int64))
    me = tl.load(state + STATE_RANK).to(tl.int32)
    world = tl.load(state + STATE_WORLD).to(tl.int32)
    epoch = tl.load(ctrl) + 1
    tl.debug_barrier()
    tl.store(ctrl, epoch)
    flags = ctrl + 8
    for pe in range(0, world):
        signal(flags + me, epoch, pe, 9)
    for pe in range(0, world):
        wait(flags + pe, epoch, 5)
