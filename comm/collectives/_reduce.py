"""reduce_scatter_tensor's kernel: one launch per call, no host synchronisation, on the pairs kernel's headers,
waits and epochs (_exchange.py: its docstring's protocol, tickets and epoch apply here too).

Reduce-scatter runs C = W * P programs (one per SM, as the pairs kernel) that each own an output column (chunks
q, q + C, ...) and reduce every writer's chunk in rank order (fp32, int64 or fp64 accumulation); column q has one
slot per writer, k * C + q, in words and a ring of its own (CollectiveState.rs_words, rs_ring), with ring chunks of
the power of two at most 1/W of a pair slot's. Its steps are the pairs kernel's: a staged writer pushes its chunk i
for each reader into that reader's ring and signals it; the reader reduces from its own ring (and straight from a
writer's tensor where that writer's input is on the heap); a writer pushes chunk i + 1 before it reduces chunk i,
so that its pushes overlap its readers' reductions. With STAGGER (CollectiveState.rs_stagger, on by default) odd
columns reduce chunk i first, so that half the programs push while half reduce (2 H100s, 2026-11-26: 255 µs against
325 µs unstaggered, NCCL 314). (Until 2026-11-26 the writers staged into their own ring and the readers pulled:
0.50x NCCL at W = 4, against 0.93x in place.)

Reduce-scatter has a ring of its own because a push lands in a peer's ring while that peer may still be in
its previous collective: two pairs calls in a row are kept apart by the per-slot reuse wait, but an
all_to_all's reader and a reduce-scatter's writer use different slots, so nothing orders them.
"""
from __future__ import annotations

import triton.language as tl

from .. import language as tcl
from ..jit import jit
from ..language.abi import take_ticket
from ._copy import copy_elements, load
from ._exchange import _chunk_size, _chunks_of, _peer_delta, _read_header, _store_header, _words

# CollectiveState.trace: what each program of a traced call writes to its row of the trace [programs, TRACE_WORDS]
# (int64; times from tcl.clock, ns): when it started, finished its headers (its chunk 0 pushed, every writer's header
# read) and ended; its chunks; and, summed over its steps, the time its reduce steps waited for the writers' ready
# signals, its push steps waited for ring slots (the readers' done signals), and the whole of its push and reduce steps
# (those waits included)
TRACE_FIELDS = ("start", "headers", "end", "chunks", "wait_ready", "wait_slot", "push", "reduce")
TRACE_WORDS = len(TRACE_FIELDS)
_TRACE_WORDS = tl.constexpr(TRACE_WORDS)


@jit
def _combine(acc, x, OP: tl.constexpr):
    if OP == 0:
        acc = acc + x
    elif OP == 1:
        acc = tl.maximum(acc, x)
    elif OP == 2:
        acc = tl.minimum(acc, x)
    else:
        acc = acc * x
    return acc


@jit
def _pick(vec, ps, p):
    """vec[p] as a scalar (vec is a small per-rank vector held in registers)."""
    return tl.sum(tl.where(ps == p, vec, 0), axis=0)


@jit
def _reduce_span(out_ptr, heap_ptr, src_offs, ps, W, c, s, length, MASKED: tl.constexpr, OP: tl.constexpr,
                 ACC: tl.constexpr, AVG: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, STREAM: tl.constexpr,
                 KEEP: tl.constexpr):
    """out[c + s : c + s + BLOCK] = op over writers p (rank order) of heap[src_offs[p] + s + ...]; src_offs
    holds each writer's chunk address as an element offset from this rank's heap (peer distance included).
    length is a multiple of VEC (16-byte vectors need n * element size % 16 == 0): the mask has VEC-element
    granules, so masked spans still move 16-byte vectors. KEEP / STREAM: the L2 policies of the writers' chunks
    and of the output (CollectiveState.ring_hints; "" for none)."""
    offs = s + tl.arange(0, BLOCK)
    mask = offs < length // VEC * VEC
    acc = tl.zeros((BLOCK,), ACC)
    for p in range(0, W):
        src = heap_ptr + _pick(src_offs, ps, p) // VEC * VEC
        if MASKED:
            x = load(src + offs, mask, KEEP).to(ACC)
        else:
            x = load(src + offs, None, KEEP).to(ACC)
        acc = tl.where(p == 0, x, _combine(acc, x, OP))
    if AVG:
        acc = acc / W
    dst = out_ptr + c // VEC * VEC
    if MASKED:
        tl.store(dst + offs, acc.to(out_ptr.dtype.element_ty), mask=mask, eviction_policy=STREAM)
    else:
        tl.store(dst + offs, acc.to(out_ptr.dtype.element_ty), eviction_policy=STREAM)


