"""Normal-mode dispatch and combine, host side: the FusedEngine that owns the buffers and launches the
kernels of normal.py (see its docstring for the algorithm), and FusedPlan, what a dispatch leaves for
combine and the backward passes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton.language as tl

import tilecomm
from tilecomm.jit import BoundLaunch, CachedLaunch, cdiv, next_pow2, pdl_available, prepare_tma

from .buffers import SymmetricState, normal_specs, row_bytes
from .normal import (NormalConfig, _BIG, _combine_recv_kernel, _combine_send_kernel, _expand_kernel, _route_kernel,
                     _send_kernel)


# ---- host side -------------------------------------------------------------------------------------
@dataclass
class FusedPlan:
    """What one fused dispatch leaves for combine and the backward passes (this rank's part).

    topk_idx: [T, K] the caller's routing (kept, not copied); plan: [W + 1 + E_l * W + E_l] int64 on the
    device: first received token of each source then N, first output row of each (local expert, source),
    tokens per expert; token_rows: [>= N, K] int32 output row of each received pair (-1: expert elsewhere);
    tokens_per_expert: [E_l] int64 view of plan; N received tokens (all sources), R output rows; most_tokens: the
    most tokens any source has (the arrival-order chunks: W per chunk of that many)."""

    topk_idx: torch.Tensor
    plan: torch.Tensor
    token_rows: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_tokens: int
    num_recv_tokens: int
    num_recv_rows: int
    most_tokens: int


_SIG_NOTIFY, _SIG_FWD_CONSUMED, _SIG_BWD_CONSUMED = range(3)
_CTR_ROUTE, _CTR_EXPAND, _CTR_COMBINE_RECV = range(3)  # launch counters (last_program)
_P2 = next_pow2


class FusedEngine:
    """Normal-mode dispatch/combine over buffers made once here (collective: every rank, same order).

    Same interface as reference.ReferenceEngine: dispatch / redispatch / combine. Symmetric state: see
    buffers.normal_specs; local scratch: per-block expert counts, launch counters, the (R, N) words
    the host reads. `free()` returns the symmetric bytes (collective)."""

    def __init__(self, num_experts: int, hidden: int, max_tokens: int, topk: int, dtype: torch.dtype):
        ctx = tilecomm.current()
        W, dev = ctx.world_size, ctx.device
        self.W, self.E, self.E_L, self.M, self.K, self.H, self.dtype = (W, num_experts, num_experts // W, max_tokens,
                                                                        topk, hidden, dtype)
        self.cuda = dev.type == "cuda"
        self.cfg = NormalConfig.for_device(dev, hidden, W)
        self.state = SymmetricState("Dispatcher(mode='normal')", normal_specs(W, num_experts, max_tokens, topk, hidden,
                                                                              dtype), zeroed=("sig", "blocks", "back_blocks"))
        self.row_bytes = row_bytes(hidden, dtype)
        # route/send tokens per program (the interpreter on CPU ranks: fewer, larger programs)
        self.bt = max(1, min(16 if self.cuda else 64, self.cfg.pairs_per_program // _P2(topk)))
        self._counts = torch.zeros((cdiv(max_tokens, self.bt), num_experts), dtype=torch.int32, device=dev)
        self._totals = torch.zeros(2 * num_experts, dtype=torch.int64, device=dev)  # the route's (_route_kernel)
        self._minmax = torch.tensor([_BIG.value, -_BIG.value], dtype=torch.int64, device=dev)
        counters = torch.zeros(3, dtype=torch.int32, device=dev)
        self._ctr = [counters[i:i + 1] for i in range(3)]
        # combine_send's chunks done per (source, block of land_bt tokens), reset by the kernel; land_bt: a
        # multiple of the chunk (a chunk never straddles two blocks)
        tpp = self.cfg.tokens_per_program
        self.land_bt = tpp * max(1, 16 // tpp)
        self._done = torch.zeros((W, max_tokens), dtype=torch.int32, device=dev)
        self._sig = [self.state.sig[i] for i in range(3)]
        # R, N, min id, max id, most tokens of a source: written by the route kernel straight into pinned host
        # memory (its device-mapped address), read by the host after the route's event: no copy to queue
        self._info = torch.zeros(5, dtype=torch.int64, pin_memory=self.cuda)
        self._event = torch.cuda.Event() if self.cuda else None
        # the expand and combine_recv launch as programmatic dependents of the send / combine_send (normal.py,
        # steps 3 and 5): sm_90 GPUs, config.trailing
        self.pdl = self.cfg.trailing and pdl_available(dev)
        self._pdl_launch = {"launch_pdl": True} if self.pdl else {}
        self._dummies, self._typed_views = {}, {}
        self._bound: dict = {}  # (launch, key) -> BoundLaunch: the dispatch launches bound to these buffers
        self.seq = [0, 0, 0]  # notify, forward channel, backward channel: the same on every rank
        # launched through the compiled kernels (no per-call Triton binding: the expand launch follows the
        # host sync, so its cost would idle the GPU); keys: the dtypes and flags that vary between calls
        self._route, self._send_k, self._expand_k, self._cs, self._cr = (CachedLaunch(k) for k in (
            _route_kernel, _send_kernel, _expand_kernel, _combine_send_kernel, _combine_recv_kernel))

    def free(self) -> None:
        self.state.free()

    # -- helpers -------------------------------------------------------------------------------------
    def _or_dummy(self, t: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """t, or a small tensor of dtype where t is None or empty (kernels get a valid pointer either way)."""
        if t is not None and t.numel():
            return t
        if dtype not in self._dummies:
            self._dummies[dtype] = torch.zeros(16, dtype=dtype, device=self._totals.device)
        return self._dummies[dtype]

    def _typed(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        key = (name, dtype)
        if key not in self._typed_views:
            self._typed_views[key] = self.state.views[name].view(-1).view(dtype)
        return self._typed_views[key]

    def _row(self, dtype: torch.dtype, cols: int, what: str) -> int:
        size = dtype.itemsize
        if cols * size > self.row_bytes:
            raise ValueError(f"{what}: rows of {cols} x {dtype} do not fit the Dispatcher's staging rows "
                             f"({self.row_bytes} bytes: hidden={self.H} x {self.dtype})")
        return self.row_bytes // size

    # -- dispatch ------------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 x2: Optional[torch.Tensor] = None):
        """x [T, H], topk_idx [T, K], topk_weights [T, K] (, x2 [T, H2]: a second payload, e.g. FP8 scales)
        -> (rows [R, H], weights [R] float32, rows2 [R, H2] or None, FusedPlan). One host sync."""
        self.state.check_live()
        W, E, E_L, K, cfg = self.W, self.E, self.E_L, self.K, self.cfg
        T = x.shape[0]
        topk = topk_idx.contiguous()
        self.seq[0] += 1
        plan = torch.empty(W + 1 + E_L * W + E_L, dtype=torch.int64, device=x.device)
        topk_arg = self._or_dummy(topk, topk.dtype)
        route = self._bound.get(("route", topk.dtype))
        if route is None:  # ROW_ENDS off: the experts get tokens_per_expert (plan's tail); varying: topk, plan, T, seq
            route = self._bound[("route", topk.dtype)] = self._route.bind(
                topk.dtype, [topk_arg, self._counts, self._totals, self._minmax, self._ctr[_CTR_ROUTE], self.state.notify,
                             self._sig[_SIG_NOTIFY], plan, self._info, plan, T, self.seq[0], E, E_L, W], (0, 7, 9, 10, 11),
                K=K, BT=self.bt, BLOCK_P=_P2(self.bt * K), BLOCK_E=_P2(E + 1), BLOCK_W=_P2(W),
                BLOCK_EL=_P2(E_L), ROW_ENDS=False, num_warps=cfg.num_warps)
        route.launch((max(1, cdiv(T, self.bt)),), topk_arg, plan, plan, T, self.seq[0])
        if self.cuda:
            self._event.record()
        # the send's inputs stay referenced until the expand is queued: the allocations below then cannot take
        # memory the send (maybe still running) reads, which the expand, beside it, would write unordered
        weights = topk_weights.float().contiguous()
        self._send(x, x2, topk, weights)
        token_rows = torch.empty((W * self.M, K), dtype=torch.int32, device=x.device)  # >= N rows; made before the sync
        if self.cuda:
            self._event.synchronize()  # the one host sync: R and N size the outputs
        R, N, lo, hi, most = self._info.tolist()
        out = torch.empty((R, x.shape[1]), dtype=x.dtype, device=x.device)
        out_w = torch.empty(R, dtype=torch.float32, device=x.device)
        out2 = None if x2 is None else torch.empty((R, x2.shape[1]), dtype=x2.dtype, device=x.device)
        p = FusedPlan(topk, plan, token_rows, plan[-E_L:], T, N, R, most)
        self._expand(p, out, out_w, out2)  # beside the send (PDL)
        del weights
        if lo < -1 or hi >= E:  # every kernel of the call ran: peers are not left waiting
            raise ValueError(f"dispatch: topk_idx values must be in [-1, {E}), got min {lo}, max {hi}")
        return out, out_w, out2, p

    def redispatch(self, p: FusedPlan, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [R, H] with p's routing (no host sync)."""
        self.state.check_live()
        self._send(x, None, p.topk_idx, None)
        out = torch.empty((p.num_recv_rows, x.shape[1]), dtype=x.dtype, device=x.device)
        self._expand(p, out, None, None)
        return out

    def _send(self, x, x2, topk, weights) -> None:
        self.seq[1] += 1
        args = (self._or_dummy(x, x.dtype), self._or_dummy(x2, torch.float32), self._or_dummy(topk, topk.dtype),
                self._or_dummy(weights, torch.float32), x.shape[0], self.seq[1])
        # (x 16-byte aligned: send_tma's rows may go by TMA)
        key = (x.dtype, x.shape[1], None if x2 is None else (x2.dtype, x2.shape[1]), topk.dtype, x.data_ptr() % 16 == 0,
               weights is None)
        send = self._bound.get(("send", key))
        if send is None:
            send = self._bound[("send", key)] = self._bind_send(key, x, x2, args)
        if send.constexprs["TMA_PIECES"]:  # (send_tma: the scratch of the descriptors the kernel builds)
            prepare_tma()
        blocks = max(1, cdiv(x.shape[0], self.bt))
        send.launch((min(blocks, self.cfg.send_programs) if self.cfg.send_programs > 0 else blocks,), *args)

    def _bind_send(self, key, x, x2, args) -> BoundLaunch:
        """The send launch of one key (dtypes, widths, whether weights come): varying are x, x2, topk, weights
        (args[:4]), T and seq; the staging views and row widths follow from the key (checked here)."""
        row = self._row(x.dtype, x.shape[1], "dispatch")
        h2, row2, rows2, align2 = 0, 0, None, 1
        if x2 is not None:
            row2 = self._row(x2.dtype, x.shape[1] * x.element_size() // x2.element_size() + x2.shape[1], "dispatch")
            h2, align2 = x2.shape[1], 16 // x2.element_size()
            rows2 = self._typed("rows", x2.dtype)[x.shape[1] * x.element_size() // x2.element_size():]
        st, K, H = self.state, self.K, x.shape[1]
        piece = 256 // x.element_size()  # send_tma: rows of whole 256-byte pieces (NormalConfig)
        tma = self.cfg.send_tma and H % piece == 0 and row * x.element_size() % 16 == 0 and key[-2]
        tma_pieces = _P2(H // piece) if tma else 0
        full = [*args[:4], self._counts, self._typed("rows", x.dtype), self._or_dummy(rows2, torch.float32), st.route,
                st.slot, st.weight, st.blocks, self._sig[_SIG_FWD_CONSUMED], args[4], args[5], self.E, self.E_L,
                self.W, self.M, x.shape[1], row, h2, row2]
        return self._send_k.bind(
            key, full, (0, 1, 2, 3, 12, 13), K=K, BT=self.bt, BLOCK_P=_P2(self.bt * K), BLOCK_T=_P2(self.bt),
            BLOCK_K=_P2(K), BLOCK_B=16, BLOCK_W=_P2(self.W), BLOCK_H=self.cfg.send_block_h,
            ALIGN=16 // x.element_size(), ALIGN2=align2, WITH_META=not key[-1], HAS_X2=x2 is not None,
            PDL=self.pdl, TMA_PIECES=tma_pieces, num_warps=self.cfg.num_warps)

    def _expand(self, p: FusedPlan, out, out_w, out2) -> None:
        args = (self._or_dummy(out, out.dtype), self._or_dummy(out2, torch.float32),
                self._or_dummy(out_w, torch.float32), self._or_dummy(p.token_rows, torch.int32), p.plan, self.seq[1])
        key = (out.dtype, out.shape[1], None if out2 is None else (out2.dtype, out2.shape[1]), out_w is None)
        expand = self._bound.get(("expand", key))
        if expand is None:
            expand = self._bound[("expand", key)] = self._bind_expand(key, out, out2, args)
        expand.launch((max(1, self.W * cdiv(p.most_tokens, self.cfg.tokens_per_program)),), *args)

    def _bind_expand(self, key, out, out2, args) -> BoundLaunch:
        """The expand launch of one key: varying are out, out2, out_w, token_rows, plan (args[:5]) and seq."""
        st, K, tpp = self.state, self.K, self.cfg.tokens_per_program
        h2 = row2 = 0
        rows2 = None
        if out2 is not None:
            skip = out.shape[1] * out.element_size() // out2.element_size()
            rows2 = self._typed("rows", out2.dtype)[skip:]
            h2, row2 = out2.shape[1], self.row_bytes // out2.element_size()
        full = [self._typed("rows", out.dtype), self._or_dummy(rows2, torch.float32), args[0], args[1], st.route,
                st.slot, st.weight, args[2], args[3], args[4], st.blocks, self._sig[_SIG_FWD_CONSUMED],
                self._ctr[_CTR_EXPAND], args[5], self.W, self.M, out.shape[1], self.row_bytes // out.element_size(), h2,
                row2, self.bt]
        return self._expand_k.bind(
            key, full, (2, 3, 7, 8, 9, 13), K=K, BT=tpp, BLOCK_T=_P2(tpp), BLOCK_K=_P2(K), BLOCK_H=self.cfg.block_h,
            FROM_META=not key[-1], HAS_X2=out2 is not None, PDL=self.pdl, num_warps=self.cfg.num_warps,
            **self._pdl_launch)

    # -- combine -------------------------------------------------------------------------------------
    def combine(self, p: FusedPlan, y: Optional[torch.Tensor], coef: Optional[torch.Tensor] = None,
                values: Optional[torch.Tensor] = None):
        """y [R, H] (or None), coef [R] float or None (= 1), values [R] float (or None) -> (out [T, H] of
        y's dtype: sum_k coef * y over each token's rows, values back at each pair [T, K] float32 or None)."""
        self.state.check_live()
        self.seq[2] += 1
        dtype = self.dtype if y is None else y.dtype
        row = self._row(dtype, self.H, "combine")
        back = self._typed("back_rows", dtype)
        st, K, tpp, T, dev = self.state, self.K, self.cfg.tokens_per_program, p.num_tokens, p.plan.device
        acc = tl.float64 if dtype == torch.float64 else tl.float32
        f32 = torch.float32
        flags = (dtype, y is None, coef is None, values is None)
        self._cs.launch(
            (max(1, self.W * cdiv(p.most_tokens, tpp)),), flags, self._or_dummy(y, dtype), self._or_dummy(coef, f32),
            self._or_dummy(values, f32), self._or_dummy(p.token_rows, torch.int32), p.plan, back, st.back_w,
            st.back_blocks, self._done, self._sig[_SIG_BWD_CONSUMED], self.seq[2], self.W, self.M, self.H, row,
            self.land_bt, K=K, BT=tpp, BLOCK_T=_P2(tpp), BLOCK_K=_P2(K), BLOCK_H=self.cfg.block_h,
            ALIGN=16 // back.element_size(), HAS_ROWS=y is not None, HAS_COEF=coef is not None,
            HAS_VALS=values is not None, ACC=acc, PDL=self.pdl, num_warps=self.cfg.num_warps, enable_fp_fusion=False)
        # made while combine_send's inputs (y, coef, values, p) are referenced: no memory it still reads, which
        # combine_recv, beside it (PDL), would write unordered
        out = None if y is None else torch.empty((T, self.H), dtype=dtype, device=dev)
        vals = None if values is None else torch.empty((T, K), dtype=f32, device=dev)
        self._cr.launch(
            (max(1, cdiv(T, tpp)),), flags + (p.topk_idx.dtype,), back, st.back_w,
            self._or_dummy(p.topk_idx, p.topk_idx.dtype), self._or_dummy(out, dtype), self._or_dummy(vals, f32),
            st.back_blocks, self._sig[_SIG_BWD_CONSUMED], self._ctr[_CTR_COMBINE_RECV], T, self.seq[2], self.E,
            self.E_L, self.W, self.M, self.H, row, self.land_bt, K=K, BT=tpp, BLOCK_T=_P2(tpp), BLOCK_K=_P2(K),
            BLOCK_H=self.cfg.block_h, HAS_ROWS=y is not None, HAS_VALS=values is not None, ACC=acc, PDL=self.pdl,
            num_warps=self.cfg.num_warps, enable_fp_fusion=False, **self._pdl_launch)
        return out, vals
