"""Soak: mixed collectives on 3 CPU ranks (all-to-all with random uneven splits, all-gather,
reduce-scatter with SUM / MAX / AVG, several dtypes and shapes, some async), every output poisoned
before the call and compared exactly with a reference each rank computes alone from every rank's
inputs (drawn from shared seeds). The expected count of wrong results is 0. Then random-routing dispatch
+ combine, both modes, bit for bit against the torch reference.

Iterations: TILECOMM_SOAK_ITERATIONS (CI default 300 collectives and 2 x 100 dispatch iterations: the
Triton interpreter takes ~0.1 s per collective and ~0.3 s per dispatch + combine on 3 ranks of a 2-core
machine, and CI's CPU suite is meant to stay near 10 minutes; every run draws fresh seeds, so CI runs add
up; GPU runs: 1000)."""
from __future__ import annotations

import os

import torch
from torch.distributed import ReduceOp

import tilecomm

ITERATIONS = int(os.environ.get("TILECOMM_SOAK_ITERATIONS", "0")) or None  # None: the defaults above
DTYPES = (torch.float32, torch.bfloat16, torch.int32, torch.int64, torch.float64)


def _input(seed: int, it: int, rank: int, shape, dtype, scale: int = 1) -> torch.Tensor:
    """Rank `rank`'s input of iteration `it`: small integers (times `scale`), exact in every dtype and
    in any sum; with scale = world size an average is an exact integer too, in any order of operations."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + it * 131 + rank)
    return (torch.randint(-8, 9, shape, generator=gen) * scale).to(dtype).to(tilecomm.current().device)


def _poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, 77 if not dtype.is_floating_point else float("nan"), dtype=dtype,
                      device=tilecomm.current().device)


def _case(plan: torch.Generator, world: int):
    """(op, dtype, cols, extra) of one iteration; every rank draws the same from `plan`."""
    op = ("a2a", "ag", "rs")[int(torch.randint(3, (1,), generator=plan))]
    dtype = DTYPES[int(torch.randint(len(DTYPES), (1,), generator=plan))]
    cols = int(torch.randint(1, 6, (1,), generator=plan))
    if op == "a2a":  # splits[src][dst] rows, uneven, zeros included
        extra = torch.randint(0, 4, (world, world), generator=plan)
    elif op == "ag":
        extra = int(torch.randint(0, 5, (1,), generator=plan))  # rows per rank
    else:
        ops = (ReduceOp.SUM, ReduceOp.MAX) + ((ReduceOp.AVG,) if dtype.is_floating_point else ())
        extra = (int(torch.randint(1, 4, (1,), generator=plan)), ops[int(torch.randint(len(ops), (1,), generator=plan))])
    is_async = bool(torch.randint(4, (1,), generator=plan) == 0)
    return op, dtype, cols, extra, is_async


def _run_one(seed: int, it: int, case, world: int, rank: int):
    """(got, expected) of one collective on this rank."""
    op, dtype, cols, extra, is_async = case
    if op == "a2a":
        splits = extra
        inputs = [_input(seed, it, r, (int(splits[r].sum()), cols), dtype) for r in range(world)]
        out = _poisoned((int(splits[:, rank].sum()), cols), dtype)
        work = tilecomm.all_to_all_single(out, inputs[rank], splits[:, rank].tolist(), splits[rank].tolist(),
                                          async_op=is_async)
        expect = torch.cat([inputs[src][int(splits[src, :rank].sum()):int(splits[src, :rank + 1].sum())]
                            for src in range(world)])
    elif op == "ag":
        inputs = [_input(seed, it, r, (extra, cols), dtype) for r in range(world)]
        out = _poisoned((world * extra, cols), dtype)
        work = tilecomm.all_gather_into_tensor(out, inputs[rank], async_op=is_async)
        expect = torch.cat(inputs)
    else:
        rows, reduce_op = extra
        scale = world if reduce_op == ReduceOp.AVG else 1
        inputs = [_input(seed, it, r, (world * rows, cols), dtype, scale) for r in range(world)]
        out = _poisoned((rows, cols), dtype)
        work = tilecomm.reduce_scatter_tensor(out, inputs[rank], op=reduce_op, async_op=is_async)
        stacked = torch.stack([x.double().cpu() for x in inputs])
        full = {ReduceOp.SUM: stacked.sum(0), ReduceOp.MAX: stacked.max(0).values,
                ReduceOp.AVG: stacked.sum(0) / world}[reduce_op]
        expect = full[rank * rows:(rank + 1) * rows].to(dtype).to(out.device)
    if is_async:
        work.wait()
    return out, expect


def soak(seed: int, iterations: int):
    world, rank = tilecomm.world_size(), tilecomm.rank()
    plan = torch.Generator().manual_seed(seed)
    wrong = []
    for it in range(iterations):
        case = _case(plan, world)
        got, expect = _run_one(seed, it, case, world, rank)
        if got.shape != expect.shape or not torch.equal(got, expect):
            wrong.append((it, case[0], str(case[1]), tuple(expect.shape)))
    return wrong


def test_mixed_collectives_soak_on_3_ranks_gives_0_wrong_results(ranks):
    seed = int(torch.randint(1 << 30, (1,)))  # fresh inputs every run; printed on failure
    wrong = ranks(3).run(soak, seed, ITERATIONS or 300)
    assert all(w == [] for w in wrong), f"seed {seed}: wrong results by rank {wrong}"


def test_random_routing_dispatch_soak_on_3_ranks(ranks):
    """Soak: normal-mode and low-latency dispatch + combine calls with random routing (uneven T,
    E, K, H, -1 ids, zero-token ranks, repeated experts in normal mode, back to back on reused buffers),
    each compared bit for bit with the torch reference (test_dispatch.random_loop_body raises on the first
    difference)."""
    from test_dispatch import random_loop_body

    seed = int(torch.randint(1 << 20, (1,)))  # fresh routing every run
    pool = ranks(3)
    for mode in ("normal", "low_latency"):
        try:
            pool.run(random_loop_body, mode, ITERATIONS or 100, seed)
        except Exception as err:
            raise AssertionError(f"{mode} dispatch soak, seed {seed}") from err
