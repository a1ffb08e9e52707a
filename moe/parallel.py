"""MoE Parallel Folding: which ranks attention layers and MoE layers share, laid out as Megatron-Core does.

Attention (dense) layers split the world as tp * cp * dp * pp; MoE layers fold the same ranks differently,
as etp * ep * edp * pp. Only pp is shared, so a rank's expert groups need not line up with its attention
groups (e.g. ep may span the tp and dp ranks of attention). dp and edp are derived from the world size.

Ranks are numbered along `order` (default "tp-cp-ep-dp-pp") with the first token varying fastest: with
tp=2, dp=4 the tp rank is `rank % 2` and the dp rank is `rank // 2 % 4`. The attention side uses the
order's tp/cp/dp/pp tokens (ep=1 there); the expert side reads the same order with tp -> etp, ep -> ep,
dp -> edp, pp -> pp (cp=1 there). `rank_groups(kind)` returns the same groups, in the same order, as
Megatron-Core's `RankGenerator(...).get_ranks(token)` for the generators that
`parallel_state.initialize_model_parallel` builds (decoder and expert).

Worked example, world 8, tp=2, ep=4 (etp=1, cp=1, pp=1, so dp=4 and edp=2), order "tp-cp-ep-dp-pp":

    >>> layout = ParallelLayout(8, tp=2, ep=4)
    >>> layout.rank_groups("tp")      # attention: tensor parallel pairs
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    >>> layout.rank_groups("dp")      # attention: data parallel
    [[0, 2, 4, 6], [1, 3, 5, 7]]
    >>> layout.rank_groups("ep")      # experts: each group holds all experts once
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    >>> layout.rank_groups("edp")     # experts: replicas of the same expert shard
    [[0, 4], [1, 5], [2, 6], [3, 7]]
    >>> layout.rank_groups("etp")
    [[0], [1], [2], [3], [4], [5], [6], [7]]

So rank 1 runs attention with rank 0 as its tp partner, then dispatches tokens to experts over ranks 0-3.
Combined kinds ("dp-cp", "tp-cp", "tp-dp", "etp-ep", "etp-ep-pp", ...) give the groups spanning all their
dimensions; within a group ranks follow `order`, as in Megatron (the kind's own token order is ignored).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["ParallelLayout", "ProcessGroups", "PIPELINE_UNSUPPORTED"]

PIPELINE_UNSUPPORTED = "pipeline parallel training (pp>1) is not supported yet"
_ORDER_TOKENS = ("tp", "pp", "dp", "ep", "cp")  # Megatron appends absent size-1 tokens in this order
_ATTENTION_KINDS = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp"}
_EXPERT_KINDS = {"etp": "tp", "ep": "ep", "edp": "dp", "pp": "pp"}
_CREATED_KINDS = ("tp", "cp", "dp", "dp-cp", "pp", "etp", "ep", "edp")


def _orthogonal_groups(dims: List[Tuple[str, int]], tokens: set) -> List[List[int]]:
    """Groups of ranks that differ only along `tokens`; `dims` lists (token, size) fastest-varying first.

    Groups are ordered by their coordinates on the other dimensions (first such dimension fastest), and
    ranks inside a group by their coordinates on `tokens` (again first in `dims` fastest)."""
    sizes = [s for _, s in dims]
    # Row-major arange over the reversed sizes: axis k is dimension len(dims)-1-k, the last one slowest.
    grid = torch.arange(prod(sizes)).reshape(sizes[::-1])
    names = [n for n, _ in dims][::-1]
    outer = [k for k, n in enumerate(names) if n not in tokens]
    inner = [k for k, n in enumerate(names) if n in tokens]
    group_size = prod(s for n, s in dims if n in tokens)
    return grid.permute(outer + inner).reshape(-1, group_size).tolist()


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's torch.distributed process groups under a ParallelLayout (from `create_groups`).

    tp/cp/dp/pp/dp_cp are the attention-side groups, etp/ep/edp the expert-side ones (pp is shared);
    `ranks` maps each kind ("tp", ..., "dp-cp", ...) to the global ranks of this rank's group."""
    rank: int
    tp: Any
    cp: Any
    dp: Any
    dp_cp: Any
    pp: Any
    etp: Any
    ep: Any
    edp: Any
    ranks: Dict[str, List[int]]