@jit
def _push_chunk(heap_ptr, in_ptr, dst, ring_at, n, c, chunk, BLOCK: tl.constexpr, VEC: tl.constexpr,
                STREAM: tl.constexpr, KEEP: tl.constexpr):
    """reduce_scatter: elements c .. c + chunk of my input's block for dst (in[dst * n + c ...]) into dst's
    ring at element offset ring_at (stores over NVLink)."""
    copy_elements(heap_ptr, _peer_delta(heap_ptr, dst) + ring_at, in_ptr, dst.to(tl.int64) * n + c,
                  tl.minimum(chunk, n - c), BLOCK, VEC, STREAM, KEEP)


@jit
def _push_step(heap_ptr, in_ptr, ready_ptr, done_ptr, me, W, P, q, i, chunk, n64, ring_off, base,
               CHUNK: tl.constexpr, DEPTH: tl.constexpr, PUSH_BLOCK: tl.constexpr, VEC: tl.constexpr,
               STREAM: tl.constexpr, KEEP: tl.constexpr, TRACE: tl.constexpr):
    """reduce_scatter, staged writer: my chunk i of column q into every reader's ring slot i % DEPTH, each once
    that reader is done with what the slot held; then the W ready signals (kernel docstring: one drain).
    Returns the ns it waited for ring slots (TRACE; else 0)."""
    c = (q + i * P).to(tl.int64) * chunk
    waited = tl.zeros((), tl.int64)
    for k in range(0, W):
        dst = (me + k) % W
        slot = k * P + q
        if i >= DEPTH:  # the reader must be done with what this ring slot held
            t0 = tcl.clock(TRACE)
            tcl.wait(done_ptr + slot, base + i + 1 - DEPTH, tcl.CMP_GE)
            waited += tcl.clock(TRACE) - t0
        _push_chunk(heap_ptr, in_ptr, dst, ring_off + slot * DEPTH * CHUNK + (i % DEPTH) * CHUNK, n64, c, chunk,
                    PUSH_BLOCK, VEC, STREAM, KEEP)
    for k in range(0, W):
        tcl.signal(ready_ptr + k * P + q, base + i + 1, (me + k) % W, tcl.SIGNAL_SET)
    return waited


@jit
def _reduce_step(out_ptr, heap_ptr, ready_ptr, done_ptr, in_place, ps, base_offs, me, W, P, q, i, n_chunks, chunk,
                 n64, base, OP: tl.constexpr, ACC: tl.constexpr, AVG: tl.constexpr, CHUNK: tl.constexpr,
                 DEPTH: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, STREAM: tl.constexpr,
                 KEEP: tl.constexpr, DISCARD: tl.constexpr, TRACE: tl.constexpr):
    """reduce_scatter, reader: output chunk i of column q = op over the writers' chunk i (staged writers' from my
    ring once they signal it, in-place writers' from their tensors), then tell the staged writers it is done.
    DISCARD: the staged writers' chunks' L2 lines are dropped first, unwritten (tcl.discard). Returns the ns it
    waited for the writers' ready signals (TRACE; else 0)."""
    c = (q + i * P).to(tl.int64) * chunk
    length = tl.minimum(chunk, n64 - c)
    t0 = tcl.clock(TRACE)
    for p in range(0, W):  # staged writers: their chunk i is in my ring
        if _pick(in_place, ps, p) == 0:
            tcl.wait(ready_ptr + ((me + W - p) % W) * P + q, base + i + 1, tcl.CMP_GE)
    waited = tcl.clock(TRACE) - t0
    src_offs = base_offs + tl.where(in_place == 0, (i % DEPTH) * CHUNK, c)
    full = length // BLOCK * BLOCK
    for s in range(0, full, BLOCK):  # whole blocks unmasked (16-byte vectors), then the tail
        _reduce_span(out_ptr, heap_ptr, src_offs, ps, W, c, tl.multiple_of(s, BLOCK), length, False,
                     OP, ACC, AVG, BLOCK, VEC, STREAM, KEEP)
    if full < length:
        _reduce_span(out_ptr, heap_ptr, src_offs, ps, W, c, full, length, True, OP, ACC, AVG, BLOCK, VEC, STREAM,
                     KEEP)
    if DISCARD:  # (before the done signals, whose release orders them)
        for p in range(0, W):
            if _pick(in_place, ps, p) == 0:
                tcl.discard(heap_ptr + _pick(src_offs, ps, p), length)
    if i < n_chunks - 1:  # the last chunk's "done" is the final signal below
        for p in range(0, W):
            if _pick(in_place, ps, p) == 0:
                tcl.signal(done_ptr + ((me + W - p) % W) * P + q, base + i + 1, p, tcl.SIGNAL_SET)
    return waited


