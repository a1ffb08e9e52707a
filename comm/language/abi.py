"""The device ABI: every number that host code and kernels must agree on, and the two kernel helpers that
write to shared device words, in one module.

- Signal operations and comparisons, with NVSHMEM's values (tests/test_native.py checks them against its
  headers).
- The GPU device-state block (backend_cuda.py writes it, language/_gpu.py reads it): int64 words, one block
  per process and device, its address compiled into kernels.
- The error record (error_record.ErrorRecord: CPU a tensor, GPU pinned host memory): int64 words
  [code, rank, a, b, c, d], filled once by the first kernel that records an error, raised by the host.
- `record_error` (the one way a kernel fills the record) and `take_ticket` (a program's index in the order
  programs start: what keeps kernels whose programs wait for each other deadlock-free).
"""
from __future__ import annotations

from enum import IntEnum

import numpy as np
import triton
import triton.language as tl

SIGNAL_SET = 9
SIGNAL_ADD = 10

CMP_EQ, CMP_NE, CMP_GT, CMP_LE, CMP_LT, CMP_GE = 0, 1, 2, 3, 4, 5
CMP_NAMES = {CMP_EQ: "==", CMP_NE: "!=", CMP_GT: ">", CMP_LE: "<=", CMP_LT: "<", CMP_GE: ">="}


class StateWord(IntEnum):
    """The GPU device-state block's words."""

    RANK = 0
    WORLD = 1
    TIMEOUT_NS = 2  # the wait timeout
    CONTROL = 3  # address of the runtime's control words on the symmetric heap
    ERROR = 4  # address of the error record
    HEAP_BASE = 5  # this rank's heap base
    HEAP_BYTES = 6
    PEER_BASES = 8  # [8 + pe]: rank pe's heap base as mapped here (0: not mapped, reached through NVSHMEM)


ERROR_WORDS = 6  # the error record: [code, rank, a, b, c, d]


class ErrorCode(IntEnum):
    """The error record's codes, and what a, b, c, d hold."""

    WAIT_TIMEOUT = 1  # a = signal address, b = expected, c = last seen, d = comparison
    COUNT_MISMATCH = 2  # a collective's counts disagree: a = peer, b = expected, c = offered
    BAD_EXPERT = 3  # an expert id outside [-1, E): a = token, b = id, c = E
    CAPACITY = 4  # more rows for one (expert, source rank) than the low-latency capacity: a = expert, b, c = capacity
    OP_MISMATCH = 6  # ranks in different collectives: a = peer, b = this rank's tag, c = the peer's
    BAD_PE = 7  # TILECOMM_CHECK=1: a tcl primitive's PE out of range: a = pe, b = world
    OFF_HEAP = 8  # TILECOMM_CHECK=1: an address off the symmetric heap: a = address, b = pe


# the words and codes as kernels use them (a jit function reads module globals only as constexprs)
STATE_RANK = tl.constexpr(int(StateWord.RANK))
STATE_WORLD = tl.constexpr(int(StateWord.WORLD))
STATE_TIMEOUT_NS = tl.constexpr(int(StateWord.TIMEOUT_NS))
STATE_CONTROL = tl.constexpr(int(StateWord.CONTROL))
STATE_ERROR = tl.constexpr(int(StateWord.ERROR))
STATE_HEAP_BASE = tl.constexpr(int(StateWord.HEAP_BASE))
STATE_HEAP_BYTES = tl.constexpr(int(StateWord.HEAP_BYTES))
STATE_PEER_BASES = tl.constexpr(int(StateWord.PEER_BASES))
ERR_WAIT_TIMEOUT = tl.constexpr(int(ErrorCode.WAIT_TIMEOUT))
ERR_COUNT_MISMATCH = tl.constexpr(int(ErrorCode.COUNT_MISMATCH))
ERR_BAD_EXPERT = tl.constexpr(int(ErrorCode.BAD_EXPERT))
ERR_CAPACITY = tl.constexpr(int(ErrorCode.CAPACITY))
ERR_OP_MISMATCH = tl.constexpr(int(ErrorCode.OP_MISMATCH))
ERR_BAD_PE = tl.constexpr(int(ErrorCode.BAD_PE))
ERR_OFF_HEAP = tl.constexpr(int(ErrorCode.OFF_HEAP))


def compare_numpy(words, value, cmp: int):
    ops = {CMP_EQ: np.equal, CMP_NE: np.not_equal, CMP_GT: np.greater, CMP_LE: np.less_equal,
           CMP_LT: np.less, CMP_GE: np.greater_equal}
    return ops[cmp](words, value)


@triton.jit
def record_error(err_ptr, code, rank, a, b, c, d):
    """Fill the error record at err_ptr unless an error is there already (first error wins). Plain stores: on
    GPUs the record is pinned host memory. tl.cast, not .to(): an int argument equal to 1 arrives as a constexpr.
    On GPUs Triton issues these scalar stores from the program's thread 0 only: a call that only another warp
    reaches records nothing (a wait timing out in one warp alone; waits whose value every warp agrees on time out
    in warp 0 too, see collectives/_exchange.py, "The epoch")."""
    if tl.load(err_ptr, volatile=True) == 0:
        tl.store(err_ptr + 1, tl.cast(rank, tl.int64))
        tl.store(err_ptr + 2, tl.cast(a, tl.int64))
        tl.store(err_ptr + 3, tl.cast(b, tl.int64))
        tl.store(err_ptr + 4, tl.cast(c, tl.int64))
        tl.store(err_ptr + 5, tl.cast(d, tl.int64))
        tl.store(err_ptr, code)


@triton.jit
def take_ticket(counter_ptr, n):
    """0, 1, ... n - 1 in the order the launch's n programs get here (the last resets the counter for the next
    launch, which starts after this one ends). A program that waits for programs of its own launch, or for
    programs of the same index on other ranks, takes its index from its ticket, not from its block index: the
    programs running are then always the lowest indices, on any schedule, so the lowest unfinished index
    always runs and no wait can deadlock, even when the grid does not fit the GPU at once or shares it with
    another kernel."""
    ticket = tl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")
    if ticket == n - 1:  # every ticket of this launch is taken
        tl.store(counter_ptr, 0)
    return ticket
