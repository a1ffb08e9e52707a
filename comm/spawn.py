"""Run N ranks from a plain `python` call: a pool of spawned processes, each with tilecomm up.

    with tilecomm.RankPool(3, backend="cpu") as pool:
        results = pool.run(my_fn, arg)       # my_fn(arg) on every rank; list of results by rank

A rank that raises makes `run` raise `RankError` naming it, with its traceback; the other ranks
are given up to `grace_s` to finish (their waits time out) before the pool is killed, so a
failure never hangs the caller. `launch(fn, n, *args)` is the one-shot form.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from .errors import TilecommError


class RankError(TilecommError):
    """A rank of a RankPool raised (or died). `.rank`, `.remote_traceback`, `.original` (if picklable)."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "", original: Optional[BaseException] = None):
        self.rank, self.remote_traceback, self.original = rank, remote_traceback, original
        super().__init__(f"rank {rank}: {message}\n--- traceback on rank {rank} ---\n{remote_traceback}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, env: Dict[str, str], conn) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import tilecomm

    try:
        if backend == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:
            torch.set_num_threads(1)
        # NCCL refuses two ranks on one GPU: ranks that share GPUs (a correctness run) use gloo
        shared = backend == "cuda" and world > torch.cuda.device_count()
        dist.init_process_group("nccl" if backend == "cuda" and not shared else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
        tilecomm.init(backend=backend)
        conn.send(("ready", None))
    except BaseException as err:  # report, then exit: the parent raises RankError
        conn.send(("err", (repr(err), traceback.format_exc(), _picklable(err))))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException as err:
            conn.send(("err", (repr(err), traceback.format_exc(), _picklable(err))))
    try:
        tilecomm.finalize()
        dist.destroy_process_group()
    finally:
        conn.close()


def _picklable(err: BaseException) -> Optional[BaseException]:
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return None


class RankPool:
    """`world_size` spawned processes with torch.distributed (gloo or nccl) and tilecomm initialised.

    backend: "cpu" or "cuda". env: extra environment for the ranks (e.g. TILECOMM_TIMEOUT_S).
    grace_s: after one rank fails, how long the others may take before the pool is killed.
    """

    def __init__(self, world_size: int, backend: str = "cpu", env: Optional[Dict[str, str]] = None,
                 grace_s: float = 60.0, start_timeout_s: float = 300.0):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"RankPool: world_size={world_size!r}; expected an int >= 1")
        if backend not in ("cpu", "cuda"):
            raise ValueError(f"RankPool: backend={backend!r}; expected 'cpu' or 'cuda'")
        self.world_size, self.backend, self.grace_s = world_size, backend, grace_s
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._conns, self._procs = [], []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(r, world_size, port, backend, dict(env or {}), child), daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect(start_timeout_s, "starting")

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable, *args, timeout_s: float = 600.0, **kwargs) -> List[Any]:
        """fn(*args, **kwargs) on every rank (fn must be picklable: a module-level function)."""
        if not self.alive:
            raise TilecommError("RankPool: the pool is closed or a rank has died")
        for c in self._conns:
            c.send((fn, args, kwargs))
        return self._collect(timeout_s, getattr(fn, "__name__", "fn"))

    def _collect(self, timeout_s: float, what: str) -> List[Any]:
        n = self.world_size
        results: List[Any] = [None] * n
        done = [False] * n
        first_err: Optional[RankError] = None
        deadline = time.monotonic() + timeout_s
        while not all(done):
            progressed = False
            for r, c in enumerate(self._conns):
                if done[r]:
                    continue
                if c.poll(0.01):
                    try:
                        tag, payload = c.recv()
                    except EOFError:
                        tag, payload = "err", (f"rank process exited (code {self._procs[r].exitcode})", "", None)
                    done[r], progressed = True, True
                    if tag == "err":
                        err = RankError(r, f"{what} raised {payload[0]}", payload[1], payload[2])
                        if first_err is None:
                            first_err = err
                            deadline = min(deadline, time.monotonic() + self.grace_s)
                    else:
                        results[r] = payload
                elif not self._procs[r].is_alive():
                    done[r], progressed = True, True
                    err = RankError(r, f"rank process died (exit code {self._procs[r].exitcode}) during {what}")
                    if first_err is None:
                        first_err = err
                        deadline = min(deadline, time.monotonic() + self.grace_s)
            if not progressed and time.monotonic() > deadline:
                self.kill()
                missing = [r for r in range(n) if not done[r]]
                raise first_err or TilecommError(f"RankPool: ranks {missing} did not finish {what} in {timeout_s:g} s")
        if first_err is not None:
            raise first_err
        return results

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5)
        self._procs, self._conns = [], []

    def close(self) -> None:
        if not self._procs:
            return
        for c in self._conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(30)
        self.kill()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def launch(fn: Callable, world_size: int, *args, backend: str = "cpu", env: Optional[Dict[str, str]] = None, **kwargs) -> List[Any]:
    """Start `world_size` ranks, run fn(*args, **kwargs) on each, shut down; results by rank."""
    with RankPool(world_size, backend=backend, env=env) as pool:
        return pool.run(fn, *args, **kwargs)
