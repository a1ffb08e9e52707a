"""Low-latency dispatch / combine (Dispatcher(mode="low_latency")) on 2, 3 and 4 CPU ranks: rows against the normal
mode's, combine against its formula, device errors, the receive hook, CUDA graphs (GPU ranks). The random-routing loops
of both modes are in test_dispatch.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tilecomm
from _reference import dev
from test_dispatch import TOKENS, _check_low_latency, _inputs, _random_inputs, _sync
from tilecomm.dispatch import Dispatcher


def low_latency_body(seed, T_by_rank, H, K, E, dtype, iters, after=None):
    """Low-latency rows (packed by their counts) equal the normal mode's; combine gives the formula. after(fast,
    T, hooked): more checks after each iteration's dispatch (test_dispatch_config: the trace)."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    M = max(T_by_rank) + 1
    fast = Dispatcher(E, H, M, K, dtype, mode="low_latency")
    ref = Dispatcher(E, H, M, K, dtype, backend="nccl")
    for it in range(iters):
        x, idx, w = _inputs(seed * 1000 + it * 10 + rank, T_by_rank[(rank + it) % world], H, K, E, dtype)
        res, want = fast.dispatch(x, idx, w, return_recv_hook=bool(it % 2)), ref.dispatch(x, idx, w)
        if res.recv_hook is not None:  # odd iterations: send half first, receive half on demand
            res.recv_hook()
        assert res.x.shape == (E // world, world * M, H)
        counts = res.tokens_per_expert.tolist()
        assert counts == want.tokens_per_expert.tolist()
        rows = torch.cat([res.x[e, :n] for e, n in enumerate(counts)])
        assert torch.equal(rows, want.x), f"iteration {it}: low-latency rows differ"
        assert torch.equal(torch.cat([res.weights[e, :n] for e, n in enumerate(counts)]), want.weights)
        if after is not None:
            after(fast, x.shape[0], res.recv_hook is not None)
        experts = torch.arange(E // world, device=x.device) + rank * (E // world)
        y = (res.x.float() * (1.0 + experts.float())[:, None, None]).to(dtype)
        out = fast.combine(y, res.handle)
        coef = torch.where(idx >= 0, w * (1.0 + idx.float()), 0.0).sum(1)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out.double(), x.double() * coef.double()[:, None], rtol=tol, atol=tol)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_low_latency_matches_normal_mode(ranks, world):
    ranks(world).run(low_latency_body, 3, TOKENS[world], 8, 3, 4 * world, torch.float32, 4)


def test_low_latency_bf16_top8(ranks):
    ranks(2).run(low_latency_body, 4, [6, 4], 16, 8, 10, torch.bfloat16, 2)


def low_latency_device_error_body(kind):
    """An expert id out of range, or more rows for one (expert, source) than the capacity (a token naming
    the same expert twice), is found on the device: nothing is written past the capacity, the next call
    raises naming the rank, and the Dispatcher stays usable. Every rank errs (a rank that raises leaves
    its peers' collective call waiting)."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    E, H, M, K = 2 * world, 8, 4, 2
    d = Dispatcher(E, H, M, K, torch.float32, mode="low_latency")
    x = torch.arange(M * H, dtype=torch.float32, device=dev()).view(M, H) + 100 * rank
    w = torch.rand(M, K, device=dev())
    if kind == "bad_id":
        idx = torch.full((M, K), -1, dtype=torch.int64, device=dev())
        idx[1, 1] = E + rank
    else:  # every token names expert E - 1 twice: 2 * M rows for a capacity of M
        idx = torch.full((M, K), E - 1, dtype=torch.int64, device=dev())
    with torch.no_grad():
        res = d.dispatch(x, idx, w)
        _sync()
        counts = res.tokens_per_expert.tolist()
        if kind == "capacity" and rank == world - 1:  # the first M pairs of every source, in (token, k) order
            gathered = [None] * world
            dist.all_gather_object(gathered, x.cpu())
            want = torch.cat([g[torch.arange(M) // K] for g in gathered])
            assert counts[-1] == world * M and torch.equal(res.x[-1, : world * M].cpu(), want)
        elif kind == "capacity":
            dist.all_gather_object([None] * world, x.cpu())
        with pytest.raises(ValueError) as err:
            d.combine(res.x, res.handle)
        want_msg = f"rank {rank}: token 1 has expert id {E + rank}" if kind == "bad_id" else \
            f"rank {rank}: low-latency dispatch sent {2 * M} rows to expert {E - 1}, more than its capacity of {M}"
        assert want_msg in str(err.value), str(err.value)
        own = torch.Generator().manual_seed(rank)
        ref = Dispatcher(E, H, M, K, torch.float32, backend="nccl")
        _check_low_latency(d, ref, *_random_inputs(own, M, H, K, E, distinct=True), it=0, hook=False)
    d.free()
    ref.free()


@pytest.mark.parametrize("kind", ["bad_id", "capacity"])
def test_low_latency_device_errors(ranks, kind):
    ranks(2).run(low_latency_device_error_body, kind)


def low_latency_combine_before_hook():
    world = tilecomm.world_size()
    d = Dispatcher(2 * world, 4, 3, 1, torch.float32, mode="low_latency")
    x, idx, w = _random_inputs(torch.Generator().manual_seed(1), 3, 4, 1, 2 * world, distinct=True)
    with torch.no_grad():
        res = d.dispatch(x, idx, w, return_recv_hook=True)
        with pytest.raises(ValueError, match="recv_hook"):
            d.combine(res.x, res.handle)
        res.recv_hook()
        with pytest.raises(ValueError, match="once"):
            res.recv_hook()
        torch.testing.assert_close(d.combine(res.x, res.handle), x * torch.where(idx >= 0, w, 0.0))
    d.free()


def test_low_latency_combine_before_recv_hook_raises(ranks):
    ranks(2).run(low_latency_combine_before_hook)


def low_latency_graph_body():
    """Low-latency dispatch + combine captured in one CUDA graph replays the eager results on new inputs."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    E, H, M, K, dtype = 4 * world, 64, 8, 3, torch.bfloat16
    d = Dispatcher(E, H, M, K, dtype, mode="low_latency")
    own = torch.Generator().manual_seed(rank)
    x, idx, w = (t.clone() for t in _random_inputs(own, M, H, K, E, distinct=True))
    x = x.to(dtype)
    scale = 1.0 + (torch.arange(E // world, device=x.device) + rank * (E // world)).float()
    with torch.no_grad():
        def step():
            res = d.dispatch(x, idx, w)
            return res, d.combine((res.x.float() * scale[:, None, None]).to(dtype), res.handle)
        step()
        torch.cuda.synchronize()
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
            g_res, g_out = step()
        torch.cuda.current_stream().wait_stream(side)
        for _ in range(3):
            nx, nidx, nw = _random_inputs(own, M, H, K, E, distinct=True)
            x.copy_(nx.to(dtype)), idx.copy_(nidx), w.copy_(nw)
            graph.replay()
            torch.cuda.synchronize()
            e_res, e_out = step()
            counts = e_res.tokens_per_expert.tolist()
            assert g_res.tokens_per_expert.tolist() == counts
            for e, n in enumerate(counts):
                assert torch.equal(g_res.x[e, :n], e_res.x[e, :n])
            assert torch.equal(g_out, e_out)
    d.free()


def test_low_latency_cuda_graph(ranks):
    from conftest import BACKEND

    if BACKEND != "cuda":
        pytest.skip("CUDA graphs need GPU ranks (TILECOMM_TEST_BACKEND=cuda)")
    ranks(2).run(low_latency_graph_body)
