"""ag_gemm, gemm_rs and the TP layers over process groups (teams): several groups at once, groups
of unequal size, non-contiguous groups, then the world again; against float64 references."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tilecomm
from _reference import dev, gather_all
from tilecomm.overlap import (ColumnParallelLinear, RowParallelLinear, ag_gemm, ag_gemm_reference, gemm_rs,
                              gemm_rs_reference)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _rel(got, want):
    return ((got.double().cpu() - want.cpu()).norm() / want.cpu().norm().clamp_min(1e-30)).item()


def _rand(shape, seed, dtype):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(dev())


def _my_group(layout):
    """Create every group of `layout` (all ranks, same order) and return (mine, its ranks)."""
    mine = None
    for ranks in layout:
        group = dist.new_group(ranks)
        if tilecomm.rank() in ranks:
            mine = (group, ranks)
    return mine


def ops_over_groups(layout, dtype):
    group, members = _my_group(layout)
    rank, me, size = tilecomm.rank(), members.index(tilecomm.rank()), len(members)
    m, K, n, mb, N = 5, 19, 23, 3, 21
    for call in range(2):  # fresh data each call: the team's buffers and flags are reused
        a = _rand((m, K), 100 * call + rank, dtype)
        b = _rand((K, n), 100 * call + 50 + members[0], dtype)  # the same within a group, not across groups
        c, gathered = ag_gemm(a, b, return_gathered=True, group=group)
        every = gather_all(a)
        want_gathered = torch.cat([every[r] for r in members])  # independent of the reference
        assert torch.equal(gathered.cpu(), want_gathered), "gathered A differs"
        want = ag_gemm_reference(a.double(), b.double(), group=group)
        assert c.shape == (size * m, n) and _rel(c, want) < TOL[dtype], f"ag_gemm call {call}: {_rel(c, want)}"
        assert _rel(want, want_gathered.double() @ b.double().cpu()) < 1e-12

        a = _rand((size * mb, K), 10 * call + rank, dtype)
        b = _rand((K, N), 10 * call + 5 + rank, dtype)
        out = gemm_rs(a, b, group=group)
        want = gemm_rs_reference(a.double(), b.double(), group=group)
        assert out.shape == (mb, N) and _rel(out, want) < TOL[dtype], f"gemm_rs call {call}: {_rel(out, want)}"
        a_all, b_all = gather_all(a), gather_all(b)
        independent = sum(a_all[r].double() @ b_all[r].double() for r in members)[me * mb:(me + 1) * mb]
        assert _rel(want, independent) < 1e-12
    # the world team still works beside the groups' teams
    world = tilecomm.world_size()
    a, b = _rand((m, K), 7 + rank, dtype), _rand((K, n), 8, dtype)
    assert _rel(ag_gemm(a, b), ag_gemm_reference(a.double(), b.double())) < TOL[dtype]
    a = _rand((world * mb, K), 9 + rank, dtype)
    assert _rel(gemm_rs(a, b[:, :N]), gemm_rs_reference(a.double(), b[:, :N].double())) < TOL[dtype]


@pytest.mark.parametrize("world,layout,dtype", [
    (4, [[0, 1], [2, 3]], torch.float32),
    (4, [[0, 2], [1, 3]], torch.bfloat16),
    (3, [[0, 1], [2]], torch.float32),  # unequal teams (the buffers are agreed over the world)
    (3, [[1], [0, 2]], torch.float32),
], ids=["4:01|23", "4:02|13-bf16", "3:01|2", "3:1|02"])
def test_ops_over_groups(ranks, world, layout, dtype):
    ranks(world).run(ops_over_groups, layout, dtype)


def tp_mlp_over_groups(layout, s_per_rank, h, f_per_rank):
    """Column -> ReLU -> Row over this rank's group equals the group's single-device MLP; each group
    has its own data and weights."""
    group, members = _my_group(layout)
    me, size = members.index(tilecomm.rank()), len(members)
    s, f = s_per_rank * size, f_per_rank * size
    torch.manual_seed(1000 + members[0])
    lin1, lin2 = nn.Linear(h, f), nn.Linear(f, h)
    x_full, g_full = torch.randn(s, h), torch.randn(s, h)
    rows = slice(me * s_per_rank, (me + 1) * s_per_rank)
    col = ColumnParallelLinear.from_linear(lin1, group=group).to(dev())
    row = RowParallelLinear.from_linear(lin2, group=group).to(dev())
    assert col.weight.tensor_parallel and col.bias.tensor_parallel and row.weight.tensor_parallel
    assert not hasattr(row.bias, "tensor_parallel")  # replicated
    x = x_full[rows].clone().to(dev()).requires_grad_()
    y = row(torch.relu(col(x)))
    (y * g_full[rows].to(dev())).sum().backward()
    x_ref = x_full.clone().requires_grad_()
    y_ref = lin2(torch.relu(lin1(x_ref)))
    (y_ref * g_full).sum().backward()
    close = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(y.detach().cpu(), y_ref[rows].detach(), **close)
    torch.testing.assert_close(x.grad.cpu(), x_ref.grad[rows], **close)
    cols = slice(me * f_per_rank, (me + 1) * f_per_rank)
    torch.testing.assert_close(col.weight.grad.cpu(), lin1.weight.grad.t()[:, cols], **close)
    torch.testing.assert_close(col.bias.grad.cpu(), lin1.bias.grad[cols], **close)
    torch.testing.assert_close(row.weight.grad.cpu(), lin2.weight.grad.t()[cols], **close)
    total = row.bias.grad.clone()
    dist.all_reduce(total, group=group)
    torch.testing.assert_close(total.cpu(), lin2.bias.grad, **close)


@pytest.mark.parametrize("world,layout", [(4, [[0, 1], [2, 3]]), (3, [[0, 1], [2]])], ids=["4:01|23", "3:01|2"])
def test_tp_layers_over_groups(ranks, world, layout):
    ranks(world).run(tp_mlp_over_groups, layout, 3, 5, 4)


def bad_groups():
    """Bad groups fail with a ValueError naming `group`, before any kernel runs (no hang)."""
    rank = tilecomm.rank()
    only_zero = dist.new_group([0])
    pair = dist.new_group([0, 1])
    a, b = torch.randn(4, 8, device=dev()), torch.randn(8, 5, device=dev())
    for fn in (ag_gemm, gemm_rs):
        with pytest.raises(ValueError, match="group"):
            fn(a, b, group="tp")
        if rank != 0:
            with pytest.raises(ValueError, match="group"):
                fn(a, b, group=only_zero)
    with pytest.raises(ValueError, match="group"):
        ColumnParallelLinear(8, 4, group=[0, 1])
    with pytest.raises(ValueError, match="multiple of the group size"):
        gemm_rs(torch.randn(3, 8, device=dev()), b, group=pair)
    with pytest.raises(ValueError, match="group size"):
        RowParallelLinear(3, 8, group=pair)
    # nothing was left half-done: a good call over the pair still works
    out = gemm_rs(torch.randn(4, 8, device=dev()), b, group=pair)
    assert out.shape == (2, 5)


def test_bad_groups(ranks):
    ranks(2).run(bad_groups)
