"""Diagnostics for the slow cases of the first GPU run (BENCHMARKS.md, GEMM section), one GPU:

    torchrun --standalone --nproc-per-node 1 tests/gemm_probe.py

matmul 1000^3 before/after tilecomm.init, then matmul / gemm_rs / ag_gemm at 8192x4096x3584 and
8192x8192x7168: wall time per call, the CUDA kernels of one call (torch.profiler), compiled variants,
do_bench, registers/spills. Not a test (no assertions)."""
import time, torch, triton, triton.testing
import tilecomm
from tilecomm.overlap import AgGemmWorkspace, GemmRsWorkspace, ag_gemm, gemm_rs, matmul
from tilecomm.overlap import gemm_rs as _  # noqa
import importlib
rsmod = importlib.import_module("tilecomm.overlap.gemm_rs")
agmod = importlib.import_module("tilecomm.overlap.ag_gemm")
from torch.profiler import profile, ProfilerActivity

def prof(label, fn):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        fn(); torch.cuda.synchronize()
    ev = [(e.key, e.device_time_total) for e in p.key_averages() if e.device_time_total > 0]
    print(label, "kernels:", [(n[:40], round(t, 1)) for n, t in ev][:8], flush=True)

def wall(label, fn, n=5):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize()
    print(label, "wall us/call", round((time.perf_counter() - t) / n * 1e6, 1), flush=True)

a = torch.randn(1000, 1000, device="cuda", dtype=torch.bfloat16); b = torch.randn(1000, 1000, device="cuda", dtype=torch.bfloat16)
prof("matmul1000 pre-init", lambda: matmul(a, b)); wall("matmul1000 pre-init", lambda: matmul(a, b))
tilecomm.init(backend="cuda", heap_bytes=3 << 30)
print("heap", tilecomm.current().heap.bytes_free() if hasattr(tilecomm.current().heap, "bytes_free") else "?", torch.cuda.mem_get_info(), flush=True)
prof("matmul1000 post-init", lambda: matmul(a, b))
for M, K, N in [(8192, 4096, 3584), (8192, 8192, 7168)]:
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16); b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    ws1 = GemmRsWorkspace(N, torch.bfloat16, M); ws2 = AgGemmWorkspace(K, torch.bfloat16, M)
    print(M, K, N, "mem", torch.cuda.mem_get_info(), flush=True)
    for name, fn in [("matmul", lambda: matmul(a, b)), ("gemm_rs", lambda: gemm_rs(a, b, workspace=ws1)),
                     ("ag_gemm", lambda: ag_gemm(a, b, workspace=ws2))]:
        wall(f"{name} {M}x{K}x{N}", fn, 3)
        prof(f"{name} {M}x{K}x{N}", fn)
    print("rs variants", len(rsmod._gemm_rs_kernel.device_caches[0][0]), "ag variants", len(agmod._gemm_kernel.device_caches[0][0]), flush=True)
    for name, fn in [("gemm_rs", lambda: gemm_rs(a, b, workspace=ws1)), ("ag_gemm", lambda: ag_gemm(a, b, workspace=ws2))]:
        print(name, "do_bench", round(triton.testing.do_bench(fn, warmup=5, rep=30) * 1e3, 1), flush=True)
    for k in list(rsmod._gemm_rs_kernel.device_caches[0][0].values())[:1] + list(agmod._gemm_kernel.device_caches[0][0].values())[:1]:
        k._init_handles(); print("n_regs", k.n_regs, "spills", k.n_spills, "smem", k.metadata.shared, flush=True)
    ws1.free(); ws2.free()
