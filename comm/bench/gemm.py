"""Tune the tile GEMM on one GPU: every candidate GemmConfig against cuBLAS, shape by shape.

    python -m tilecomm.bench.gemm [--shapes 8192x8192x7168,...] [--dtype bfloat16] [--json out.json]

Shapes are MxNxK (C [M, N] = A [M, K] @ B [K, N]); the defaults are the local GEMMs of the overlap
bars at TP=4 and the table's size classes. For each shape: cuBLAS (torch.matmul) µs and TFLOP/s,
then each config's µs, TFLOP/s, % of cuBLAS, shared memory and spilled registers; the best config
last. Each result is checked against torch.matmul before it is timed (relative error < 2e-2).
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.testing
from tilecomm.overlap.tiles import GemmConfig, _matmul_kernel, matmul, num_programs

DEFAULT_SHAPES = [(8192, 7168, 8192), (8192, 3584, 4096), (2048, 8192, 7168), (2048, 4096, 3584),
                  (4096, 4096, 4096), (512, 1024, 1024)]
CANDIDATES = [GemmConfig(bm, bn, bk, w, s) for bm, bn, bk, w, s in [
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
    (128, 128, 64, 4, 5), (256, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4),
    (128, 128, 32, 4, 5)]]


def _parse(text: str) -> list[tuple[int, int, int]]:
    try:
        return [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",")]
    except ValueError:
        raise SystemExit(f"--shapes: expected a comma list of MxNxK, got {text!r}") from None


def _compiled() -> dict:
    """The tile GEMM's compiled kernels on the current device, by cache key."""
    return dict(_matmul_kernel.device_caches[torch.cuda.current_device()][0])


def _resources(kernels: list) -> tuple[int, int]:
    """(shared memory bytes, spilled registers) of the kernel compiled for one config."""
    if not kernels:
        return -1, -1
    k = kernels[0]
    k._init_handles()
    return int(k.metadata.shared), int(k.n_spills)


def run(shapes, dtype) -> list[dict]:
    rows, seen = [], {}
    for M, N, K in shapes:
        a = torch.randn(M, K, device="cuda", dtype=dtype)
        b = torch.randn(K, N, device="cuda", dtype=dtype)
        ref = a @ b
        flops = 2.0 * M * N * K
        cublas = triton.testing.do_bench(lambda a=a, b=b: a @ b, warmup=25, rep=100) * 1e3
        print(f"\n{M}x{N}x{K}: cuBLAS {cublas:8.1f} µs {flops / cublas / 1e6:6.0f} TFLOP/s "
              f"(programs {num_programs(1 << 30, a.device)})")
        best = None
        for cfg in CANDIDATES:
            before = _compiled()
            try:
                out = matmul(a, b, config=cfg)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if err > 2e-2:
                    raise RuntimeError(f"relative error {err:.3g}")
                us = triton.testing.do_bench(lambda a=a, b=b, cfg=cfg: matmul(a, b, config=cfg), warmup=25, rep=100) * 1e3
            except (RuntimeError, triton.runtime.errors.OutOfResources) as e:  # reported, not fatal
                print(f"  {cfg}: failed: {str(e).splitlines()[0][:120]}")
                continue
            new = [k for key, k in _compiled().items() if key not in before]
            smem, spills = seen[cfg] = _resources(new) if new else seen.get(cfg, (-1, -1))
            row = {"M": M, "N": N, "K": K, "dtype": str(dtype), "config": cfg.__dict__, "us": us,
                   "cublas_us": cublas, "tflops": flops / us / 1e6, "cublas_tflops": flops / cublas / 1e6,
                   "pct_cublas": 100 * cublas / us, "smem": smem, "spills": spills}
            rows.append(row)
            print(f"  {cfg.BLOCK_M:>3}x{cfg.BLOCK_N:<3}x{cfg.BLOCK_K:<3} w{cfg.num_warps} s{cfg.num_stages}: "
                  f"{us:8.1f} µs {row['tflops']:6.0f} TFLOP/s {row['pct_cublas']:5.1f}% of cuBLAS "
                  f"smem {smem // 1024} KiB spills {spills}")
            if best is None or us < best["us"]:
                best = row
        if best:
            print(f"  best: {best['config']} {best['pct_cublas']:.1f}% of cuBLAS")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=_parse, default=DEFAULT_SHAPES)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tilecomm.bench.gemm times GPU kernels; torch sees no CUDA device")
    rows = run(args.shapes, getattr(torch, args.dtype))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
