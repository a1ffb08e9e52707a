"""`MoELayer` = Router + dispatcher + this rank's GroupedSwiGLUExperts (+ optional SharedExpert).

    layer = MoELayer(MoEConfig(hidden=64, ffn_hidden=128, num_experts=8, topk=2,
                               router=dict(aux_loss_coeff=1e-2)), dispatcher="tilecomm")
    y, aux_loss = layer(x)      # x [B, S, H] or [T, H] (config.dtype) -> y (same shape), scalar aux_loss

The dispatcher is the only parallel piece; the math is in router.py / experts.py. Anything with the
Dispatcher interface works (`num_experts`, `rank`, `world_size`, `num_local_experts`, `dispatch(x, idx,
w) -> res` with res.x [R, H] expert-major, res.tokens_per_expert [E_l], res.handle, and
`combine(y, handle) -> [T, H]`): a tilecomm.dispatch.Dispatcher (EP over the world: rank r owns experts
r*E/EP ... (r+1)*E/EP - 1) or `LocalDispatcher` (EP = 1, no distributed runtime: a sort and the
fused permute / weighted unpermute of moe/ops/permute.py, no host sync). Under torch.compile the
local dispatcher is traced with the rest of the layer; any other dispatcher runs eagerly between
compiled graphs (a graph break). dispatcher="fused" holds a tilecomm.overlap.FusedMoEWorkspace instead: the
experts then run as tilecomm.overlap.fused_moe (dispatch fused into the gate_up grouped GEMM, combine into the
down one, forward and backward), computing what dispatcher="tilecomm" computes.

Initialisation is per global id from config.seed (router: slot 0, expert e: slot 1 + e, shared expert:
slot 1 + E; see experts.expert_generator), so layers built with the same config on EP = 1, 2, 3 ...
hold the same router and shared weights and matching expert slices. `shard_expert_state` cuts an EP = 1
state dict into one rank's state (e.g. to load a checkpoint into an EP layer).

Gradients under EP: router / shared-expert parameters are replicated (all-reduce their gradients over
the ranks); expert gradients are local and already include every rank's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

import torch
import torch.nn as nn

from tilecomm.dispatch.handle import DispatchResult

from .experts import GroupedSwiGLUExperts, SharedExpert, expert_generator
from .ops.permute import permute, unpermute
from .router import Router, RouterConfig, count_per_expert

EXPERT_PARAMS = ("experts.w_gate_up", "experts.w_down")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    hidden: int
    ffn_hidden: int
    num_experts: int
    topk: int
    router: Union[RouterConfig, dict, None] = None  # RouterConfig, or its other fields as a dict
    num_shared_experts: int = 0  # > 0: one dense SwiGLU of shared_ffn_hidden (default n * ffn_hidden)
    shared_ffn_hidden: Optional[int] = None
    dtype: torch.dtype = torch.float32  # experts, shared expert and the tokens (the router is fp32)
    seed: int = 0
    init_std: float = 0.02
    max_tokens_per_rank: int = 65536  # for the default tilecomm Dispatcher
    experts_impl: str = "auto"  # "auto" | "grouped" | "loop" | "tilecomm" (experts.GroupedSwiGLUExperts)

    def __post_init__(self):
        for name in ("hidden", "ffn_hidden", "num_experts", "max_tokens_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoEConfig: {name}={value!r}; expected an int >= 1")
        if not isinstance(self.topk, int) or not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"MoEConfig: topk={self.topk!r}; expected an int in [1, num_experts={self.num_experts}]")

    def router_config(self) -> RouterConfig:
        r = self.router
        if isinstance(r, RouterConfig):
            if (r.num_experts, r.topk) != (self.num_experts, self.topk):
                raise ValueError("MoEConfig: router.num_experts / router.topk differ from the layer's")
            return r
        return RouterConfig(num_experts=self.num_experts, topk=self.topk, **(r or {}))


@dataclass
class LocalHandle:
    """pair_row [T, K]: row of pair (t, k), -1 if dropped; row_pair [R = T*K]: pair p = t*K + k behind
    each row, -1 for the rows of dropped pairs (zero rows after the kept ones); topk_weights [T, K]
    float32 (autograd-connected: combine's backward gives them their gradient)."""
    num_tokens: int
    pair_row: torch.Tensor
    row_pair: torch.Tensor
    topk_weights: torch.Tensor


class LocalDispatcher:
    """EP = 1 permute / unpermute with the Dispatcher interface. Rows are expert-major, then token
    index (the same order a Dispatcher gives, with one rank); R = T*K rows always (a static shape:
    no host sync, and torch.compile sees no data-dependent size), the rows of pairs dropped by
    capacity last and zero (tokens_per_expert counts only the kept ones)."""

    rank, world_size = 0, 1

    def __init__(self, num_experts: int, hidden: int, topk: int, dtype: Optional[torch.dtype] = None):
        self.num_experts = self.num_local_experts = num_experts
        self.hidden, self.topk, self.dtype = hidden, topk, dtype

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> DispatchResult:
        T, K = topk_idx.shape
        E = self.num_experts
        key = topk_idx.long().reshape(-1)
        key = torch.where(key >= 0, key, E)  # dropped pairs sort last
        sorted_key, order = torch.sort(key, stable=True)  # expert, then pair index (= token, then k)
        row_pair = torch.where(sorted_key < E, order, -1)
        pair_row = torch.empty_like(order).scatter_(0, order, torch.arange(T * K, device=key.device))
        pair_row = torch.where(key < E, pair_row, -1).view(T, K)
        weights = topk_weights.float()
        row_weights = torch.where(row_pair >= 0, weights.detach().reshape(-1)[order], 0.0)
        rows = permute(x, row_pair, pair_row)
        counts = count_per_expert(topk_idx, E)
        return DispatchResult(rows, row_weights, counts, LocalHandle(T, pair_row, row_pair, weights))

    def combine(self, y: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
        """out[t] = sum_k w[t, k] * y[row(t, k)], accumulated in fp32 (or wider) in k order."""
        return unpermute(y, handle.topk_weights, handle.pair_row, handle.row_pair)


def make_dispatcher(config: MoEConfig, kind: str = "auto", group=None, share_with=None, dtype=None):
    """"local" (LocalDispatcher), "tilecomm" / "nccl" (tilecomm.dispatch.Dispatcher over the EP world),
    "fused" (tilecomm.overlap.FusedMoEWorkspace: fused dispatch + experts + combine), or "auto": tilecomm
    when its runtime is up with more than one rank, else local. share_with: another layer's dispatcher of
    the same config, whose symmetric buffers this one reuses (the layers of a model dispatch one after
    another, so one set of buffers serves them all; a fused workspace is shared as it is). dtype: the tokens'
    dtype where it is not config.dtype (a Trainer casts fp32-built layers to bf16 on GPUs: pass bf16 there)."""
    if dtype is not None:
        config = replace(config, dtype=dtype)
    if kind == "auto":
        import tilecomm
        kind = "tilecomm" if tilecomm.is_initialized() and tilecomm.world_size() > 1 else "local"
    if kind == "local":
        return LocalDispatcher(config.num_experts, config.hidden, config.topk, config.dtype)
    if kind == "fused":
        from tilecomm.overlap import FusedMoEWorkspace
        if isinstance(share_with, FusedMoEWorkspace):
            if (share_with.num_experts, share_with.hidden, share_with.ffn_hidden, share_with.max_tokens,
                    share_with.topk, share_with.dtype) != (config.num_experts, config.hidden, config.ffn_hidden,
                                                           config.max_tokens_per_rank, config.topk, config.dtype):
                raise ValueError("make_dispatcher: share_with is a FusedMoEWorkspace of another configuration")
            return share_with
        return FusedMoEWorkspace(config.num_experts, config.hidden, config.ffn_hidden, config.max_tokens_per_rank,
                                 config.topk, config.dtype)
    from tilecomm.dispatch import Dispatcher
    buffers = getattr(share_with, "buffers", None)
    return Dispatcher(config.num_experts, config.hidden, config.max_tokens_per_rank, config.topk, config.dtype,
                      group=group, backend=kind, buffers=buffers)


def dispatcher_heap_bytes(config: MoEConfig, kind: str, world: int, dtype=None) -> int:
    """Symmetric heap bytes that make_dispatcher(config, kind, dtype=dtype) takes on each of `world` ranks (once:
    the layers of a model share one set, see share_with); 0 for kinds that use no symmetric memory ("local",
    "nccl"). The runtime's heap must hold this beside its collectives' workspace (tilecomm.init's heap_bytes)."""
    if kind in ("local", "nccl") or (kind == "auto" and world == 1):
        return 0
    if kind not in ("tilecomm", "fused", "auto"):
        raise ValueError(f"dispatcher_heap_bytes: kind={kind!r}; expected 'auto', 'local', 'tilecomm', 'nccl' or 'fused'")
    from tilecomm.dispatch.buffers import normal_specs, symmetric_bytes
    args = (world, config.num_experts, config.max_tokens_per_rank, config.topk, config.hidden, dtype or config.dtype)
    if kind == "fused":
        from tilecomm.overlap.moe_fused import fused_moe_specs
        return symmetric_bytes(fused_moe_specs(*args))
    return symmetric_bytes(normal_specs(*args))


class MoELayer(nn.Module):
    """See the module docstring. `dispatcher`: an object with the Dispatcher interface, a kind for
    make_dispatcher ("auto", "local", "tilecomm", "nccl"), or None (= "auto")."""

    def __init__(self, config: MoEConfig, dispatcher=None, device=None):
        super().__init__()
        self.config = config
        if dispatcher is None or isinstance(dispatcher, str):
            dispatcher = make_dispatcher(config, dispatcher or "auto")
        self._check_dispatcher(dispatcher)
        self.dispatcher = dispatcher  # plain attribute: swap it for another of the same EP geometry
        self.ep_rank, self.ep_size = dispatcher.rank, dispatcher.world_size
        E_l = config.num_experts // self.ep_size
        if device is None:
            device = getattr(dispatcher, "device", None)
        c = config
        self.router = Router(c.router_config(), c.hidden, device=device, generator=expert_generator(c.seed, 0),
                             init_std=c.init_std)
        self.experts = GroupedSwiGLUExperts(E_l, c.hidden, c.ffn_hidden, c.dtype, device=device, impl=c.experts_impl,
                                            first_expert=self.ep_rank * E_l, seed=c.seed, init_std=c.init_std)
        self.shared = None
        if c.num_shared_experts:
            self.shared = SharedExpert(c.hidden, c.shared_ffn_hidden or c.num_shared_experts * c.ffn_hidden, c.dtype,
                                       device=device, generator=expert_generator(c.seed, 1 + c.num_experts),
                                       init_std=c.init_std)

    @property
    def local_experts(self) -> range:
        """Global ids of the experts this layer holds."""
        n = self.experts.num_local_experts
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)

    def _check_dispatcher(self, d) -> None:
        c = self.config
        if d.num_experts != c.num_experts or getattr(d, "topk", c.topk) != c.topk or getattr(d, "hidden", c.hidden) != c.hidden:
            raise ValueError("MoELayer: the dispatcher's num_experts / topk / hidden differ from the config's")
        if hasattr(self, "ep_rank") and (d.rank, d.world_size) != (self.ep_rank, self.ep_size):
            raise ValueError("MoELayer: a new dispatcher must have the same EP rank and size as the experts")

    def __setattr__(self, name, value):
        if name == "dispatcher" and "dispatcher" in self.__dict__:
            self._check_dispatcher(value)
        super().__setattr__(name, value)

    def forward(self, x: torch.Tensor):
        """x [B, S, H] or [T, H] -> (y like x, aux_loss scalar float32). [B, S, H] gives the router
        seq_len = S (for the sequence-level aux loss)."""
        if x.dim() not in (2, 3) or x.shape[-1] != self.config.hidden:
            raise ValueError(f"MoELayer: x must be [B, S, {self.config.hidden}] or [T, {self.config.hidden}], got {tuple(x.shape)}")
        tokens = x.reshape(-1, x.shape[-1])
        r = self.router(tokens, seq_len=x.shape[1] if x.dim() == 3 else None)
        if isinstance(self.dispatcher, LocalDispatcher):  # traceable by torch.compile
            res = self.dispatcher.dispatch(tokens, r.topk_idx, r.topk_weights)
            y = self.dispatcher.combine(self.experts(res.x, res.tokens_per_expert), res.handle)
        elif not hasattr(self.dispatcher, "dispatch"):  # a FusedMoEWorkspace: dispatch, experts, combine in one op
            y = _eager_fused(self.dispatcher, tokens, r.topk_idx, r.topk_weights, self.experts)
        else:
            res = _eager_dispatch(self.dispatcher, tokens, r.topk_idx, r.topk_weights)
            y = _eager_combine(self.dispatcher, self.experts(res.x, res.tokens_per_expert), res.handle)
        if self.shared is not None:
            y = y + self.shared(tokens)
        return y.view(x.shape), r.aux_loss


@torch.compiler.disable
def _eager_dispatch(dispatcher, x, topk_idx, topk_weights):
    return dispatcher.dispatch(x, topk_idx, topk_weights)


@torch.compiler.disable
def _eager_combine(dispatcher, y, handle):
    return dispatcher.combine(y, handle)


@torch.compiler.disable
def _eager_fused(workspace, x, topk_idx, topk_weights, experts):
    from tilecomm.overlap import fused_moe
    return fused_moe(x, topk_idx, topk_weights, experts.w_gate_up, experts.w_down, workspace)


def shard_expert_state(state: dict, ep_rank: int, ep_size: int, num_experts: int) -> dict:
    """An EP = 1 MoELayer state dict -> the state of EP rank ep_rank of ep_size (expert slices cut,
    everything else copied)."""
    if num_experts % ep_size:
        raise ValueError(f"shard_expert_state: {num_experts} experts do not split over {ep_size} ranks")
    n = num_experts // ep_size
    return {k: (v[ep_rank * n:(ep_rank + 1) * n].clone() if k in EXPERT_PARAMS else v.clone()) for k, v in state.items()}


__all__ = ["MoEConfig", "MoELayer", "LocalDispatcher", "LocalHandle", "make_dispatcher", "shard_expert_state"]
