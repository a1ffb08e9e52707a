"""tilecomm's GEMMs beside cuBLAS / torch._grouped_mm on one GPU, from the same run.

    python -m tilecomm.bench.gemm [--ops matmul,ag_gemm,gemm_rs,grouped] [--sweep] [--autotune] [--json out.json]

Rows (bf16; FLOPs = 2·M·N·K, µs = triton.testing.do_bench median, L2 flushed between calls):
* matmul MxNxK: tilecomm.overlap.matmul vs torch.matmul (cuBLAS), C [M, N] = A [M, K] @ B [K, N];
* ag_gemm / gemm_rs MxKxN at world size 1 (one rank: the fused kernels with their waits and epilogues,
  no link) vs cuBLAS of the same product; workspaces made up front, as layers do;
* grouped LAYER.proj.product: tilecomm.overlap.grouped_mm's three products (fwd y = x @ w[e],
  dx = dy @ w[e]^T, dw[e] = x_e^T @ dy_e) vs torch._grouped_mm's, for the gate_up ([R, H] x [E, H, 2F])
  and down ([R, F] x [E, F, H]) projections of three expert layers, rows routed uniformly at random.
ratio = baseline µs / tilecomm µs (> 1: tilecomm faster); wall µs: 20 calls back to back and one synchronize,
per call (the host cost do_bench hides). Every result is checked against the baseline first (relative
Frobenius error < 2e-2); a failing row is printed as FAILED and the others still run. --sweep also times
every tiles.CANDIDATES config on the matmul shapes (the data behind tiles._TABLE); --autotune runs the ops
with a GemmTuner instead of the table.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import triton
import triton.testing

MATMUL = [(8192, 7168, 8192), (8192, 3584, 4096), (2048, 8192, 7168), (4096, 4096, 4096), (8192, 8192, 8192),
          (8000, 3500, 4096), (1000, 1000, 1000)]
FUSED = [(8192, 8192, 7168), (8192, 4096, 3584), (8000, 4096, 3500)]  # M x K x N
LAYERS = {"64x1536x768": (64, 1536, 768, 98304), "256x7168x2048": (256, 7168, 2048, 32768),
          "8x4096x14336": (8, 4096, 14336, 16384)}  # experts, hidden, ffn, rows
TOL = 2e-2


def _us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60) * 1e3


def _wall_us(fn, calls: int = 20) -> float:
    """µs per call of `calls` calls back to back and one synchronize (host cost included; do_bench hides it)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _err(x, ref) -> float:
    ref = ref.float()
    return ((x.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _row(op, shape, flops, fn, base_fn, baseline, err) -> dict:
    """Time fn (tilecomm) and base_fn (the baseline) on the same tensors; print and return the row."""
    ours, base = _us(fn), _us(base_fn)
    wall, base_wall = _wall_us(fn), _wall_us(base_fn)
    row = {"op": op, "shape": shape, "us": ours, "baseline_us": base, "baseline": baseline,
           "tflops": flops / ours / 1e6, "baseline_tflops": flops / base / 1e6, "ratio": base / ours, "rel_err": err,
           "wall_us": wall, "baseline_wall_us": base_wall}
    print(f"{op:<26} {shape:<22} {ours:9.1f} {flops / ours / 1e6:7.0f} {base:9.1f} {flops / base / 1e6:7.0f} "
          f"{base / ours:6.3f} {wall:9.1f} {base_wall:9.1f}  {baseline}", flush=True)
    return row


def _guarded(rows: list, label: str, body) -> None:
    """Append body()'s row; a failing row is printed and the benchmark goes on."""
    try:
        rows.append(body())
    except Exception as exc:  # noqa: BLE001 (reported, not fatal: the other rows still run)
        print(f"{label}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}", flush=True)


def bench_matmul(dt, config) -> list:
    from tilecomm.overlap import matmul

    rows = []
    for M, N, K in MATMUL:
        a, b = torch.randn(M, K, device="cuda", dtype=dt), torch.randn(K, N, device="cuda", dtype=dt)
        _guarded(rows, f"matmul {M}x{N}x{K}", lambda: _row(
            "matmul", f"{M}x{N}x{K}", 2.0 * M * N * K, lambda: matmul(a, b, config=config), lambda: a @ b, "cuBLAS",
            _checked(f"matmul {M}x{N}x{K}", matmul(a, b, config=config), a @ b)))
    return rows


def _checked(label: str, got, ref) -> float:
    """The relative error of got against ref; raises past TOL (the row is then reported as failed)."""
    err = _err(got, ref)
    if err > TOL:
        raise RuntimeError(f"{label}: relative error {err:.3g}")
    return err


def bench_fused(dt, ops, config) -> list:
    """ag_gemm / gemm_rs at world size 1 (needs tilecomm.init: a one-rank world)."""
    from tilecomm.overlap import AgGemmWorkspace, GemmRsWorkspace, ag_gemm, gemm_rs

    rows = []
    for M, K, N in FUSED:
        a, b = torch.randn(M, K, device="cuda", dtype=dt), torch.randn(K, N, device="cuda", dtype=dt)
        ref = a @ b
        for op in ops:
            if op == "ag_gemm":
                ws = AgGemmWorkspace(K, dt, M)
                fn = lambda: ag_gemm(a, b, workspace=ws, config=config)  # noqa: E731
            else:
                ws = GemmRsWorkspace(N, dt, M)
                fn = lambda: gemm_rs(a, b, workspace=ws, config=config)  # noqa: E731
            label = f"{op} {M}x{K}x{N}"
            _guarded(rows, label, lambda: _row(op, f"{M}x{K}x{N}", 2.0 * M * N * K, fn, lambda: a @ b, "cuBLAS",
                                               _checked(label, fn(), ref)))
            ws.free()
    return rows


def _routing(E: int, R: int) -> torch.Tensor:
    counts = torch.bincount(torch.randint(E, (R,), generator=torch.Generator().manual_seed(E)), minlength=E)
    return counts.cumsum(0).to(torch.int32).cuda()


def bench_grouped(dt, config) -> list:
    from tilecomm.overlap import grouped as g

    rows = []
    for name, (E, H, F, R) in LAYERS.items():
        offs = _routing(E, R)
        for proj, (K, N) in (("gate_up", (H, 2 * F)), ("down", (F, H))):
            x = torch.randn(R, K, device="cuda", dtype=dt)
            w = torch.randn(E, K, N, device="cuda", dtype=dt) / math.sqrt(K)
            dy = torch.randn(R, N, device="cuda", dtype=dt)
            products = {
                "fwd": (lambda: g._rows(x, w, offs, False, config), lambda: torch._grouped_mm(x, w, offs=offs)),
                "dx": (lambda: g._rows(dy, w, offs, True, config),
                       lambda: torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs)),
                "dw": (lambda: g._wgrad(x, dy, offs, E, None), lambda: torch._grouped_mm(x.t(), dy, offs=offs)),
            }
            for prod, (ours, theirs) in products.items():
                try:
                    ref = theirs()
                except RuntimeError as exc:  # a layout this torch build does not take
                    print(f"grouped {name}.{proj}.{prod}: torch._grouped_mm n/a: {str(exc).splitlines()[0][:100]}")
                    continue
                label = f"grouped {name}.{proj}.{prod}"
                _guarded(rows, label, lambda: _row(f"grouped.{proj}.{prod}", name, 2.0 * R * K * N, ours, theirs,
                                                   "torch._grouped_mm", _checked(label, ours(), ref)))
    return rows


def sweep(dt) -> list:
    """Every candidate config on the matmul shapes (what tiles._TABLE is chosen from)."""
    from tilecomm.overlap import matmul
    from tilecomm.overlap.tiles import CANDIDATES

    rows = []
    for M, N, K in MATMUL:
        a, b = torch.randn(M, K, device="cuda", dtype=dt), torch.randn(K, N, device="cuda", dtype=dt)
        ref, base = a @ b, _us(lambda: a @ b)
        best = None
        for cfg in CANDIDATES:
            try:
                err = _err(matmul(a, b, config=cfg), ref)
                us = _us(lambda: matmul(a, b, config=cfg)) if err < TOL else float("nan")
            except Exception as exc:  # reported, not fatal: a config that does not fit
                print(f"  sweep {M}x{N}x{K} {cfg}: failed: {str(exc).splitlines()[0][:100]}")
                continue
            rows.append({"shape": f"{M}x{N}x{K}", "config": cfg.launch(), "us": us, "cublas_us": base, "err": err})
            print(f"  sweep {M}x{N}x{K} {cfg.BLOCK_M}x{cfg.BLOCK_N}x{cfg.BLOCK_K} g{cfg.GROUP_M} w{cfg.num_warps} "
                  f"s{cfg.num_stages} e{cfg.EPILOGUE_SPLIT} ws{int(cfg.WARP_SPECIALIZE)}: {us:8.1f} µs "
                  f"{100 * base / us:5.1f}% of cuBLAS (err {err:.1e})", flush=True)
            if us == us and (best is None or us < best[0]):
                best = (us, cfg)
        if best:
            print(f"  best {M}x{N}x{K}: {best[1]} {100 * base / best[0]:.1f}% of cuBLAS", flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="matmul,ag_gemm,gemm_rs,grouped")
    p.add_argument("--sweep", action="store_true", help="time every candidate config on the matmul shapes first")
    p.add_argument("--autotune", action="store_true", help="pass a GemmTuner as config (tunes per shape bucket)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    ops = args.ops.split(",")
    if not set(ops) <= {"matmul", "ag_gemm", "gemm_rs", "grouped"}:
        raise SystemExit(f"--ops: expected a comma list of matmul,ag_gemm,gemm_rs,grouped, got {args.ops!r}")
    if not torch.cuda.is_available():
        raise SystemExit("tilecomm.bench.gemm times GPU kernels; torch sees no CUDA device")
    from tilecomm.overlap import GemmTuner

    torch.manual_seed(0)
    dt, config = torch.bfloat16, (GemmTuner() if args.autotune else None)
    out = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__}
    if args.sweep:
        out["sweep"] = sweep(dt)
    print(f"{'op':<26} {'shape':<22} {'µs':>9} {'TFLOP/s':>7} {'base µs':>9} {'TFLOP/s':>7} {'ratio':>6} "
          f"{'wall µs':>9} {'base wall':>9}  baseline")
    rows = bench_matmul(dt, config) if "matmul" in ops else []
    fused = [op for op in ("ag_gemm", "gemm_rs") if op in ops]
    if fused:
        import tilecomm
        from tilecomm import runtime

        if not runtime.is_initialized():
            tilecomm.init(backend="cuda")  # world size 1 under a plain python or a one-rank torchrun
        rows += bench_fused(dt, fused, config)
    if "grouped" in ops:
        rows += bench_grouped(dt, config)
    out["rows"] = rows
    _summary(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def _summary(rows) -> None:
    """Geometric means of the ratios per op family (the issue's bars are stated on them)."""
    fams = {}
    for r in rows:
        fams.setdefault(r["op"].split(".")[0], []).append(r["ratio"])
    for fam, ratios in fams.items():
        print(f"geomean ratio {fam}: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} "
              f"(min {min(ratios):.3f}, {len(ratios)} rows)")


if __name__ == "__main__":
    main()
