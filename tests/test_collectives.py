"""Collectives against independent references, on 2, 3 and 4 CPU ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import triton.language as tl

import tilecomm
from tilecomm.collectives import _exchange as kx, state as state_module
from tilecomm.collectives.state import TABLE_ARG_RANKS
from tilecomm.errors import PeerMismatchError
from _reference import all_to_all_ref, dev, gather_all, poison, reduce_scatter_ref, uneven_splits
from conftest import BACKEND

BACKEND_IS_CPU = BACKEND == "cpu"

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool, torch.float8_e4m3fn]


def _random(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen).to(dev()) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype).to(dev())
    return torch.randn(shape, generator=gen).to(dev()).to(dtype)


def a2a_uneven(seed, dtype, hidden, symmetric):
    rank, world = tilecomm.rank(), tilecomm.world_size()
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    in_splits = uneven_splits(world, gen)
    all_splits = [None] * world
    dist.all_gather_object(all_splits, in_splits)
    out_splits = [all_splits[p][rank] for p in range(world)]
    x = _random((sum(in_splits), hidden), dtype, gen)
    if symmetric:  # the zero-copy path needs the same allocation on every rank
        rows = max(sum(s) for s in all_splits)
        buf = tilecomm.empty((rows, hidden), dtype)
        x = buf[: x.shape[0]].copy_(x)
    out = poison(torch.empty((sum(out_splits), hidden), dtype=dtype, device=dev()))
    tilecomm.all_to_all_single(out, x, out_splits, in_splits)
    ref = all_to_all_ref(gather_all(x.view(torch.uint8) if dtype.itemsize == 1 else x), all_splits, rank)
    got = out.view(torch.uint8) if dtype.itemsize == 1 else out
    assert torch.equal(got.cpu(), ref), f"rank {rank}: all_to_all_single mismatch"
    if symmetric:
        tilecomm.free(buf)
    return out.shape[0]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_to_all_single_uneven(ranks, world, dtype):
    rows = ranks(world).run(a2a_uneven, world, dtype, 5, False)
    assert len(rows) == world


def a2a_uneven_pinned_table(seed, dtype, hidden):
    """a2a_uneven through the pinned split table that worlds of more than TABLE_ARG_RANKS ranks use."""
    state = tilecomm.current().collectives
    state.table_arg_ranks = 0
    try:
        a2a_uneven(seed, dtype, hidden, False)
        a2a_uneven(seed + 1, dtype, hidden, False)  # the next table slot
    finally:
        state.table_arg_ranks = TABLE_ARG_RANKS


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_all_to_all_single_uneven_pinned_table(ranks, world, dtype):
    ranks(world).run(a2a_uneven_pinned_table, world, dtype, 5)


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_single_symmetric_input_in_place(ranks, world):
    ranks(world).run(a2a_uneven, 11, torch.float32, 33, True)


def mixed_placements(seed, calls, direct):
    """_mixed_calls on the runtime's collectives, or (direct) on a CollectiveState with `direct` on, where a pair goes
    DIRECT (the writer stores into the reader's output) if both ranks' outputs are on the heap: one call then mixes
    three ways."""
    from tilecomm.collectives.state import CollectiveState

    ctx = tilecomm.current()
    default = ctx.collectives
    if direct:
        ctx.collectives = CollectiveState.create(ctx, 2 * default.ring.numel(), direct=True)
    try:
        _mixed_calls(seed, calls)
    finally:
        if direct:
            ctx.collectives.free()
            ctx.collectives = default


def _mixed_calls(seed, calls):
    """all_to_all_single (uneven, even) and all_gather_into_tensor with each rank's input and output on the heap or
    not, per rank and call: a pair is read in place where its writer's input is on the heap, else staged through
    the reader's ring, so one call mixes both (readers learn which from each writer's header). Rows of 8 floats
    (every piece 16-byte aligned) or 9 (pieces mostly off 16-byte boundaries: such a call stages everything), and
    one call whose pairs span several ring chunks. Every rank draws every rank's inputs from that rank's seed, so the
    references need no communication; outputs are poisoned first."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    gens = [torch.Generator().manual_seed(seed * 100 + p) for p in range(world)]
    chunk_rows = tilecomm.current().collectives.chunk_bytes // 32  # rows of 8 floats per ring chunk
    cap = world * (2 * chunk_rows + 16) * 9
    in_buf, out_buf = tilecomm.empty((cap,), torch.float32), tilecomm.empty((cap,), torch.float32)

    def place(t, buf, on_heap):
        return buf[: t.numel()].view(t.shape).copy_(t) if on_heap else t

    def draw(gen, p, call, hidden):
        """Rank p's call: (input on the heap, output on the heap, rows it sends to each rank, its inputs). Inputs:
        all on the heap (every pair in place), then on the even ranks only, then at random; outputs the same way
        (every pair DIRECT where the state allows it, then between even ranks)."""
        in_heap, out_heap = (bool(v) for v in torch.randint(0, 2, (2,), generator=gen))
        in_heap, out_heap = ((True, True), (p % 2 == 0, p % 2 == 0), (in_heap, out_heap))[call % 3]
        splits = uneven_splits(world, gen) if call != 1 else [2 * chunk_rows + 5 + p for p in range(world)]
        xs = [torch.randn(rows, hidden, generator=gen) for rows in (sum(splits), world * 2, 3)]
        return in_heap, out_heap, splits, xs

    for call in range(calls):
        hidden = 9 if call % 3 == 2 else 8
        drawn = [draw(gens[p], p, call, hidden) for p in range(world)]  # every rank's, from its seed
        in_heap, out_heap, in_splits, (x_uneven, x_even, x_gather) = drawn[rank]
        all_splits = [d[2] for d in drawn]
        out_splits = [all_splits[p][rank] for p in range(world)]
        calls_and_refs = (
            (lambda out, x: tilecomm.all_to_all_single(out, x, out_splits, in_splits), x_uneven, sum(out_splits),
             all_to_all_ref([d[3][0] for d in drawn], all_splits, rank)),
            (tilecomm.all_to_all_single, x_even, world * 2,
             all_to_all_ref([d[3][1] for d in drawn], [[2] * world] * world, rank)),
            (tilecomm.all_gather_into_tensor, x_gather, world * 3, torch.cat([d[3][2] for d in drawn])))
        for op, x, out_rows, ref in calls_and_refs:
            x = place(x.to(dev()), in_buf, in_heap)
            out = poison(place(torch.empty(out_rows, hidden, device=dev()), out_buf, out_heap))
            op(out, x)
            assert torch.equal(out.cpu(), ref), (rank, call, out_rows, in_heap, out_heap)
    tilecomm.free(in_buf)
    tilecomm.free(out_buf)


