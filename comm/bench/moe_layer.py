"""`python -m tilecomm.bench moe_layer`: one MoE layer, forward + backward, with dispatcher="fused"
(tilecomm.overlap.fused_moe) beside dispatcher="tilecomm" (Dispatcher + torch._grouped_mm experts + combine),
on one GPU at world size 1 (bench/world1.py's method: the very kernels of a multi-GPU run, local memory in
place of NVLink), or under torchrun on W ranks (expert parallelism over all of them), where the NCCL path
(dispatcher="nccl": torch ops + torch.distributed all_to_all) runs beside both. Layers, bf16, per rank:

    pretrain     4 x 4096 tokens, hidden 1536, 64 experts, top-6, ffn 768   (the pretraining preset's layer)
    deepseek_v3  4096 tokens, hidden 7168, 256 experts, top-8, ffn 2048

    python -m tilecomm.bench moe_layer                                   # world 1, this GPU
    torchrun --nproc-per-node 4 -m tilecomm.bench moe_layer              # EP = 4

One layer object runs every path (its dispatcher is swapped: the same weights, router and tokens); "torch gemm"
is the tilecomm path with the experts on torch._grouped_mm (experts impl="grouped") instead of what impl="auto"
runs (on Hopper GPUs in bf16: tilecomm.overlap.grouped_mm; the column is the measurement behind that choice,
moe/experts.py). Each row,
from one run: µs per forward+backward call (N calls back to back, one synchronize: measure.per_call_us; on W
ranks the max over ranks), every path, ratio = tilecomm / fused (the issue's bar: >= 1.25), expert TFLOP/s of
the fused call (6 * rows * hidden * ffn * 3 FLOPs: gate_up, down, forward and twice backward), host syncs of
one forward (measure.host_syncs; the Dispatcher's one is expected), and the largest relative difference of the
output and the gradients of each path from the tilecomm path's (checked before timing: above 5e-2 aborts).
On CPU the layers run at toy sizes: a smoke test, not a measurement.
"""
from __future__ import annotations

import json
from typing import List, Optional

import torch

import tilecomm

from . import measure

PRESETS = {"pretrain": dict(tokens=4 * 4096, hidden=1536, experts=64, topk=6, ffn=768),
           "deepseek_v3": dict(tokens=4096, hidden=7168, experts=256, topk=8, ffn=2048)}
_CPU = {"toy": dict(tokens=48, hidden=64, experts=12, topk=2, ffn=32)}  # 12 experts: 1, 2, 3 or 4 ranks


def _heap_bytes(presets: dict, dtype: torch.dtype, world: int) -> int:
    from tilecomm.dispatch.buffers import normal_specs, symmetric_bytes
    from tilecomm.overlap.moe_fused import fused_moe_specs

    # one preset's buffers at a time (each row frees its own, also when it fails)
    need = max(symmetric_bytes(normal_specs(world, p["experts"], p["tokens"], p["topk"], p["hidden"], dtype)) +
               symmetric_bytes(fused_moe_specs(world, p["experts"], p["tokens"], p["topk"], p["hidden"], dtype))
               for p in presets.values())
    return tilecomm.heap_bytes_for(need)


def _step(layer, x, grad_out):
    """Forward + backward of the layer; parameter gradients reset first (no accumulation kernels)."""
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    y, _ = layer(x)
    y.backward(grad_out)
    return y


def rel_diff(a: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 26) -> float:
    """|a - ref| / |ref| (Frobenius), in float32 chunks on a's device (ref may be in host memory): a
    DeepSeek-like layer's w_gate_up gradient is 7.5G elements, 28 GiB as one float32 copy (the bench ran out of
    memory on an H200 there, 2026-11-27)."""
    a, ref = a.reshape(-1), ref.reshape(-1)
    diff = norm = 0.0
    for i in range(0, ref.numel(), chunk):
        r = ref[i:i + chunk].to(a.device).float()
        diff += (a[i:i + chunk].float() - r).square().sum().item()
        norm += r.square().sum().item()
    return (diff / max(norm, 1e-60)) ** 0.5


