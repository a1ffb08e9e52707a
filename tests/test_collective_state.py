"""The collectives' state under load and under its other knobs, on 2 and 3 CPU ranks (GPU ranks: run_gpu.sh):
transfers that stream through the ring, peers that run ahead into the next collective, other programs-per-SM,
ring and split-table settings, a side stream beside compute that holds the SMs, and the ring's sizing rules."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import tilecomm
from _reference import all_to_all_ref, dev, gather_all, poison, reduce_scatter_ref, uneven_splits
from conftest import BACKEND


def beside_busy_sms(seed):
    """Collectives on a side stream while the caller's stream runs matmuls (the usual way to overlap expert
    communication with compute): on GPUs the matmuls hold SMs, so a collective's grid may not be resident at once,
    and each rank's matmuls take a different time, so its programs start at different moments on every rank.
    Results equal the references; nothing times out."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    cuda = dev().type == "cuda"
    gen = torch.Generator().manual_seed(seed + rank)
    rows, n = (4096, 4096) if cuda else (12, 48)
    a = torch.randn(n, n, generator=gen).to(dev())
    x = torch.randn(world * rows, 64, generator=gen).to(dev())
    inputs = gather_all(x)
    refs = {"a2a": all_to_all_ref(inputs, [[rows] * world] * world, rank),
            "rs": reduce_scatter_ref(inputs, rank, "sum"), "ag": torch.cat([t[:rows] for t in inputs])}
    side = torch.cuda.Stream() if cuda else None
    for trial in range(3):
        outs = {k: poison(torch.empty(v.shape, device=dev())) for k, v in refs.items()}
        if cuda:
            torch.cuda.synchronize()
            side.wait_stream(torch.cuda.current_stream())
        busy = [a @ a for _ in range(2 + (rank + trial) % 3)]  # queued on the caller's stream
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            tilecomm.all_to_all_single(outs["a2a"], x)
            tilecomm.reduce_scatter_tensor(outs["rs"], x)
            tilecomm.all_gather_into_tensor(outs["ag"], x[:rows])
        if cuda:
            torch.cuda.current_stream().wait_stream(side)
        tilecomm.check_errors()
        assert torch.equal(outs["a2a"].cpu(), refs["a2a"].cpu()), f"rank {rank}, trial {trial}: all_to_all"
        assert torch.equal(outs["ag"].cpu(), refs["ag"].cpu()), f"rank {rank}, trial {trial}: all_gather"
        torch.testing.assert_close(outs["rs"].double().cpu(), refs["rs"], rtol=1e-5, atol=1e-5)
        del busy


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_beside_compute_that_holds_the_sms(ranks, world):
    ranks(world).run(beside_busy_sms, 31)


