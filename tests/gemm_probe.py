"""GPU diagnostic of tilecomm's GEMM launches (not a test: no assertions), one GPU:

    torchrun --standalone --nproc-per-node 1 tests/gemm_probe.py      (bash tests/run_gpu.sh probe)

For each shape (M x K x N, bf16) and op (overlap.matmul, ag_gemm and gemm_rs at world size 1 with workspaces
made up front, grouped_mm forward) beside cuBLAS `a @ b` (torch._grouped_mm) on the same tensors, one line:

    host   µs per call of 20 calls back to back without waiting (the Python + launch cost)
    wall   µs per call of the same 20 calls plus one synchronize (what a caller sees)
    kernel µs of one call's CUDA kernels (torch.profiler, mean of 3 calls), with the kernels' names and their
           launch facts from the profiler trace (grid, registers, shared memory, blocks/SM, occupancy)
    bench  triton.testing.do_bench median (L2 flushed)
    first  µs of the first call (compiles), second: of the next one (should be near `wall`)

then every compiled variant of every GEMM kernel (registers, spilled registers = local bytes / 4, shared
memory, warps), the CachedLaunch entries per kernel (a count that grows with calls means an unstable key),
and a summary table. Cases run in order of importance within PROBE_BUDGET_S seconds (default 240; run_gpu.sh
gives the probe GEMM_PROBE_TIMEOUT, default 300); a case that fails prints its error and the rest go on.

Reading it: host should be a few tens of µs for every tilecomm op (Triton's own launch path: ~100+ µs, see the
"launch paths" line); host close to wall on a large GEMM means the call waits for the GPU (a host sync);
kernel far above cuBLAS's with a small grid or low occupancy in the launch facts means too few programs ran
at once; first >> second is compilation; second >> wall is a one-off cost after the first call.
"""
import importlib
import json
import math
import os
import tempfile
import time
import traceback

import torch
import triton
import triton.testing
from torch.profiler import ProfilerActivity, profile

import tilecomm
from tilecomm.jit import CachedLaunch
from tilecomm.overlap import AgGemmWorkspace, GemmRsWorkspace, ag_gemm, gemm_rs, grouped_mm, matmul

tiles = importlib.import_module("tilecomm.overlap.tiles")
agmod = importlib.import_module("tilecomm.overlap.ag_gemm")
rsmod = importlib.import_module("tilecomm.overlap.gemm_rs")
grmod = importlib.import_module("tilecomm.overlap.grouped")
team = importlib.import_module("tilecomm.overlap.team")

START, BUDGET = time.perf_counter(), float(os.environ.get("PROBE_BUDGET_S", "240"))
DT = torch.bfloat16
SUMMARY = []


def out(*parts):
    print(*parts, flush=True)


def host_wall(fn, n: int):
    """(host µs, wall µs) per call of n calls back to back."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def kernels(fn, calls: int = 3):
    """(total kernel µs per call, [(name, µs per call)], {name: launch facts}) from torch.profiler; the facts
    (grid, registers per thread, shared memory, blocks per SM, occupancy) come from its chrome trace."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    ev = [(e.key, e.device_time_total / calls) for e in p.key_averages() if e.device_time_total > 0]
    facts = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            p.export_chrome_trace(os.path.join(tmp, "trace.json"))
            with open(os.path.join(tmp, "trace.json")) as f:
                trace = json.load(f)
        for e in trace.get("traceEvents", []):
            a = e.get("args", {})
            if e.get("cat") == "kernel" and e.get("name") not in facts:
                facts[e.get("name")] = (f"grid {a.get('grid')} block {a.get('block')} "
                                        f"regs {a.get('registers per thread')} smem {a.get('shared memory')} "
                                        f"blocks/SM {a.get('blocks per SM')} "
                                        f"occupancy {a.get('est. achieved occupancy %')}%")
    except Exception as exc:  # noqa: BLE001 (the facts are extra)
        facts["?"] = f"(no trace facts: {type(exc).__name__})"
    return sum(t for _, t in ev), sorted(ev, key=lambda e: -e[1]), facts


