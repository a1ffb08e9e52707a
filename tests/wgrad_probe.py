"""GPU diagnostic of the expert weight gradient (not a test: no assertions), one GPU:

    python3 tests/wgrad_probe.py [--once]          (bash tests/run_gpu.sh wgradprobe / wgradncu)

dw[e] = x[rows of e]^T @ dy[rows of e] for the DeepSeek-V3-like layer's two products (256 experts, ~128 rows
each: gate_up 7168 x 4096, down 2048 x 7168), the same products on one rank's share at EP = 4 (64 experts, ~512
rows each: "deepseek/4"), the pretraining layer's down product (64 experts, 1536 rows) and a Mixtral-like layer's
two (8 experts, ~2048 rows), bf16, random top-k
routing; --shapes picks some, --configs adds loop-form / GemmConfig variants beside the default. Each line:
tilecomm's weight-gradient kernel per variant, torch._grouped_mm on the same tensors, and what the GPU's memory
does with the same output bytes in the same run (`zero_` of dw: the write ceiling; `copy_` of dw: read + write),
so that the kernel's rate reads against the floor of its writes.
--once: one call of each (for ncu). --store-tiles: only the gradient's stores (no loads, no MMA), per tile shape,
tile order and programs per SM, beside `zero_` of the same bytes: the store ceiling of the kernel's output layout."""
import argparse
import dataclasses
import importlib

import torch
import triton
import triton.language as tl
import triton.testing

import tilecomm

grmod = importlib.import_module("tilecomm.overlap.grouped")
tiles = importlib.import_module("tilecomm.overlap.tiles")

SHAPES = {  # name: (experts, rows, K = x's columns, N = dy's columns)
    "deepseek gate_up dw": (256, 32768, 7168, 4096),
    "deepseek down dw": (256, 32768, 2048, 7168),
    "pretrain down dw": (64, 98304, 768, 1536),
    # one rank's share of the DeepSeek-like layer at EP = 4: 64 experts, ~512 rows each
    "deepseek/4 gate_up dw": (64, 32768, 7168, 4096),
    "deepseek/4 down dw": (64, 32768, 2048, 7168),
    # a Mixtral-like layer (8 experts, 4096, ffn 14336, 16384 rows: ~2048 rows each)
    "mixtral gate_up dw": (8, 16384, 4096, 28672),
    "mixtral down dw": (8, 16384, 14336, 4096),
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
                    "field=value: form=per_item/flat picks the kernel (default: grouped.py's choice), the rest "
                    "GemmConfig int fields over that form's config, e.g. 'form=per_item' or 'num_stages=4,EPILOGUE_SPLIT=2'")
    ap.add_argument("--store-tiles", action="store_true", help="the stores alone, per tile layout (see above)")
    ap.add_argument("--shapes", default="", help="','-separated substrings of the shape names to run (default: all)")
    args = ap.parse_args()
    variants = [None] + [variant(c) for c in args.configs.split(";") if c]
    for name, shape in SHAPES.items():
        if not args.shapes or any(part in name for part in args.shapes.split(",")):
            if args.store_tiles:
                store_probe(name, *shape)
            else:
                probe(name, *shape, variants, args.once)
            torch.cuda.empty_cache()


