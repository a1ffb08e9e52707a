"""Stage-by-stage diagnosis of tilecomm.overlap.fused_moe at world size 1 (a diagnostic, not a test).

    python3 tests/fused_moe_probe.py                 # small: 256 tokens, hidden 128, 8 experts, top-2, ffn 64
    python3 tests/fused_moe_probe.py --large         # also the pretraining preset's layer (bf16)
    python3 tests/fused_moe_probe.py --gpu-tiles     # on CPU ranks: the GPU's tile config in the interpreter

For each dtype (fp32, bf16; fp64 with --fp64) and each FusedMoEConfig variant, one forward and one backward
through FusedMoEWorkspace.forward / .backward, and each stage compared with torch computed from the fused
path's own inputs of that stage (so the first wrong stage is the one that prints FAIL):

    rows     row_pair / row_src / row_w (exact: the expert-major order, (expert, token, k) at world 1)
    x_rows   the gathered rows = x[token of each row] (exact)
    h        x_rows @ w_gate_up[e]              act   silu(h_gate) * h_up (from the fused h)
    out      sum over the token's rows of w * (act @ w_down[e])  (from the fused act)
    g_rows   grad_out[token]   act_w  w * act    dh    SwiGLU backward of w * (grad_out @ w_down[e]^T)
    grad_w   <grad_out[token], act @ w_down[e]> grad_x sum over rows of dh @ w_gate_up[e]^T
    dw_down / dw_gate_up: act_w^T @ g_rows, x_rows^T @ dh per expert
    e2e      every output against fused_moe_reference (the unfused Dispatcher path)

A failing stage lists its worst rows with (expert, row inside the expert, row inside its BLOCK_M tile) and
columns: the pattern points at the index math. Also a check that a tensor tl.atomic_add's old values reach every
thread that holds a copy (wait_words relies on it). The summary is printed last.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch
import triton
import triton.language as tl

import tilecomm
from tilecomm.dispatch import Dispatcher
from tilecomm.overlap import FusedMoEWorkspace, fused_moe_reference
from tilecomm.overlap import moe_fused
from tilecomm.overlap.moe_config import FusedGemm, FusedMoEConfig
from tilecomm.overlap.tiles import GemmConfig

SUMMARY = []


def _tol(dtype):
    return {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]


def _expected_order(idx, K):
    """(row_pair [R], expert [R]) in the expert-major order at world 1: expert, then token, then k."""
    T = idx.shape[0]
    e = idx.reshape(-1).long()
    flat = torch.arange(T * K, device=idx.device)
    valid = e >= 0
    key = e[valid] * (T * K) + flat[valid]
    order = torch.argsort(key)
    return flat[valid][order], e[valid][order]


def _rows_report(name, got, want, experts, offs, block_m, tol, limit=6):
    """Relative error per row; prints the worst rows with their place in the tile grid."""
    got, want = got.double(), want.double()
    scale = want.norm().clamp_min(1e-30) / max(1, want.shape[0]) ** 0.5
    per_row = (got - want).norm(dim=-1) / scale if got.dim() == 2 else (got - want).abs() / scale
    rel = float((got - want).norm() / want.norm().clamp_min(1e-30))
    ok = rel <= tol and bool(torch.isfinite(got).all())
    line = f"  {name:11s} rel {rel:9.2e}  {'ok' if ok else 'FAIL'}"
    if not ok:
        bad = (per_row > 10 * tol) | ~torch.isfinite(per_row)
        line += f"  bad rows {int(bad.sum())}/{per_row.shape[0]}"
        rows = torch.nonzero(bad).flatten()[:limit].tolist() or per_row.argsort(descending=True)[:limit].tolist()
        starts = torch.cat([offs.new_zeros(1), offs[:-1]]).long() if offs is not None else None
        for r in rows:
            where = ""
            if experts is not None and starts is not None:
                e = int(experts[r])
                inner = r - int(starts[e])
                where = f" e={e} row_in_e={inner} row_in_tile={inner % block_m}"
            if got.dim() == 2:
                diff = (got[r] - want[r]).abs()
                cols = torch.nonzero(diff > diff.max() * 0.5).flatten()[:8].tolist()
                line += f"\n      row {r}{where} err {float(per_row[r]):.2e} cols {cols} got {got[r, cols[:3]].tolist()} " \
                        f"want {want[r, cols[:3]].tolist()}"
            else:
                line += f"\n      row {r}{where} got {float(got[r]):.6g} want {float(want[r]):.6g}"
    print(line, flush=True)
    return ok


def _exact(name, got, want, limit=8):
    ok = got.shape == want.shape and bool((got == want).all())
    line = f"  {name:11s} {'exact ok' if ok else 'FAIL'}"
    if not ok:
        if got.shape != want.shape:
            line += f" shapes {tuple(got.shape)} vs {tuple(want.shape)}"
        else:
            bad = torch.nonzero(got != want).flatten()[:limit].tolist()
            line += f" {int((got != want).sum())} differ; first {bad}: got {got[bad].tolist()} want {want[bad].tolist()}"
    print(line, flush=True)
    return ok


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _torch_moe(x, idx, w, w_gu, w_dn, grad_out):
    """out and the gradients (x, w, w_gate_up, w_down) in fp64 torch: a loop over experts."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w, w_gu, w_dn)]
    xd, wd, gud, dnd = leaves
    F = w_dn.shape[1]
    out = torch.zeros_like(xd)
    for e in range(w_gu.shape[0]):
        t, k = torch.nonzero(idx == e, as_tuple=True)
        if t.numel():
            h = xd[t] @ gud[e]
            y = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ dnd[e]
            out = out.index_add(0, t, y * wd[t, k][:, None])
    out.backward(grad_out.double())
    return [out.detach()] + [leaf.grad for leaf in leaves]


