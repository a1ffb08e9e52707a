"""torch's NVSHMEM all-to-all (`torch.ops.symm_mem.all_to_all_vdev`) beside NCCL's, the third column of
the all_to_all rows (issue 14): the same sizes, splits, timing and checks as collectives.py.

    torchrun --nproc-per-node 4 -m tilecomm.bench.torch_a2av            # 4096 and 128 rows x 7168 bf16
    torchrun --nproc-per-node 4 -m tilecomm.bench.torch_a2av --uneven   # collectives.py's uneven splits

A process of its own, without tilecomm: torch's symmetric memory runs on its own NVSHMEM instance
(`symm_mem.set_backend("NVSHMEM")`), and tilecomm's heap is one too, so the two never share a process.
The op takes symmetric tensors and split sizes along dim 0; this file passes 1-D tensors, so the splits
are element counts whichever unit a torch version documents; the input splits live in a
symmetric int64 tensor written before each call, as a training step would. Its output is compared bit
for bit with `dist.all_to_all_single`'s on the same input before timing. Where the op or torch's NVSHMEM
is missing, each row says why (`torch_us` null) and the NCCL column is still timed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

import torch
import torch.distributed as dist

from .collectives import RunConfig, _gather, _sync, _time_us, uneven_splits


def _splits(rows: int, world: int, uneven: bool) -> List[List[int]]:
    return uneven_splits(rows, world) if uneven else [[rows // world] * world for _ in range(world)]


class _TorchA2AV:
    """torch's op on symmetric buffers big enough for every size of the run (made once, up front)."""

    def __init__(self, max_elems: int, dtype: torch.dtype, device: torch.device):
        from torch.distributed import _symmetric_memory as symm

        if not symm.is_nvshmem_available():
            raise RuntimeError("torch was built without NVSHMEM (symm_mem.is_nvshmem_available() is False)")
        symm.set_backend("NVSHMEM")
        self.group = dist.group.WORLD.group_name
        symm.enable_symm_mem_for_group(self.group)
        world = dist.get_world_size()
        self.inp = symm.empty(max_elems, dtype=dtype, device=device)
        self.out = symm.empty(max_elems, dtype=dtype, device=device)
        n_args = len(torch.ops.symm_mem.all_to_all_vdev.default._schema.arguments)
        self.split_api = n_args == 5  # (in, out, in_splits, out_splits_offsets, group); older: in_out_splits
        rows = (1, 2) if self.split_api else (3,)
        self.in_splits = symm.empty((rows[0], world), dtype=torch.int64, device=device)
        self.out_meta = symm.empty((2, world), dtype=torch.int64, device=device) if self.split_api else None
        for t in (self.inp, self.out, self.in_splits, self.out_meta):
            if t is not None:
                symm.rendezvous(t, self.group)

    def call(self, send_elems: torch.Tensor) -> None:
        """One all-to-all of the leading sum(send_elems) elements of `inp` into `out` (split sizes in elements)."""
        self.in_splits[0].copy_(send_elems, non_blocking=True)
        if self.split_api:
            torch.ops.symm_mem.all_to_all_vdev(self.inp, self.out, self.in_splits[0], self.out_meta, self.group)
        else:
            torch.ops.symm_mem.all_to_all_vdev(self.inp, self.out, self.in_splits, self.group)


def _row(cfg: RunConfig, rows: int, hidden: int, uneven: bool, torch_op: Optional[_TorchA2AV], why: Optional[str]):
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    dt = getattr(torch, cfg.dtype)
    n = _splits(rows, world, uneven)
    send, recv = n[rank], [n[s][rank] for s in range(world)]
    x = torch.randn(sum(send), hidden, device=device).to(dt)
    ref = torch.empty(sum(recv), hidden, dtype=dt, device=device)
    kw = {"output_split_sizes": recv, "input_split_sizes": send}
    dist.all_to_all_single(ref, x, **kw)
    off_rank = sum(sum(n[s]) - n[s][s] for s in range(world)) / world
    nbytes = off_rank * hidden * dt.itemsize
    t_nccl = max(_gather(_time_us(lambda: dist.all_to_all_single(ref, x, **kw), cfg, True)))
    t_torch = None
    if torch_op is not None and why is None:
        torch_op.inp[:x.numel()].copy_(x.reshape(-1))
        send_elems = torch.tensor([s * hidden for s in send], dtype=torch.int64, device=device)
        torch_op.out.fill_(float("nan"))
        torch_op.call(send_elems)
        _sync(True)
        got = torch_op.out[:ref.numel()].view_as(ref)
        bad = int((got != ref).sum())
        problems = [p for p in _gather(f"rank {rank}: {bad} elements differ from NCCL's" if bad else None) if p]
        if problems:
            why = "output differs: " + "; ".join(problems)
        else:
            t_torch = max(_gather(_time_us(lambda: torch_op.call(send_elems), cfg, True)))
    return {"op": "all_to_all", "shape": f"{rows}x{hidden}", "dtype": cfg.dtype, "world": world, "uneven": uneven,
            "nccl_us": t_nccl, "torch_us": t_torch, "torch_vs_nccl": (t_nccl / t_torch) if t_torch else None,
            "bytes": nbytes, "torch_unavailable": why, "baseline": "torch.ops.symm_mem.all_to_all_vdev (NVSHMEM)"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tilecomm.bench.torch_a2av", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="4096,128", help="comma list of rows per rank (default 4096,128)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--uneven", action="store_true", help="collectives.py's uneven splits")
    p.add_argument("--json", dest="json_path", metavar="PATH")
    args = p.parse_args(argv)
    if "RANK" not in os.environ or not torch.cuda.is_available():
        p.error("run under torchrun on GPUs (torch's NVSHMEM op has no CPU form)")
    rows = [int(r) for r in args.rows.split(",")]
    world = int(os.environ["WORLD_SIZE"])
    if any(r <= 0 or r % world for r in rows) or args.hidden <= 0:
        p.error(f"--rows {args.rows}: every count must be positive and divide by the world size ({world})")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    torch.manual_seed(dist.get_rank())
    cfg = RunConfig(dtype=args.dtype, json_path=args.json_path)
    torch_op, why = None, None
    max_elems = max(max(map(sum, _splits(r, world, args.uneven))) for r in rows) * world * args.hidden
    try:
        torch_op = _TorchA2AV(max_elems, getattr(torch, args.dtype), torch.device("cuda", local))
    except Exception as exc:  # no NVSHMEM in this torch, op missing, rendezvous failed: the row says so
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    why = next((w for w in _gather(why) if w), None)
    out = [_row(cfg, r, args.hidden, args.uneven, torch_op, why) for r in rows]
    if dist.get_rank() == 0:
        print(f"all_to_all, world {world}{', uneven' if args.uneven else ''}: NCCL vs {out[0]['baseline']} "
              f"(time = max over ranks of median µs per call; ratio = NCCL / torch)")
        for r in out:
            torch_col = f"{r['torch_us']:.1f} µs  ratio {r['torch_vs_nccl']:.2f}" if r["torch_us"] else \
                f"n/a ({r['torch_unavailable']})"
            print(f"  {r['shape']:>10} {r['dtype']}: NCCL {r['nccl_us']:.1f} µs   torch {torch_col}")
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(out, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