@dataclass(frozen=True)
class ParallelLayout:
    """The rank layout of MoE Parallel Folding: tp*cp*dp*pp = world (attention), etp*ep*edp*pp = world (MoE).

    world_size: number of ranks. tp, cp, pp: attention tensor/context/pipeline parallel sizes; etp, ep:
    expert tensor/expert model parallel sizes. dp and edp are derived. order: how ranks are numbered,
    '-'-separated tokens from tp, cp, ep, dp, pp, first varying fastest; a token may be left out only when
    its size is 1 on both sides. Raises ValueError for an impossible layout, with the reason."""
    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    etp: int = 1
    ep: int = 1
    order: str = "tp-cp-ep-dp-pp"
    dp: int = field(init=False)
    edp: int = field(init=False)

    def __post_init__(self):
        for name in ("world_size", "tp", "cp", "pp", "etp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ParallelLayout: {name}={v!r}; expected a positive int")
        w = self.world_size
        if w % (self.tp * self.cp * self.pp):
            raise ValueError(f"ParallelLayout: world_size {w} is not divisible by tp*cp*pp = "
                             f"{self.tp}*{self.cp}*{self.pp} = {self.tp * self.cp * self.pp}")
        if w % (self.etp * self.ep * self.pp):
            raise ValueError(f"ParallelLayout: world_size {w} is not divisible by etp*ep*pp = "
                             f"{self.etp}*{self.ep}*{self.pp} = {self.etp * self.ep * self.pp}")
        object.__setattr__(self, "dp", w // (self.tp * self.cp * self.pp))
        object.__setattr__(self, "edp", w // (self.etp * self.ep * self.pp))
        if not isinstance(self.order, str):
            raise ValueError(f"ParallelLayout: order={self.order!r}; expected a string like 'tp-cp-ep-dp-pp'")
        order = self.order.strip().lower()
        tokens = order.split("-")
        unknown = [t for t in tokens if t not in _ORDER_TOKENS]
        if unknown:
            raise ValueError(f"ParallelLayout: order {self.order!r} has unknown token(s) {unknown}; "
                             f"expected tokens from {sorted(_ORDER_TOKENS)}")
        dup = sorted({t for t in tokens if tokens.count(t) > 1})
        if dup:
            raise ValueError(f"ParallelLayout: order {self.order!r} repeats {dup}")
        for side in ("attention", "expert"):
            sizes = self._sizes(side)
            for t in _ORDER_TOKENS:
                if t not in tokens and sizes[t] != 1:
                    raise ValueError(f"ParallelLayout: order {self.order!r} lacks {t!r}, but the {side} side "
                                     f"needs it (size {sizes[t]}); add it to the order")
        object.__setattr__(self, "order", order)
        # Megatron-Core: unless pp is the slowest dimension, both sides must replicate data alike ...
        if not order.endswith("pp") and self.pp > 1 and self.edp != self.dp:
            raise ValueError(f"ParallelLayout: with order {order!r} (pp not last) and pp={self.pp}, dp "
                             f"({self.dp}) and edp ({self.edp}) must be equal; put pp last in the order")
        # ... and the pipeline stages must hold the same ranks for attention and for experts.
        if self.rank_groups("pp") != _orthogonal_groups(self._dims("expert"), {"pp"}):
            raise ValueError(f"ParallelLayout: order {order!r} gives different pipeline groups to attention "
                             f"(tp={self.tp}, cp={self.cp}, dp={self.dp}) and experts (etp={self.etp}, "
                             f"ep={self.ep}, edp={self.edp}); put pp last in the order")

    def _sizes(self, side: str) -> Dict[str, int]:
        if side == "attention":
            return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        return {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp}

    def _dims(self, side: str) -> List[Tuple[str, int]]:
        tokens = self.order.split("-")
        tokens += [t for t in _ORDER_TOKENS if t not in tokens]
        sizes = self._sizes(side)
        return [(t, sizes[t]) for t in tokens]

    @staticmethod
    def _parse_kind(kind: str) -> Tuple[str, set]:
        parts = kind.strip().lower().split("-") if isinstance(kind, str) else [kind]
        known = set(_ATTENTION_KINDS) | set(_EXPERT_KINDS)
        bad = [p for p in parts if p not in known]
        if bad:
            raise ValueError(f"ParallelLayout: unknown kind {kind!r}; expected one of {sorted(known)} "
                             f"or several joined by '-' (e.g. 'dp-cp', 'etp-ep')")
        if len(set(parts)) != len(parts):
            raise ValueError(f"ParallelLayout: kind {kind!r} repeats a dimension")
        expert_only = [p for p in parts if p in ("etp", "ep", "edp")]
        attention_only = [p for p in parts if p in ("tp", "cp", "dp")]
        if expert_only and attention_only:
            raise ValueError(f"ParallelLayout: kind {kind!r} mixes attention dimensions {attention_only} with "
                             f"expert dimensions {expert_only}; they are different foldings of the ranks")
        if expert_only:
            return "expert", {_EXPERT_KINDS[p] for p in parts}
        return "attention", {_ATTENTION_KINDS[p] for p in parts}

    def rank_groups(self, kind: str) -> List[List[int]]:
        """All groups of `kind` (tp, cp, dp, pp, etp, ep, edp, or several joined by '-', e.g. 'dp-cp'),
        equal to Megatron-Core's RankGenerator.get_ranks for the matching generator, order included."""
        side, tokens = self._parse_kind(kind)
        return _orthogonal_groups(self._dims(side), tokens)

    def group_of(self, kind: str, rank: int) -> List[int]:
        """The ranks of `rank`'s group of `kind`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"ParallelLayout: rank {rank} is outside world_size {self.world_size}")
        return next(g for g in self.rank_groups(kind) if rank in g)

    @property
    def pipeline_training_supported(self) -> bool:
        """False when pp > 1: the groups can be built, but training with pipeline stages is not."""
        return self.pp == 1

    def check_trainable(self) -> None:
        """Raise NotImplementedError if this layout asks for pipeline parallel training (pp > 1)."""
        if self.pp > 1:
            raise NotImplementedError(f"{PIPELINE_UNSUPPORTED} (this layout has pp={self.pp}); use pp=1")

    def create_groups(self, backend: Optional[str] = None, timeout: Any = None) -> ProcessGroups:
        """Create every group of every kind with dist.new_group (collective: all ranks call this, and every
        rank creates the same groups in the same order) and return the ones holding this rank.
        Groups with identical ranks are created once and shared between kinds."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ParallelLayout.create_groups: torch.distributed is not initialised")
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"ParallelLayout.create_groups: layout is for {self.world_size} ranks but "
                             f"torch.distributed has {dist.get_world_size()}")
        rank = dist.get_rank()
        kwargs = {k: v for k, v in (("backend", backend), ("timeout", timeout)) if v is not None}
        made: Dict[Tuple[int, ...], Any] = {}
        mine: Dict[str, Any] = {}
        ranks: Dict[str, List[int]] = {}
        for kind in _CREATED_KINDS:
            for group in self.rank_groups(kind):
                key = tuple(group)
                if key not in made:
                    made[key] = dist.new_group(ranks=group, **kwargs)
                if rank in group:
                    mine[kind.replace("-", "_")], ranks[kind] = made[key], group
        return ProcessGroups(rank=rank, ranks=ranks, **mine)
