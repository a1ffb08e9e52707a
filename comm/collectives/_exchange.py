"""The kernels behind tilecomm's collectives: one launch per call, no host synchronisation.

Every call runs one persistent grid of `W * P` programs (W ranks, P programs per peer slot, fixed for
the runtime's life, so every rank runs the same programs in the same order). Program `pid = k * P + q`
on rank `me` serves one *pair slot*: it sends to `dst = me + k` and receives from `src = me - k`
(mod W); the program with the same pid on `dst` is its reader, the one on `src` its writer. The self
pair (k = 0) takes exactly the same path as a peer: a store through `symm_at(ptr, me)` is the NVLink
store at distance 0.

Per call and slot (`e` = the slot's epoch, a device word the program bumps, so nothing is passed from
the host and a captured CUDA graph replays correctly):

0. reuse    (from the second call on) the writer waits for the reader's final `done` of its previous
            call (`e << 32 - 1`): from then on the reader's ring region and header word for this slot are
            free. The reader sent it at the end of that call, so the wait is usually one local load.
   open     (CollectiveState.direct only, off by default) first of all, the reader stores its receive header
            into the *writer's* words (`_open`: where the writer may store this pair's data in the reader's
            heap, its output's place, or -1 where its output is not on the heap; how many elements it takes)
            and SETs the writer's `done[pid] = e << 32`. A writer whose own output is on the heap waits for
            that (`done >= e << 32` implies the reuse wait) and reads the receive header: where the reader's
            output is on the heap too, the pair goes DIRECT (step 2).
1. header   the writer stores `meta[pid] = (heap offset of its data, element count, in place, tag)`
            into the *reader's* words and SETs the reader's `ready[pid] = e << 32` (staged:
            `e << 32 | 1`: its chunk 0 is in the reader's ring slot 0 already, so a pair of one chunk per
            program costs one signal each way).
2. stream   the data moves in chunks of CHUNK elements, chunk c = q, q + P, ... of the pair.
            Staged (ordinary tensors): the writer *pushes* chunk i into ring slot i % DEPTH of the
            reader's ring (stores over NVLink, no round trip) and SETs `ready = e << 32 | i + 1`; the
            reader copies it from its own ring into its output and SETs the writer's `done = e << 32 |
            i + 1` (not after its last chunk: step 3 says it); the writer reuses a ring slot only once
            the reader is done with it. A staged call costs about two copies at world 1, whatever the
            ring's size: one H200, all_gather 8192^2 127-190 µs for rings of 8-66 MiB against 68 for a
            copy (in place: 80; tests/collective_sweep.py, 2026-11-27, BENCHMARKS.md).
            In place (inputs on the symmetric heap): the reader copies straight from the writer's tensor.
            DIRECT (`direct` on, both outputs on the heap): the writer's header says DIRECT (ready = e << 32),
            then it stores its chunks straight into the reader's output where the receive header says, and
            SETs ready = e << 32 | 1 once they have landed (TMA stores: one completion wait, not one per
            chunk); the reader has nothing to copy and waits for that signal. One pass over the data, no
            ring, no handshake per chunk. (Both outputs: a writer whose own output is not on the heap never
            waits for the receive header, so a call where only some ranks pass heap outputs stays correct,
            staged or in place.) On 2 H200s (2026-11-27) DIRECT by vector stores, and by TMA with a wait per
            chunk, moved 4096x7168 no faster than staging; on 4 H200s (2026-11-28) 2-3% faster than in place,
            slower than staging ordinary tensors; hence off by default.
3. finish   the reader SETs `done = e << 32 | ALL`. A writer whose input is read in place waits for it
            before it exits, so the input is free for the caller's next kernel; a staged or DIRECT writer's
            input was read only by itself, so it exits at once (step 0 of its next call waits instead).

A reader checks the writer's count against what it expects; a mismatch is recorded as a device error
(raised as PeerMismatchError at the next call) and the smaller count is moved. reduce_scatter's kernel, built on
the same headers and waits, is in _reduce.py.

A program waits only for the program with its own pid on another rank, at an earlier step of the same
call or at the end of the previous call, and a pid is the order in which the program started on its rank
(abi.take_ticket; with block indices, 3 programs per SM hung on 4 H200s), so the running programs are always
the lowest pids on each rank: the Triton interpreter (programs one after another) never deadlocks, nor does a GPU grid
that is not co-resident (another kernel holds some SMs, or more programs than fit). The default grid fits: two
programs per SM, and both kernels keep to 128 registers a thread so that two 256-thread programs share an SM
(tests/test_gpu_compile.py checks it). Every wait has the runtime's timeout.

The epoch: a program's epoch is a scalar that every thread loads and thread 0 alone stores back bumped (that is
how Triton lowers a scalar load and store). Without a barrier between them, a warp that reaches the load after
thread 0's store reads the new epoch and bumps it again: its base is a call ahead, so it waits for a `done` that never
comes, and the program never reaches the barrier in front of its header's signal (its timeout is not even recorded:
only thread 0 records). That was the hang of 3 programs per SM on 4 H200s and 4 H100s (2026-11-26; the state words
read during the hang by tests/collective_sweep.py --snapshot showed every program started and 1-2 late programs per
rank without a header); late programs start while their SM is busy, so their warps start apart.
"""
from __future__ import annotations

