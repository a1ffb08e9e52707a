"""A tiny job started by a launcher (mpirun, torchrun, or plain python): tilecomm.init() must find
the ranks by itself, then a kernel and a collective must give the known answer."""
from __future__ import annotations

import torch

import tilecomm


def main() -> None:
    ctx = tilecomm.init(backend="cpu")
    rank, world = tilecomm.rank(), tilecomm.world_size()
    x = torch.arange(world * 2, dtype=torch.float32) + 100 * rank
    out = torch.empty_like(x)
    tilecomm.all_to_all_single(out, x)
    expect = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * p for p in range(world)])
    assert torch.equal(out, expect), (out, expect)
    tilecomm.barrier()
    print(f"bootstrap={ctx.boot.kind} rank={rank} world={world} ok", flush=True)
    tilecomm.finalize()


if __name__ == "__main__":
    main()