def under_other_knobs(seed, programs_per_sm, rs_stagger, ring_hints=False, tma=False, balanced=False, discard=False,
                      trace=False):
    """Every collective, several calls of fresh sizes, on a CollectiveState made with other tuning knobs, against
    the references; small ring chunks, so reduce_scatter's columns reuse their ring slots. programs_per_sm=3: on GPU
    ranks more programs than the SMs hold at once (late programs start while their SM is busy, so their warps start
    apart: that hung while warps of a program could disagree on its epoch, comm/collectives/_exchange.py "The
    epoch"); CPU ranks keep one program per peer. rs_stagger: odd reduce_scatter columns reduce before they push (the default), or not.
    ring_hints: the staged pairs' loads and stores with L2 eviction policies (their own compiled variant on GPUs).
    tma: the pairs' pushes and reads by TMA (comm/collectives/_copy.py: whole tiles of 256-byte rows) at every size
    (tma_min_bytes 0), pairs of whole tiles and a rest (96-byte rows); also an all_to_all read in place from the
    heap, and, with `direct` on, one into heap outputs (DIRECT: the writers' TMA stores land in the readers'
    outputs, one completion wait per program). balanced: equal chunks per program (a 32 KiB ring chunk, so that the
    first call's 12000-element pairs go as two chunks of 6144 and 5856 elements, not 8192 and 3808). discard: readers
    drop each ring chunk once read (CollectiveState.ring_discard; on CPU ranks tcl.discard poisons the chunk, so a
    chunk dropped before it was read, or a ring slot rewritten before its drop, gives wrong results). trace: every
    reduce_scatter program records its step times (CollectiveState.trace), checked for consistency: each column's
    chunks add up to the call's, its times are ordered and its waits lie inside the steps that contain them."""
    from tilecomm.collectives.state import CollectiveState

    rank, world = tilecomm.rank(), tilecomm.world_size()
    ctx = tilecomm.current()
    gen = torch.Generator().manual_seed(seed + rank)
    chunk, step = (32 if balanced else 16) << 10, 8 << 10
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count if dev().type == "cuda" else 1
    workspace = 2 * world * max(1, programs_per_sm * sms // world) * 2 * chunk
    state = CollectiveState.create(ctx, workspace, programs_per_sm, chunk, step, rs_stagger=rs_stagger,
                                   ring_hints=ring_hints, tma_push=tma, tma_read=tma, direct=tma,
                                   balanced_chunks=balanced, ring_discard=discard, trace=trace)
    state.tma_min_bytes = 0
    default, ctx.collectives = ctx.collectives, state
    on_heap = tilecomm.empty((world * (500 + 37 * 2), 24), torch.float32) if tma else None
    out_heap = tilecomm.empty((world * (500 + 37 * 2), 24), torch.float32) if tma else None
    try:
        assert dev().type != "cuda" or state.programs_per_peer == max(1, programs_per_sm * sms // world)
        for call in range(3):
            x = torch.randn(world * (500 + 37 * call), 24, generator=gen).to(dev())
            rows = x.shape[0] // world
            inputs = gather_all(x)
            a2a, ag, rs = (poison(torch.empty_like(x)), poison(torch.empty_like(x)),
                           poison(torch.empty(rows, 24, device=dev())))
            splits = uneven_splits(world, torch.Generator().manual_seed(1000 * rank + seed + call), max_rows=rows)
            all_splits = [None] * world
            dist.all_gather_object(all_splits, splits)
            recv = [all_splits[p][rank] for p in range(world)]
            xu = x[:sum(splits)]
            a2a_uneven = poison(torch.empty(sum(recv), 24, device=dev()))
            tilecomm.all_to_all_single(a2a, x)
            tilecomm.all_to_all_single(a2a_uneven, xu, recv, splits)
            tilecomm.all_gather_into_tensor(ag, x[:rows])
            tilecomm.reduce_scatter_tensor(rs, x)
            if tma:
                in_place = poison(torch.empty_like(x))
                tilecomm.all_to_all_single(in_place, on_heap[:x.shape[0]].copy_(x))
                direct = poison(out_heap[:x.shape[0]])
                tilecomm.all_to_all_single(direct, x)
                tilecomm.check_errors()
                assert torch.equal(in_place, a2a), f"call {call}: read in place"
                assert torch.equal(direct, a2a), f"call {call}: DIRECT"
            tilecomm.check_errors()
            assert torch.equal(a2a.cpu(), all_to_all_ref(inputs, [[rows] * world] * world, rank)), f"call {call}"
            assert torch.equal(a2a_uneven.cpu(), all_to_all_ref(gather_all(xu), all_splits, rank)), f"call {call}"
            assert torch.equal(ag.cpu(), torch.cat([t[:rows] for t in inputs])), f"call {call}"
            torch.testing.assert_close(rs.double().cpu().flatten(), reduce_scatter_ref(inputs, rank, "sum"), rtol=1e-5,
                                       atol=1e-5)
            if trace:
                check_reduce_trace(state, rs.numel(), rs.element_size())
    finally:
        if dev().type == "cuda":
            torch.cuda.synchronize()
        state.free()
        ctx.collectives = default
        if on_heap is not None:
            tilecomm.free(on_heap)
            tilecomm.free(out_heap)


def check_reduce_trace(state, n: int, elem: int) -> None:
    """The last reduce_scatter's trace (CollectiveState.trace) against what the call must have done: one row per
    program, chunks of the state's reduce_scatter chunk covering the n output elements, start <= headers <= end,
    and the summed push / reduce steps (each containing its waits) inside headers .. end."""
    tr = state.reduce_scatter_trace()
    chunk = state._launch_config(("reduce", elem, True, 0, False, False, "acc"))["CHUNK"]
    assert tr["start"].numel() == state._pairs_grid[0]
    assert int(tr["chunks"].sum()) == -(-n // chunk), (tr["chunks"].tolist(), n, chunk)
    assert bool((tr["start"] > 0).all()) and bool((tr["start"] <= tr["headers"]).all())
    assert bool((tr["headers"] <= tr["end"]).all())
    for wait, step in (("wait_ready", "reduce"), ("wait_slot", "push")):
        assert bool((tr[wait] >= 0).all()) and bool((tr[wait] <= tr[step]).all()), (wait, tr[wait], tr[step])
    assert bool((tr["push"] + tr["reduce"] <= tr["end"] - tr["headers"]).all())
    assert bool((tr["reduce"] > 0).any()) and bool((tr["push"][tr["chunks"] > 1] > 0).any())  # (staged inputs)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("knobs", [(3, False), (2, True), (2, True, True), (2, True, False, True),
                                   (2, True, False, False, True), (2, True, True, False, False, True),
                                   (2, True, False, False, False, False, True)],
                         ids=["three_programs_per_sm_unstaggered", "staggered", "ring_hints", "tma", "balanced_chunks",
                              "ring_discard", "trace"])
def test_collectives_under_other_knobs(ranks, world, knobs):
    ranks(world).run(under_other_knobs, 41, *knobs)


def streams_through_the_ring(seed, elems_per_pair):
    """Pairs several ring slots long (the data wraps the staging ring), one rank's input on the
    symmetric heap (read in place) and the others' staged: every writer's mode is its own."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    gen = torch.Generator().manual_seed(seed + rank)
    splits = [elems_per_pair + 7 * p for p in range(world)]  # uneven, not multiples of 16 bytes
    all_splits = [None] * world
    dist.all_gather_object(all_splits, splits)
    recv = [all_splits[p][rank] for p in range(world)]
    heap_in = tilecomm.empty((max(sum(s) for s in all_splits),), torch.float32)
    x = torch.randn(sum(splits), generator=gen).to(dev())
    if rank == 0:
        x = heap_in[: x.numel()].copy_(x)
    for _ in range(2):  # back to back: the second call reuses the ring the first one filled
        out = poison(torch.empty(sum(recv), device=dev()))
        tilecomm.all_to_all_single(out, x, recv, splits)
        ref = all_to_all_ref(gather_all(x), all_splits, rank)
        assert torch.equal(out.cpu(), ref), f"rank {rank}: streamed all_to_all_single mismatch"
    tilecomm.free(heap_in)


@pytest.mark.parametrize("world", [2, 3])
def test_transfers_larger_than_the_ring_stream_through_it(ranks, world):
    ranks(world).run(streams_through_the_ring, 17, 150_001)


def skewed_sequence(seed, n, slow_ms):
    """Collectives back to back with no host synchronisation between them, rank 0 slowed down (CPU ranks:
    a random pause of up to slow_ms after each of its signals and waits), so its peers run ahead: their
    pushes for the next collective, into its ring and header words, start while it is still reading the
    previous one. all_to_all (staged, then in place), all_gather and reduce_scatter share the staging ring;
    every output is kept and checked against references made only at the end."""
    from tilecomm.language import _cpu

    rank, world = tilecomm.rank(), tilecomm.world_size()
    gen = torch.Generator().manual_seed(seed + rank)
    heap_in = tilecomm.empty((world * n,), torch.float32)
    plan = ["a2a", "ag", "a2a", "rs", "a2a_heap", "ag", "a2a", "a2a", "rs", "ag", "a2a_heap", "a2a"]
    inputs, outputs = [], []
    jitter = _cpu._JITTER_S
    if rank == 0 and BACKEND == "cpu":
        _cpu._JITTER_S = slow_ms / 1e3
    try:
        for op in plan:
            x = torch.randn(world * n, generator=gen).to(dev())
            if op == "a2a_heap":
                x = heap_in.copy_(x)  # read in place
            if op.startswith("a2a"):
                out = poison(torch.empty(world * n, device=dev()))
                tilecomm.all_to_all_single(out, x)
            elif op == "rs":
                out = poison(torch.empty(n, device=dev()))
                tilecomm.reduce_scatter_tensor(out, x)
            else:
                out = poison(torch.empty(world * world * n, device=dev()))
                tilecomm.all_gather_into_tensor(out, x)
            inputs.append(x.cpu().clone())
            outputs.append(out)
    finally:
        _cpu._JITTER_S = jitter  # the pool's ranks serve later tests
    for step, op in enumerate(plan):
        every = gather_all(inputs[step])
        if op.startswith("a2a"):
            want = all_to_all_ref(every, [[n] * world] * world, rank)
        elif op == "rs":
            want = reduce_scatter_ref(every, rank, "sum").float()
        else:
            want = torch.cat(every)
        torch.testing.assert_close(outputs[step].cpu(), want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, step=step, op=op: f"rank {rank}, step {step} ({op}): {m}")
    tilecomm.free(heap_in)


@pytest.mark.parametrize("world", [2, 3])
def test_peers_run_ahead_into_the_next_collective(ranks, world):
    """Fails every time on 2 CPU ranks without the pairs writer's wait for its reader's last `done` of the
    previous call (wrong rows, or a wait that times out when a header is overwritten), and on 3 without
    reduce_scatter's wait for its readers (a peer's next push lands in a ring the slowed rank still reads)."""
    ranks(world).run(skewed_sequence, 31, 20_001, 60)


def reduce_scatter_large_mixed(seed):
    """A reduce-scatter larger than the ring, in-place and staged writers mixed, every op."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    n = 70_003
    heap_in = tilecomm.empty((world * n,), torch.float32)
    for op_name in ("sum", "max", "avg"):
        op = getattr(dist.ReduceOp, op_name.upper())
        x = torch.randn(world * n, generator=torch.Generator().manual_seed(seed + rank)).to(dev())
        if rank == 1:
            x = heap_in.copy_(x)
        out = poison(torch.empty(n, device=dev()))
        tilecomm.reduce_scatter_tensor(out, x, op=op)
        ref = reduce_scatter_ref(gather_all(x), rank, op_name)
        torch.testing.assert_close(out.double().cpu(), ref.double(), rtol=1e-5, atol=1e-5)
    tilecomm.free(heap_in)


