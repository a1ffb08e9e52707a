"""Host-side exchange between ranks: the few object collectives init and the heap need.

Three ways in: an initialised torch.distributed world (torchrun, or the spawn helper), MPI
(mpi4py under mpirun), or a single process. `make_bootstrap()` picks one in that order.
"""
from __future__ import annotations

import datetime
from typing import Any, List

import torch
import torch.distributed as dist

from . import _env


class Bootstrap:
    """rank/world_size plus object all-gather, broadcast and barrier on the host."""

    rank: int = 0
    world_size: int = 1
    kind: str = "single"

    def all_gather_object(self, obj: Any) -> List[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class TorchBootstrap(Bootstrap):
    kind = "torch"

    def __init__(self, owns_group: bool):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.owns_group = owns_group
        # A gloo group for host objects even when the default group is NCCL (no device syncs).
        self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj, root=0):
        box = [obj]
        dist.broadcast_object_list(box, src=root, group=self.group)
        return box[0]

    def barrier(self):
        dist.barrier(group=self.group)

    def close(self):
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


class MPIBootstrap(Bootstrap):
    kind = "mpi"

    def __init__(self):
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()

    def all_gather_object(self, obj):
        return self.comm.allgather(obj)

    def broadcast_object(self, obj, root=0):
        return self.comm.bcast(obj, root=root)

    def barrier(self):
        self.comm.Barrier()




def make_bootstrap(device_backend: str) -> Bootstrap:
    """torch.distributed if initialised, else MPI under mpirun, else RANK/WORLD_SIZE, else one rank."""
    if dist.is_available() and dist.is_initialized():
        return TorchBootstrap(owns_group=False)
    env = _env.launcher_env()
    if env["under_mpi"]:
        try:
            return MPIBootstrap()
        except ImportError:
            raise RuntimeError(
                "tilecomm.init: running under mpirun but mpi4py is not installed; "
                "pip install 'tilecomm[mpi]' or start the ranks with torchrun"
            ) from None
    if "RANK" in env and "WORLD_SIZE" in env:
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if key not in env:
                raise RuntimeError(f"tilecomm.init: RANK/WORLD_SIZE are set but {key} is not (torchrun sets all four)")
        pg_backend = "nccl" if device_backend == "cuda" else "gloo"
        if device_backend == "cuda" and "LOCAL_RANK" in env:
            torch.cuda.set_device(int(env["LOCAL_RANK"]))
        dist.init_process_group(backend=pg_backend, timeout=datetime.timedelta(seconds=max(60.0, 2 * _env.timeout_s())))
        return TorchBootstrap(owns_group=True)
    return Bootstrap()
