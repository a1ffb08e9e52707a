"""tilecomm's GEMMs beside cuBLAS / torch._grouped_mm on one GPU, from the same run.

    python -m tilecomm.bench.gemm [--ops matmul,ag_gemm,gemm_rs,grouped] [--sweep] [--autotune] [--json out.json]

Rows (bf16; FLOPs = 2·M·N·K, µs = triton.testing.do_bench median, L2 flushed between calls):
* matmul MxNxK: tilecomm.overlap.matmul vs torch.matmul (cuBLAS), C [M, N] = A [M, K] @ B [K, N];
* ag_gemm / gemm_rs MxKxN at world size 1, each push (one rank: push="kernel" runs the fused kernels with their
  waits and epilogues, push="copy" cuBLAS alone, no link) vs cuBLAS of the same product; workspaces made up
  front, as layers do;
* grouped LAYER.proj.product: tilecomm.overlap.grouped_mm's three products (fwd y = x @ w[e],
  dx = dy @ w[e]^T, dw[e] = x_e^T @ dy_e) vs torch._grouped_mm's, for the gate_up ([R, H] x [E, H, 2F])
  and down ([R, F] x [E, F, H]) projections of three expert layers, rows routed uniformly at random.
ratio = baseline µs / tilecomm µs (> 1: tilecomm faster); with --rounds N (default 3) each side is timed N times,
alternating tilecomm and baseline, and the row takes each side's median (the spread prints as the lowest and highest
per-round ratio: one do_bench figure of a 256-expert product moved by 25% between runs, 2026-11-27); wall µs: 20 calls
back to back and one synchronize, per call (the host cost do_bench hides). Every result is checked against the
baseline first (relative Frobenius error < 2e-2); a failing row is printed as FAILED and the others still run.
--sweep also times every tiles.SWEEP_CANDIDATES config on the matmul shapes (the data behind tiles._TABLE);
--autotune runs the ops with a GemmTuner instead of the table.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
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


def _err(x, ref, chunk: int = 1 << 26) -> float:
    """Relative Frobenius error of x against ref, in fp32 chunks (a 256-expert dw is 15 GB in bf16)."""
    x, ref = x.reshape(-1), ref.reshape(-1)
    diff = norm = 0.0
    for i in range(0, ref.numel(), chunk):
        r = ref[i:i + chunk].float()
        diff += (x[i:i + chunk].float() - r).square().sum().item()
        norm += r.square().sum().item()
    return math.sqrt(diff) / max(math.sqrt(norm), 1e-30)


ROUNDS = 3  # --rounds


def _alternating_us(fn, base_fn, rounds: int) -> tuple:
    """(median µs of fn, median µs of base_fn, per-round ratios): the two timed in turn, `rounds` times each, so
    that a drift of the GPU's clock or of what L2 holds falls on both sides alike."""
    ours, base = [], []
    for _ in range(rounds):
        ours.append(_us(fn))
        base.append(_us(base_fn))
    return statistics.median(ours), statistics.median(base), [b / o for o, b in zip(ours, base)]


def _row(op, shape, flops, fn, base_fn, baseline, err) -> dict:
    """Time fn (tilecomm) and base_fn (the baseline) on the same tensors; print and return the row."""
    ours, base, ratios = _alternating_us(fn, base_fn, ROUNDS)
    wall, base_wall = _wall_us(fn), _wall_us(base_fn)
    row = {"op": op, "shape": shape, "us": ours, "baseline_us": base, "baseline": baseline,
           "tflops": flops / ours / 1e6, "baseline_tflops": flops / base / 1e6, "ratio": base / ours, "rel_err": err,
           "round_ratios": ratios, "wall_us": wall, "baseline_wall_us": base_wall}
    print(f"{op:<26} {shape:<22} {ours:9.1f} {flops / ours / 1e6:7.0f} {base:9.1f} {flops / base / 1e6:7.0f} "
          f"{base / ours:6.3f} {min(ratios):5.3f}-{max(ratios):5.3f} {wall:9.1f} {base_wall:9.1f}  {baseline}",
          flush=True)
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


def fused_heap_bytes(dt) -> int:
    """A heap for bench_fused at world 1: the largest workspace it makes (ag_gemm's gather holds two [M, K]
    buffers, by call parity; gemm_rs's receive buffer [M, N], two with the copy push) beside the collectives'
    share."""
    import tilecomm

    from .. import _env

    size = torch.empty((), dtype=dt).element_size()
    need = max(max(2 * M * K, 2 * M * N) * size for M, K, N in FUSED)
    return max(_env.heap_bytes(torch.cuda.is_available()), tilecomm.heap_bytes_for(need))