def _rel_diffs(names: List[str], a: List[torch.Tensor], b: List[torch.Tensor]) -> dict:
    """name -> |a - b| / |b| (Frobenius norms)."""
    return {n: rel_diff(u, v) for n, u, v in zip(names, a, b)}


def _preset_row(name: str, p: dict, dtype: torch.dtype, iters: int, on_gpu: bool) -> dict:
    from tilecomm.moe.layer import MoEConfig, make_dispatcher

    c = MoEConfig(hidden=p["hidden"], ffn_hidden=p["ffn"], num_experts=p["experts"], topk=p["topk"], dtype=dtype,
                  max_tokens_per_rank=p["tokens"], seed=0, init_std=0.02)
    kinds = {}
    try:  # the symmetric buffers go back also when the row fails (the next preset needs the heap)
        for kind in ("tilecomm", "fused") + (("nccl",) if tilecomm.world_size() > 1 else ()):
            kinds[kind] = make_dispatcher(c, kind)
        return _measure_row(name, p, c, kinds, iters, on_gpu)
    finally:
        for d in kinds.values():
            if hasattr(d, "free"):
                d.free()


# path -> (the dispatcher it takes from _preset_row's, the experts' impl)
_PATHS = {"tilecomm": ("tilecomm", "auto"), "fused": ("fused", "auto"), "nccl": ("nccl", "auto"),
          "torch_gemm": ("tilecomm", "grouped")}


def _use_path(layer, kinds: dict, path: str) -> None:
    kind, impl = _PATHS[path]
    layer.dispatcher, layer.experts.impl = kinds[kind], impl


def _measure_row(name: str, p: dict, c, kinds: dict, iters: int, on_gpu: bool) -> dict:
    from tilecomm.moe.layer import MoELayer

    dev = tilecomm.current().device
    dtype = c.dtype
    layer = MoELayer(c, dispatcher=kinds["tilecomm"], device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(p["tokens"], p["hidden"], generator=gen, device=dev).to(dtype).requires_grad_()
    grad_out = torch.randn(p["tokens"], p["hidden"], generator=gen, device=dev).to(dtype)
    paths = [path for path, (kind, _) in _PATHS.items() if kind in kinds]
    results, us, syncs = {}, {}, {}
    for path in paths:
        _use_path(layer, kinds, path)
        y = _step(layer, x, grad_out)
        results[path] = [y.detach().clone(), x.grad.clone()] + [q.grad.clone() for q in layer.parameters()]
    names = ["out", "grad x"] + [f"grad {n}" for n, _ in layer.named_parameters()]
    diffs = {}  # {name: largest over ranks and the other paths of |path - tilecomm| / |tilecomm|}
    for path in paths:
        if path != "tilecomm":
            for n, v in _rel_diffs(names, results[path], results["tilecomm"]).items():
                diffs[n] = max(diffs.get(n, 0.0), _max_over_ranks(v))
    diff = max(diffs.values())
    if diff > 5e-2:
        raise AssertionError(f"moe_layer {name}: the paths differ from the tilecomm path (relative {diff:.3g}; " +
                             ", ".join(f"{n} {v:.2e}" for n, v in diffs.items()) + ")")
    for path in paths:
        _use_path(layer, kinds, path)
        _barrier(on_gpu)
        us[path] = _max_over_ranks(measure.per_call_us(lambda: _step(layer, x, grad_out), iters, min(3, iters),
                                                       on_gpu=on_gpu))
        with torch.no_grad():
            syncs[path] = measure.host_syncs(lambda: layer(x), on_gpu)
    rows = p["tokens"] * p["topk"]
    flops = 6 * rows * p["hidden"] * p["ffn"] * 3
    return dict(op=f"moe_layer {name}", world=tilecomm.world_size(), fused_us=us["fused"], tilecomm_us=us["tilecomm"],
                nccl_us=us.get("nccl"), torch_gemm_us=us["torch_gemm"], ratio=us["tilecomm"] / us["fused"],
                fused_tflops=flops / us["fused"] / 1e6,
                fused_syncs=syncs["fused"], tilecomm_syncs=syncs["tilecomm"], max_rel_diff=diff, rel_diffs=diffs)


def _max_over_ranks(value: float) -> float:
    import torch.distributed as dist

    if tilecomm.world_size() == 1:
        return value
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, value)
    return max(got)


