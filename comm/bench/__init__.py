"""Benchmarks: tilecomm's collectives against torch.distributed on the same tensors.

    torchrun --nproc-per-node 4 -m tilecomm.bench all_to_all        # GPUs: NCCL is the baseline
    torchrun --nproc-per-node 4 -m tilecomm.bench all_gather --symmetric --json ag.json
    python -m tilecomm.bench reduce_scatter --backend cpu --world-size 2 --shape 64x128   # gloo

Without torchrun the command spawns its own ranks (`tilecomm.launch`). Each row gives the max
over ranks of each rank's median µs per call, the ratio baseline/tilecomm (above 1: tilecomm is
faster) and GB/s = bytes / time, with bytes counted per rank as what leaves the rank:

    all_to_all      input bytes  × (W-1)/W    (input: rows × hidden on each rank)
    all_gather      output bytes × (W-1)/W    (output: the gathered shape)
    reduce_scatter  input bytes  × (W-1)/W    (input: the shape before scattering)

`collectives.run_rank(config)` is the body every rank runs; `__main__` is the command line.
"""
from .collectives import OPS, BenchMismatch, Config, run_rank

__all__ = ["OPS", "BenchMismatch", "Config", "run_rank"]
