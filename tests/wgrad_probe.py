"""GPU diagnostic of the expert weight gradient (not a test: no assertions), one GPU:

    python3 tests/wgrad_probe.py [--once]          (bash tests/run_gpu.sh wgradprobe / wgradncu)

dw[e] = x[rows of e]^T @ dy[rows of e] for the DeepSeek-V3-like layer's two products (256 experts, ~128 rows
each: gate_up 7168 x 4096, down 2048 x 7168), the same products on one rank's share at EP = 4 (64 experts, ~512
rows each: "deepseek/4") and the pretraining layer's down product (64 experts, 1536 rows), bf16, random top-k
routing; --shapes picks some, --configs adds loop-form / GemmConfig variants beside the default. Each line:
tilecomm's weight-gradient kernel per variant, torch._grouped_mm on the same tensors, and what the GPU's memory
does with the same output bytes in the same run (`zero_` of dw: the write ceiling; `copy_` of dw: read + write),
so that the kernel's rate reads against the floor of its writes.
--once: one call of each (for ncu)."""
import argparse
import dataclasses
import importlib

import torch
import triton.testing

grmod = importlib.import_module("tilecomm.overlap.grouped")

SHAPES = {  # name: (experts, rows, K = x's columns, N = dy's columns)
    "deepseek gate_up dw": (256, 32768, 7168, 4096),
    "deepseek down dw": (256, 32768, 2048, 7168),
    "pretrain down dw": (64, 98304, 768, 1536),
    # one rank's share of the DeepSeek-like layer at EP = 4: 64 experts, ~512 rows each
    "deepseek/4 gate_up dw": (64, 32768, 7168, 4096),
    "deepseek/4 down dw": (64, 32768, 2048, 7168),
}


def operands(E, R, K, N, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    counts = torch.bincount(torch.randint(0, E, (R,), device="cuda", generator=gen), minlength=E)
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(R, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    dy = torch.randn(R, N, device="cuda", generator=gen, dtype=torch.bfloat16)
    return x, dy, offs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--once", action="store_true")
    ap.add_argument("--configs", default="", help="';'-separated variants beside the default, each comma-separated "
                    "field=int: flat=0/1 picks the loop form (default: grouped.py's choice), the rest GemmConfig "
                    "fields over that form's config, e.g. 'flat=0' or 'num_stages=4,EPILOGUE_SPLIT=2'")
    ap.add_argument("--shapes", default="", help="','-separated substrings of the shape names to run (default: all)")
    args = ap.parse_args()
    variants = [None] + [variant(c) for c in args.configs.split(";") if c]
    for name, shape in SHAPES.items():
        if not args.shapes or any(part in name for part in args.shapes.split(",")):
            probe(name, *shape, variants, args.once)
            torch.cuda.empty_cache()


def variant(text):
    """(flat: bool or None, GemmConfig or None) from 'field=int,...' (see --configs)."""
    fields = {k: int(v) for k, v in (f.split("=") for f in text.split(","))}
    flat = bool(fields.pop("flat")) if "flat" in fields else None
    if not fields:
        return flat, None
    return flat, dataclasses.replace(grmod._WGRAD["per_item" if flat is False else "flat"], **fields)


def probe(name, E, R, K, N, variants, once):
    x, dy, offs = operands(E, R, K, N)
    ref = torch._grouped_mm(x.t(), dy, offs=offs)
    dw_bytes = E * K * N * 2
    if once:
        grmod._wgrad(x, dy, offs, E, None)
        torch._grouped_mm(x.t(), dy, offs=offs)
        torch.cuda.synchronize()
        return
    scratch = torch.empty_like(ref)
    base = {"torch._grouped_mm": lambda: torch._grouped_mm(x.t(), dy, offs=offs),
            "zero_ of dw": lambda: scratch.zero_(), "copy_ of dw": lambda: scratch.copy_(ref)}
    times = {k: triton.testing.do_bench(f, warmup=5, rep=60) * 1e3 for k, f in base.items()}
    print(f"{name}: E={E} rows={R} K={K} N={N}, dw {dw_bytes / 1e9:.2f} GB; " + ", ".join(
        f"{k} {t:.1f} µs ({dw_bytes / t / 1e6:.2f} TB/s of dw)" for k, t in times.items()), flush=True)
    for var in variants:
        flat, cfg = var or (None, None)
        try:
            got = grmod._wgrad(x, dy, offs, E, cfg, flat)
            err = (got.float() - ref.float()).abs().max().item()
            got = None  # (15 GB at the DeepSeek-like shape: freed before the timing)
            t = triton.testing.do_bench(lambda: grmod._wgrad(x, dy, offs, E, cfg, flat), warmup=5, rep=60) * 1e3
            form = {None: "", True: "flat ", False: "per item "}[flat]
            print(f"  {form + str(cfg or 'default'):70s} {t:9.1f} µs  {dw_bytes / t / 1e6:.2f} TB/s  "
                  f"torch/this {times['torch._grouped_mm'] / t:.3f}  max err {err:.3g}", flush=True)
        except Exception as exc:  # keep sweeping
            print(f"  {var}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)


if __name__ == "__main__":
    main()
