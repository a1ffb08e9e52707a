"""Independent references for the collectives: torch ops on data gathered over gloo."""
from __future__ import annotations

import torch
import torch.distributed as dist

import tilecomm


# The tiny transformer the MoE-stack tests train (tilecomm.moe.ModelConfig fields).
MODEL = dict(vocab_size=32, hidden=16, num_layers=2, num_heads=2, ffn_hidden=32, num_dense_layers=1, max_seq_len=16)


class ConcatRanks:
    """All W data-parallel ranks' batches of a step as one batch: what one process sees when it plays every rank."""

    def __init__(self, data, world):
        self.data, self.world = data, world

    def batch(self, step, rank, batch_size, seq_len):
        return torch.cat([self.data.batch(step, r, batch_size // self.world, seq_len) for r in range(self.world)])


def dev() -> torch.device:
    """Where the running backend keeps its tensors (cpu ranks, or this rank's GPU)."""
    return tilecomm.current().device


def poison(t):
    """t filled with a value no collective produces here (outputs are poisoned before a call)."""
    if t.dtype == torch.bool:
        return t.fill_(True)
    if t.dtype in (torch.float8_e4m3fn,):
        t.view(torch.uint8).fill_(0x7F)
        return t
    return t.fill_(-77)


def uneven_splits(world, gen, max_rows=7):
    """Rows this rank sends to each rank: random, zeros included; sometimes none at all."""
    if torch.rand(1, generator=gen).item() < 0.25:
        return [0] * world  # a rank that sends nothing at all
    return [int(v) for v in torch.randint(0, max_rows, (world,), generator=gen)]


def gather_all(t: torch.Tensor) -> list:
    """Every rank's tensor t (any shape per rank), via gloo object all-gather."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t.cpu())
    return out


def all_to_all_ref(inputs: list, in_splits_all: list, rank: int) -> torch.Tensor:
    """Rows rank receives: from each source p in order, p's rows destined to `rank`."""
    pieces = []
    for p, x in enumerate(inputs):
        start = sum(in_splits_all[p][:rank])
        pieces.append(x[start: start + in_splits_all[p][rank]])
    return torch.cat(pieces, dim=0)


def reduce_scatter_ref(inputs: list, rank: int, op: str) -> torch.Tensor:
    stacked = torch.stack([x.reshape(len(inputs), -1)[rank].double() for x in inputs])
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.mean(0)
    if op == "max":
        return stacked.max(0).values
    if op == "min":
        return stacked.min(0).values
    return stacked.prod(0)
