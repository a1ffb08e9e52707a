"""Where the time of one MoE layer's forward + backward goes, fused beside unfused (a diagnostic, not a test).

    python3 tests/fused_moe_profile.py [--presets pretrain,deepseek_v3] [--variants pretrain] [--fused-only]
    torchrun --nproc-per-node 4 tests/fused_moe_profile.py ...     # world 4: expert parallelism over the ranks

bf16, the layers of comm/bench/moe_layer.py, at world 1 (one GPU) or at the torchrun world (one rank per GPU, each
rank its own tokens; rank 0 prints its own times and kernels; a failure at world > 1 stops the run, since a
rank alone cannot skip a collective). For each layer and each path (dispatcher
"tilecomm": Dispatcher + torch._grouped_mm experts + combine; "fused": tilecomm.overlap.fused_moe): µs per
call (measure.per_call_us), host syncs of one forward + backward, and torch.profiler's GPU kernels of one
call by name (count, µs; summed over --steps profiled calls, divided by their number). For the layers named by --variants
also the fused path under other FusedMoEConfig launches (its kernels' µs each). Full tables go to --out
(profile.txt, profile.json); a summary is printed last.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

import tilecomm
from tilecomm.bench import measure
from tilecomm.bench.moe_layer import PRESETS, _init, _step, rel_diff
from tilecomm.moe.layer import MoEConfig, MoELayer, make_dispatcher
from tilecomm.overlap import FusedMoEWorkspace
from tilecomm.overlap.moe_config import WIDE_LAYER, FusedGemm, FusedMoEConfig
from tilecomm.overlap.tiles import GemmConfig

LOG = []
OUT_FILE = None
GAPS = False  # --gaps: also idle_gaps() of every path


def say(line: str = "") -> None:
    if tilecomm.rank():
        return
    print(line, flush=True)
    LOG.append(line)
    if OUT_FILE:
        with open(OUT_FILE, "a") as f:
            f.write(line + "\n")


def kernels(fn, steps: int):
    """{kernel name: [count per call, µs per call]} and the summed GPU µs per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    table = collections.defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = table[e.name[:90]]
            row[0] += 1 / steps
            row[1] += e.device_time_total / steps
    return dict(table), sum(v[1] for v in table.values())


