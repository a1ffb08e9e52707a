"""fused_moe: the SwiGLU experts of an expert-parallel MoE layer with dispatch fused into the first grouped
GEMM and combine into the second (COMET style), forward and backward, differentiable.

    ws = FusedMoEWorkspace(num_experts=64, hidden=1536, ffn_hidden=768, max_tokens_per_rank=16384, topk=6,
                           dtype=torch.bfloat16)              # collective; owns every symmetric buffer
    out = fused_moe(x, topk_idx, topk_weights, w_gate_up, w_down, ws)
    # x [T, H]; topk_idx [T, K] int (-1 = none); topk_weights [T, K] float; w_gate_up [E_l, H, 2F] ([gate | up]);
    # w_down [E_l, F, H] (this rank's experts: rank r owns r*E_l ... (r+1)*E_l - 1) -> out [T, H]
    # out[t] = sum_k topk_weights[t, k] * (silu(x_t @ Wg_e) * (x_t @ Wu_e)) @ Wd_e,  e = topk_idx[t, k]

Launch configuration (tiles, work items, the choice per layer): moe_config.py.

It computes what Dispatcher.dispatch -> grouped SwiGLU experts -> Dispatcher.combine computes (the same rows
in the same order, the same roundings where the unfused path rounds), in six launches and one host sync
(the route's received row count R, as the Dispatcher's):

    route    the Dispatcher's route kernel (dispatch/normal.py): plan of rows per (local expert, source)
    send     moe_comm.py: each token row once per destination rank, then per pair a word that says
             "row (local expert, source, slot) is here" (per-row signals)
    gate_up  moe_gemm.py: waits per row tile for its rows, gathers them from the staging buffer by index
             into x_rows (the operand w_gate_up's gradient needs), h = x @ w_gate_up by TMA with the
             SwiGLU epilogue
    release  consumed signal: the staging buffer may be overwritten
    down     moe_gemm.py: y = act @ w_down stored straight into the source rank's back buffer at (token, k),
             flag per row
    reduce   moe_comm.py: on the source, out[t] = sum_k topk_weights[t, k] * back[t, k] (fp32, the unfused
             combine's order and roundings) once its pairs' flags are set

Backward, the same way: send of grad_out (combine's gradient is a dispatch) -> `_down_grad_kernel` (gathered
rows @ w_down^T, SwiGLU backward, routing-weight gradients <g, y> per row) -> release -> weight gradients as
grouped GEMMs (grouped.py `_wgrad`: w_down from w * act and the gathered g, w_gate_up from x_rows and dh) ->
`_scatter_kernel` of dh @ w_gate_up^T into the sources (dispatch's gradient is a combine) -> reduce (grad_x
and the routing-weight gradients).

Streams: every launch runs on the current stream, in order. A GEMM's waits are on other ranks' sends (running
concurrently on their GPUs; this rank's own rows were pushed by the send just before) or their GEMMs: a
persistent GEMM never waits on a kernel queued behind it on the same GPU (which could not get an SM), and on
CPU ranks, where the interpreter runs each launch to completion, every wait is on a peer or an earlier launch.
`fused_moe_reference` is the unfused path (any Dispatcher + a torch loop over experts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import triton.language as tl

import tilecomm
from tilecomm.dispatch.buffers import Spec, SymmetricState
from tilecomm.dispatch.dispatcher import Dispatcher
from tilecomm.dispatch.normal import _BIG, _route_kernel
from tilecomm.errors import PeerMismatchError
from tilecomm.jit import CachedLaunch, cdiv, next_pow2, prepare_tma

from .grouped import _wgrad
from .moe_comm import _reduce_kernel, _send_kernel
from .moe_gemm import _down_grad_kernel, _gate_up_kernel, _gather_kernel, _scatter_kernel
from .moe_config import FusedGemm, FusedMoEConfig
from .team import _RELEASE, team_of
from .tiles import dot_precision, num_programs, tma_operand

_P2 = next_pow2


def fused_moe_specs(W: int, E: int, M: int, K: int, H: int, dtype: torch.dtype) -> Dict[str, Spec]:
    """Symmetric buffers (S = M * K slots per (local expert, source)): stage [W, M, H] token rows from each
    source; words / pair_w [E_l, W, S] (seq << 32 | pair index, routing weight of each arrived row); back
    [M * K, H] expert rows of this rank's pairs, back_w [M * K] float32 per-pair values, flags [M * K];
    notify [2, W, E_l + 1] / notify_sig [2, W] (the route kernel's, double-buffered by call parity);
    consumed [2, W] (the staging and the back channel)."""
    e_local, S = E // W, M * K
    return {"stage": ((W, M, H), dtype), "words": ((e_local, W, S), torch.int64),
            "pair_w": ((e_local, W, S), torch.float32), "back": ((S, H), dtype), "back_w": ((S,), torch.float32),
            "flags": ((S,), torch.int64), "notify": ((2, W, e_local + 1), torch.int64),
            "notify_sig": ((2, W), torch.int64), "consumed": ((2, W), torch.int64)}


@dataclass
class FusedMoESaved:
    """What the forward leaves for the backward (this rank). topk_idx [T, K]; slots [T, K] int32 (each pair's
    slot at its expert); plan (route kernel layout); offs [E_l] int32 cumulative rows per expert; per row
    [R]: pair index t * K + k and source rank (int32), routing weight (float32); x_rows [R, H] the gathered
    rows, h [R, 2F], act [R, F]."""

    num_tokens: int
    topk_idx: torch.Tensor
    slots: torch.Tensor
    plan: torch.Tensor
    offs: torch.Tensor
    row_pair: torch.Tensor
    row_src: torch.Tensor
    row_w: torch.Tensor
    x_rows: Optional[torch.Tensor]
    h: torch.Tensor
    act: torch.Tensor


class FusedMoEWorkspace:
    """Symmetric buffers and launch state of fused_moe over the world (expert parallelism over every rank).

    Collective: construct on every rank in the same order with the same arguments (PeerMismatchError names
    both ranks otherwise). Has the Dispatcher's descriptive attributes (num_experts, hidden, topk, rank,
    world_size, num_local_experts, device, dtype, max_tokens), so a MoELayer can hold it as its dispatcher;
    the MoE layers of a model share one (they run one after another). `free()` returns the buffers
    (collective); later calls raise."""

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int, max_tokens_per_rank: int, topk: int,
                 dtype: torch.dtype = torch.bfloat16, config: Optional[FusedMoEConfig] = None):
        ctx = tilecomm.current()
        args = dict(num_experts=num_experts, hidden=hidden, ffn_hidden=ffn_hidden,
                    max_tokens_per_rank=max_tokens_per_rank, topk=topk)
        for name, value in args.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"FusedMoEWorkspace: {name}={value!r}; expected a positive int")
        if num_experts % ctx.world_size or topk > num_experts:
            raise ValueError(f"FusedMoEWorkspace: num_experts={num_experts} must divide by the world size "
                             f"({ctx.world_size}) and be >= topk={topk}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"FusedMoEWorkspace: dtype={dtype!r}; expected a floating-point torch.dtype")
        self._agree(ctx, tuple(args.values()) + (str(dtype),))
        W, dev = ctx.world_size, ctx.device
        self.rank, self.world_size, self.device, self.dtype = ctx.rank, W, dev, dtype
        self._on_cuda = dev.type == "cuda"  # (read by Dispatcher._check, which fused_moe runs on this workspace)
        self.num_experts, self.hidden, self.ffn_hidden, self.max_tokens, self.topk = num_experts, hidden, ffn_hidden, \
            max_tokens_per_rank, topk
        self.num_local_experts = num_experts // W
        self.cfg = config or FusedMoEConfig.for_device(dev, hidden, dtype, ffn_hidden)
        self.state = SymmetricState("FusedMoEWorkspace", fused_moe_specs(W, num_experts, max_tokens_per_rank, topk,
                                                                         hidden, dtype),
                                    zeroed=("words", "flags", "notify_sig", "consumed"))
        self.team = team_of(None, "FusedMoEWorkspace")
        # route / send: tokens per program as the Dispatcher's (its per-block expert counts give the slots)
        self.bt = max(1, min(16 if dev.type == "cuda" else 64, (128 if dev.type == "cuda" else 256) // _P2(topk)))
        self._counts = torch.zeros((cdiv(max_tokens_per_rank, self.bt), num_experts), dtype=torch.int32,
                                   device=dev)
        self._totals = torch.zeros(2 * num_experts, dtype=torch.int64, device=dev)  # the route's (_route_kernel)
        self._minmax = torch.tensor([_BIG.value, -_BIG.value], dtype=torch.int64, device=dev)
        self._launches = torch.zeros(2, dtype=torch.int32, device=dev)  # last-program counters: route, reduce
        # scatter: items done per row tile (at most W * M * K rows received), reset by the kernel after each launch
        self._row_tiles_done = torch.zeros(cdiv(W * max_tokens_per_rank * topk, self.cfg.scatter.tiles.BLOCK_M)
                                           + self.num_local_experts + 1, dtype=torch.int32, device=dev)
        # R, N, min id, max id, most tokens of a source: the route kernel writes them straight into pinned host
        # memory (its device-mapped address); the host reads them after the route's event
        self._info = torch.zeros(5, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._event = torch.cuda.Event() if dev.type == "cuda" else None
        self._dummies: dict = {}
        # the kernels' launchers: after a configuration's first launch, no Triton argument binding per call
        # (~50-100 µs of host time each on these VMs; after the route's host sync the GPU waits for them)
        self._route_k, self._send_k, self._gather_k, self._gate_up_k, self._down_grad_k, self._scatter_k, \
            self._reduce_k = (CachedLaunch(k) for k in (_route_kernel, _send_kernel, _gather_kernel, _gate_up_kernel,
                                                        _down_grad_kernel, _scatter_kernel, _reduce_kernel))
        self.seq = [0, 0, 0]  # route, staging channel, back channel: the same on every rank

    @staticmethod
    def _agree(ctx, args: tuple) -> None:
        if ctx.world_size == 1:
            return
        for r, theirs in enumerate(ctx.boot.all_gather_object(args)):
            if theirs != args:
                raise PeerMismatchError(f"FusedMoEWorkspace: rank {ctx.rank} has {args}, rank {r} has {theirs}; "
                                        "every rank must construct it with the same arguments")

    def free(self) -> None:
        """Collective: return the symmetric buffers (waits for this rank's kernels)."""
        self.state.free()

    def _ptr(self, t: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """t, or a small tensor of dtype where t is None or empty (kernels get a valid pointer either way)."""
        if t is not None and t.numel():
            return t
        if dtype not in self._dummies:
            self._dummies[dtype] = torch.zeros(16, dtype=dtype, device=self.device)
        return self._dummies[dtype]

    def _acc(self):
        return tl.float64 if self.dtype == torch.float64 else tl.float32

    # -- launches ------------------------------------------------------------------------------------
    def _route(self, topk: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The Dispatcher's route kernel on this workspace's notify buffers -> (plan, offs [E_l] int32 row ends of
        the local experts); records the event after which the host reads (R, N, lo, hi)."""
        W, E, E_L, K = self.world_size, self.num_experts, self.num_local_experts, self.topk
        self.seq[0] += 1
        parity = self.seq[0] % 2
        plan = torch.empty(W + 1 + E_L * W + E_L, dtype=torch.int64, device=self.device)
        offs = torch.empty(E_L, dtype=torch.int32, device=self.device)
        self._route_k.launch_keyed(
            (max(1, cdiv(topk.shape[0], self.bt)),),
            self._ptr(topk, topk.dtype), self._counts, self._totals, self._minmax, self._launches[0:1],
            self.state.notify[parity], self.state.notify_sig[parity], plan, self._info, offs, topk.shape[0],
            self.seq[0], E, E_L, W, K=K, BT=self.bt, BLOCK_P=_P2(self.bt * K), BLOCK_E=_P2(E + 1),
            BLOCK_W=_P2(W), BLOCK_EL=_P2(E_L), ROW_ENDS=True, num_warps=4)
        if self._event is not None:
            self._event.record()
        return plan, offs

    def _received(self):
        """(R, min id, max id) of the last route: the one host sync."""
        if self._event is not None:
            self._event.synchronize()
        R, _, lo, hi, _ = self._info.tolist()
        return R, lo, hi

    def _send(self, x, topk, weights, slots) -> None:
        """Rows of x [T, H] to the expert ranks; weights [T, K] float32 (forward: slots are computed into
        `slots`) or None (backward: slots are read)."""
        self.seq[1] += 1
        st, T, cfg = self.state, x.shape[0], self.cfg
        self._send_k.launch_keyed(
            (max(1, cdiv(T, self.bt)),),
            self._ptr(x, x.dtype), self._ptr(topk, topk.dtype), self._ptr(weights, torch.float32), self._counts,
            self._ptr(slots, torch.int32), st.stage, st.pair_w, st.words, st.consumed[0], T, self.seq[1],
            self.num_experts, self.num_local_experts, self.world_size, self.max_tokens, self.hidden,
            self.max_tokens * self.topk, K=self.topk, BT=self.bt, BLOCK_P=_P2(self.bt * self.topk),
            BLOCK_T=_P2(self.bt), BLOCK_K=_P2(self.topk), BLOCK_B=16, BLOCK_W=_P2(self.world_size),
            BLOCK_H=cfg.block_h, ALIGN=16 // x.element_size(), WITH_META=weights is not None, num_warps=4)

    def _release_stage(self) -> None:
        """SET consumed[0][me] = seq everywhere: this rank has read the staged rows of the call."""
        team = self.team
        _RELEASE.launch_keyed((1,), self.state.consumed[0], team.pes, self.seq[1], team.index, team.size)

    def _rows_buffer(self, rows: int, cols: int) -> torch.Tensor:
        """[rows, cols] of the data type with a 16-byte aligned row stride (a TMA operand)."""
        pad = max(1, 16 // self.dtype.itemsize)
        return torch.empty((rows, cdiv(cols, pad) * pad), dtype=self.dtype, device=self.device)[:, :cols]

    def _wgrad(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """[E_l, A, B]: a[rows of e]^T @ b[rows of e] per local expert."""
        E_L = self.num_local_experts
        if self.dtype == torch.float64 and self.device.type == "cuda":
            # grouped._wgrad_kernel's fp64 dot needs out_dtype on Triton 3.6: torch per expert (one host read)
            counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long()).tolist()
            return torch.stack([p.T @ q for p, q in zip(a.split(counts), b.split(counts))])
        return _wgrad(a, b, offs, E_L, self.cfg.wgrad)

    def _gemm_args(self, launch: FusedGemm, R: int, col_items: int = 1, per_sm: int = 0):
        """(grid, launch keywords) of a fused GEMM kernel over R rows: col_items items per BLOCK_M rows of an
        expert (at most R / BLOCK_M + E_l row tiles); per_sm programs per SM (0: launch.programs_per_sm)."""
        g = launch.tiles
        tiles = (cdiv(R, g.BLOCK_M) + self.num_local_experts) * col_items
        programs = min(tiles, (per_sm or launch.programs_per_sm) * num_programs(tiles, self.device))
        return (programs,), dict(
            BLOCK_M=g.BLOCK_M, BLOCK_N=g.BLOCK_N, BLOCK_K=g.BLOCK_K, E_PAD=_P2(self.num_local_experts + 1),
            ACC=self._acc(), PRECISION=dot_precision(self.dtype), num_warps=g.num_warps, num_stages=g.num_stages)

    def _shape_args(self) -> tuple:
        """(E_l, W, M, S, K): the fused GEMMs' shape arguments after their column counts."""
        return self.num_local_experts, self.world_size, self.max_tokens, self.max_tokens * self.topk, self.topk

    def _gather(self, launch: FusedGemm, R: int, plan, offs, rows_buf, records: Optional[tuple]) -> None:
        """`_gather_kernel` ahead of a fused GEMM whose items split the columns: the arrived rows of this call's
        staging channel copied into rows_buf; records (row_pair, row_src, row_w): also each row's pair index,
        source rank and routing weight (the forward)."""
        st, f32 = self.state, torch.float32
        row_pair, row_src, row_w = records or (self._ptr(None, torch.int32),) * 2 + (self._ptr(None, f32),)
        grid, kw = self._gemm_args(launch, R, per_sm=launch.gather_per_sm)
        self._gather_k.launch_keyed(grid, st.stage, st.words, st.pair_w, plan, offs, rows_buf, row_pair, row_src,
                                    row_w, self.seq[1], R, self.hidden, *self._shape_args(), rows_buf.stride(0),
                                    BLOCK_M=kw["BLOCK_M"], BLOCK_W=_P2(self.world_size), COPY_N=launch.copy_cols,
                                    E_PAD=kw["E_PAD"], RECORD=records is not None, num_warps=4)

    @staticmethod
    def _item_cols(launch: FusedGemm, N: int) -> int:
        """Output columns per work item of a GEMM with N of them (launch.item_cols; 0: all, rounded up to BLOCK_N)."""
        return launch.item_cols or cdiv(N, launch.tiles.BLOCK_N) * launch.tiles.BLOCK_N

    def _scatter_back(self, a, w, offs, row_pair, row_src, R, vals, b_trans: bool) -> None:
        """Rows a[R, KA] @ w[e] (w[e]^T with b_trans) into their sources' back rows (+ per-row vals)."""
        self.seq[2] += 1
        st = self.state
        a_t, _ = tma_operand(a)
        w_t, _ = tma_operand(w)
        launch, N = self.cfg.scatter, self.hidden
        item_n = self._item_cols(launch, N)
        grid, kw = self._gemm_args(launch, R, cdiv(N, item_n))
        self._scatter_k.launch_keyed(
            grid,
            a_t, w_t, offs, self._ptr(row_pair, torch.int32), self._ptr(row_src, torch.int32),
            self._ptr(vals, torch.float32), st.back, st.back_w, st.flags, st.consumed[1], self._row_tiles_done,
            self.seq[2], R, a.shape[1], N, item_n, self.num_local_experts, self.world_size, a_t.stride(0),
            w_t.stride(0), w_t.stride(1), GROUP_M=launch.tiles.GROUP_M, B_TRANS=b_trans, HAS_VALS=vals is not None,
            ALIGN=16 // a.element_size(), **kw)

    def _reduce(self, topk, T: int, coef, with_values: bool):
        """out [T, H] = sum_k coef[t, k] * back[t, k] (coef [T, K] float32, or None = 1), and the per-pair
        values [T, K] float32."""
        st, K = self.state, self.topk
        out = torch.empty((T, self.hidden), dtype=self.dtype, device=self.device)
        values = torch.empty((T, K), dtype=torch.float32, device=self.device) if with_values else None
        self._reduce_k.launch_keyed(
            (max(1, cdiv(T, self.bt)),),
            st.back, st.back_w, st.flags, self._ptr(topk, topk.dtype), self._ptr(coef, torch.float32),
            self._ptr(out, self.dtype), self._ptr(values, torch.float32), st.consumed[1], self._launches[1:2], T,
            self.seq[2], self.num_experts, self.world_size, self.hidden, K=K, BT=self.bt, BLOCK_P=_P2(self.bt * K),
            BLOCK_T=_P2(self.bt), BLOCK_K=_P2(K), BLOCK_H=self.cfg.block_h, HAS_COEF=coef is not None,
            HAS_VALUES=with_values, ACC=self._acc(), num_warps=4, enable_fp_fusion=False)
        return out, values

    # -- forward / backward --------------------------------------------------------------------------
    def forward(self, x, topk_idx, topk_weights, w_gate_up, w_down, save: bool):
        """-> (out [T, H], FusedMoESaved). Inputs checked by fused_moe."""
        self.state.check_live()
        prepare_tma()
        T, K, H, F, dev, st = x.shape[0], self.topk, self.hidden, w_down.shape[1], self.device, self.state
        topk = topk_idx.contiguous()
        plan, offs = self._route(topk)
        slots = torch.empty((T, K), dtype=torch.int32, device=dev)
        weights = topk_weights.float().contiguous()
        self._send(x, topk, weights, slots)
        w_gu, up = _gate_up_operand(w_gate_up, F)  # what needs no row count: made while route and send run
        launch = self.cfg.gate_up
        item_n = self._item_cols(launch, F)
        gather = item_n >= F  # one item per row tile: it gathers its rows itself
        R, lo, hi = self._received()
        # after the sync the GPU is idle until the first kernel below: that kernel's buffers first, in few allocations
        rows = max(R, 1)  # kernels and descriptors get at least one row
        x_rows = self._rows_buffer(rows, H)  # the GEMM's A operand (TMA), kept for w_gate_up's gradient
        # each row's pair, source and routing weight; rows of 16 bytes' multiples keep the kernels' pointers aligned
        records = torch.empty((3, cdiv(rows, 4) * 4), dtype=torch.int32, device=dev)[:, :rows]
        row_pair, row_src, row_w = records[0], records[1], records[2].view(torch.float32)
        if not gather:
            self._gather(launch, R, plan, offs, x_rows, (row_pair, row_src, row_w))
        h = torch.empty((rows, 2 * F), dtype=self.dtype, device=dev)
        act = torch.empty((rows, F), dtype=self.dtype, device=dev)
        grid, kw = self._gemm_args(launch, R, cdiv(F, item_n))
        self._gate_up_k.launch_keyed(
            grid,
            st.stage, st.words, st.pair_w, w_gu, plan, offs, h, act, x_rows, row_pair, row_src, row_w, self.seq[1], R,
            H, F, item_n, *self._shape_args(), x_rows.stride(0), w_gu.stride(0), w_gu.stride(1), up,
            GROUP_M=launch.tiles.GROUP_M, GATHER=gather, BLOCK_W=_P2(self.world_size), COPY_N=launch.copy_cols, **kw)
        self._release_stage()
        self._scatter_back(act, w_down, offs, row_pair, row_src, R, None, b_trans=False)
        out, _ = self._reduce(topk, T, weights, with_values=False)
        if lo < -1 or hi >= self.num_experts:  # every kernel of the call ran: peers are not left waiting
            raise ValueError(f"fused_moe: topk_idx values must be in [-1, {self.num_experts}), got min {lo}, max {hi}")
        saved = FusedMoESaved(T, topk, slots, plan, offs, row_pair[:R], row_src[:R], row_w[:R],
                              x_rows[:R] if save else None, h[:R], act[:R])
        return out, saved

    def backward(self, s: FusedMoESaved, grad_out: torch.Tensor, w_gate_up, w_down, need_gate_up: bool = True,
                 need_down: bool = True):
        """-> (grad_x [T, H], grad_topk_weights [T, K] float32, grad_w_gate_up, grad_w_down (None where not needed)).
        Every rank runs every collective launch whatever it needs."""
        self.state.check_live()
        prepare_tma()
        R, H, F, dev, st = s.h.shape[0], self.hidden, w_down.shape[1], self.device, self.state
        grad_out = grad_out.to(self.dtype).contiguous()
        self._send(grad_out, s.topk_idx, None, s.slots)
        rows = max(R, 1)
        dh = torch.empty((rows, 2 * F), dtype=self.dtype, device=dev)
        g_rows = self._rows_buffer(rows, H)
        act_w = torch.empty((rows, F), dtype=self.dtype, device=dev)
        w_dn, _ = tma_operand(w_down)
        launch = self.cfg.down_grad
        item_n = self._item_cols(launch, F)
        parts = cdiv(F, item_n)  # each row's <g, y> in parts, summed below (fp64 data: in fp64)
        if parts > 1:
            self._gather(launch, R, s.plan, s.offs, g_rows, None)
        gw_parts = torch.empty((parts, rows), dtype=torch.promote_types(self.dtype, torch.float32), device=dev)
        grid, kw = self._gemm_args(launch, R, parts)
        self._down_grad_k.launch_keyed(
            grid,
            st.stage, st.words, w_dn, s.plan, s.offs, self._ptr(s.row_w, torch.float32), self._ptr(s.h, self.dtype),
            dh, g_rows, act_w, gw_parts, self.seq[1], R, H, F, item_n, *self._shape_args(), g_rows.stride(0),
            w_dn.stride(0), w_dn.stride(1), rows, GROUP_M=launch.tiles.GROUP_M, GATHER=parts == 1,
            BLOCK_W=_P2(self.world_size), COPY_N=launch.copy_cols, **kw)
        row_gw = (gw_parts[0] if parts == 1 else gw_parts.sum(0)).float()
        self._release_stage()
        grad_w_down = self._wgrad(act_w[:R], g_rows[:R], s.offs) if need_down else None  # (w act)^T @ g
        grad_w_gate_up = self._wgrad(s.x_rows, dh[:R], s.offs) if need_gate_up else None
        self._scatter_back(dh, w_gate_up, s.offs, s.row_pair, s.row_src, R, row_gw, b_trans=True)
        grad_x, grad_w = self._reduce(s.topk_idx, s.num_tokens, None, with_values=True)
        return grad_x, grad_w, grad_w_gate_up, grad_w_down


class _FusedMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, w_gate_up, w_down, ws, topk_idx):
        out, saved = ws.forward(x, topk_idx, topk_weights, w_gate_up, w_down, save=ctx.needs_input_grad[2])
        ctx.ws, ctx.saved, ctx.weights_dtype = ws, saved, topk_weights.dtype
        ctx.save_for_backward(w_gate_up, w_down)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        w_gate_up, w_down = ctx.saved_tensors
        need = ctx.needs_input_grad
        grad_x, grad_w, grad_gu, grad_down = ctx.ws.backward(ctx.saved, grad_out, w_gate_up, w_down, need[2], need[3])
        return grad_x if need[0] else None, grad_w.to(ctx.weights_dtype) if need[1] else None, grad_gu, grad_down, \
            None, None


def _gate_up_operand(w_gate_up: torch.Tensor, F: int):
    """(w, up): w_gate_up as the gate_up kernel reads it (unit column stride, aligned rows) and the element offset
    of its up columns. Gate and up columns get one TMA descriptor each, so the up columns must start 16-byte
    aligned: where F * itemsize is not a multiple of 16, a copy with each half padded."""
    pad = max(1, 16 // w_gate_up.element_size())
    if F % pad == 0:
        w, _ = tma_operand(w_gate_up)
        return w, F
    E_L, H = w_gate_up.shape[0], w_gate_up.shape[1]
    Fp = cdiv(F, pad) * pad
    w = w_gate_up.new_zeros((E_L, H, 2, Fp))
    w[..., :F] = w_gate_up.reshape(E_L, H, 2, F)
    return w.view(E_L, H, 2 * Fp), Fp


def _check_weights(ws: FusedMoEWorkspace, x, w_gate_up, w_down) -> None:
    E_L, H, F = ws.num_local_experts, ws.hidden, ws.ffn_hidden
    for name, w, shape in (("w_gate_up", w_gate_up, (E_L, H, 2 * F)), ("w_down", w_down, (E_L, F, H))):
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != shape:
            raise ValueError(f"fused_moe: {name} must be {list(shape)} (this rank's experts), got "
                             f"{getattr(w, 'shape', type(w))}")
        if w.dtype != x.dtype or w.device != x.device:
            raise TypeError(f"fused_moe: {name} is {w.dtype} on {w.device}; x is {x.dtype} on {x.device}")


def fused_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor, workspace: FusedMoEWorkspace) -> torch.Tensor:
    """See the module docstring: x [T, H] (the workspace's dtype), topk_idx [T, K] int32/int64 (-1 = none),
    topk_weights [T, K] float, w_gate_up [E_l, H, 2F], w_down [E_l, F, H] -> out [T, H]. Differentiable in
    x, topk_weights, w_gate_up and w_down. Collective: every rank calls it (and its backward) in the same order.
    Arguments are checked before any kernel runs (expert ids on the device: ValueError at the end of the call)."""
    if not isinstance(workspace, FusedMoEWorkspace):
        raise TypeError(f"fused_moe: workspace must be a FusedMoEWorkspace, got {type(workspace).__name__}")
    Dispatcher._check(workspace, x, topk_idx, topk_weights)  # the Dispatcher's checks, on the same attributes
    _check_weights(workspace, x, w_gate_up, w_down)
    return _FusedMoE.apply(x.contiguous(), topk_weights, w_gate_up, w_down, workspace, topk_idx)


def fused_moe_reference(x, topk_idx, topk_weights, w_gate_up, w_down, dispatcher) -> torch.Tensor:
    """The unfused path: dispatcher.dispatch -> per-expert torch SwiGLU -> dispatcher.combine (any Dispatcher;
    backend "nccl" makes it plain torch). Differentiable."""
    res = dispatcher.dispatch(x, topk_idx, topk_weights)
    F = w_down.shape[1]
    outs, start = [], 0
    for e, n in enumerate(res.tokens_per_expert.tolist()):
        h = res.x[start:start + n] @ w_gate_up[e]
        outs.append((torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ w_down[e])
        start += n
    y = torch.cat(outs) if outs else res.x.new_zeros((0, x.shape[1]))
    return dispatcher.combine(y, res.handle)
