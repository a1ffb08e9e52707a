"""`python -m tilecomm.bench moe_layer`: one MoE layer, forward + backward, with dispatcher="fused"
(tilecomm.overlap.fused_moe) beside dispatcher="tilecomm" (Dispatcher + torch._grouped_mm experts + combine),
on one GPU at world size 1 (bench/world1.py's method: the very kernels of a multi-GPU run, local memory in
place of NVLink). Layers, bf16:

    pretrain     4 x 4096 tokens, hidden 1536, 64 experts, top-6, ffn 768   (the pretraining preset's layer)
    deepseek_v3  4096 tokens, hidden 7168, 256 experts, top-8, ffn 2048

One layer object runs both (its dispatcher is swapped: the same weights, router and tokens). Each row,
from one run: µs per forward+backward call (N calls back to back, one synchronize: measure.per_call_us),
both paths, ratio = tilecomm / fused (the issue's bar: >= 1.25), expert TFLOP/s of the fused call
(6 * rows * hidden * ffn * 3 FLOPs: gate_up, down, forward and twice backward), host syncs of one forward
(measure.host_syncs; the Dispatcher's one is expected), and the largest relative difference of the output
and the gradients between the two paths (checked before timing: above 5e-2 aborts). On CPU the layers run
at toy sizes: a smoke test, not a measurement.
"""
from __future__ import annotations

import json
from typing import List, Optional

import torch

import tilecomm

from . import measure

PRESETS = {"pretrain": dict(tokens=4 * 4096, hidden=1536, experts=64, topk=6, ffn=768),
           "deepseek_v3": dict(tokens=4096, hidden=7168, experts=256, topk=8, ffn=2048)}
_CPU = {"toy": dict(tokens=48, hidden=64, experts=8, topk=2, ffn=32)}