@pytest.mark.parametrize("direct", [False, True], ids=["in_place_or_staged", "direct"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_heap_and_ordinary_tensors_mix_per_rank(ranks, world, direct):
    ranks(world).run(mixed_placements, world, 3, direct)


def a2a_even_matches_gloo(dtype):
    world = tilecomm.world_size()
    x = torch.randn(world * 3, 4, 2, device=dev()).to(dtype)
    out = torch.full_like(x, -5)
    ref = torch.empty_like(x)
    tilecomm.all_to_all_single(out, x)
    dist.all_to_all_single(ref, x)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_to_all_single_even_splits_match_gloo(ranks, world):
    ranks(world).run(a2a_even_matches_gloo, torch.float32)


def a2a_autograd(seed):
    rank, world = tilecomm.rank(), tilecomm.world_size()
    gen = torch.Generator().manual_seed(seed + rank)
    in_splits = uneven_splits(world, gen)
    all_splits = [None] * world
    dist.all_gather_object(all_splits, in_splits)
    out_splits = [all_splits[p][rank] for p in range(world)]
    x = torch.randn(sum(in_splits), 3, generator=gen, dtype=torch.float64).to(dev()).requires_grad_()
    w = torch.randn(sum(out_splits), 3, generator=gen, dtype=torch.float64).to(dev())
    out = torch.empty(sum(out_splits), 3, dtype=torch.float64, device=dev())
    tilecomm.all_to_all_single(out, x, out_splits, in_splits)
    (out * w).sum().backward()
    # d/dx of sum(a2a(x) * w) = a2a with swapped splits applied to w
    expect = torch.empty_like(x)
    dist.all_to_all_single(expect, w, in_splits, out_splits)
    assert torch.equal(x.grad, expect)


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_single_autograd(ranks, world):
    ranks(world).run(a2a_autograd, 3)


def all_gather_body(seed, dtype, numel):
    rank, world = tilecomm.rank(), tilecomm.world_size()
    x = _random((numel,), dtype, torch.Generator().manual_seed(seed + rank))
    out = poison(torch.empty(world * numel, dtype=dtype, device=dev()))
    tilecomm.all_gather_into_tensor(out, x)
    view = (lambda t: t.view(torch.uint8)) if dtype.itemsize == 1 else (lambda t: t)
    ref = torch.cat([view(t) for t in gather_all(x)])
    assert torch.equal(view(out).cpu(), ref)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool], ids=str)
