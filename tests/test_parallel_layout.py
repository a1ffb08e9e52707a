"""ParallelLayout (MoE Parallel Folding) against an independent reference of Megatron-Core's rank groups.

The reference below follows the definition, not Megatron's algorithm: number the ranks along the order
(first token fastest), read each rank's coordinates, and put ranks that agree on every coordinate outside
the kind in one group; groups sort by their outside coordinates, members by their inside coordinates
(first token fastest in both). The hard-coded cases are the examples in the docstrings of
Megatron-LM's megatron/core/parallel_state.py (initialize_model_parallel and
generate_masked_orthogonal_rank_groups).
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from _reference import dev
from tilecomm.moe.parallel import PIPELINE_UNSUPPORTED, ParallelLayout

TOKENS = ("tp", "cp", "ep", "dp", "pp")
ATTENTION = {"tp": ["tp"], "cp": ["cp"], "dp": ["dp"], "pp": ["pp"], "dp-cp": ["dp", "cp"],
             "cp-dp": ["dp", "cp"], "tp-cp": ["tp", "cp"], "tp-dp": ["tp", "dp"],
             "tp-dp-cp": ["tp", "dp", "cp"], "tp-pp": ["tp", "pp"]}
EXPERT = {"etp": ["tp"], "ep": ["ep"], "edp": ["dp"], "etp-ep": ["tp", "ep"],
          "etp-ep-pp": ["tp", "ep", "pp"], "ep-pp": ["ep", "pp"]}


def ref_groups(sizes: dict, order: str, dims: list) -> list:
    """Groups of ranks differing only along `dims`, ranks numbered along `order` (first fastest)."""
    tokens = order.split("-") + [t for t in TOKENS if t not in order.split("-")]
    world = 1
    for t in tokens:
        world *= sizes[t]
    groups = {}
    for rank in range(world):
        coord, rest = {}, rank
        for t in tokens:
            coord[t], rest = rest % sizes[t], rest // sizes[t]
        outside = tuple(coord[t] for t in reversed(tokens) if t not in dims)
        inside = tuple(coord[t] for t in reversed(tokens) if t in dims)
        groups.setdefault(outside, []).append((inside, rank))
    return [[r for _, r in sorted(members)] for _, members in sorted(groups.items())]


def ref_layout(world, tp, cp, pp, etp, ep, order):
    """(attention sizes, expert sizes) if Megatron-Core accepts the layout, else None."""
    if world % (tp * cp * pp) or world % (etp * ep * pp):
        return None
    att = {"tp": tp, "cp": cp, "ep": 1, "dp": world // (tp * cp * pp), "pp": pp}
    exp = {"tp": etp, "cp": 1, "ep": ep, "dp": world // (etp * ep * pp), "pp": pp}
    named = order.split("-")
    if any(t not in named and (att[t] > 1 or exp[t] > 1) for t in TOKENS):
        return None  # a token of size > 1 left out of the order
    if not order.endswith("pp") and pp > 1 and att["dp"] != exp["dp"]:
        return None
    if ref_groups(att, order, ["pp"]) != ref_groups(exp, order, ["pp"]):
        return None
    return att, exp


ORDERS = ["tp-cp-ep-dp-pp", "tp-ep-dp-pp", "tp-dp-pp", "tp-pp-dp", "tp-cp-pp-ep-dp", "dp-tp-cp-ep-pp",
          "ep-tp-dp-pp"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("world", [4, 8, 12, 16])
def test_matches_reference_for_every_layout(world, order):
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    accepted = 0
    for tp, cp, pp, etp, ep in itertools.product(divisors, repeat=5):
        ref = ref_layout(world, tp, cp, pp, etp, ep, order)
        if ref is None:
            with pytest.raises(ValueError):
                ParallelLayout(world, tp=tp, cp=cp, pp=pp, etp=etp, ep=ep, order=order)
            continue
        accepted += 1
        layout = ParallelLayout(world, tp=tp, cp=cp, pp=pp, etp=etp, ep=ep, order=order)
        att, exp = ref
        assert (layout.dp, layout.edp) == (att["dp"], exp["dp"])
        for kind, dims in ATTENTION.items():
            assert layout.rank_groups(kind) == ref_groups(att, order, dims), (kind, tp, cp, pp, etp, ep)
        for kind, dims in EXPERT.items():
            assert layout.rank_groups(kind) == ref_groups(exp, order, dims), (kind, tp, cp, pp, etp, ep)
    assert accepted > 0


def test_megatron_docstring_examples():
    # initialize_model_parallel: 16 GPUs, tp=2, pp=4.
    layout = ParallelLayout(16, tp=2, pp=4)
    assert layout.rank_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert layout.rank_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert layout.rank_groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    # initialize_model_parallel, context_parallel_size: 8 GPUs, tp=4, cp=2.
    assert ParallelLayout(8, tp=4, cp=2).rank_groups("cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # generate_masked_orthogonal_rank_groups: order tp-pp-dp, sizes 2-2-2 (etp=2 keeps edp == dp, which
    # initialize_model_parallel requires when pp is not last).
    tpd = ParallelLayout(8, tp=2, pp=2, etp=2, order="tp-pp-dp")
    assert tpd.rank_groups("dp") == tpd.rank_groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # generate_masked_orthogonal_rank_groups: [tp, dp, pp] = [2, 3, 4].
    dp = ParallelLayout(24, tp=2, pp=4, order="tp-dp-pp").rank_groups("dp")
    assert len(dp) == 8 and dp[0] == [0, 2, 4] and dp[1] == [1, 3, 5] and dp[7] == [19, 21, 23]


def test_folding_example_world8_tp2_ep4():
    layout = ParallelLayout(8, tp=2, ep=4)
    assert (layout.dp, layout.edp) == (4, 2)
    assert layout.rank_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.rank_groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.rank_groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.rank_groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.rank_groups("etp") == [[r] for r in range(8)]
    assert layout.group_of("ep", 6) == [4, 5, 6, 7]
    # Members follow the order (cp before dp), not the kind string; "cp-dp" is the same kind.
    l2 = ParallelLayout(8, tp=2, cp=2)
    assert l2.rank_groups("dp-cp") == l2.rank_groups("cp-dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert ParallelLayout(8, tp=2, etp=2, ep=2).rank_groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=8, tp=3), "not divisible by tp\\*cp\\*pp"),
    (dict(world_size=8, etp=2, ep=8), "not divisible by etp\\*ep\\*pp"),
    (dict(world_size=8, tp=0), "tp=0"),
    (dict(world_size=8, ep=-2), "ep=-2"),
    (dict(world_size=8, tp=2.0), "tp=2.0"),
    (dict(world_size=0), "world_size=0"),
    (dict(world_size=8, pp=2, order="tp-cp-ep-dp"), "lacks 'pp'"),
    (dict(world_size=8, ep=2, order="tp-dp-pp"), "lacks 'ep'"),
    (dict(world_size=8, cp=2, order="tp-ep-dp-pp"), "lacks 'cp'"),
    (dict(world_size=8, order="tp-ep-pp"), "lacks 'dp'"),
    (dict(world_size=8, order="tp-tp-dp-pp"), "repeats"),
    (dict(world_size=8, order="tp-xp-dp-pp"), "unknown token"),
    (dict(world_size=8, order=""), "unknown token"),
    (dict(world_size=8, pp=2, ep=4, order="tp-pp-ep-dp"), "must be equal"),
    (dict(world_size=8, tp=2, pp=2, ep=2, order="tp-pp-ep-dp"), "different pipeline groups"),
])
def test_bad_layouts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout(**kwargs)


@pytest.mark.parametrize("kind", ["foo", "tp-ep", "edp-dp", "tp-tp", "", "tp-"])
def test_bad_kinds(kind):
    with pytest.raises(ValueError):
        ParallelLayout(8, tp=2, ep=2).rank_groups(kind)


def test_pipeline_training_unsupported():
    assert ParallelLayout(8, tp=2).pipeline_training_supported
    ParallelLayout(8, tp=2).check_trainable()
    layout = ParallelLayout(8, pp=2, ep=2)
    assert not layout.pipeline_training_supported
    assert layout.rank_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # the layout itself is fine
    with pytest.raises(NotImplementedError, match=r"pipeline parallel training \(pp>1\) is not supported yet"):
        layout.check_trainable()
    assert PIPELINE_UNSUPPORTED == "pipeline parallel training (pp>1) is not supported yet"


def create_groups_body(kwargs):
    rank = dist.get_rank()
    layout = ParallelLayout(dist.get_world_size(), **kwargs)
    groups = layout.create_groups()
    assert groups.rank == rank
    seen = {}
    for kind in ("tp", "cp", "dp", "dp-cp", "pp", "etp", "ep", "edp"):
        pg, members = getattr(groups, kind.replace("-", "_")), groups.ranks[kind]
        assert members == layout.group_of(kind, rank), kind
        assert dist.get_process_group_ranks(pg) == members, kind
        x = torch.tensor([float(rank + 1)], device=dev())
        dist.all_reduce(x, group=pg)
        assert x.item() == sum(r + 1 for r in members), kind
        seen[kind] = members
    with pytest.raises(ValueError, match="layout is for 8 ranks"):
        ParallelLayout(8).create_groups()
    return seen


@pytest.mark.parametrize("kwargs", [dict(tp=2, ep=4), dict(tp=2, ep=2, etp=2), dict(cp=2, ep=2),
                                    dict(pp=2, ep=2), dict()])
def test_create_groups_on_4_ranks(ranks, kwargs):
    results = ranks(4).run(create_groups_body, kwargs)
    layout = ParallelLayout(4, **kwargs)
    for rank, seen in enumerate(results):
        for kind, members in seen.items():
            assert rank in members and members in layout.rank_groups(kind)