def bench_fused(dt, ops, config) -> list:
    """ag_gemm / gemm_rs at world size 1 (needs tilecomm.init: a one-rank world), each push: "copy" (cuBLAS per
    block; at world 1 the GEMM alone) and "kernel" (the fused Triton kernel with its waits and epilogue)."""
    from tilecomm.overlap import AgGemmWorkspace, GemmRsWorkspace, ag_gemm, gemm_rs

    rows = []
    for M, K, N in FUSED:
        a, b = torch.randn(M, K, device="cuda", dtype=dt), torch.randn(K, N, device="cuda", dtype=dt)
        ref = a @ b
        for op in ops:
            for push in ("copy", "kernel"):
                if op == "ag_gemm":
                    ws = AgGemmWorkspace(K, dt, M, push=push)
                    fn = lambda: ag_gemm(a, b, workspace=ws, config=config)  # noqa: E731
                else:
                    ws = GemmRsWorkspace(N, dt, M, push=push)
                    fn = lambda: gemm_rs(a, b, workspace=ws, config=config)  # noqa: E731
                label = f"{op} {push} {M}x{K}x{N}"
                _guarded(rows, label, lambda: _row(f"{op} {push}", f"{M}x{K}x{N}", 2.0 * M * N * K, fn, lambda: a @ b,
                                                   "cuBLAS", _checked(label, fn(), ref)))
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


def _cfg_name(cfg) -> str:
    return (f"{cfg.BLOCK_M}x{cfg.BLOCK_N}x{cfg.BLOCK_K} g{cfg.GROUP_M} w{cfg.num_warps} s{cfg.num_stages} "
            f"e{cfg.EPILOGUE_SPLIT} ws{int(cfg.WARP_SPECIALIZE)} f{int(cfg.FLATTEN)} p{cfg.PROGRAMS_PER_SM}"
            f"{' ptr' if cfg.POINTER_STORES else ''}")


def sweep_grouped(dt, products: list, old_module: str | None = None) -> list:
    """Every grouped.WGRAD_CANDIDATES (dw) or grouped.ROWS_CANDIDATES (fwd, dx) config on the named products
    ("LAYER.proj.product"), beside torch._grouped_mm and, with old_module, that module's kernels (a previous
    grouped.py) with their default configs; what grouped's tables are chosen from. Each config whose result
    matches is timed once per round, torch too, for --rounds rounds; a row is the median."""
    import importlib.util

    from tilecomm.overlap import grouped as g

    old = None
    if old_module:  # a file (e.g. a previous commit's grouped.py) loaded as a module of tilecomm.overlap
        spec = importlib.util.spec_from_file_location("tilecomm.overlap._grouped_before", old_module)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    rows = []
    for spec in products:
        name, proj, prod = spec.split(".")
        E, H, F, R = LAYERS[name]
        K, N = (H, 2 * F) if proj == "gate_up" else (F, H)
        offs = _routing(E, R)
        x = torch.randn(R, K, device="cuda", dtype=dt)
        w = torch.randn(E, K, N, device="cuda", dtype=dt) / math.sqrt(K) if prod != "dw" else None
        dy = torch.randn(R, N, device="cuda", dtype=dt)
        if prod == "dw":
            theirs = lambda: torch._grouped_mm(x.t(), dy, offs=offs)  # noqa: E731
            ours = lambda mod, cfg, form=None: (mod._wgrad(x, dy, offs, E, cfg) if form is None  # noqa: E731
                                                else mod._wgrad(x, dy, offs, E, cfg, form=form))
            candidates = g.WGRAD_CANDIDATES
        else:
            a, trans = (x, False) if prod == "fwd" else (dy, True)
            theirs = (lambda: torch._grouped_mm(x, w, offs=offs)) if prod == "fwd" else (
                lambda: torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs))
            ours = lambda mod, cfg, a=a, trans=trans: mod._rows(a, w, offs, trans, cfg)  # noqa: E731
            candidates = g.ROWS_CANDIDATES
        ref = theirs()
        flops = 2.0 * R * K * N
        runs = [("default", g, None, {})] + ([("old", old, None, {})] if old else [])
        if prod == "dw":  # both loop forms with their own default configs
            runs += [("flat form", g, None, {"form": "flat"}), ("per-item form", g, None, {"form": "per_item"})]
        runs += [(_cfg_name(c), g, c, {}) for c in candidates]
        checked = []
        for label, mod, cfg, kw in runs:
            fn = lambda mod=mod, cfg=cfg, kw=kw: ours(mod, cfg, **kw)  # noqa: E731
            try:
                err = _err(fn(), ref)
            except Exception as exc:  # reported, not fatal: a config that does not fit or compile
                print(f"  sweep {spec} {label}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}",
                      flush=True)
                continue
            if err >= TOL:
                print(f"  sweep {spec} {label}: wrong result (relative error {err:.1e})", flush=True)
                continue
            checked.append((label, mod, err, fn))
        # round robin: every config and torch once per round, ROUNDS rounds, medians (a drift hits all alike)
        times = {label: [] for label, *_ in checked}
        times["torch"] = []
        for _ in range(ROUNDS):
            times["torch"].append(_us(theirs))
            for label, _mod, _err_, fn in checked:
                times[label].append(_us(fn))
        base = statistics.median(times["torch"])
        print(f"  sweep {spec}: torch._grouped_mm {base:9.1f} µs {flops / base / 1e6:5.0f} TFLOP/s "
              f"(median of {ROUNDS})", flush=True)
        best = None
        for label, mod, err, _fn in checked:
            us = statistics.median(times[label])
            rows.append({"product": spec, "config": label, "us": us, "torch_us": base, "err": err,
                         "round_us": times[label], "torch_round_us": times["torch"]})
            print(f"  sweep {spec} {label:<44}: {us:9.1f} µs ratio {base / us:6.3f} (err {err:.1e})", flush=True)
            if mod is g and (best is None or us < best[0]):
                best = (us, label)
        if best:
            print(f"  best {spec}: {best[1]} ratio {base / best[0]:.3f}", flush=True)
        x = w = dy = ref = None  # free the operands before the next product
        torch.cuda.empty_cache()
    return rows


