"""Where the copy push's time goes (a diagnostic for issue 14's ag_gemm / gemm_rs bars, any number of GPUs):

    torchrun --nproc-per-node 4 tests/copy_push_probe.py
    PROBE_TP=4 torchrun --nproc-per-node 1 tests/copy_push_probe.py   # one GPU, the bar shapes at TP = 4

At W = 1 the op has no peer shard: with OWN_SHARD_BY_CUBLAS=False its one shard goes through the persistent GEMM
(a wait before each tile, the tile loop unflattened), which `tc matmul` times beside it on the same product.

For each bar shape (tilecomm.bench.overlap's), beside cuBLAS's whole GEMM in the same run (µs per call, max over
ranks of each rank's median, as the bench times them):
  tc matmul   tilecomm.overlap.matmul of the whole product (the persistent TMA GEMM without shards or waits)
  blocks      the W row-block GEMMs of the op, back to back, no communication (what the op computes, in pieces)
  fused       the op with its workspace (push="copy")
  no copies   the same with the copy engine's copies skipped (flags still written: the result is wrong, the
              GEMMs and waits are the op's): fused - no copies = what the copies cost the GEMMs
  FLAG=value  the op's other form: gemm_rs.FUSED_OWN_BLOCK (True: the fused kernel's own tiles add the slots in their
              epilogue; False: cuBLAS, then an add pass) or ag_gemm.OWN_SHARD_BY_CUBLAS (False: the own shard copied
              into its gather slot too and every shard through the persistent GEMM), flipped from its default
  host        µs the host takes to issue one call (20 calls, no synchronize between): above the GPU's time the
              op is host-bound
Not a test: the bench checks the results.
"""
import importlib
import os
import statistics
import time

import torch
import torch.distributed as dist

import tilecomm
from tilecomm.bench.collectives import RunConfig, _time_us
from tilecomm.bench.overlap import _gpu_shapes, _problem

# (the package binds functions of these names)
ag, rs = importlib.import_module("tilecomm.overlap.ag_gemm"), importlib.import_module("tilecomm.overlap.gemm_rs")


def _host_us(fn, calls=20):
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    return host


def _blocks(shape, W, device):
    M, K, N = shape  # ag_gemm: W shards [M/W, K] @ [K, N]; gemm_rs: W row blocks of a [M, K] @ b [K, N]
    a, b = torch.randn(M, K, device=device).bfloat16(), torch.randn(K, N, device=device).bfloat16()
    c = torch.empty(M, N, device=device, dtype=torch.bfloat16)
    mb = M // W

    def run():
        for i in range(W):
            torch.mm(a[i * mb:(i + 1) * mb], b, out=c[i * mb:(i + 1) * mb])
    return run


def main():
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    W, rank = dist.get_world_size(), dist.get_rank()
    tilecomm.init(heap_bytes=1 << 30)
    device = torch.device("cuda", local)
    cfg = RunConfig(warmup=5, reps=20, iters=10, json_path=None, seed=0)
    for op in ("ag_gemm", "gemm_rs"):
        for shape in _gpu_shapes(op, int(os.environ.get("PROBE_TP", W))):  # (the bar shapes' N at that TP)
            fns = _problem(op, shape, torch.bfloat16, device)
            ws = fns["workspace"]
            try:
                rows = {"cuBLAS whole": fns["gemm"], "tc matmul": fns["tc_gemm"], "blocks": _blocks(shape, W, device),
                        "fused": fns["fused"]}
                times = {name: _time_us(fn, cfg, True) for name, fn in rows.items()}
                host = _host_us(fns["fused"])
                copy = ws.issuer.copy
                ws.issuer.copy = lambda *args: None  # the copies skipped, the flags still written
                times["no copies"] = _time_us(fns["fused"], cfg, True)
                ws.issuer.copy = copy
                # the own block's / shard's other form (gemm_rs.FUSED_OWN_BLOCK, ag_gemm.OWN_SHARD_BY_CUBLAS)
                module, flag = (rs, "FUSED_OWN_BLOCK") if op == "gemm_rs" else (ag, "OWN_SHARD_BY_CUBLAS")
                default = getattr(module, flag)
                setattr(module, flag, not default)
                times[f"{flag}={not default}"] = _time_us(fns["fused"], cfg, True)
                setattr(module, flag, default)
                torch.cuda.synchronize()
                dist.barrier()
                every = [None] * W
                dist.all_gather_object(every, (times, host))
                if rank == 0:
                    whole = max(t["cuBLAS whole"] for t, _ in every)
                    line = "  ".join(f"{name} {max(t[name] for t, _ in every):7.1f} "
                                     f"({max(t[name] for t, _ in every) / whole:.3f})" for name in times)
                    print(f"{op} {'x'.join(map(str, shape))} world {W}: {line}  host {max(h for _, h in every):6.1f} "
                          f"(median {statistics.median(h for _, h in every):.1f})", flush=True)
            finally:
                ws.free()
    tilecomm.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