def _heap_bytes(presets: dict, dtype: torch.dtype) -> int:
    from tilecomm.dispatch.buffers import normal_specs, symmetric_bytes
    from tilecomm.overlap.moe_fused import fused_moe_specs

    # one preset's buffers at a time (each row frees its own, also when it fails); the runtime gives a quarter of
    # the heap to the collectives' workspace (TILECOMM_WORKSPACE_BYTES), so the layers get three quarters
    need = max(symmetric_bytes(normal_specs(1, p["experts"], p["tokens"], p["topk"], p["hidden"], dtype)) +
               symmetric_bytes(fused_moe_specs(1, p["experts"], p["tokens"], p["topk"], p["hidden"], dtype))
               for p in presets.values())
    return -(-(need + (64 << 20)) * 4 // 3 // (2 << 20)) * (2 << 20)  # whole 2 MiB


def _step(layer, x, grad_out):
    """Forward + backward of the layer; parameter gradients reset first (no accumulation kernels)."""
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    y, _ = layer(x)
    y.backward(grad_out)
    return y


def _rel_diffs(names: List[str], a: List[torch.Tensor], b: List[torch.Tensor]) -> dict:
    """name -> |a - b| / |b| (Frobenius norms)."""
    return {n: float((u.float() - v.float()).norm() / v.float().norm().clamp_min(1e-30)) for n, u, v in zip(names, a, b)}


def _preset_row(name: str, p: dict, dtype: torch.dtype, iters: int, on_gpu: bool) -> dict:
    from tilecomm.moe.layer import MoEConfig, make_dispatcher

    c = MoEConfig(hidden=p["hidden"], ffn_hidden=p["ffn"], num_experts=p["experts"], topk=p["topk"], dtype=dtype,
                  max_tokens_per_rank=p["tokens"], seed=0, init_std=0.02)
    kinds = {}
    try:  # the symmetric buffers go back also when the row fails (the next preset needs the heap)
        for kind in ("tilecomm", "fused"):
            kinds[kind] = make_dispatcher(c, kind)
        return _measure_row(name, p, c, kinds, iters, on_gpu)
    finally:
        for d in kinds.values():
            d.free()


def _measure_row(name: str, p: dict, c, kinds: dict, iters: int, on_gpu: bool) -> dict:
    from tilecomm.moe.layer import MoELayer

    dev = tilecomm.current().device
    dtype = c.dtype
    layer = MoELayer(c, dispatcher=kinds["tilecomm"], device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(p["tokens"], p["hidden"], generator=gen, device=dev).to(dtype).requires_grad_()
    grad_out = torch.randn(p["tokens"], p["hidden"], generator=gen, device=dev).to(dtype)
    results, us, syncs = {}, {}, {}
    for kind, d in kinds.items():
        layer.dispatcher = d
        y = _step(layer, x, grad_out)
        results[kind] = [y.detach().clone(), x.grad.clone()] + [q.grad.clone() for q in layer.parameters()]
    names = ["out", "grad x"] + [f"grad {n}" for n, _ in layer.named_parameters()]
    diffs = _rel_diffs(names, results["fused"], results["tilecomm"])
    diff = max(diffs.values())
    if diff > 5e-2:
        raise AssertionError(f"moe_layer {name}: fused and tilecomm layers differ (relative {diff:.3g}; " +
                             ", ".join(f"{n} {v:.2e}" for n, v in diffs.items()) + ")")
    for kind, d in kinds.items():
        layer.dispatcher = d
        us[kind] = measure.per_call_us(lambda: _step(layer, x, grad_out), iters, min(3, iters), on_gpu=on_gpu)
        with torch.no_grad():
            syncs[kind] = measure.host_syncs(lambda: layer(x), on_gpu)
    rows = p["tokens"] * p["topk"]
    flops = 6 * rows * p["hidden"] * p["ffn"] * 3
    return dict(op=f"moe_layer {name}", fused_us=us["fused"], tilecomm_us=us["tilecomm"],
                ratio=us["tilecomm"] / us["fused"], fused_tflops=flops / us["fused"] / 1e6,
                fused_syncs=syncs["fused"], tilecomm_syncs=syncs["tilecomm"], max_rel_diff=diff, rel_diffs=diffs)


def run(backend: str, json_path: Optional[str], iters: int) -> List[dict]:
    on_gpu = backend == "cuda" or (backend == "auto" and torch.cuda.is_available())
    presets = PRESETS if on_gpu else _CPU
    dtype = torch.bfloat16 if on_gpu else torch.float32
    tilecomm.init(backend=backend, heap_bytes=_heap_bytes(presets, dtype))
    on_gpu = tilecomm.current().backend == "cuda"
    print(f"MoE layer forward+backward, world 1 on {torch.cuda.get_device_name() if on_gpu else 'CPU'}, {dtype}")
    print(f"{'layer':24s} {'fused µs':>10s} {'tilecomm µs':>12s} {'ratio':>6s} {'TFLOP/s':>8s} {'syncs f/t':>9s} "
          f"{'rel diff':>9s}")
    out = []
    for name, p in presets.items():
        try:
            row = _preset_row(name, p, dtype, iters, on_gpu)
        except Exception as err:  # keep the other rows
            print(f"moe_layer {name} failed: {type(err).__name__}: {err}", flush=True)
            out.append(dict(op=f"moe_layer {name}", error=f"{type(err).__name__}: {err}"))
            continue
        out.append(row)
        print(f"{row['op']:24s} {row['fused_us']:10.1f} {row['tilecomm_us']:12.1f} {row['ratio']:6.2f} "
              f"{row['fused_tflops']:8.1f} {row['fused_syncs']:4d}/{row['tilecomm_syncs']:<4d} "
              f"{row['max_rel_diff']:9.2e}", flush=True)
        print("    rel diff per tensor: " + ", ".join(f"{n} {v:.1e}" for n, v in row["rel_diffs"].items()), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    tilecomm.finalize()
    return out