def test_reduce_scatter_larger_than_the_ring(ranks):
    ranks(3).run(reduce_scatter_large_mixed, 23)


@pytest.mark.parametrize("backend", ["cuda", "cpu"])
def test_ring_steps_are_powers_of_two_for_any_workspace(backend):
    """A launch's load step is a tl.arange, so a power of two, and at most its ring chunk, for every workspace
    size, world size and element size (a 28 KiB ring chunk once made fp32 steps of 7168 elements on 4 H200s:
    every all_to_all failed to compile). No ranks: the sizing and launch configs are plain Python."""
    from tilecomm.collectives import state as st

    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    on_gpu = backend == "cuda"
    default = st._GPU_CHUNK_BYTES if on_gpu else st._CPU_CHUNK_BYTES
    for W in (2, 3, 4, 8):
        for slots in ((132 // W) * W, W):
            for workspace in [2 ** 20 * m // 8 for m in range(1, 700, 7)]:
                chunk = st.ring_chunk_bytes(workspace, slots, default, st._BLOCK_BYTES if on_gpu else default)
                assert 2 * slots * st.DEPTH * chunk <= workspace and chunk <= default
                if chunk < 4096 * W:  # create() raises MemoryError
                    continue
                state = st.CollectiveState.sizes_only(backend, W, chunk, rs_stagger=False, max_w=8)
                for elem in (1, 2, 4, 8):
                    for key in (("pairs", elem, True, True, False, False, False, False, False, False),
                                ("reduce", elem, True, 0, False, False, "acc")):
                        c = state._launch_config(key)
                        steps = [c["BLOCK"]] + ([c["PUSH_BLOCK"]] if "PUSH_BLOCK" in c else [])
                        assert all(pow2(b) and b <= c["CHUNK"] for b in steps), (W, slots, workspace, elem, key, c)
                        assert c["CHUNK"] * elem * (W if key[0] == "reduce" else 1) <= chunk


def test_two_programs_per_sm_only_where_the_workspace_holds_their_rings():
    """Two programs per SM need two rings of 2 * SMs * DEPTH whole chunks; a smaller workspace gets one program
    per SM (with whole chunks if they fit), never two with smaller chunks."""
    from tilecomm.collectives import state as st

    chunk, step = st._GPU_CHUNK_BYTES, st._BLOCK_BYTES
    for sms in (132, 78, 148):
        for W in (2, 3, 4, 8):
            one, two = max(1, sms // W), max(1, 2 * sms // W)
            need_two = 2 * W * two * st.DEPTH * chunk
            for workspace in (need_two, need_two - 4096, need_two // 2, 16 << 20, 1 << 30):
                P = st.programs_per_peer(sms, W, 2, workspace, chunk, step)
                assert P == (two if workspace >= need_two else one), (sms, W, workspace, P)
                assert st.programs_per_peer(sms, W, 1, workspace, chunk, step) == one
    assert st.programs_per_peer(132, 4, 2, 256 << 20, chunk, step) == 66  # the default GPU heap's quarter