import triton.language as tl

from .. import language as tcl
from ..jit import jit
from ..language.abi import ERR_COUNT_MISMATCH, ERR_OP_MISMATCH, record_error, take_ticket
from ._copy import ROW_BYTES, move, row_desc

# The header's tag: which collective a rank is in, and its element size (ranks must call the same ones
# in the same order; a reader that finds another tag records ERR_OP_MISMATCH).
OPS = {1: "all_to_all_single", 2: "all_gather_into_tensor", 3: "reduce_scatter_tensor"}


def op_tag(op: int, elem: int) -> int:
    return op * 16 + elem


def describe_tag(tag: int) -> str:
    return f"{OPS.get(tag // 16, f'op {tag // 16}')} of {tag % 16}-byte elements"


@jit
def _peer_delta(ptr, pe):
    """Element distance from ptr to the same symmetric object on pe (a multiple of 16 bytes)."""
    elem = ptr.dtype.element_ty.primitive_bitwidth // 8
    return (tcl.symm_at(ptr, pe).to(tl.int64) - ptr.to(tl.int64)) // elem


@jit
def _chunk_size(count, P, CHUNK: tl.constexpr, BALANCED: tl.constexpr):
    """Elements per chunk of a `count`-element pair: spread over all P programs when that keeps chunks
    of at least 2048 elements, at most CHUNK (a ring slot); a multiple of 2048 (so of 16 bytes). BALANCED
    (CollectiveState.balanced_chunks): where a program's share takes several chunks, the chunks are made equal
    (a share of 1.7 ring slots: two chunks of 0.85 slot each, not one of 1 and one of 0.7, which left the programs
    with two whole chunks the last to finish). Both ends of a pair compute it from the writer's count."""
    per_program = (count + P - 1) // P
    if BALANCED:
        rounds = tl.maximum((per_program + CHUNK - 1) // CHUNK, 1)
        per_program = (per_program + rounds - 1) // rounds
    return tl.minimum(tl.maximum((per_program + 2047) // 2048, 1) * 2048, CHUNK)


@jit
def _chunks_of(count, q, P, chunk):
    """How many of the chunks q, q + P, q + 2P, ... of a `count`-element pair exist."""
    n = (count + chunk - 1) // chunk
    return tl.maximum(n - q + P - 1, 0) // P


# How a pair's data reaches its reader (a header's third word): through the reader's ring, read by it in place from
# the writer's input, or stored by the writer straight into the reader's output (both outputs on the heap).
STAGED, IN_PLACE_READ, DIRECT = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@jit
def _publish(meta_ptr, ready_ptr, slot, dst, offset, count, mode, TAG: tl.constexpr, ready):
    """Header of one pair slot, stored at meta_ptr (my own words, or dst's where the reader reads it
    locally): where my data for dst lies (heap element offset), how much, how it travels (`mode`: STAGED,
    IN_PLACE_READ, DIRECT) and which collective this is; then SET dst's ready word to `ready` (the call's base,
    or base + 1 when ring slot 0 already holds chunk 0: one signal for both; DIRECT: every chunk is in dst's
    output already)."""
    _store_header(meta_ptr, slot, offset, count, mode, TAG)
    tcl.signal(ready_ptr + slot, ready, dst, tcl.SIGNAL_SET)


@jit
def _store_header(meta_ptr, slot, offset, count, mode, TAG: tl.constexpr):
    """The four header words of `_publish`, without its signal."""
    tl.store(meta_ptr + 4 * slot, offset)
    tl.store(meta_ptr + 4 * slot + 1, count)
    tl.store(meta_ptr + 4 * slot + 2, mode.to(tl.int64))
    tl.store(meta_ptr + 4 * slot + 3, tl.full((), TAG, tl.int64))


@jit
def _open(dest_ptr, done_ptr, slot, src, dest, count, base):
    """Receive header of one pair slot, stored into src's words before this program waits for anything: where
    src may store its data for me (an element offset in my heap: my output there, at src's place; -1: my output
    is not on my heap) and how much I take; then SET src's done word to the call's base (above what my previous
    call left there, below every later done of this call)."""
    remote = tcl.symm_at(dest_ptr, src)
    tl.store(remote + 2 * slot, dest)
    tl.store(remote + 2 * slot + 1, count)
    tcl.signal(done_ptr + slot, base, src, tcl.SIGNAL_SET)


@jit
def _read_header(meta_ptr, ready_ptr, err_ptr, slot, src, expected, base, TAG: tl.constexpr, LOCAL: tl.constexpr):
    """Wait for src's header on `slot` (LOCAL: src stored it in my words, else it is in src's); return
    (heap offset of its data, count to move, mode (STAGED, IN_PLACE_READ, DIRECT), the count src offers). A
    different collective or count on src is recorded as a device error."""
    tok = tcl.wait(ready_ptr + slot, base, tcl.CMP_GE)
    if LOCAL:
        remote = tcl.consume_token(meta_ptr, tok)
    else:
        remote = tcl.consume_token(tcl.symm_at(meta_ptr, src), tok)
    offset = tl.load(remote + 4 * slot, cache_modifier=".cg")
    offered = tl.load(remote + 4 * slot + 1, cache_modifier=".cg")
    mode = tl.load(remote + 4 * slot + 2, cache_modifier=".cg")
    tag = tl.load(remote + 4 * slot + 3, cache_modifier=".cg")
    if tag != TAG:
        record_error(err_ptr, ERR_OP_MISMATCH, tcl.rank(), src, TAG, tag, 0)
        offered = offered * 0  # move nothing from a rank in another collective
    elif offered != expected:
        record_error(err_ptr, ERR_COUNT_MISMATCH, tcl.rank(), src, expected, offered, 0)
    return offset, tl.minimum(offered, expected), mode, offered


@jit
def _words(words_ptr, P):
    """The state's int64 words (CollectiveState): meta [S, 4], ready [S], done [S], epochs [S], then the ticket
    counter; S = W * P. (The pairs kernel's words go on with its receive headers: `_dest_words`.)"""
    S = tcl.num_ranks() * P
    return words_ptr, words_ptr + 4 * S, words_ptr + 5 * S, words_ptr + 6 * S, words_ptr + 7 * S


@jit
def _dest_words(words_ptr, P):
    """The pairs kernel's receive headers [S, 2] (`_open`), after the ticket counter."""
    return words_ptr + 7 * tcl.num_ranks() * P + 1


@jit
def _packed_counts(peer, t0, t1, t2, t3, t4, t5, t6, t7, HIGH: tl.constexpr):
    """(elements before `peer`'s, elements of `peer`) from the packed counts t_p of peers 0..7: bit 62 set (so
    that every word is an int64 argument), elements received from p in bits 32-61, sent to p in bits 0-31
    (HIGH: the received ones). Words of peers past the world are 0 and never picked. Summed in int32: the
    caller keeps each direction's total below 2^30 elements."""
    c0, c1, c2, c3 = _half(t0, HIGH), _half(t1, HIGH), _half(t2, HIGH), _half(t3, HIGH)
    c4, c5, c6, c7 = _half(t4, HIGH), _half(t5, HIGH), _half(t6, HIGH), _half(t7, HIGH)
    before = (tl.where(peer > 0, c0, 0) + tl.where(peer > 1, c1, 0) + tl.where(peer > 2, c2, 0)
              + tl.where(peer > 3, c3, 0) + tl.where(peer > 4, c4, 0) + tl.where(peer > 5, c5, 0)
              + tl.where(peer > 6, c6, 0))
    count = tl.where(peer == 0, c0, tl.where(peer == 1, c1, tl.where(peer == 2, c2, tl.where(
        peer == 3, c3, tl.where(peer == 4, c4, tl.where(peer == 5, c5, tl.where(peer == 6, c6, c7)))))))
    return before.to(tl.int64), count.to(tl.int64)


@jit
def _half(t, HIGH: tl.constexpr):
    t = tl.cast(t, tl.int64)  # (an argument of 1 is a constexpr)
    if HIGH:
        return ((t >> 32) % (1 << 30)).to(tl.int32)
    return (t % (1 << 32)).to(tl.int32)


@jit(do_not_specialize=["ring_off", "in_heap_off", "out_heap_off", "n_even", "P", "t0", "t1", "t2", "t3", "t4", "t5",
                        "t6", "t7"])
def _pairs_kernel(in_ptr, out_ptr, heap_ptr, words_ptr, table_ptr, err_ptr, ring_off, in_heap_off, out_heap_off,
                  n_even, P, t0, t1, t2, t3, t4, t5, t6, t7,
                  EVEN: tl.constexpr, GATHER: tl.constexpr, IN_PLACE: tl.constexpr, OPEN: tl.constexpr,
                  OUT_HEAP: tl.constexpr, MOVE: tl.constexpr,
                  TAG: tl.constexpr, CHUNK: tl.constexpr, DEPTH: tl.constexpr, BLOCK: tl.constexpr,
                  VEC: tl.constexpr, TABLE_ARGS: tl.constexpr, STREAM: tl.constexpr, KEEP: tl.constexpr,
                  TMA_PUSH: tl.constexpr, TMA_READ: tl.constexpr, BALANCED: tl.constexpr, DISCARD: tl.constexpr):
    """all_to_all_single (GATHER False) and all_gather_into_tensor (GATHER True: every peer gets all of
    the input). in, out and heap are moved as MOVE (an integer type of the element's width, so the
    caller passes its tensors as they are). Offsets and counts in elements; with EVEN every pair moves
    n_even elements; with TABLE_ARGS (up to 8 ranks) t_p packs the elements sent to p (low 32 bits) and
    received from p (high 32 bits), so no program reads a table; else
    table[2p], table[2p + 1] are (offset, count) sent to p and table[2W + 2p], ... received from p
    (pinned host memory). IN_PLACE: my input lies on the heap at in_heap_off (readers may load it). OPEN
    (CollectiveState.direct, the same on every rank): readers announce where they take data (`_open`); then
    OUT_HEAP: my output lies on the heap at out_heap_off, so I wait for my reader's receive header and, where its
    output is on its heap too, store my data straight into it (DIRECT: no ring, no reader copy; by TMA, one wait
    for the stores' completion before the final signal, not one per chunk). STREAM / KEEP: the L2
    eviction policies of a staged pair's data read or written once (its input, its output) and of the ring
    (CollectiveState.ring_hints; "" for none). TMA_PUSH / TMA_READ: a writer's pushes / a reader's copies move
    their whole tiles of 256-byte rows by TMA (_copy.move), through descriptors made once per program: the
    pair's input and the ring region (or the reader's output) on dst / this rank's output and what it reads
    (its own ring region, or src's input in place). BALANCED: equal chunks per program (`_chunk_size`). DISCARD
    (CollectiveState.ring_discard): a reader drops each ring chunk's L2 lines once it has copied them out
    (tcl.discard), so that the ring never costs a write-back to memory."""
    in_ptr = in_ptr.to(tl.pointer_type(MOVE))
    out_ptr = out_ptr.to(tl.pointer_type(MOVE))
    heap_ptr = heap_ptr.to(tl.pointer_type(MOVE))
    meta_ptr, ready_ptr, done_ptr, epoch_ptr, ticket_ptr = _words(words_ptr, P)
    dest_ptr = _dest_words(words_ptr, P)
    pid = take_ticket(ticket_ptr, tl.num_programs(0)).to(tl.int32)
    k = pid // P
    q = pid % P
    me = tcl.rank()
    W = tcl.num_ranks()
    dst = (me + k) % W
    src = (me + W - k) % W
    e = tl.load(epoch_ptr + pid) + 1
    tl.debug_barrier()  # every warp reads the old epoch before thread 0 stores the new one (docstring: "The epoch")
    tl.store(epoch_ptr + pid, e)
    base = e << 32
    last = ((e + 1) << 32) - 1  # done word of a reader that has finished this call
    if EVEN:
        s_off = dst.to(tl.int64) * n_even * (1 - GATHER)
        s_cnt = n_even + 0 * s_off
        r_off = src.to(tl.int64) * n_even
        r_cnt = s_cnt
    elif TABLE_ARGS:
        s_off, s_cnt = _packed_counts(dst, t0, t1, t2, t3, t4, t5, t6, t7, False)
        r_off, r_cnt = _packed_counts(src, t0, t1, t2, t3, t4, t5, t6, t7, True)
    else:
        s_off = tl.load(table_ptr + 2 * dst)
        s_cnt = tl.load(table_ptr + 2 * dst + 1)
        r_off = tl.load(table_ptr + 2 * W + 2 * src)
        r_cnt = tl.load(table_ptr + 2 * W + 2 * src + 1)
    if OPEN:  # my receive header, before any wait (my writer may wait for it): where src may put my data
        if OUT_HEAP:
            _open(dest_ptr, done_ptr, pid, src, out_heap_off + r_off, r_cnt, base)
        else:
            _open(dest_ptr, done_ptr, pid, src, tl.full((), -1, tl.int64), r_cnt, base)
    # my ring region on dst (and dst's words) hold what I sent in my previous call until dst's final done
    slot0 = ring_off + pid * DEPTH * CHUNK
    peer_dst = _peer_delta(heap_ptr, dst)
    ROW: tl.constexpr = ROW_BYTES // (MOVE.primitive_bitwidth // 8)
    SLOT_ROWS: tl.constexpr = CHUNK // ROW
    if OUT_HEAP:  # dst's receive header: also says dst is done with my previous call
        tok = tcl.wait(done_ptr + pid, base, tcl.CMP_GE)
        mine = tcl.consume_token(dest_ptr, tok)
        dest = tl.load(mine + 2 * pid, cache_modifier=".cg")
        direct_cnt = tl.minimum(s_cnt, tl.load(mine + 2 * pid + 1, cache_modifier=".cg"))
        direct = dest >= 0
    else:  # (constants: the kernel compiles as it did before DIRECT)
        if e > 1:
            tcl.wait(done_ptr + pid, base - 1, tcl.CMP_GE)
        dest = -1
        direct_cnt = 0
        direct = False
    if TMA_PUSH:  # where my pushes go: dst's output (DIRECT), else my region of its ring
        in_desc = row_desc(in_ptr + s_off, s_cnt)
        push_desc = row_desc(heap_ptr + peer_dst + tl.where(direct, dest, slot0),
                             tl.where(direct, direct_cnt, DEPTH * CHUNK))
    else:
        in_desc, push_desc = in_ptr, heap_ptr
    s_chunk = _chunk_size(s_cnt, P, CHUNK, BALANCED)
    # staged: chunk 0 goes into dst's ring slot 0 before the header, whose signal then also says "chunk 0 ready";
    # DIRECT: the header first (ready = base), my chunks straight into dst's output in the loop below, then
    # ready = base + 1 once they have landed
    n_send = tl.where(direct, _chunks_of(direct_cnt, q, P, s_chunk), _chunks_of(s_cnt, q, P, s_chunk) * (1 - IN_PLACE))
    staged_first = (n_send > 0) & (dest < 0)
    if staged_first:
        c0 = q.to(tl.int64) * s_chunk
        move(push_desc, heap_ptr, peer_dst + slot0, 0, in_desc, in_ptr, s_off + c0, c0 // ROW,
             tl.minimum(s_chunk, s_cnt - c0), BLOCK, VEC, STREAM, KEEP, TMA_PUSH, True)
    _publish(tcl.symm_at(meta_ptr, dst), ready_ptr, pid, dst, in_heap_off + s_off, s_cnt,
             tl.where(direct, DIRECT, IN_PLACE), TAG, tl.where(staged_first, base + 1, base))
    remote_off, cnt, remote_mode, offered = _read_header(meta_ptr, ready_ptr, err_ptr, pid, src, r_cnt, base,
                                                         TAG, True)
    # interleave my sends to dst with my receives from src, chunk by chunk (a pair's chunking follows from
    # its writer's count, which both ends know)
    r_chunk = _chunk_size(offered, P, CHUNK, BALANCED)
    n_recv = _chunks_of(cnt, q, P, r_chunk)
    if OPEN:
        n_recv = tl.where(remote_mode == DIRECT, 0, n_recv)
    peer_src = _peer_delta(heap_ptr, src)
    if TMA_READ:
        out_desc = row_desc(out_ptr + r_off, cnt)
        staged = remote_mode != IN_PLACE_READ
        read_desc = row_desc(tl.where(staged, heap_ptr + slot0, heap_ptr + peer_src + remote_off),
                             tl.where(staged, DEPTH * CHUNK, cnt))
    else:
        out_desc, read_desc = out_ptr, heap_ptr
    for i in range(0, tl.maximum(n_send, n_recv)):
        slot = slot0 + (i % DEPTH) * CHUNK
        if (i < n_send) & ((i > 0) | direct):
            c = (q + i * P).to(tl.int64) * s_chunk
            if (dest < 0) & (i >= DEPTH):  # the reader must be done with what this ring slot held
                tcl.wait(done_ptr + pid, base + i - DEPTH + 1, tcl.CMP_GE)
            move(push_desc, heap_ptr, peer_dst + tl.where(direct, dest + c, slot),
                 tl.where(direct, c // ROW, (i % DEPTH) * SLOT_ROWS), in_desc, in_ptr, s_off + c, c // ROW,
                 tl.minimum(s_chunk, tl.where(direct, direct_cnt, s_cnt) - c), BLOCK, VEC, STREAM, KEEP, TMA_PUSH,
                 dest < 0)  # (DIRECT: one completion wait after the loop)
            if dest < 0:
                tcl.signal(ready_ptr + pid, base + i + 1, dst, tcl.SIGNAL_SET)
        if i < n_recv:
            c = (q + i * P).to(tl.int64) * r_chunk
            if remote_mode == STAGED:
                tcl.wait(ready_ptr + pid, base + i + 1, tcl.CMP_GE)  # its barrier keeps the loads after
                move(out_desc, out_ptr, r_off + c, c // ROW, read_desc, heap_ptr, slot, (i % DEPTH) * SLOT_ROWS,
                     tl.minimum(r_chunk, cnt - c), BLOCK, VEC, KEEP, STREAM, TMA_READ, True)
                if DISCARD:  # (before the done signal below or after the loop, whose release orders it)
                    tcl.discard(heap_ptr + slot, tl.minimum(r_chunk, cnt - c))
                if i < n_recv - 1:  # the last chunk's "done" is the final signal below
                    tcl.signal(done_ptr + pid, base + i + 1, src, tcl.SIGNAL_SET)
            else:
                move(out_desc, out_ptr, r_off + c, c // ROW, read_desc, heap_ptr, peer_src + remote_off + c, c // ROW,
                     tl.minimum(r_chunk, cnt - c), BLOCK, VEC, "", "", TMA_READ, True)
    if direct:  # every store of my chunks has landed in dst's output (TMA: waited here; vector stores: the release)
        if TMA_PUSH:
            tcl.bulk_wait(tl.full((), 0, tl.int32))
        tcl.signal(ready_ptr + pid, base + 1, dst, tcl.SIGNAL_SET)
    if OPEN:
        if remote_mode == DIRECT:
            tcl.wait(ready_ptr + pid, base + 1, tcl.CMP_GE)
    # finish: src may reuse my ring region and words; my input, where dst reads it in place, is free once dst
    # says it is done
    tcl.signal(done_ptr + pid, last, src, tcl.SIGNAL_SET)
    if IN_PLACE:
        if dest < 0:  # (DIRECT: no reader loads my input)
            tcl.wait(done_ptr + pid, last, tcl.CMP_GE)
