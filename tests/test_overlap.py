"""ag_gemm, gemm_rs and the TP layers against float64 references, on 2, 3 and 4 CPU ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tilecomm
from _reference import dev, gather_all
from tilecomm.overlap import ColumnParallelLinear, RowParallelLinear, ag_gemm, gemm_rs, matmul

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _rel(got, want):
    return ((got.double().cpu() - want).norm() / want.norm().clamp_min(1e-30)).item()


def _rand(shape, seed, dtype):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(dev())


def ag_gemm_body(m, K, n, dtype, calls):
    rank = tilecomm.rank()
    for call in range(calls):  # fresh data each call: the gather buffer and flags are reused
        a = _rand((m, K), 100 * call + rank, dtype)
        b = _rand((K, n), 100 * call + 77, dtype)
        c, gathered = ag_gemm(a, b, return_gathered=True)
        full = torch.cat([t.double() for t in gather_all(a)])
        assert torch.equal(gathered.cpu(), full.to(dtype)), "gathered A differs"
        err = _rel(c, full @ b.double().cpu())
        assert err < TOL[dtype], f"call {call}: rel err {err}"


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_ag_gemm(ranks, world, dtype):
    ranks(world).run(ag_gemm_body, 19, 23, 37, dtype, 2)


def gemm_rs_body(mb, K, N, dtype, calls):
    rank, world = tilecomm.rank(), tilecomm.world_size()
    for call in range(calls):
        a = _rand((world * mb, K), 10 * call + rank, dtype)
        b = _rand((K, N), 10 * call + 5 + rank, dtype)
        out = gemm_rs(a, b)
        parts = [x.double() @ y.double() for x, y in zip(gather_all(a), gather_all(b))]
        want = sum(parts)[rank * mb:(rank + 1) * mb]
        err = _rel(out, want)
        assert out.shape == (mb, N) and err < TOL[dtype], f"call {call}: rel err {err}"


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gemm_rs(ranks, world, dtype):
    ranks(world).run(gemm_rs_body, 17, 29, 21, dtype, 2)


def test_matmul_alone():
    a, b = torch.randn(37, 45), torch.randn(45, 29)
    assert _rel(matmul(a, b), a.double() @ b.double()) < 1e-5


def tp_mlp_body(s, h, f, seed):
    """Column -> ReLU -> Row with sequence parallelism equals a single-device two-layer MLP."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    torch.manual_seed(seed)
    lin1, lin2 = nn.Linear(h, f), nn.Linear(f, h)  # float32: the kernels' widest GEMM type
    x_full = torch.randn(s, h)
    g_full = torch.randn(s, h)
    rows = slice(rank * s // world, (rank + 1) * s // world)
    col, row = ColumnParallelLinear.from_linear(lin1), RowParallelLinear.from_linear(lin2)
    col, row = col.to(dev()), row.to(dev())
    x = x_full[rows].clone().to(dev()).requires_grad_()
    y = row(torch.relu(col(x)))
    (y * g_full[rows].to(dev())).sum().backward()
    y, xg = y.detach().cpu(), x.grad.cpu()
    x_ref = x_full.clone().requires_grad_()
    y_ref = lin2(torch.relu(lin1(x_ref)))
    (y_ref * g_full).sum().backward()
    torch.testing.assert_close(y, y_ref[rows].detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(xg, x_ref.grad[rows], rtol=1e-4, atol=1e-5)
    fb = f // world
    torch.testing.assert_close(col.weight.grad.cpu(), lin1.weight.grad.t()[:, rank * fb:(rank + 1) * fb], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(col.bias.grad.cpu(), lin1.bias.grad[rank * fb:(rank + 1) * fb], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(row.weight.grad.cpu(), lin2.weight.grad.t()[rank * fb:(rank + 1) * fb], rtol=1e-4, atol=1e-5)
    # the row layer's bias is replicated: its gradient is this rank's share; summed over ranks it is the full one
    total = row.bias.grad.clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total.cpu(), lin2.bias.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("world", [2, 3])
def test_tp_layers_match_single_device_mlp(ranks, world):
    ranks(world).run(tp_mlp_body, 6 * world, 10, 4 * world, 3)


def bad_overlap_inputs():
    world = tilecomm.world_size()
    a, b = torch.randn(4, 8), torch.randn(8, 5)
    for fn in (ag_gemm, gemm_rs):
        with pytest.raises(ValueError, match="inner dimensions"):
            fn(torch.randn(world * 2, 7), b)
        with pytest.raises(TypeError, match="share a dtype"):
            fn(a, b.half())
        with pytest.raises(ValueError, match="contiguous"):
            fn(torch.randn(8, world * 4).t(), b)
        with pytest.raises(ValueError, match="2-D"):
            fn(torch.randn(3), b)
    with pytest.raises(ValueError, match="multiple of the group size"):
        gemm_rs(torch.randn(world * 2 + 1, 8), b)
    with pytest.raises(ValueError, match="divide by"):
        ColumnParallelLinear(8, world * 2 + 1)


def test_bad_overlap_inputs(ranks):
    ranks(2).run(bad_overlap_inputs)