def _barrier(on_gpu: bool) -> None:
    """Every rank's queued work done and every rank here (the timings start together)."""
    if on_gpu:
        torch.cuda.synchronize()
    if tilecomm.world_size() > 1:
        tilecomm.barrier()


def _init(backend: str, presets: dict, dtype: torch.dtype) -> None:
    """tilecomm (and under torchrun torch.distributed: NCCL on GPUs, gloo on CPU) with a heap for the layers."""
    import os

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1
    if world > 1:
        on_gpu = backend == "cuda" or (backend == "auto" and torch.cuda.is_available())
        if on_gpu:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        else:
            dist.init_process_group("gloo")
    tilecomm.init(backend=backend, heap_bytes=_heap_bytes(presets, dtype, world))


def run(backend: str, json_path: Optional[str], iters: int, layers: Optional[List[str]] = None) -> List[dict]:
    """layers: names of PRESETS to run (default all; on CPU ranks the toy layers always)."""
    import torch.distributed as dist

    on_gpu = backend == "cuda" or (backend == "auto" and torch.cuda.is_available())
    presets = {n: p for n, p in PRESETS.items() if layers is None or n in layers} if on_gpu else _CPU
    dtype = torch.bfloat16 if on_gpu else torch.float32
    _init(backend, presets, dtype)
    on_gpu, world = tilecomm.current().backend == "cuda", tilecomm.world_size()
    say = print if tilecomm.rank() == 0 else (lambda *a, **k: None)
    say(f"MoE layer forward+backward, world {world} (expert parallelism over every rank) on "
        f"{torch.cuda.get_device_name() if on_gpu else 'CPU'}, {dtype}; µs: max over ranks")
    say(f"{'layer':24s} {'fused µs':>10s} {'tilecomm µs':>12s} {'nccl µs':>10s} {'ratio':>6s} {'TFLOP/s':>8s} "
        f"{'syncs f/t':>9s} {'rel diff':>9s} {'torch gemm µs':>14s}")
    out = []
    for name, p in presets.items():
        try:
            row = _preset_row(name, p, dtype, iters, on_gpu)
        except Exception as err:  # keep the other rows (world 1 only: a rank alone cannot skip a collective)
            if world > 1:
                raise
            say(f"moe_layer {name} failed: {type(err).__name__}: {err}", flush=True)
            out.append(dict(op=f"moe_layer {name}", error=f"{type(err).__name__}: {err}"))
            continue
        out.append(row)
        nccl = "n/a" if row["nccl_us"] is None else f"{row['nccl_us']:.1f}"
        say(f"{row['op']:24s} {row['fused_us']:10.1f} {row['tilecomm_us']:12.1f} {nccl:>10s} {row['ratio']:6.2f} "
            f"{row['fused_tflops']:8.1f} {row['fused_syncs']:4d}/{row['tilecomm_syncs']:<4d} "
            f"{row['max_rel_diff']:9.2e} {row['torch_gemm_us']:14.1f}", flush=True)
        say("    rel diff per tensor: " + ", ".join(f"{n} {v:.1e}" for n, v in row["rel_diffs"].items()), flush=True)
    if json_path and tilecomm.rank() == 0:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    tilecomm.finalize()
    if dist.is_initialized():
        dist.destroy_process_group()
    return out