def _case(size, dtype, cfg, label):
    T, H, E, K, F = size
    dev = tilecomm.current().device
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(T, H, generator=gen).to(dev, dtype)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(dev)
    idx[torch.rand(T, K, generator=gen).to(dev) < 0.05] = -1
    w = torch.rand(T, K, generator=gen).to(dev)
    w_gu = (torch.randn(E, H, 2 * F, generator=gen) * H ** -0.5).to(dev, dtype)
    w_dn = (torch.randn(E, F, H, generator=gen) * F ** -0.5).to(dev, dtype)
    grad_out = torch.randn(T, H, generator=gen).to(dev, dtype)
    tol = _tol(dtype)
    print(f"== {label}: T={T} H={H} E={E} K={K} F={F} {dtype} {cfg}", flush=True)
    ws = FusedMoEWorkspace(E, H, F, T, K, dtype, config=cfg)
    captured = []
    real_wgrad = moe_fused._wgrad
    moe_fused._wgrad = lambda a, b, *rest: captured.append((a, b)) or real_wgrad(a, b, *rest)
    stages = []
    t0 = time.time()
    try:
        out, s = ws.forward(x, idx, w, w_gu, w_dn, save=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        print(f"  (forward done after {time.time() - t0:.1f} s, compiles included)", flush=True)
        gx, gw, g_gu, g_dn = ws.backward(s, grad_out, w_gu, w_dn)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        print(f"  (backward done after {time.time() - t0:.1f} s)", flush=True)
    finally:
        moe_fused._wgrad = real_wgrad
    bm = cfg.gate_up.tiles.BLOCK_M
    pair_want, e_want = _expected_order(idx, K)
    R = pair_want.shape[0]
    stages.append(("rows", _exact("row_pair", s.row_pair.long(), pair_want)
                   & _exact("row_src", s.row_src.long(), torch.zeros_like(pair_want))
                   & _exact("row_w", s.row_w, w.reshape(-1)[pair_want])))
    pair = s.row_pair.long().clamp(0, T * K - 1)
    tok, ex = pair // K, idx.reshape(-1)[pair].long().clamp(min=0)
    offs = s.offs
    f64 = torch.float64
    stages.append(("x_rows", _exact("x_rows", s.x_rows, x[tok])))
    xr = s.x_rows.to(f64)
    h_want = torch.bmm(xr[:, None, :], w_gu.to(f64)[ex])[:, 0]
    stages.append(("h", _rows_report("h", s.h, h_want, ex, offs, bm, tol)))
    hg, hu = s.h.to(f64)[:, :F], s.h.to(f64)[:, F:]
    stages.append(("act", _rows_report("act", s.act, torch.nn.functional.silu(hg) * hu, ex, offs, bm, tol)))
    y = torch.bmm(s.act.to(f64)[:, None, :], w_dn.to(f64)[ex])[:, 0]
    out_want = torch.zeros(T, H, dtype=f64, device=dev).index_add_(0, tok, y * s.row_w.to(f64)[:, None])
    stages.append(("out", _rows_report("out", out, out_want, None, None, bm, tol)))
    go = grad_out.to(f64)[tok]
    if len(captured) == 2:
        (act_w, g_rows), (xr_c, dh) = captured
        stages.append(("g_rows", _rows_report("g_rows", g_rows, go, ex, offs, bm, tol)))
        stages.append(("act_w", _rows_report("act_w", act_w, s.act.to(f64) * s.row_w.to(f64)[:, None], ex, offs, bm,
                                             tol)))
        d_act = torch.bmm(go[:, None, :], w_dn.to(f64)[ex].transpose(1, 2))[:, 0] * s.row_w.to(f64)[:, None]
        sig = torch.sigmoid(hg)
        dh_want = torch.cat([d_act * hu * sig * (1 + hg * (1 - sig)), d_act * hg * sig], 1)
        stages.append(("dh", _rows_report("dh", dh, dh_want, ex, offs, bm, tol)))
    else:
        print(f"  (weight-gradient inputs not captured: {len(captured)} _wgrad calls)")
        dh = None
    gw_want = torch.zeros(T * K, dtype=f64, device=dev).index_add_(0, pair, (go * y).sum(1)).reshape(T, K)
    # routing-weight gradients are float32 for every data type
    stages.append(("grad_w", _rows_report("grad_w", gw.reshape(-1), gw_want.reshape(-1), None, None, bm,
                                          max(tol, 1e-6))))
    if dh is not None:
        gx_rows = torch.bmm(dh.to(f64)[:, None, :], w_gu.to(f64)[ex].transpose(1, 2))[:, 0]
        gx_want = torch.zeros(T, H, dtype=f64, device=dev).index_add_(0, tok, gx_rows)
        stages.append(("grad_x", _rows_report("grad_x", gx, gx_want, None, None, bm, tol)))
        counts = torch.bincount(ex, minlength=E).tolist()
        dn_want = torch.stack([a.T @ b for a, b in zip(act_w.to(f64).split(counts), g_rows.to(f64).split(counts))])
        gu_want = torch.stack([a.T @ b for a, b in zip(xr.split(counts), dh.to(f64).split(counts))])
        stages.append(("dw_down", _rows_report("dw_down", g_dn.flatten(0, 1), dn_want.flatten(0, 1), None, None, bm, tol)))
        stages.append(("dw_gate_up", _rows_report("dw_gate_up", g_gu.flatten(0, 1), gu_want.flatten(0, 1), None, None,
                                                  bm, tol)))
    # end to end: the unfused path (Dispatcher) and fp64 torch of the same inputs
    d = Dispatcher(E, H, T, K, dtype)
    leaves = [t.clone().requires_grad_() for t in (x, w, w_gu, w_dn)]
    ref = fused_moe_reference(leaves[0], idx, leaves[1], leaves[2], leaves[3], d)
    ref.backward(grad_out)
    d.free()
    ws.free()
    exact = _torch_moe(x, idx, w, w_gu, w_dn, grad_out)
    names = ("out", "x", "w", "w_gate_up", "w_down")
    fused = (out, gx, gw, g_gu, g_dn)
    unfused = (ref.detach(), leaves[0].grad, leaves[1].grad, leaves[2].grad, leaves[3].grad)
    e2e = True
    for name, got, want, ex in zip(names, fused, unfused, exact):
        rel = _rel(got, want)
        good = rel <= (5 * tol if dtype == torch.bfloat16 else max(tol, 1e-6) if name == "w" else tol)
        e2e &= good
        print(f"  e2e {name:10s} fused vs unfused {rel:9.2e}  {'ok' if good else 'FAIL'}   vs fp64 torch: fused "
              f"{_rel(got, ex):9.2e} unfused {_rel(want, ex):9.2e}", flush=True)
    stages.append(("e2e", e2e))
    first = next((n for n, ok in stages if not ok), None)
    SUMMARY.append(f"{label:28s} {str(dtype):15s} first failing stage: {first or 'none'}")


@triton.jit
def _bcast_kernel(words_ptr, out_ptr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
    """The layout of moe_gemm._arrived_rows: old values of a [BLOCK_M] atomic used as a [BLOCK_M, BLOCK_C] gather."""
    r = tl.arange(0, BLOCK_M)
    s = tl.arange(0, BLOCK_W)
    src = tl.sum((r[:, None] >= s[None, :] * 0).to(tl.int32), axis=1) - 1
    cur = tl.atomic_add(words_ptr + r + src, 0, mask=r < BLOCK_M, sem="acquire", scope="sys")
    cols = tl.arange(0, BLOCK_C)
    tl.store(out_ptr + r[:, None] * BLOCK_C + cols[None, :], (cur % (1 << 32))[:, None] + cols[None, :] * 0)


def _atomic_broadcast_check():
    dev = tilecomm.current().device
    words = (torch.arange(128, device=dev, dtype=torch.int64) + 1) | (7 << 32)
    out = torch.zeros(128, 64, dtype=torch.int64, device=dev)
    if dev.type != "cuda":
        return
    _bcast_kernel[(1,)](words, out, BLOCK_M=128, BLOCK_W=1, BLOCK_C=64, num_warps=8)
    want = (torch.arange(128, device=dev) + 1)[:, None].expand(128, 64)
    bad = int((out != want).sum())
    SUMMARY.append(f"atomic old values broadcast to every copy: {'ok' if bad == 0 else f'FAIL ({bad} wrong)'}")


def _compiled_resources():
    """Registers and spills of every compiled variant of the fused GEMMs (Triton's own counts, GPU only)."""
    from tilecomm.overlap import moe_gemm

    for fn in (moe_gemm._gate_up_kernel, moe_gemm._down_grad_kernel, moe_gemm._scatter_kernel):
        try:
            for cache in getattr(fn, "device_caches", {}).values():
                for kernel in cache[0].values():
                    kernel._init_handles()
                    consts = {k: v for k, v in getattr(kernel, "constants", {}).items() if "BLOCK" in str(k)}
                    SUMMARY.append(f"{fn.__name__}: regs {kernel.n_regs} spills {kernel.n_spills} shared "
                                   f"{kernel.metadata.shared} warps {kernel.metadata.num_warps} {consts}")
        except Exception as err:  # noqa: BLE001
            SUMMARY.append(f"{fn.__name__}: no resource counts ({type(err).__name__}: {err})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--large", action="store_true", help="also the pretraining preset's layer (bf16)")
    ap.add_argument("--fp64", action="store_true")
    ap.add_argument("--gpu-tiles", action="store_true", help="CPU ranks: also the GPU's bf16 tile config")
    ap.add_argument("--variants", action="store_true", help="GPU, bf16: also 1 stage / 64 columns / 64 rows")
    args = ap.parse_args()
    tilecomm.init(backend=os.environ.get("TILECOMM_BACKEND", "auto"), heap_bytes=(1536 if args.large else 64) << 20)
    dev = tilecomm.current().device
    small = (256, 128, 8, 2, 64)
    runs = [("default", dtype, FusedMoEConfig.for_device(dev, small[1], dtype))
            for dtype in [torch.float32, torch.bfloat16] + ([torch.float64] if args.fp64 else [])]
    if args.gpu_tiles:
        runs.append(("gpu-tiles", torch.bfloat16, FusedMoEConfig(block_h=min(256, small[1]))))
    if args.variants and dev.type == "cuda":
        tiles = {"1-stage": GemmConfig(128, 128, 64, 8, 8, 1, 1, False), "n64": GemmConfig(128, 64, 64, 8, 8, 3, 1, False),
                 "m64-4warps": GemmConfig(64, 64, 32, 8, 4, 3, 1, False)}
        runs += [(name, torch.bfloat16, FusedMoEConfig(*(FusedGemm(g),) * 3)) for name, g in tiles.items()]
    try:
        _atomic_broadcast_check()
    except Exception as err:  # noqa: BLE001 - a diagnostic: report and go on
        SUMMARY.append(f"atomic broadcast check failed: {type(err).__name__}: {err}")
    for label, dtype, cfg in runs:
        try:
            _case(small, dtype, cfg, f"small/{label}")
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            SUMMARY.append(f"small/{label:22s} {str(dtype):15s} raised {type(err).__name__}: {str(err)[:300]}")
    if args.large:
        size = (16384, 1536, 64, 6, 768)
        try:
            _case(size, torch.bfloat16, FusedMoEConfig.for_device(dev, size[1], torch.bfloat16), "pretrain/default")
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            SUMMARY.append(f"pretrain/default raised {type(err).__name__}: {str(err)[:300]}")
    _compiled_resources()
    print("\n== fused_moe_probe summary", flush=True)
    for line in SUMMARY:
        print("  " + line, flush=True)
    tilecomm.finalize()


if __name__ == "__main__":
    sys.exit(main())
