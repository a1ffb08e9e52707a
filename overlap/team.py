"""Teams: the ranks one fused op runs over (a torch.distributed group, or the world).

The kernels never ask for the global rank or the world size. They take `me` (this rank's index in
the team), `W` (the team's size) and `pes_ptr`, a device table of the members' global ranks, and
reach member i through PE `tl.load(pes_ptr + i)`. The world is the team of all ranks, so one kernel
source serves both. Worked example, world 4, group [1, 3] on global rank 3:

    team = team_of(group, "ag_gemm")   # ranks (1, 3), index 1, size 2, pes tensor([1, 3], int32)

Symmetric workspaces are per team (their flags and epochs count that team's calls): the cache key
holds the team's ranks. The symmetric heap is one world-wide first-fit allocator whose `empty` is
collective over the world, so workspace creation is too: every rank must create workspaces at the
same points of its program (SPMD: every TP group calls the same layers with the same shapes, in the
same order). Buffer sizes are agreed over the world (the largest any team asks for), so teams of
different sizes (a group of 2 beside a group of 1) still allocate alike.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton.language as tl

import tilecomm
import tilecomm.language as tcl

from .tiles import SymmetricWorkspace


@dataclass(frozen=True)
class Team:
    """ranks: global ranks in group order; index: this rank's position in `ranks`; size: len(ranks);
    pes: [size] int32 on the runtime's device, pes[i] = ranks[i] (the PE id kernels put/signal to)."""

    ranks: tuple[int, ...]
    index: int
    size: int
    pes: torch.Tensor


def team_of(group, what: str) -> Team:
    """The Team of `group` (None or the world group: all ranks), cached in the runtime context.
    Raises ValueError naming `group` when it is not a process group containing this rank."""
    ctx = tilecomm.current()
    if group is None or group is dist.GroupMember.WORLD:
        ranks = tuple(range(ctx.world_size))
    else:
        if not isinstance(group, dist.ProcessGroup):
            raise ValueError(f"{what}: group must be None or a torch.distributed ProcessGroup that contains this "
                             f"rank, got {group!r} (a rank outside a group gets a non-member placeholder)")
        ranks = tuple(dist.get_process_group_ranks(group))
        if ctx.rank not in ranks:
            raise ValueError(f"{what}: group {list(ranks)} does not contain this rank ({ctx.rank})")
        if any(not 0 <= r < ctx.world_size for r in ranks):
            raise ValueError(f"{what}: group {list(ranks)} has ranks outside tilecomm's world of {ctx.world_size}")
    key = ("team", ranks)
    team = ctx.caches.get(key)
    if team is None:
        pes = torch.tensor(ranks, dtype=torch.int32, device=ctx.device)
        team = ctx.caches[key] = Team(ranks, ranks.index(ctx.rank), len(ranks), pes)
    return team


def team_workspace(team: Team, key: tuple, specs: dict[str, tuple[tuple, torch.dtype, bool]]) -> SymmetricWorkspace:
    """The op's SymmetricWorkspace for `team` (created on first use, collectively over the world; see the
    module docstring). specs: name -> (shape, dtype, zeroed). Each buffer is the leading `prod(shape)`
    elements of a flat symmetric allocation whose length is the largest any rank asked for."""
    def make():
        ctx = tilecomm.current()
        numels = [math.prod(shape) for shape, _, _ in specs.values()]
        if ctx.world_size > 1:
            numels = [max(column) for column in zip(*ctx.boot.all_gather_object(numels))]
        buffers = {}
        for (name, (shape, dtype, zeroed)), numel in zip(specs.items(), numels):
            flat = (tilecomm.zeros if zeroed else tilecomm.empty)((numel,), dtype)
            buffers[name] = flat[:math.prod(shape)].view(shape)
        return buffers

    return SymmetricWorkspace.get(key + ("team", team.ranks), make)


@tilecomm.jit
def _release_kernel(consumed_ptr, pes_ptr, epoch, me, W):
    """SET consumed[me] = epoch on every team member: this rank is done reading the call's buffers."""
    for i in range(W):
        tcl.signal(consumed_ptr + me, epoch, tl.load(pes_ptr + i), tcl.SIGNAL_SET)


def release(ws: SymmetricWorkspace, team: Team) -> None:
    """Tell every member that this rank has finished the call on `ws` (its `consumed` words)."""
    _release_kernel[(1,)](ws.consumed, team.pes, ws.epoch, team.index, team.size)
