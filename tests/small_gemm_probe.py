"""GPU diagnostic (not a test): tilecomm.overlap.matmul on small shapes, each config beside cuBLAS, one GPU:

    python3 tests/small_gemm_probe.py            (bash tests/run_gpu.sh smallgemm)

The bench's 1000^3 row reads ~40 µs against cuBLAS's ~12 (bench.gemm, 4 H200s, 2026-11-28) with every config the
sweep tries. Whether that is the host or the kernel: for each shape (M x N x K, bf16) and config, one line of
    kernel  the call's GPU time (torch.profiler, median over calls 2..20 back to back)
    host    µs per call of calls back to back without waiting (Python + launch)
    wall    µs per call of the same calls plus one synchronize
    bench   triton.testing.do_bench (L2 flushed: the kernel's time, the host hidden behind the flush)
each also for cuBLAS (a @ b), and the result checked against it.
"""
import torch
import triton.testing

from tilecomm.bench.measure import host_us, kernel_profile, per_call_us
from tilecomm.overlap import matmul
from tilecomm.overlap.tiles import GemmConfig, _TABLE, matmul_bucket

SHAPES = [(1000, 1000, 1000), (1024, 1024, 1024), (2048, 2048, 2048), (256, 4096, 4096), (4096, 4096, 256),
          (2048, 8192, 7168)]
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, EPILOGUE_SPLIT, WARP_SPECIALIZE, FLATTEN, PER_SM)
CONFIGS = [(64, 64, 64, 8, 4, 4, 1, False, True, 1), (64, 64, 64, 8, 4, 4, 1, False, False, 1),
           (64, 64, 64, 8, 4, 4, 1, False, True, 2), (64, 128, 64, 8, 4, 4, 1, False, True, 1),
           (128, 64, 64, 8, 4, 4, 1, False, True, 1), (128, 128, 64, 8, 8, 4, 1, False, True, 1),
           (128, 128, 64, 8, 4, 4, 1, False, True, 2), (128, 256, 64, 8, 8, 3, 1, False, True, 1)]


def line(label, fn, ref=None):
    got = fn()
    err = "" if ref is None else f"  max|err| {(got.float() - ref.float()).abs().max().item():.3g}"
    _, kern, names = kernel_profile(fn, 20)
    print(f"  {label:<44} kernel {kern:7.1f}  host {host_us(fn, 200):7.1f}  wall {per_call_us(fn, 200):7.1f}  "
          f"bench {triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3:7.1f}{err}  [{names}]", flush=True)


def main():
    print(f"device {torch.cuda.get_device_name()}", flush=True)
    for M, N, K in SHAPES:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        ref = a @ b
        name = matmul_bucket(M, N, torch.bfloat16)
        print(f"{M}x{N}x{K} (table: {name} = {_TABLE[name]})", flush=True)
        line("cuBLAS a @ b", lambda: a @ b)
        line("tilecomm table", lambda: matmul(a, b), ref)
        for c in CONFIGS:
            cfg = GemmConfig(*c)
            try:
                line(f"{c[:3]} g{c[3]} w{c[4]} s{c[5]} flat{int(c[8])} x{c[9]}", lambda: matmul(a, b, config=cfg), ref)
            except Exception as exc:  # noqa: BLE001 (a config that does not fit: reported, the rest go on)
                print(f"  {c}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}", flush=True)


if __name__ == "__main__":
    main()