def test_all_gather_into_tensor(ranks, world, dtype):
    ranks(world).run(all_gather_body, 7, dtype, 1 + 37 * world)


def reduce_scatter_body(seed, dtype, numel, op_name):
    rank, world = tilecomm.rank(), tilecomm.world_size()
    op = getattr(dist.ReduceOp, {"prod": "PRODUCT"}.get(op_name, op_name.upper()))
    gen = torch.Generator().manual_seed(seed + rank)
    x = _random((world * numel,), dtype, gen)
    if op_name == "prod":
        x = (x.abs() % 3 + 1).to(dtype) if not dtype.is_floating_point else (torch.rand(world * numel, generator=gen).to(dev()) + 0.5).to(dtype)
    out = poison(torch.empty(numel, dtype=dtype, device=dev()))
    tilecomm.reduce_scatter_tensor(out, x, op=op)
    ref = reduce_scatter_ref(gather_all(x), rank, op_name)
    if dtype.is_floating_point:
        tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
        torch.testing.assert_close(out.double().cpu(), ref.to(dtype).double(), rtol=tol, atol=tol)
    else:
        assert torch.equal(out.cpu(), ref.to(dtype))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_reduce_scatter_sum(ranks, world, dtype):
    ranks(world).run(reduce_scatter_body, 5, dtype, 301, "sum")


@pytest.mark.parametrize("op", ["avg", "max", "min", "prod"])
def test_reduce_scatter_ops(ranks, op):
    ranks(3).run(reduce_scatter_body, 9, torch.float32, 129, op)


def test_reduce_scatter_int64_sum(ranks):
    ranks(3).run(reduce_scatter_body, 2, torch.int64, 64, "sum")


def ag_rs_autograd():
    rank, world = tilecomm.rank(), tilecomm.world_size()
    x = torch.randn(5, dtype=torch.float64, requires_grad=True, device=dev())
    g = torch.empty(world * 5, dtype=torch.float64, device=dev())
    tilecomm.all_gather_into_tensor(g, x)
    w = torch.arange(world * 5, dtype=torch.float64, device=dev()) * (rank + 1)
    (g * w).sum().backward()
    # d/dx_r = sum over ranks q of w_q[r-th chunk] = r-th chunk of arange * sum(q+1)
    expect = torch.arange(world * 5, dtype=torch.float64, device=dev())[rank * 5:(rank + 1) * 5] * sum(range(1, world + 1))
    assert torch.allclose(x.grad, expect)


def test_all_gather_autograd(ranks):
    ranks(3).run(ag_rs_autograd)


def many_calls(iters):
    """Back-to-back collectives with fresh random sizes: staging reuse must never race."""
    for i in range(iters):
        a2a_uneven(1000 + i, torch.float32, 3, False)
        all_gather_body(2000 + i, torch.float32, 1 + i % 5)


def test_back_to_back_random_calls(ranks):
    ranks(4).run(many_calls, 15)


def async_op_work():
    x = torch.randn(tilecomm.world_size() * 2, device=dev())
    out = torch.empty_like(x)
    work = tilecomm.all_to_all_single(out, x, async_op=True)
    assert work.wait()  # orders the current stream after the call (the host does not block, as with NCCL)
    if x.is_cuda:
        torch.cuda.current_stream().synchronize()
    assert work.is_completed()
    ref = torch.empty_like(x)
    dist.all_to_all_single(ref, x)
    assert torch.equal(out, ref)


def test_async_op_returns_work(ranks):
    ranks(2).run(async_op_work)


