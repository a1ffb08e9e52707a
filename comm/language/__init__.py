"""`tilecomm.language` (import as `tcl`): OpenSHMEM-style primitives for Triton kernels.

Use them inside `@tilecomm.jit` kernels. Each primitive has a GPU implementation (compiled by
Triton: NVLink loads/stores and atomics, NVSHMEM device calls for unmapped peers) and a CPU one
(run by the Triton interpreter on the shared-memory heap); one kernel source serves both.

All operations act for the whole program (one Triton program = one CUDA block):

    rank() / num_ranks()            this PE and the number of PEs (int32)
    symm_at(ptr, pe)                address of the same symmetric object on PE pe (directly mapped peers)
    put(dst, src, nelems, pe)       copy nelems elements from local src to symmetric dst on pe
    get(dst, src, nelems, pe)       copy nelems elements from symmetric src on pe to local dst
    signal(sig, value, pe, op)      op SIGNAL_SET or SIGNAL_ADD on pe's signal word; release: this
                                    program's earlier puts/stores to pe land before the signal does
                                    (once per program; a block of words: SIGNAL_SET only under
                                    TILECOMM_TRANSPORT=nvshmem, a compile error otherwise)
    wait(sig, value, cmp)           acquire-spin until the local word at sig (or every word of a block
                                    of pointers, polled together: one round trip each poll) compares
                                    cmp to value; returns the word(s) (a token). Past TILECOMM_TIMEOUT_S
                                    it gives up: on CPU it raises WaitTimeoutError, on GPU it records
                                    the error and the host raises WaitTimeoutError at the next
                                    launch/check (either way naming the first word that did not hold);
                                    a GPU wait that has lasted 1 ms also gives up once any error is
                                    recorded (the kernels queued behind a first timeout end at once).
    consume_token(x, token)         x, made dependent on token (keeps loads after the wait)
    fence() / quiet()               order / complete this program's earlier puts
    proxy_fence(x)                  x (int32), after this program's earlier generic accesses (a wait's
                                    acquire, plain stores) are ordered before its later TMA (async-proxy)
                                    loads and stores: wait, then proxy_fence, then read a peer's data by TMA
    bulk_wait(x)                    x (int32), after this program's TMA stores are complete and ordered
                                    before its later generic accesses: TMA stores, bulk_wait, then signal
                                    (Triton waits only until a TMA store has read its shared memory)
    discard(ptr, nelems)            the program has read local ptr[0:nelems] and nothing reads it before it is
                                    written again: GPU: its whole 128-byte L2 lines are dropped without
                                    being written back (after a barrier of the program); CPU: overwritten
                                    with a poison value. A later signal's release orders it like a store
    barrier_all()                   all PEs meet (call from one program per kernel per rank)
    clock(ENABLED=True)             a timestamp in ns (int64) for a kernel's own timing: GPU %globaltimer, CPU
                                    the host's monotonic clock; 0, with no read compiled, where the constexpr
                                    ENABLED is False (a kernel whose timing is a compile-time option:
                                    CollectiveState.trace, LowLatencyConfig.trace)

Signal words are int64 symmetric tensors (int32 works too). Compare ops: CMP_EQ, CMP_NE, CMP_GT,
CMP_GE, CMP_LT, CMP_LE (NVSHMEM's values).
"""
from __future__ import annotations

import triton.language as tl

from ..jit import TileKernel
from . import abi as _c
from . import _cpu, _gpu

SIGNAL_SET = tl.constexpr(_c.SIGNAL_SET)
SIGNAL_ADD = tl.constexpr(_c.SIGNAL_ADD)
CMP_EQ = tl.constexpr(_c.CMP_EQ)
CMP_NE = tl.constexpr(_c.CMP_NE)
CMP_GT = tl.constexpr(_c.CMP_GT)
CMP_LE = tl.constexpr(_c.CMP_LE)
CMP_LT = tl.constexpr(_c.CMP_LT)
CMP_GE = tl.constexpr(_c.CMP_GE)


def _primitive(name: str) -> TileKernel:
    return TileKernel(getattr(_gpu, name).fn, cpu_impl=getattr(_cpu, name))


rank = _primitive("rank")
num_ranks = _primitive("num_ranks")
symm_at = _primitive("symm_at")
put = _primitive("put")
get = _primitive("get")
signal = _primitive("signal")
wait = _primitive("wait")
consume_token = _primitive("consume_token")
fence = _primitive("fence")
quiet = _primitive("quiet")
barrier_all = _primitive("barrier_all")
proxy_fence = _primitive("proxy_fence")
bulk_wait = _primitive("bulk_wait")
discard = _primitive("discard")
clock = _primitive("clock")

__all__ = ["rank", "num_ranks", "symm_at", "put", "get", "signal", "wait", "consume_token", "fence", "quiet",
           "barrier_all", "proxy_fence", "bulk_wait", "discard", "clock", "SIGNAL_SET", "SIGNAL_ADD", "CMP_EQ", "CMP_NE",
           "CMP_GT", "CMP_LE", "CMP_LT", "CMP_GE"]
