"""Device helpers the dispatch kernels share (plain `triton.jit` functions, usable on both backends).

    last_program(counter_ptr)     True in exactly one program of the launch: the last to get here.
                                  Every program's earlier stores (local and to peers) happen-before
                                  whatever that program does next, e.g. the signal that hands the
                                  buffers to a peer. Resets the counter for the next launch.
    last_of(counter_ptr, n)       the same among the n programs of a launch that call it (one role).
    peer_offset(ptr, pe, ALIGN)   element offset from ptr to the same symmetric object on pe
                                  (vector of pes allowed), with the alignment hint that keeps stores
                                  through it 16-byte vectorised (heaps are page aligned).
    wait_all(sig_ptr, value, W)   acquire-wait until sig[0..W) >= value (8 words per poll: one round trip
                                  for up to 8 ranks).
    signal_all(sig_ptr, value, W) SET sig on every rank (release: this program's stores land first).

Programs take their roles from `tilecomm.language.abi.take_ticket` and record errors with its
`record_error` (codes: abi.ErrorCode), as every kernel of the package does.
"""
from __future__ import annotations

import triton
import triton.language as tl

import tilecomm.language as tcl


@triton.jit
def last_program(counter_ptr):
    return last_of(counter_ptr, tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2))


@triton.jit
def last_of(counter_ptr, n):
    # Every thread's earlier stores happen-before the count: the barrier orders them before the one thread's
    # atomic, whose release at system scope is cumulative (the pattern of CUDA's grid sync: bar.sync, then one
    # thread's fence and atomic). Until 2026-11-28 every thread also fenced at system scope first: in the
    # low-latency dispatch at world 1 (ncu, one H200) the receivers' fences took more stall samples than their copies.
    tl.debug_barrier()
    old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    last = old == n - 1
    if last:
        tl.store(counter_ptr, 0)
    return last


@triton.jit
def peer_offset(ptr, pe, ALIGN: tl.constexpr):
    delta = (tcl.symm_at(ptr, pe).to(tl.int64) - ptr.to(tl.int64)) // (ptr.dtype.element_ty.primitive_bitwidth // 8)
    return tl.multiple_of(delta, ALIGN)


@triton.jit
def wait_all(sig_ptr, value, W):
    lanes = tl.arange(0, 8)
    for r0 in range(0, W, 8):
        tcl.wait(sig_ptr + tl.minimum(r0 + lanes, W - 1), value, tcl.CMP_GE)  # lanes past W: the last word again


@triton.jit
def signal_all(sig_ptr, value, W):
    for r in range(0, W):
        tcl.signal(sig_ptr, value, r, tcl.SIGNAL_SET)