def complex_and_bad_dtypes():
    rank, world = tilecomm.rank(), tilecomm.world_size()
    x = torch.randn(world * 3, dtype=torch.complex64, generator=torch.Generator().manual_seed(rank)).to(dev())
    out = torch.empty(3, dtype=torch.complex64, device=dev())
    tilecomm.reduce_scatter_tensor(out, x)
    ref = sum(t[rank * 3:(rank + 1) * 3] for t in gather_all(x))
    torch.testing.assert_close(out.cpu(), ref)
    gathered = torch.empty(world * 3 * world, dtype=torch.complex64, device=dev())
    tilecomm.all_gather_into_tensor(gathered, x)
    assert torch.equal(gathered.cpu(), torch.cat(gather_all(x)))
    with pytest.raises(TypeError, match="op=AVG needs a floating dtype"):
        tilecomm.reduce_scatter_tensor(torch.empty(3, dtype=torch.int64, device=dev()),
                                       torch.ones(world * 3, dtype=torch.int64, device=dev()), op=dist.ReduceOp.AVG)
    with pytest.raises(TypeError, match="complex tensors reduce with SUM or AVG"):
        tilecomm.reduce_scatter_tensor(out, x, op=dist.ReduceOp.MAX)
    with pytest.raises(TypeError, match="output has dtype torch.uint32; expected one of"):
        tilecomm.all_to_all_single(torch.empty(world, dtype=torch.uint32, device=dev()),
                                   torch.empty(world, dtype=torch.uint32, device=dev()))


def test_complex_tensors_and_dtype_errors(ranks):
    ranks(2).run(complex_and_bad_dtypes)


def _graph_replays_eager(out, x, outs, ins, what):
    """Capture all_to_all_single(out, x, outs, ins) in a CUDA graph; each replay gives the eager call's result."""
    tilecomm.all_to_all_single(out, x, outs, ins)
    torch.cuda.synchronize()
    expect = out.clone()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            tilecomm.all_to_all_single(out, x, outs, ins)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        out.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expect), what


