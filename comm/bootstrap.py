"""Host-side exchange between ranks: the few object collectives init and the heap need.

Three ways in: an initialised torch.distributed world (torchrun, or the spawn helper), MPI
(mpi4py under mpirun), or a single process. `make_bootstrap()` picks one in that order.

Every exchange waits at most `timeout_s` (TILECOMM_TIMEOUT_S) for the other ranks and then raises
`HostTimeoutError` naming this rank and the call (`what`); a peer that exits raises `HostWaitError`.
Either failure leaves the exchange unusable (gloo closes its connections after a timeout), so later
calls raise at once, naming the first failure, instead of pairing with the wrong peer call.
"""
from __future__ import annotations

import datetime
import time
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from . import _env
from .errors import HostTimeoutError, HostWaitError


class Bootstrap:
    """rank/world_size plus object all-gather, broadcast and barrier on the host.

    `what` names the calling API in errors ("tilecomm.barrier", "tilecomm.empty", ...)."""

    rank: int = 0
    world_size: int = 1
    kind: str = "single"
    timeout_s: float = 60.0
    failed: Optional[str] = None  # the first failed exchange; later ones raise at once

    def all_gather_object(self, obj: Any, what: str = "host all-gather") -> List[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, root: int = 0, what: str = "host broadcast") -> Any:
        return obj

    def barrier(self, what: str = "host barrier") -> None:
        pass

    def close(self) -> None:
        pass

    def set_timeout(self, seconds: float) -> None:
        self.timeout_s = seconds

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        """fn() with its failures turned into HostWaitError / HostTimeoutError naming rank and call."""
        if self.failed is not None:
            raise HostWaitError(self.rank, what, f"an earlier host-side exchange failed ({self.failed}); the runtime "
                                                 "cannot continue: call tilecomm.finalize() and exit")
        try:
            return fn()
        except (RuntimeError, HostWaitError) as err:  # gloo/MPI: a timeout or a peer's closed connection
            text = str(err)
            self.failed = f"{what}: {text.splitlines()[0][:200] if text else type(err).__name__}"
            if isinstance(err, HostWaitError):
                raise
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise HostTimeoutError(self.rank, what, self.timeout_s, detail=text.splitlines()[0][:200]) from err
            raise HostWaitError(self.rank, what, f"a peer rank exited or closed its connection ({text[:300]})") from err


class TorchBootstrap(Bootstrap):
    kind = "torch"

    def __init__(self, owns_group: bool, timeout_s: float):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.owns_group, self.timeout_s = owns_group, timeout_s
        # Our own gloo group: host objects never touch the device (no NCCL syncs), and its timeout is
        # TILECOMM_TIMEOUT_S whatever timeout the default group was created with.
        self.group = self._guard("tilecomm.init (bootstrap group)", lambda: dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))

    def all_gather_object(self, obj, what="host all-gather"):
        out = [None] * self.world_size
        self._guard(what, lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def broadcast_object(self, obj, root=0, what="host broadcast"):
        box = [obj]
        self._guard(what, lambda: dist.broadcast_object_list(box, src=root, group=self.group))
        return box[0]

    def barrier(self, what="host barrier"):
        self._guard(what, lambda: dist.barrier(group=self.group))

    def set_timeout(self, seconds):
        self.timeout_s = seconds
        set_pg_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)  # torch >= 2.3
        if set_pg_timeout is not None and self.group is not None:
            set_pg_timeout(datetime.timedelta(seconds=seconds), self.group)

    def close(self):
        if not dist.is_initialized():
            return
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
        if self.owns_group:
            dist.destroy_process_group()


class MPIBootstrap(Bootstrap):
    """MPI blocking collectives cannot time out: every exchange first meets in a non-blocking
    barrier polled against the deadline, so a missing rank raises instead of blocking forever."""

    kind = "mpi"

    def __init__(self, timeout_s: float):
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        self.timeout_s = timeout_s

    def _meet(self, what: str) -> None:
        req = self.comm.Ibarrier()
        deadline, pause = time.monotonic() + self.timeout_s, 1e-5
        while not req.Test():
            if time.monotonic() > deadline:
                raise RuntimeError(f"MPI Ibarrier timed out after {self.timeout_s:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)

    def all_gather_object(self, obj, what="host all-gather"):
        return self._guard(what, lambda: (self._meet(what), self.comm.allgather(obj))[1])

    def broadcast_object(self, obj, root=0, what="host broadcast"):
        return self._guard(what, lambda: (self._meet(what), self.comm.bcast(obj, root=root))[1])

    def barrier(self, what="host barrier"):
        self._guard(what, lambda: self._meet(what))


def make_bootstrap(device_backend: str, timeout_s: Optional[float] = None) -> Bootstrap:
    """torch.distributed if initialised, else MPI under mpirun, else RANK/WORLD_SIZE, else one rank.
    timeout_s bounds every host-side wait (default TILECOMM_TIMEOUT_S)."""
    limit = _env.timeout_s() if timeout_s is None else _env.check_timeout(timeout_s, "timeout_s")
    if dist.is_available() and dist.is_initialized():
        return TorchBootstrap(owns_group=False, timeout_s=limit)
    env = _env.launcher_env()
    if env["under_mpi"]:
        try:
            return MPIBootstrap(limit)
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
        rank = int(env["RANK"])
        boot = Bootstrap()
        boot.rank, boot.timeout_s = rank, limit
        boot._guard("tilecomm.init (rendezvous at MASTER_ADDR:MASTER_PORT)", lambda: dist.init_process_group(
            backend=pg_backend, timeout=datetime.timedelta(seconds=limit)))
        return TorchBootstrap(owns_group=True, timeout_s=limit)
    boot = Bootstrap()
    boot.timeout_s = limit
    return boot