def sweep(dt, shapes=None) -> list:
    """Every candidate config on the matmul shapes (what tiles._TABLE is chosen from)."""
    from tilecomm.overlap import matmul
    from tilecomm.overlap.tiles import SWEEP_CANDIDATES

    rows = []
    for M, N, K in shapes or MATMUL:
        a, b = torch.randn(M, K, device="cuda", dtype=dt), torch.randn(K, N, device="cuda", dtype=dt)
        ref, base = a @ b, _us(lambda: a @ b)
        best = None
        for cfg in SWEEP_CANDIDATES:
            try:
                err = _err(matmul(a, b, config=cfg), ref)
                us = _us(lambda: matmul(a, b, config=cfg)) if err < TOL else float("nan")
            except Exception as exc:  # reported, not fatal: a config that does not fit
                print(f"  sweep {M}x{N}x{K} {cfg}: failed: {str(exc).splitlines()[0][:100]}")
                continue
            rows.append({"shape": f"{M}x{N}x{K}", "config": cfg.launch(), "us": us, "cublas_us": base, "err": err})
            print(f"  sweep {M}x{N}x{K} {_cfg_name(cfg)}: {us:8.1f} µs {100 * base / us:5.1f}% of cuBLAS "
                  f"(err {err:.1e})", flush=True)
            if us == us and (best is None or us < best[0]):
                best = (us, cfg)
        if best:
            print(f"  best {M}x{N}x{K}: {best[1]} {100 * base / best[0]:.1f}% of cuBLAS", flush=True)
    return rows


def main(argv=None) -> None:
    global ROUNDS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="matmul,ag_gemm,gemm_rs,grouped")
    p.add_argument("--sweep", action="store_true", help="time every candidate config on the matmul shapes first")
    p.add_argument("--sweep-shapes", default=None, help="--sweep on these MxNxK shapes only (comma list)")
    p.add_argument("--sweep-grouped", default=None,
                   help="time every grouped candidate config on these products first (comma list of LAYER.proj.product)")
    p.add_argument("--old-grouped", default=None, help="with --sweep-grouped: also time the kernels of this grouped.py file (a previous version)")
    p.add_argument("--autotune", action="store_true", help="pass a GemmTuner as config (tunes per shape bucket)")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help="time each row's two sides this many times, alternating; the medians make the row")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds: expected a positive integer, got {args.rounds}")
    ROUNDS = args.rounds
    ops = [op for op in args.ops.split(",") if op]  # --ops "": the sweeps alone
    if not set(ops) <= {"matmul", "ag_gemm", "gemm_rs", "grouped"}:
        raise SystemExit(f"--ops: expected a comma list of matmul,ag_gemm,gemm_rs,grouped, got {args.ops!r}")
    if not torch.cuda.is_available():
        raise SystemExit("tilecomm.bench.gemm times GPU kernels; torch sees no CUDA device")
    from tilecomm.overlap import GemmTuner

    torch.manual_seed(0)
    dt, config = torch.bfloat16, (GemmTuner() if args.autotune else None)
    out = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__}
    print(f"{out['device']}, torch {out['torch']}, triton {out['triton']}", flush=True)
    if args.sweep_grouped:
        out["sweep_grouped"] = sweep_grouped(dt, args.sweep_grouped.split(","), args.old_grouped)
    if args.sweep:
        shapes = [tuple(map(int, s.split("x"))) for s in args.sweep_shapes.split(",")] if args.sweep_shapes else None
        out["sweep"] = sweep(dt, shapes)
    print(f"{'op':<26} {'shape':<22} {'µs':>9} {'TFLOP/s':>7} {'base µs':>9} {'TFLOP/s':>7} {'ratio':>6} "
          f"{'rounds':>11} {'wall µs':>9} {'base wall':>9}  baseline")
    rows = bench_matmul(dt, config) if "matmul" in ops else []
    fused = [op for op in ("ag_gemm", "gemm_rs") if op in ops]
    if fused:
        import tilecomm
        from tilecomm import runtime

        if not runtime.is_initialized():  # world size 1 under a plain python or a one-rank torchrun
            tilecomm.init(backend="cuda", heap_bytes=fused_heap_bytes(dt))
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