def no_sync_and_graph_replay():
    """GPU: a call makes no host synchronisation, and a captured call replays with the eager result (even
    splits, then uneven ones through either path)."""
    world, rank, state = tilecomm.world_size(), tilecomm.rank(), tilecomm.current().collectives
    x = torch.randn(world * 64, 33, device=dev())
    out = torch.empty_like(x)
    splits = [64] * world
    # uneven splits: counts as kernel arguments, then through the pinned table (worlds beyond TABLE_ARG_RANKS)
    ins, outs = [10 + 3 * p + rank for p in range(world)], [10 + 3 * rank + p for p in range(world)]
    x_uneven, out_uneven = torch.randn(sum(ins), 33, device=dev()), torch.empty(sum(outs), 33, device=dev())
    for arg_ranks in (TABLE_ARG_RANKS, 0):
        state.table_arg_ranks = arg_ranks
        try:
            for _ in range(2):
                tilecomm.all_to_all_single(out, x, splits, splits)
                tilecomm.all_to_all_single(out_uneven, x_uneven, outs, ins)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                tilecomm.all_to_all_single(out, x, splits, splits)
                tilecomm.all_to_all_single(out_uneven, x_uneven, outs, ins)
                tilecomm.all_gather_into_tensor(torch.empty(world * x.numel(), device=dev()), x)
                tilecomm.reduce_scatter_tensor(torch.empty(x.numel() // world, device=dev()), x.reshape(-1))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            _graph_replays_eager(out, x, splits, splits, "even splits")
            _graph_replays_eager(out_uneven, x_uneven, outs, ins, f"uneven, table_arg_ranks={arg_ranks}")
        finally:
            state.table_arg_ranks = TABLE_ARG_RANKS


@pytest.mark.parametrize("world", [2, 3])
def test_no_host_sync_and_cuda_graph_replay(ranks, world):
    if BACKEND_IS_CPU:
        pytest.skip("CUDA graphs and sync debug mode need GPU ranks")
    ranks(world).run(no_sync_and_graph_replay)


def compiled_matches_eager():
    """torch.compile(fullgraph=True) of a function calling the three collectives with fixed splits (and a
    reduce-scatter with op=MAX: a ReduceOp argument traced by Dynamo, which torch 2.11's could not hash) gives
    the eager result, forward and backward (aot_eager on CPU ranks: no C++ toolchain needed)."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    splits = [2 + p for p in range(world)]  # uneven, the same on every rank: all_to_all with fixed splits
    recv = [2 + rank] * world

    def step(x, y):
        a = torch.empty(sum(recv), 3, device=x.device)
        tilecomm.all_to_all_single(a, x * 2, recv, splits)
        g = torch.empty(world * y.numel(), device=y.device)
        tilecomm.all_gather_into_tensor(g, y)
        r = torch.empty(y.numel() // world, device=y.device)
        tilecomm.reduce_scatter_tensor(r, g[: y.numel()] + 1)
        m = torch.empty(y.numel() // world, device=y.device)  # an op other than the default (no autograd: MAX)
        tilecomm.reduce_scatter_tensor(m, g[: y.numel()].detach() * (rank + 1), op=tilecomm.ReduceOp.MAX)
        return a.sum() * 3 + (g * g).sum() + r.sum(), a, g, r, m

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(sum(splits), 3, generator=gen).to(dev()).requires_grad_()
    y = torch.randn(world * 4, generator=gen).to(dev()).requires_grad_()
    backend = "aot_eager" if x.device.type == "cpu" else "inductor"
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    eager_out = step(x, y)
    eager_out[0].backward()
    grads = (x.grad.clone(), y.grad.clone())
    x.grad = y.grad = None
    comp_out = compiled(x, y)
    comp_out[0].backward()
    for e, c in zip(eager_out, comp_out):
        torch.testing.assert_close(c, e)
    torch.testing.assert_close(x.grad, grads[0])
    torch.testing.assert_close(y.grad, grads[1])


def test_torch_compile_fullgraph_matches_eager(ranks):
    ranks(2).run(compiled_matches_eager)


def different_collectives():
    """Rank 0 calls all_gather_into_tensor while rank 1 calls all_to_all_single with the same sizes: both
    ranks raise PeerMismatchError naming both collectives (nothing is moved), and the next matched call works."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    x = torch.randn(world * 4, device=dev())
    out = torch.empty(world * world * 4 if rank == 0 else world * 4, device=dev())
    with pytest.raises(PeerMismatchError, match="called all_(gather_into_tensor|to_all_single) of 4-byte elements "
                                                "while rank \\d called all_"):
        if rank == 0:
            tilecomm.all_gather_into_tensor(out, x)
        else:
            tilecomm.all_to_all_single(out, x)
        if x.device.type == "cuda":  # GPUs record it on the device, seen once the kernel has run
            torch.cuda.synchronize()
        tilecomm.check_errors()
    good = torch.empty_like(x)
    tilecomm.all_to_all_single(good, x)
    ref = torch.empty_like(x)
    dist.all_to_all_single(ref, x)
    assert torch.equal(good, ref)


def test_ranks_in_different_collectives_raise(ranks):
    ranks(2).run(different_collectives)


@tilecomm.jit
def _packed_counts_kernel(out_ptr, t0, t1, t2, t3, t4, t5, t6, t7):
    p = tl.program_id(0)
    s_before, s_rows = kx._packed_counts(p, t0, t1, t2, t3, t4, t5, t6, t7, False)
    r_before, r_rows = kx._packed_counts(p, t0, t1, t2, t3, t4, t5, t6, t7, True)
    tl.store(out_ptr + 4 * p, s_before)
    tl.store(out_ptr + 4 * p + 1, s_rows)
    tl.store(out_ptr + 4 * p + 2, r_before)
    tl.store(out_ptr + 4 * p + 3, r_rows)


@pytest.mark.skipif(not BACKEND_IS_CPU, reason="one interpreted kernel, no ranks")
@pytest.mark.parametrize("world", [1, 5, 8])
def test_packed_counts_of_eight_ranks(world):
    """The element counts an uneven all_to_all of up to 8 ranks passes as kernel arguments, unpacked by every
    peer's program: elements before its own and its own, sent and received (zeros, large counts, absent peers)."""
    gen = torch.Generator().manual_seed(world)
    sent = torch.randint(0, 1 << 26, (world,), generator=gen).tolist()
    recv = torch.randint(0, 1 << 26, (world,), generator=gen).tolist()
    sent[0], recv[-1] = 0, 0
    words = [state_module._MARK | r << 32 | s for s, r in zip(sent, recv)] + [0] * (8 - world)
    out = torch.full((8, 4), -1, dtype=torch.int64)
    _packed_counts_kernel[(world,)](out, *words)
    for p in range(world):
        assert out[p].tolist() == [sum(sent[:p]), sent[p], sum(recv[:p]), recv[p]], f"peer {p}"