def timed_once(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e6


def measure(label: str, fn, flops: float, ref=None) -> None:
    """One op on one shape: every figure of the module docstring, printed and added to the summary."""
    first = timed_once(fn)
    second = timed_once(fn)
    err = float("nan")
    if ref is not None:
        got = fn().float()
        err = ((got - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    n = 20 if second < 20000 else 3  # a pathological call (tens of ms) gets few repetitions
    host, wall = host_wall(fn, n)
    kern, names, facts = kernels(fn, 3 if second < 20000 else 1)
    bench = triton.testing.do_bench(fn, warmup=5, rep=30) * 1e3 if second < 20000 else float("nan")
    out(f"{label:<34} host {host:8.1f}  wall {wall:8.1f}  kernel {kern:8.1f}  bench {bench:8.1f}  "
        f"first {first:10.1f}  second {second:9.1f}  TFLOP/s(bench) {flops / bench / 1e6 if bench == bench else 0:5.0f}"
        f"  err {err:.1e}")
    out(f"{'':<34} kernels: " + ", ".join(f"{k[:48]} {t:.1f}" for k, t in names[:6]))
    for name, fact in list(facts.items())[:4]:
        out(f"{'':<38}{name[:40]}: {fact}")
    SUMMARY.append((label, host, wall, kern, bench))


def case(label: str, body, always: bool = False) -> None:
    """Run one case unless the time budget is spent; a failure prints its error and the probe goes on."""
    if not always and time.perf_counter() - START > BUDGET:
        out(f"{label}: skipped (PROBE_BUDGET_S={BUDGET:.0f} s spent)")
        return
    try:
        body()
    except Exception as exc:  # a diagnostic: report and continue
        out(f"{label}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        out("".join(traceback.format_exc().splitlines(True)[-6:]))
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 (a device fault: later cases will say so too)
        out(f"{label}: synchronize after the case failed: {type(exc).__name__}: {exc}")


def operands(M: int, K: int, N: int):
    g = torch.Generator(device="cuda").manual_seed(M + K + N)
    return (torch.randn(M, K, device="cuda", dtype=DT, generator=g),
            torch.randn(K, N, device="cuda", dtype=DT, generator=g) / math.sqrt(K))


def fused(op, make_workspace, label: str, a, b, flops: float, ref) -> None:
    """ag_gemm or gemm_rs (op) at world size 1 with a workspace made up front and freed after."""
    ws = make_workspace()
    try:
        measure(label, lambda: op(a, b, workspace=ws), flops, ref)
    finally:
        ws.free()


def gemm_shape(M: int, K: int, N: int) -> None:
    """cuBLAS and tilecomm's ops on one M x K x N product (ag_gemm / gemm_rs at world 1: the whole product)."""
    a, b = operands(M, K, N)
    ref = a @ b
    flops = 2.0 * M * N * K
    shape = f"{M}x{K}x{N}"
    case(f"cublas {shape}", lambda: measure(f"cublas   {shape}", lambda: a @ b, flops))
    case(f"matmul {shape}", lambda: measure(f"matmul   {shape}", lambda: matmul(a, b), flops, ref))
    case(f"gemm_rs {shape}", lambda: fused(gemm_rs, lambda: GemmRsWorkspace(N, DT, M), f"gemm_rs  {shape}", a, b,
                                           flops, ref))
    case(f"ag_gemm {shape}", lambda: fused(ag_gemm, lambda: AgGemmWorkspace(K, DT, M), f"ag_gemm  {shape}", a, b,
                                           flops, ref))


def launch_paths() -> None:
    """matmul 1000^3 host time through CachedLaunch (default) and through Triton's ordinary launch."""
    a, b = operands(1000, 1000, 1000)
    matmul(a, b)
    on = host_wall(lambda: matmul(a, b), 50)
    CachedLaunch.enabled = False
    try:
        off = host_wall(lambda: matmul(a, b), 50)
    finally:
        CachedLaunch.enabled = True
    e = torch.empty(1000, 1000, device="cuda", dtype=DT)
    floor = host_wall(lambda: torch.empty(1000, 1000, device="cuda", dtype=DT).copy_(e), 50)
    out(f"matmul 1000^3 host/wall µs per call: CachedLaunch {on[0]:.1f}/{on[1]:.1f}, Triton's launch path "
        f"{off[0]:.1f}/{off[1]:.1f}; floor (torch.empty + copy_) {floor[0]:.1f}/{floor[1]:.1f}")


def grouped() -> None:
    """grouped_mm forward (check_offs=False: no host sync) on the 64-expert layer's gate_up, vs torch."""
    E, H, F, R = 64, 1536, 768, 32768
    offs = torch.bincount(torch.randint(E, (R,)), minlength=E).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(R, H, device="cuda", dtype=DT)
    w = torch.randn(E, H, 2 * F, device="cuda", dtype=DT) / math.sqrt(H)
    flops = 2.0 * R * H * 2 * F
    shape = f"{E}x{H}x{2 * F} R={R}"
    ref = torch._grouped_mm(x, w, offs=offs)
    case("torch grouped", lambda: measure(f"torch._grouped_mm {shape}", lambda: torch._grouped_mm(x, w, offs=offs),
                                          flops))
    case("grouped_mm", lambda: measure(f"grouped_mm {shape}", lambda: grouped_mm(x, w, offs, check_offs=False),
                                       flops, ref))


def variants() -> None:
    """Every compiled variant of the GEMM kernels: registers, spills, shared memory."""
    out("compiled variants (spills = local memory bytes / 4, incl. any callee stack; want 0 for the GEMMs):")
    for mod, name in ((tiles, "_matmul_kernel"), (agmod, "_gemm_kernel"), (agmod, "_push_kernel"),
                      (rsmod, "_gemm_rs_kernel"), (team, "_release_kernel"), (grmod, "_rows_kernel"),
                      (grmod, "_wgrad_kernel")):
        fn = getattr(mod, name)
        for dev, cache in fn.device_caches.items():
            for ck in list(cache[0].values()):
                try:
                    ck._init_handles()
                    src = getattr(ck, "src", None)
                    consts = {fn.arg_names[k[0]]: v for k, v in getattr(src, "constants", {}).items()
                              if k and fn.arg_names[k[0]].isupper()}
                    out(f"  {name:<16} regs {ck.n_regs:3d} spills {ck.n_spills:4d} smem {ck.metadata.shared:6d} "
                        f"warps {ck.metadata.num_warps} stages {ck.metadata.num_stages} {consts}")
                except Exception as exc:  # noqa: BLE001
                    out(f"  {name}: (could not read: {type(exc).__name__}: {exc})")
    for mod, name in ((tiles, "_MATMUL"), (agmod, "_GEMM"), (agmod, "_PUSH"), (rsmod, "_GEMM_RS"), (team, "_RELEASE"),
                      (grmod, "_ROWS"), (grmod, "_WGRAD_LAUNCH")):
        launcher = getattr(mod, name, None)
        if launcher is not None:
            out(f"  CachedLaunch {name}: {len(launcher.kernels)} entries")


def main() -> None:
    out(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    a, b = operands(1000, 1000, 1000)
    case("matmul 1000^3 pre-init", lambda: measure("matmul   1000^3 before init", lambda: matmul(a, b), 2e9))
    case("tilecomm.init", lambda: tilecomm.init(backend="cuda", heap_bytes=3 << 30), always=True)
    out(f"GPU memory free/total {torch.cuda.mem_get_info()}")
    case("launch paths", launch_paths)
    gemm_shape(1000, 1000, 1000)
    gemm_shape(8192, 4096, 3584)
    gemm_shape(8192, 8192, 7168)
    gemm_shape(8000, 4000, 3500)  # not multiples of the block; N = 3500: unaligned rows (padded copy of b)
    case("grouped", grouped)
    case("variants", variants, always=True)
    out("\nsummary (µs per call; kernel = GPU time of the call's kernels, host = Python + launch; x base = this "
        "figure / the same shape's cuBLAS or torch._grouped_mm figure, below 1 is faster):")
    out(f"{'case':<40} {'host':>8} {'wall':>8} {'kernel':>8} {'bench':>8} {'wall x base':>11} {'kernel x base':>13}")
    base = {label.split(None, 1)[1]: (wall, kern) for label, _, wall, kern, _ in SUMMARY
            if label.startswith(("cublas", "torch"))}
    for label, host, wall, kern, bench in SUMMARY:
        b = base.get(label.split(None, 1)[1], (math.nan, math.nan))
        out(f"{label:<40} {host:8.1f} {wall:8.1f} {kern:8.1f} {bench:8.1f} {wall / b[0]:11.2f} {kern / b[1]:13.2f}")
    out(f"probe took {time.perf_counter() - START:.0f} s")


if __name__ == "__main__":
    main()
