"""Where the copy push's time goes (a diagnostic for issue 14's ag_gemm / gemm_rs bars, any number of GPUs):

    torchrun --nproc-per-node 4 tests/copy_push_probe.py
    PROBE_TP=4 torchrun --nproc-per-node 1 tests/copy_push_probe.py   # one GPU, the bar shapes at TP = 4
    PROBE_TP=4 PROBE_ONCE=1 ncu -k regex:_gemm_kernel ... torchrun ...  # ag_gemm's small bar shape: three calls of
        tc matmul, of the "copied" form with no copies and of "in_place", nothing timed (ncu: launch-skip 2 / 5)

At W = 1 the op has no peer shard: with OWN_SHARD="copied" its one shard goes through the persistent GEMM (a wait
before each tile, the tile loop unflattened), with "in_place" through its flattened own-shard loop, which `tc matmul`
times beside them on the same product.

For each bar shape (tilecomm.bench.overlap's), beside cuBLAS's whole GEMM in the same run (µs per call, max over
ranks of each rank's median; every rep times the columns in turn, as the bench does):
  tc matmul   tilecomm.overlap.matmul of the whole product (the persistent TMA GEMM without shards or waits)
  blocks      the W row-block GEMMs of the op, back to back, no communication (what the op computes, in pieces)
  fused       the op with its workspace (push="copy")
  no copies   the same with the copy engine's copies skipped (flags still written: the result is wrong, the
              GEMMs and waits are the op's): fused - no copies = what the copies cost the GEMMs
  FLAG=value  the op's other forms: gemm_rs.FUSED_OWN_BLOCK (True: the fused kernel's own tiles add the slots in their
              epilogue; False: cuBLAS, then an add pass) or ag_gemm.OWN_SHARD ("cublas", "in_place": every shard
              through the persistent GEMM, the own one read from a_shard; "copied": the own shard copied into its
              gather slot too), each with and without copies (at W = 1 "copied" with no copies is the persistent
              GEMM of the one shard, no wait held up)
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
from tilecomm.bench.collectives import RunConfig, _times_us
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


def _no_copies(fn, ws):
    """fn with the copy engine's copies skipped (the flags still written: the result is wrong; the GEMMs and
    waits are the op's): fused - no copies = what the copies cost the GEMMs."""
    def run():
        copy, ws.issuer.copy = ws.issuer.copy, lambda *args: None
        try:
            return fn()
        finally:
            ws.issuer.copy = copy
    return run


def _with(fn, module, flag, value):
    """fn with module.flag = value for the call."""
    def run():
        saved = getattr(module, flag)
        setattr(module, flag, value)
        try:
            return fn()
        finally:
            setattr(module, flag, saved)
    return run


def main():
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    W, rank = dist.get_world_size(), dist.get_rank()
    tilecomm.init(heap_bytes=1 << 30)
    device = torch.device("cuda", local)
    cfg = RunConfig(warmup=5, reps=20, iters=10, json_path=None, seed=0)
    if os.environ.get("PROBE_ONCE"):
        shape = _gpu_shapes("ag_gemm", int(os.environ.get("PROBE_TP", W)))[1]
        fns = _problem("ag_gemm", shape, torch.bfloat16, device)
        try:
            for run in (fns["tc_gemm"], _with(_no_copies(fns["fused"], fns["workspace"]), ag, "OWN_SHARD", "copied"),
                        _with(fns["fused"], ag, "OWN_SHARD", "in_place")):
                for _ in range(3):
                    run()
            torch.cuda.synchronize()
        finally:
            fns["workspace"].free()
        tilecomm.finalize()
        dist.destroy_process_group()
        return
    for op in ("ag_gemm", "gemm_rs"):
        for shape in _gpu_shapes(op, int(os.environ.get("PROBE_TP", W))):  # (the bar shapes' N at that TP)
            fns = _problem(op, shape, torch.bfloat16, device)
            ws = fns["workspace"]
            try:
                # the op's other forms (gemm_rs.FUSED_OWN_BLOCK, ag_gemm.OWN_SHARD), set around each call
                module, flag = (rs, "FUSED_OWN_BLOCK") if op == "gemm_rs" else (ag, "OWN_SHARD")
                others = [not rs.FUSED_OWN_BLOCK] if op == "gemm_rs" else [f for f in ag.OWN_SHARD_FORMS
                                                                            if f != ag.OWN_SHARD]
                rows = {"cuBLAS whole": fns["gemm"], "tc matmul": fns["tc_gemm"], "blocks": _blocks(shape, W, device),
                        "fused": fns["fused"], "no copies": _no_copies(fns["fused"], ws)}
                for other in others:
                    rows[f"{flag}={other}"] = _with(fns["fused"], module, flag, other)
                    rows[f"{flag}={other} no copies"] = _with(_no_copies(fns["fused"], ws), module, flag, other)
                times = _times_us(rows, cfg, True)  # the columns in turn inside every rep (the bench's timing)
                host = _host_us(fns["fused"])
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