def variant(text):
    """(form: str or None, GemmConfig or None) from 'field=value,...' (see --configs)."""
    fields = dict(f.split("=") for f in text.split(","))
    form = fields.pop("form", None)
    fields = {k: int(v) for k, v in fields.items()}
    if not fields:
        return form, None
    return form, dataclasses.replace(grmod._WGRAD[form or "flat"], **fields)


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
        form, cfg = var or (None, None)
        try:
            got = grmod._wgrad(x, dy, offs, E, cfg, form)
            err = (got.float() - ref.float()).abs().max().item()
            got = None  # (15 GB at the DeepSeek-like shape: freed before the timing)
            t = triton.testing.do_bench(lambda: grmod._wgrad(x, dy, offs, E, cfg, form), warmup=5, rep=60) * 1e3
            print(f"  {(form + ' ' if form else '') + str(cfg or 'default'):70s} {t:9.1f} µs  {dw_bytes / t / 1e6:.2f} TB/s  "
                  f"torch/this {times['torch._grouped_mm'] / t:.3f}  max err {err:.3g}", flush=True)
        except Exception as exc:  # keep sweeping
            print(f"  {var}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)


@tilecomm.jit
def _store_tiles_kernel(dw_ptr, E, K, N, stride_e, stride_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BOXES: tl.constexpr, GROUP_M: tl.constexpr):
    """dw [E, K, N] bf16 written tile by tile as the weight-gradient kernel's epilogue writes it (items expert by
    expert, tile_position order, TMA stores of BOXES boxes of BLOCK_M x BLOCK_N / BOXES), with nothing else."""
    desc = tiles.desc3(dw_ptr, E, K, N, stride_e, stride_k, BLOCK_M, BLOCK_N // BOXES)
    tiles_m = tl.cdiv(K, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for item in range(tl.program_id(0), E * tiles_m * tiles_n, tl.num_programs(0)):
        e = item // (tiles_m * tiles_n)
        pid_m, pid_n = tiles.tile_position(item % (tiles_m * tiles_n), tiles_m, tiles_n, GROUP_M)
        for b in tl.static_range(BOXES):
            val = tl.full((1, BLOCK_M, BLOCK_N // BOXES), item + b, tl.float32)
            desc.store([e, pid_m * BLOCK_M, pid_n * BLOCK_N + b * (BLOCK_N // BOXES)], val.to(tl.bfloat16))


# (BLOCK_M, BLOCK_N, boxes, GROUP_M, warps, programs per SM): the wgrad default's layout first
STORE_LAYOUTS = [(128, 256, 1, 8, 8, 1), (128, 256, 1, 1, 8, 1), (128, 256, 2, 8, 8, 1), (128, 256, 1, 8, 8, 2),
                 (64, 512, 2, 8, 8, 1), (64, 512, 2, 1, 8, 1), (128, 128, 1, 8, 4, 2), (64, 256, 1, 8, 4, 4),
                 (256, 128, 1, 8, 8, 1)]


def store_probe(name, E, R, K, N):
    tiles.prepare_tma()
    dw = torch.empty((E, K, N), dtype=torch.bfloat16, device="cuda")
    dw_bytes = dw.numel() * 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    t0 = triton.testing.do_bench(lambda: dw.zero_(), warmup=5, rep=60) * 1e3
    print(f"{name} stores alone: dw {dw_bytes / 1e9:.2f} GB, zero_ {t0:.1f} µs ({dw_bytes / t0 / 1e6:.2f} TB/s)", flush=True)
    for bm, bn, boxes, group_m, warps, per_sm in STORE_LAYOUTS:
        items = E * triton.cdiv(K, bm) * triton.cdiv(N, bn)
        grid = (min(items, per_sm * sms),)

        def run(grid=grid, bm=bm, bn=bn, boxes=boxes, group_m=group_m, warps=warps):
            _store_tiles_kernel[grid](dw, E, K, N, dw.stride(0), dw.stride(1), BLOCK_M=bm, BLOCK_N=bn, BOXES=boxes,
                                      GROUP_M=group_m, num_warps=warps)
        try:
            run()
            t = triton.testing.do_bench(run, warmup=5, rep=60) * 1e3
            print(f"  {bm}x{bn} in {boxes} box(es), GROUP_M {group_m}, {warps} warps, {per_sm}/SM: {t:9.1f} µs  "
                  f"{dw_bytes / t / 1e6:.2f} TB/s  ({t0 / t:.2f} of zero_)", flush=True)
        except Exception as exc:  # keep sweeping
            print(f"  {bm}x{bn}/{boxes}/{group_m}/{warps}/{per_sm}: failed {type(exc).__name__}: {str(exc)[:200]}",
                  flush=True)


if __name__ == "__main__":
    main()
