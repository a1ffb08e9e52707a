"""Teams: the ranks one fused op runs over (a torch.distributed group, or the world).

The kernels never ask for the global rank or the world size. They take `me` (this rank's index in
the team), `W` (the team's size) and `pes_ptr`, a device table of the members' global ranks, and
reach member i through PE `tl.load(pes_ptr + i)`. The world is the team of all ranks, so one kernel
source serves both. Worked example, world 4, group [1, 3] on global rank 3:

    team = team_of(group, "ag_gemm")   # ranks (1, 3), index 1, size 2, pes tensor([1, 3], int32)

Symmetric workspaces (`OpWorkspace`) belong to the object that runs the op: a layer creates its
workspaces in `__init__`, `ag_gemm` / `gemm_rs` called without one create a temporary workspace for
the call and free it after. Creation is collective over the world (the symmetric heap is one world-wide
first-fit allocator): every rank must create workspaces at the same points of its program (SPMD: every TP
group builds the same layers in the same order). Buffer sizes are agreed over the world (the largest any
rank asks for), so teams of different sizes still allocate alike. At a workspace's first use the members
compare a fingerprint of the call (op, shapes, dtype) and raise PeerMismatchError naming both ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton.language as tl

import tilecomm
import tilecomm.language as tcl

from tilecomm import _env, stream_ops
from tilecomm.errors import PeerMismatchError
from tilecomm.heap import ALIGN, NamedViews
from tilecomm.jit import CachedLaunch


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


PUSH_MODES = ("auto", "copy", "kernel")


def push_mode(push: str, team: Team, what: str) -> str:
    """How a fused op's workspace moves data to the other members, the same on every rank: "kernel" (its
    kernels store over NVLink / NVSHMEM), "copy" (the copy engine, flags by stream writes: tilecomm.stream_ops),
    or for "auto" "copy" where every rank can have it. Collective over the world, as a workspace is; ValueError
    naming `what` for an unknown push, and on every rank where "copy" is asked for and some rank cannot have it."""
    if push not in PUSH_MODES:
        raise ValueError(f"{what}: push={push!r}; expected one of {PUSH_MODES}")
    if push == "kernel":
        return push
    ctx = tilecomm.current()
    if _env.transport() == "nvshmem" and ctx.device.type == "cuda":
        why = "TILECOMM_TRANSPORT=nvshmem (pushes go through NVSHMEM calls)"
    elif any(ctx.heap.peers[pe] is None for pe in team.ranks):
        why = "a member of the team is not directly reachable (no load/store mapping of its heap)"
    else:
        why = stream_ops.available(ctx.device)
    reasons = ctx.boot.all_gather_object(why) if ctx.world_size > 1 else [why]
    failing = [(r, w) for r, w in enumerate(reasons) if w is not None]
    if not failing:
        return "copy"
    if push == "copy":
        raise ValueError(f"{what}: push='copy' is not available on rank {failing[0][0]}: {failing[0][1]}")
    return "kernel"


def workspace_team(what: str, group, push: str, **sizes) -> tuple[Team, str]:
    """A fused op's workspace's checks, before anything is allocated: the team of `group`, each size a positive
    int (ValueError naming it and `what`), then the push mode (`push_mode`, collective). Returns (team, push)."""
    team = team_of(group, what)
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{what}: {name} must be a positive int, got {v!r}")
    return team, push_mode(push, team, what)


class OpWorkspace(NamedViews):
    """Symmetric buffers of one fused op over one team, allocated once (collectively over the world).

    specs: name -> (shape, dtype, zeroed); each buffer is the leading prod(shape) elements of a flat
    symmetric allocation whose length is the largest any rank asked for. `begin(fingerprint)` starts a
    call and returns its epoch (1, 2, ...: the same on every member); `free()` (collective) returns the
    buffers once no kernel uses them any more."""

    VIEWS = "buffers"

    def __init__(self, team: Team, op: str, specs: dict[str, tuple[tuple, torch.dtype, bool]]):
        ctx = tilecomm.current()
        numels = [math.prod(shape) for shape, _, _ in specs.values()]
        if ctx.world_size > 1:
            numels = [max(column) for column in zip(*ctx.boot.all_gather_object(numels))]
        self.team, self.op, self.epoch, self._fingerprint = team, op, 0, None
        self._flat, self.buffers = [], {}
        for (name, (shape, dtype, zeroed)), numel in zip(specs.items(), numels):
            flat = tilecomm.empty((numel,), dtype)
            if zeroed:
                flat.zero_()
            self._flat.append(flat)
            self.buffers[name] = flat[:math.prod(shape)].view(shape)
        tilecomm.barrier()  # zeroed words are zero everywhere before any peer signals into them

    @staticmethod
    def heap_bytes_of(specs: dict[str, tuple[tuple, torch.dtype, bool]]) -> int:
        """Symmetric heap bytes a workspace of these specs takes on each rank (its buffers, each rounded up to
        the heap's alignment), for sizing TILECOMM_HEAP_BYTES / tilecomm.init(heap_bytes=)."""
        return sum(-(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN for shape, dtype, _ in specs.values())

    def begin(self, fingerprint: tuple) -> int:
        """The next call's epoch. At first use, every rank's fingerprint is compared with its team's."""
        if self._fingerprint is None:
            ctx = tilecomm.current()
            seen = ctx.boot.all_gather_object(fingerprint) if ctx.world_size > 1 else [fingerprint]
            mine = self.team.ranks[self.team.index]
            for r in self.team.ranks:
                if seen[r] != fingerprint:
                    raise PeerMismatchError(f"{self.op}: rank {mine} called with {fingerprint}, rank {r} with "
                                            f"{seen[r]} (every member of the group must pass the same shapes)")
            self._fingerprint = fingerprint
        self.epoch += 1
        return self.epoch

    def free(self) -> None:
        """Collective: wait for this rank's kernels, then give the buffers back to the heap."""
        if self._flat and self._flat[0].is_cuda:
            torch.cuda.synchronize(self._flat[0].device)
        tilecomm.barrier()
        for flat in self._flat:
            tilecomm.free(flat)
        self._flat, self.buffers = [], {}


@tilecomm.jit(do_not_specialize=["epoch"])
def _release_kernel(consumed_ptr, pes_ptr, epoch, me, W):
    """SET consumed[me] = epoch on every team member: this rank is done reading the call's buffers."""
    for i in range(W):
        tcl.signal(consumed_ptr + me, epoch, tl.load(pes_ptr + i), tcl.SIGNAL_SET)


_RELEASE = CachedLaunch(_release_kernel)  # its compiled kernel (module-level, like Triton's own kernel cache)


def release(ws: OpWorkspace, team: Team) -> None:
    """Tell every member that this rank has finished the call on `ws` (its `consumed` words)."""
    _RELEASE.launch_keyed((1,), ws.consumed, team.pes, ws.epoch, team.index, team.size)