def idle_gaps(fn, label: str, top: int = 6):
    """Where the GPU waits during one call (the second of two profiled back to back): its longest gaps between
    kernels, each with the kernels on either side and the host calls that overlap it most (torch.profiler, CPU
    and CUDA activities; the trace goes to OUT/trace_<label>.json)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
    if OUT_FILE and tilecomm.rank() == 0:
        prof.export_chrome_trace(os.path.join(os.path.dirname(OUT_FILE), f"trace_{label}.json"))
    events = prof.events()
    gpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    half = gpu[len(gpu) // 2:]  # the second call's kernels, about
    found = []
    for a, b in zip(half, half[1:]):
        gap = b.time_range.start - a.time_range.end
        if gap > 0:
            found.append((gap, a, b))
    found.sort(key=lambda g: -g[0])
    total = sum(g for g, _, _ in found)
    say(f"  GPU idle in the second call: {total:.0f} µs over {len(found)} gaps; the longest:")
    for gap, a, b in found[:top]:
        lo, hi = a.time_range.end, b.time_range.start
        overlap = collections.Counter()
        for e in cpu:
            o = min(hi, e.time_range.end) - max(lo, e.time_range.start)
            if o > 0:
                overlap[e.name[:48]] += o
        busy = ", ".join(f"{n} {o:.0f}" for n, o in overlap.most_common(4))
        say(f"    {gap:8.1f} µs after {a.name[:36]} before {b.name[:36]} | host: {busy}")
    return total


def syncs(fn) -> int:
    return measure.host_syncs(fn, True)


def results(layer, x, grad_out, to_host: bool):
    """Output and every gradient of one forward + backward (compared across paths; to_host: copies in host
    memory, since a DeepSeek-like layer's gradients alone take 22.5 GB)."""
    y = _step(layer, x, grad_out)
    out = [y.detach(), x.grad] + [q.grad for q in layer.parameters()]
    return [t.to("cpu") if to_host else t for t in out]


def profile_path(name, kind, layer, x, grad_out, steps, iters, reference=None):
    """Profile one path; with reference (the unfused path's results()) first say how far this one is from it."""
    step = lambda: _step(layer, x, grad_out)  # noqa: E731
    diff = None
    if reference is not None:
        names = ["out", "grad x"] + [f"grad {n}" for n, _ in layer.named_parameters()]
        diffs = {n: rel_diff(a, b) for n, a, b in zip(names, results(layer, x, grad_out, False), reference)}
        diff = max(diffs.values())
        say(f"{name} / {kind}: max relative difference from the unfused path {diff:.2e} (" +
            ", ".join(f"{n} {v:.1e}" for n, v in diffs.items()) + ")")
    us = measure.per_call_us(step, iters, 3, on_gpu=True)
    table, gpu = kernels(step, steps)
    n_sync = syncs(step)
    say(f"\n== {name} / {kind}: {us:.1f} µs per call (wall), GPU busy {gpu:.1f} µs, "
        f"{sum(v[0] for v in table.values()):.0f} kernels, {n_sync} host syncs")
    for k, (count, t) in sorted(table.items(), key=lambda kv: -kv[1][1]):
        say(f"  {t:9.1f} µs {count:5.1f}x  {k}")
    idle = idle_gaps(step, f"{name}_{kind}".replace(":", "_").replace(" ", "_").replace(",", "")) if GAPS else None
    return dict(us=us, gpu_us=gpu, syncs=n_sync, kernels=table, max_rel_diff=diff, idle_us=idle)


_G = lambda m, n, warps, stages: GemmConfig(m, n, 64, 8, warps, stages, 1, False)  # noqa: E731
VARIANTS = {  # None: the workspace's own choice (FusedMoEConfig.for_device); then changes to try (their kernels
    # build for sm_90 in tests/gpu_compile.py)
    "default": None,
    "whole-row items": FusedMoEConfig(),
    "split-column items": WIDE_LAYER,
    "split, 128-row gate_up": replace(WIDE_LAYER, gate_up=FusedGemm(_G(128, 128, 8, 3), item_cols=128)),
    "split, wgrad pointer stores": replace(WIDE_LAYER, wgrad=GemmConfig(128, 256, 64, 8, 8, 3, 1, False,
                                                                        POINTER_STORES=True)),
    "split, scatter 4 stages": replace(WIDE_LAYER, scatter=FusedGemm(_G(128, 256, 8, 4), item_cols=256)),
    # sm_90 build with Triton 3.6 (the device's): 4 warps, 242 registers, 98 KB of shared memory: two programs fit
    # an SM (8 warps take 142 registers: two would not), so one's epilogue (its rows stored to their sources) and
    # pipeline fill can run beside the other's main loop
    "split, scatter 128x128 2 per SM": replace(WIDE_LAYER, scatter=FusedGemm(_G(128, 128, 4, 3), 2, item_cols=128)),
    "split, gate_up gather 1 per SM": replace(WIDE_LAYER, gate_up=replace(WIDE_LAYER.gate_up, gather_per_sm=0)),
    "split, gate_up 2 per SM 4 warps": replace(WIDE_LAYER, gate_up=FusedGemm(_G(64, 128, 4, 3), 2, copy_cols=128,
                                                                          item_cols=128)),
}


def run_preset(name, p, args, report):
    dev = tilecomm.current().device
    c = MoEConfig(hidden=p["hidden"], ffn_hidden=p["ffn"], num_experts=p["experts"], topk=p["topk"],
                  dtype=torch.bfloat16, max_tokens_per_rank=p["tokens"], seed=0, init_std=0.02)
    gen = torch.Generator(device=dev).manual_seed(tilecomm.rank())
    x = torch.randn(p["tokens"], p["hidden"], generator=gen, device=dev).to(c.dtype).requires_grad_()
    grad_out = torch.randn(p["tokens"], p["hidden"], generator=gen, device=dev).to(c.dtype)
    d = make_dispatcher(c, "tilecomm")
    layer = MoELayer(c, dispatcher=d, device=dev)
    rows, reference = {}, None
    try:
        reference = results(layer, x, grad_out, True)
        if not args.fused_only:
            rows["tilecomm"] = profile_path(name, "tilecomm", layer, x, grad_out, args.steps, args.iters)
    finally:
        d.free()
    wanted = args.variants.split(",")
    variants = {k: VARIANTS[k] for k in (args.only.split(";") if args.only else VARIANTS)} if name in wanted else \
        {"default": None}
    for vname, cfg in variants.items():
        ws = None
        try:
            ws = FusedMoEWorkspace(c.num_experts, c.hidden, c.ffn_hidden, c.max_tokens_per_rank, c.topk, c.dtype,
                                   config=cfg)
            layer.dispatcher = ws
            rows[f"fused:{vname}"] = profile_path(name, f"fused:{vname}", layer, x, grad_out, args.steps, args.iters,
                                                  reference)
        except Exception as err:  # keep the other variants (world 1: a rank alone cannot skip a collective)
            if tilecomm.world_size() > 1:
                raise
            say(f"{name} fused:{vname} failed: {type(err).__name__}: {str(err)[:300]}")
        finally:
            if ws is not None:
                ws.free()
    report[name] = rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="pretrain,deepseek_v3")
    ap.add_argument("--variants", default="", help="comma-separated layers that also run the fused config variants")
    ap.add_argument("--only", default="", help="\";\"-separated variant names (default: all of VARIANTS)")
    ap.add_argument("--fused-only", action="store_true", help="skip the unfused path")
    ap.add_argument("--gaps", action="store_true", help="where the GPU waits in one call (host calls, trace)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    global OUT_FILE, GAPS
    OUT_FILE = os.path.join(args.out, "profile.txt")
    GAPS = args.gaps
    presets = {k: PRESETS[k] for k in args.presets.split(",")}
    _init("cuda", presets, torch.bfloat16)
    say(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, world {tilecomm.world_size()}")
    report = {}
    t0 = time.time()
    for name, p in presets.items():
        try:
            run_preset(name, p, args, report)
        except Exception as err:
            if tilecomm.world_size() > 1:
                raise
            say(f"{name} failed: {type(err).__name__}: {str(err)[:300]}")
        torch.cuda.empty_cache()
    if tilecomm.rank() == 0:
        with open(os.path.join(args.out, "profile.json"), "w") as f:
            json.dump(report, f, indent=1)
    say(f"\nsummary ({time.time() - t0:.0f} s)")
    for name, rows in report.items():
        for kind, r in rows.items():
            top = sorted(r["kernels"].items(), key=lambda kv: -kv[1][1])[:6]
            vs = f" {rows['tilecomm']['us'] / r['us']:5.2f}x" if "tilecomm" in rows and kind != "tilecomm" else "      "
            err = f" diff {r['max_rel_diff']:.1e}" if r.get("max_rel_diff") is not None else ""
            say(f"{name:12s} {kind:22s} {r['us']:9.1f} µs wall{vs}{err} {r['gpu_us']:9.1f} GPU {r['syncs']:3d} syncs | " +
                  "; ".join(f"{k[:28]} {v[1]:.0f}" for k, v in top))
    tilecomm.finalize()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
