"""`python -m tilecomm.bench {all_to_all,all_gather,reduce_scatter,dispatch,ag_gemm,gemm_rs,self,moe_layer} [options]`
(see tilecomm.bench).

Under torchrun (RANK and WORLD_SIZE set) every process is one rank: torch.distributed is
initialised here (NCCL on GPUs, gloo on CPU), then tilecomm.init. Otherwise the command spawns
--world-size ranks itself with tilecomm.launch. --backend cpu (or no GPU) runs the Triton
interpreter against gloo, with small default sizes: a functional check, not a performance number.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Tuple

import torch

from . import dispatch as dispatch_bench
from . import overlap as overlap_bench
from .collectives import OPS, BenchMismatch, Config, heap_bytes_needed, make_case, run_rank

# (GPU, CPU) defaults
_DEFAULTS = {"rows": ("4096,128", "64"), "hidden": (7168, 128), "shape": ("8192x8192", "64x128"),
             "dtype": ("bfloat16", "float32"), "warmup": (5, 1), "reps": (20, 3), "iters": (10, 2)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tilecomm.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("op", choices=OPS + ("dispatch",) + overlap_bench.OPS + ("self", "moe_layer"),
                   help="self: every op at world size 1 on this GPU beside a copy floor (bench/world1.py); "
                        "moe_layer: a MoE layer with dispatcher 'fused' beside 'tilecomm', world 1 (bench/moe_layer.py)")
    p.add_argument("--backend", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda when torch sees a GPU, else cpu (gloo baseline, timings not meaningful)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to spawn when not under torchrun (default: the GPU count; 2 on cpu)")
    p.add_argument("--rows", help="all_to_all: comma list of rows per rank (default 4096,128; cpu 64)")
    p.add_argument("--hidden", type=int, help="all_to_all, dispatch: elements per row (default 7168; cpu 128)")
    p.add_argument("--tokens", type=int, help="dispatch: tokens per rank (default 4096, low_latency 128; cpu 64, 16)")
    p.add_argument("--mode", choices=("normal", "low_latency"), default="normal",
                   help="dispatch: the tilecomm Dispatcher's mode (the nccl baseline is always mode normal)")
    p.add_argument("--experts", type=int, help="dispatch: experts, split evenly over ranks (default 256; cpu 24)")
    p.add_argument("--topk", type=int, help="dispatch: distinct experts per token (default 8; cpu 4)")
    p.add_argument("--shape", help="all_gather: gathered output, reduce_scatter: input before scattering; "
                                   "comma list of RxC (default 8192x8192; cpu 64x128)")
    p.add_argument("--shapes", help="ag_gemm: comma list of MxKxn, gemm_rs: of MxkxN (M = total rows; "
                                    "default: the TP=W bar shapes; cpu 48x32x40,72x48x24)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default bfloat16 (cpu float32)")
    p.add_argument("--symmetric", action="store_true",
                   help="allocate inputs with tilecomm.empty (used in place, no staging copy)")
    p.add_argument("--uneven", action="store_true",
                   help="all_to_all: a different row count for every (source, destination) pair (bench/collectives.py)")
    p.add_argument("--warmup", type=int, help="untimed calls per size and library (default 5; cpu 1)")
    p.add_argument("--reps", type=int, help="timed reps, barrier before each (default 20; cpu 3)")
    p.add_argument("--iters", type=int, help="back-to-back calls timed per rep (default 10; cpu 2)")
    p.add_argument("--layers", help="moe_layer: comma list of its layers (default: all; see bench/moe_layer.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write the rows as a JSON list (rank 0)")
    return p


def _shapes(args, p: argparse.ArgumentParser) -> List[Tuple[int, int]]:
    try:
        if args.op == "all_to_all":
            return [(int(r), int(args.hidden)) for r in args.rows.split(",")]
        return [tuple(int(d) for d in s.lower().split("x")) for s in args.shape.split(",")]
    except ValueError:
        p.error(f"cannot parse --rows {args.rows!r} / --shape {args.shape!r} (e.g. --rows 4096,128, --shape 8192x8192)")


def _config(args, backend: str, world: int, p: argparse.ArgumentParser) -> Config:
    """Fill unset options with the GPU or CPU default; check every size against the world size."""
    k = 0 if backend == "cuda" else 1
    for name, pair in _DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, pair[k])
    shapes = _shapes(args, p)
    if any(len(s) != 2 or min(s) <= 0 for s in shapes):
        p.error(f"sizes must be two positive dims, got {shapes}")
    if min(args.warmup, args.reps - 1, args.iters - 1) < 0:
        p.error("--reps and --iters must be >= 1, --warmup >= 0")
    for s in shapes:
        try:
            make_case(args.op, s, args.dtype, world)
        except ValueError as err:
            p.error(str(err))
    if args.uneven and args.op != "all_to_all":
        p.error("--uneven applies to all_to_all only")
    return Config(args.op, shapes, symmetric=args.symmetric, uneven=args.uneven, dtype=args.dtype,
                  warmup=args.warmup, reps=args.reps,
                  iters=args.iters, json_path=args.json_path, seed=args.seed)


def _heap_bytes(cfg: Config, world: int) -> int:
    from .. import _env

    cases = [make_case(cfg.op, s, cfg.dtype, world) for s in cfg.shapes]
    return max(_env.heap_bytes(torch.cuda.is_available()), heap_bytes_needed(cases))


def _in_process(cfg: Config, backend: str, heap: int, body=run_rank) -> None:
    """One torchrun rank: init torch.distributed and tilecomm here, run, tear down."""
    import torch.distributed as dist

    import tilecomm

    if backend == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    tilecomm.init(backend=backend, heap_bytes=heap)
    body(cfg)  # on an error, skip the collective teardown (a peer may be gone); exit cleans up
    tilecomm.finalize()
    dist.destroy_process_group()


def _spawned(cfg: Config, backend: str, world: int, heap: int, body=run_rank) -> None:
    import tilecomm
    from tilecomm.spawn import RankError

    try:
        tilecomm.launch(body, world, cfg, backend=backend, env={"TILECOMM_HEAP_BYTES": str(heap)})
    except RankError as err:
        if isinstance(err.original, BenchMismatch):
            raise err.original from None
        raise


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    backend = args.backend
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "cuda" and not torch.cuda.is_available():
        p.error("--backend cuda: torch sees no GPU; use --backend cpu")
    if args.op == "self":
        from . import world1

        world1.run(backend, args.json_path, args.iters or (50 if backend == "cuda" else 2))
        return 0
    if args.op == "moe_layer":
        from . import moe_layer

        layers = args.layers.split(",") if args.layers else None
        unknown = sorted(set(layers or ()) - set(moe_layer.PRESETS))
        if unknown:
            p.error(f"--layers {args.layers}: unknown {unknown}; expected a comma list of {sorted(moe_layer.PRESETS)}")
        moe_layer.run(backend, args.json_path, args.iters or (20 if backend == "cuda" else 2), layers)
        return 0
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_launcher:
        world = int(os.environ["WORLD_SIZE"])
        if args.world_size not in (None, world):
            p.error(f"--world-size {args.world_size} under a launcher with WORLD_SIZE={world}")
    else:
        world = args.world_size or (torch.cuda.device_count() if backend == "cuda" else 2)
        if backend == "cuda" and world > torch.cuda.device_count():
            p.error(f"--world-size {world}: only {torch.cuda.device_count()} GPUs visible")
    if world < 1:
        p.error("--world-size must be >= 1")
    if args.op == "dispatch":
        try:
            cfg = dispatch_bench.config_from_args(args, backend, world)
        except ValueError as err:
            p.error(str(err))
        body, heap = dispatch_bench.run_rank, dispatch_bench.heap_bytes(cfg, world)
    elif args.op in overlap_bench.OPS:
        try:
            cfg = overlap_bench.config_from_args(args, backend, world)
        except ValueError as err:
            p.error(str(err))
        body, heap = overlap_bench.run_rank, overlap_bench.heap_bytes(cfg, world)
    else:
        cfg = _config(args, backend, world, p)
        body, heap = run_rank, _heap_bytes(cfg, world)
    try:
        if under_launcher:
            _in_process(cfg, backend, heap, body)
        else:
            _spawned(cfg, backend, world, heap, body)
    except BenchMismatch as err:
        print(f"tilecomm.bench: ABORTED, results differ: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