@jit(do_not_specialize=["ring_off", "in_heap_off", "n", "P"])
def _reduce_kernel(in_ptr, out_ptr, heap_ptr, words_ptr, err_ptr, ring_off, in_heap_off, n, P, trace_ptr,
                   OP: tl.constexpr, ACC: tl.constexpr, AVG: tl.constexpr, IN_PLACE: tl.constexpr, CHUNK: tl.constexpr, DEPTH: tl.constexpr, BLOCK: tl.constexpr,
                   PUSH_BLOCK: tl.constexpr, VEC: tl.constexpr, MAX_W: tl.constexpr, TAG: tl.constexpr,
                   STAGGER: tl.constexpr, STREAM: tl.constexpr, KEEP: tl.constexpr, BALANCED: tl.constexpr,
                   DISCARD: tl.constexpr, TRACE: tl.constexpr):
    """reduce_scatter_tensor: out[j] = op over ranks p, in rank order, of p's in[me * n + j]. Program q
    owns output chunks q, q + P, ... and uses the slots k * P + q of every k (P here is the column count the
    host passes, C = W * programs_per_peer; words_ptr is its own word set, ring_off its own ring). As a
    writer, slot k * P + q is mine towards the reader me + k: its header and, staged, my chunks pushed into
    that reader's ring. As a reader, slot k * P + q holds the writer me - k's. BLOCK: elements per reduce step
    (W writers' blocks loaded at once), PUSH_BLOCK: per push step.

    A writer pushes its chunk to every reader before it signals any of them: a signal's release waits until the
    program's stores so far have landed, so signalling each reader right after its chunk made the W pushes of a
    step one after another, each waiting out its own transfer; pushed first, the chunks to different readers
    cross the links together and the first signal waits once for all of them (the later signals find nothing
    left to wait for). The waits between them are on the readers' earlier "done" words, which never depend on
    this step's signals. BALANCED: equal chunks per program (_exchange._chunk_size). DISCARD
    (CollectiveState.ring_discard): reduced ring chunks leave L2 unwritten (_reduce_step). TRACE
    (CollectiveState.trace): program q writes where its time went to trace_ptr[q, :] (TRACE_FIELDS)."""
    meta_ptr, ready_ptr, done_ptr, epoch_ptr, ticket_ptr = _words(words_ptr, P)
    q = take_ticket(ticket_ptr, tl.num_programs(0)).to(tl.int32)
    row = trace_ptr + q.to(tl.int64) * _TRACE_WORDS  # (the trace's times go to memory at once: not held in registers)
    if TRACE:
        tl.store(row + 0, tcl.clock())
    me = tcl.rank()
    W = tcl.num_ranks()
    e = tl.load(epoch_ptr + q) + 1
    tl.debug_barrier()  # every warp reads the old epoch before thread 0 stores the new one (docstring: "The epoch")
    base = e << 32
    last = ((e + 1) << 32) - 1
    n64 = n + 0 * e
    chunk = _chunk_size(n64, P, CHUNK, BALANCED)
    n_chunks = _chunks_of(n64, q, P, chunk)
    c0 = q.to(tl.int64) * chunk
    for k in range(0, W):  # my header (staged: with my chunk 0, pushed first) into every reader's words
        dst = (me + k) % W
        slot = k * P + q
        tl.store(epoch_ptr + slot, e)
        if e > 1:  # dst is done with my previous call: its header word, ring region and (in place) my input
            tcl.wait(done_ptr + slot, base - 1, tcl.CMP_GE)
        if not IN_PLACE:
            if n_chunks > 0:
                _push_chunk(heap_ptr, in_ptr, dst, ring_off + slot * DEPTH * CHUNK, n64, c0, chunk, PUSH_BLOCK, VEC,
                            STREAM, KEEP)
        _store_header(tcl.symm_at(meta_ptr, dst), slot, in_heap_off + dst.to(tl.int64) * n64, n64,
                      tl.full((), IN_PLACE, tl.int64), TAG)
    for k in range(0, W):  # then the ready signals (one drain for every reader's chunk 0 and header)
        tcl.signal(ready_ptr + k * P + q, base + (n_chunks > 0).to(tl.int64) * (1 - IN_PLACE), (me + k) % W,
                   tcl.SIGNAL_SET)
    for k in range(0, W):  # every writer's header (the counts must agree: n everywhere)
        _read_header(meta_ptr, ready_ptr, err_ptr, k * P + q, (me + W - k) % W, n64, base, TAG, True)
    # the headers, read once: is each writer's data in place (on its heap), or pushed into my ring
    ps = tl.arange(0, MAX_W)
    slots = ((me + W - ps) % W) * P + q
    in_place = tl.load(meta_ptr + 4 * slots + 2, mask=ps < W, other=1, cache_modifier=".cg")
    base_offs = tl.where(in_place == 0, ring_off + slots * DEPTH * CHUNK,
                         _peer_delta(heap_ptr, ps % W) + tl.load(meta_ptr + 4 * slots, mask=ps < W, other=0,
                                                                 cache_modifier=".cg"))
    # STAGGER: odd columns reduce chunk i before pushing chunk i + 1, even ones after, so that at any moment about
    # half the programs push (NVLink) while the other half reduce (local memory), instead of all of them doing each
    # in turn. Column q only waits for column q (on every rank, the same parity), so either order is deadlock-free.
    reduce_first = (q % 2 == 1) & STAGGER
    if TRACE:
        tl.store(row + 1, tcl.clock())
    wait_ready = tl.zeros((), tl.int64)
    wait_slot = tl.zeros((), tl.int64)
    push_ns = tl.zeros((), tl.int64)
    reduce_ns = tl.zeros((), tl.int64)
    for i in range(0, n_chunks):
        for step in range(0, 2):  # step 0: reduce if this column reduces first, else push; step 1: the other
            t0 = tcl.clock(TRACE)
            if (step == 0) == reduce_first:
                wait_ready += _reduce_step(out_ptr, heap_ptr, ready_ptr, done_ptr, in_place, ps, base_offs, me, W, P,
                                           q, i, n_chunks, chunk, n64, base, OP, ACC, AVG, CHUNK, DEPTH, BLOCK, VEC,
                                           STREAM, KEEP, DISCARD, TRACE)
                reduce_ns += tcl.clock(TRACE) - t0
            elif not IN_PLACE:
                if i + 1 < n_chunks:  # chunk 0 went with the header
                    wait_slot += _push_step(heap_ptr, in_ptr, ready_ptr, done_ptr, me, W, P, q, i + 1, chunk, n64,
                                            ring_off, base, CHUNK, DEPTH, PUSH_BLOCK, VEC, STREAM, KEEP, TRACE)
                    push_ns += tcl.clock(TRACE) - t0
    # finish: every writer may reuse its ring region on me and its words; my input, where readers load it
    # in place, is free once they say they are done (a staged writer exits: its next call waits instead)
    for p in range(0, W):
        tcl.signal(done_ptr + ((me + W - p) % W) * P + q, last, p, tcl.SIGNAL_SET)
    if IN_PLACE:
        for k in range(0, W):
            tcl.wait(done_ptr + k * P + q, last, tcl.CMP_GE)
    if TRACE:
        tl.store(row + 2, tcl.clock())
        tl.store(row + 3, n_chunks.to(tl.int64))
        tl.store(row + 4, wait_ready)
        tl.store(row + 5, wait_slot)
        tl.store(row + 6, push_ns)
        tl.store(row + 7, reduce_ns)
