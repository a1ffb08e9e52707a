"""Run N ranks from a plain `python` call: a pool of spawned processes, each with tilecomm up.

    with tilecomm.RankPool(3, backend="cpu") as pool:
        results = pool.run(my_fn, arg)       # my_fn(arg) on every rank; list of results by rank

A rank that raises makes `run` raise `RankError` naming it, with its traceback; the other ranks
are given `grace_s` to finish (their waits time out) before the pool is killed, so a failure never
hangs the caller. A rank that dies is the one named, not the peers that then lost it.
`launch(fn, n, *args)` is the one-shot form.

Lifetime: the ranks die with the pool's process (Linux: the kernel's parent-death signal; elsewhere
a watchdog thread), so SIGTERM or SIGKILL to the launcher leaves no orphan; Ctrl-C (SIGINT) or any
exception in the launcher kills the ranks at once. The rendezvous store lives in the launcher and
listens on 127.0.0.1 only; every rank-to-rank wait (rendezvous, process groups, tilecomm's waits)
is bounded by TILECOMM_TIMEOUT_S (from `env`, else the environment).
"""
from __future__ import annotations

import ctypes
import datetime
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from . import _env
from .errors import HostWaitError, TilecommError, WaitTimeoutError

# errors a rank raises because another rank failed first: the pool names the other rank
_CONSEQUENTIAL = (HostWaitError, WaitTimeoutError)


class RankError(TilecommError):
    """A rank of a RankPool raised (or died). `.rank`, `.remote_traceback`, `.original` (if picklable)."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "", original: Optional[BaseException] = None):
        self.rank, self.remote_traceback, self.original = rank, remote_traceback, original
        tail = f"\n--- traceback on rank {rank} ---\n{remote_traceback}" if remote_traceback else ""
        super().__init__(f"rank {rank}: {message}{tail}")


def _listening_socket() -> socket.socket:
    """A socket bound to 127.0.0.1 on a free port, already listening (the store server adopts it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def _die_with_parent(parent_pid: int, kernel_signal: bool) -> None:
    """Kill this process when the launcher dies. PR_SET_PDEATHSIG fires when the launcher *thread*
    exits, so it is only used for pools made on the main thread; the watchdog covers the rest."""
    if kernel_signal and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    if os.getppid() != parent_pid:  # the launcher died before we got here
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="tilecomm-parent-watchdog", daemon=True).start()


def _worker(rank: int, world: int, port: int, backend: str, env: Dict[str, str], conn, parent_pid: int,
            kernel_signal: bool) -> None:
    _die_with_parent(parent_pid, kernel_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the launcher, which stops the ranks
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pair sockets on loopback too
    try:
        import torch
        import torch.distributed as dist

        import tilecomm

        conn.send(("imported", None))
        if conn.recv() != "go":  # all ranks imported: the rendezvous clock starts now
            return
        limit = _env.timeout_s()
        timeout = datetime.timedelta(seconds=limit)
        if backend == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:
            torch.set_num_threads(1)
        # NCCL refuses two ranks on one GPU: ranks that share GPUs (a correctness run) use gloo
        shared = backend == "cuda" and world > torch.cuda.device_count()
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout)
        dist.init_process_group("nccl" if backend == "cuda" and not shared else "gloo", store=store,
                                rank=rank, world_size=world, timeout=timeout)
        tilecomm.init(backend=backend)
        conn.send(("ready", None))
    except BaseException as err:  # report, then exit: the parent raises RankError
        _send_error(conn, err)
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
            _send_error(conn, err)
            if tilecomm.is_initialized() and tilecomm.current().boot.failed is not None:
                conn.close()  # host exchanges are broken for good: leave, so that the pool is seen dead
                return
    try:
        tilecomm.finalize()
        dist.destroy_process_group()
    except Exception:  # a peer failed earlier and the pool already reported it
        pass
    finally:
        conn.close()


def _send_error(conn, err: BaseException) -> None:
    try:
        conn.send(("err", (repr(err), traceback.format_exc(), _picklable(err))))
    except (BrokenPipeError, OSError):
        pass


def _picklable(err: BaseException) -> Optional[BaseException]:
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return None


def _exit_text(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class RankPool:
    """`world_size` spawned processes with torch.distributed (gloo or nccl) and tilecomm initialised.

    backend: "cpu" or "cuda". env: extra environment for the ranks (e.g. TILECOMM_TIMEOUT_S).
    timeout_s: limit of every wait between ranks (default: TILECOMM_TIMEOUT_S of env / the environment).
    grace_s: after one rank fails, how long the others may take before the pool is killed
    (default timeout_s + 10: their own waits give up by then).
    start_timeout_s: how long the processes may take to import torch and tilecomm.
    """

    def __init__(self, world_size: int, backend: str = "cpu", env: Optional[Dict[str, str]] = None,
                 grace_s: Optional[float] = None, start_timeout_s: float = 300.0, timeout_s: Optional[float] = None):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"RankPool: world_size={world_size!r}; expected an int >= 1")
        if backend not in ("cpu", "cuda"):
            raise ValueError(f"RankPool: backend={backend!r}; expected 'cpu' or 'cuda'")
        env = {k: str(v) for k, v in (env or {}).items()}
        if timeout_s is None:
            timeout_s = _env.timeout_s({**os.environ, **env})
        self.timeout_s = _env.check_timeout(timeout_s, "RankPool: timeout_s")
        env["TILECOMM_TIMEOUT_S"] = repr(self.timeout_s)
        self.grace_s = self.timeout_s + 10.0 if grace_s is None else _env.check_timeout(grace_s, "RankPool: grace_s")
        self.world_size, self.backend = world_size, backend
        self._conns: List[Any] = []
        self._procs: List[Any] = []
        import torch.distributed as dist

        sock = _listening_socket()
        port = sock.getsockname()[1]
        try:
            self._store = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=self.timeout_s),
                                        wait_for_workers=False, master_listen_fd=sock.fileno())
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store's server owns the descriptor now and closes it
        ctx = mp.get_context("spawn")
        on_main = threading.current_thread() is threading.main_thread()
        try:
            for r in range(world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(r, world_size, port, backend, env, child, os.getpid(), on_main),
                                   daemon=True, name=f"tilecomm-rank-{r}")
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            self._collect(start_timeout_s, "starting (import)", expect="imported")
            for c in self._conns:
                c.send("go")
            self._collect(2 * self.timeout_s + 30.0, "starting (rendezvous and tilecomm.init)", expect="ready")
        except BaseException:
            self.kill()
            raise

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable, *args, timeout_s: Optional[float] = None, **kwargs) -> List[Any]:
        """fn(*args, **kwargs) on every rank (fn must be picklable: a module-level function).
        timeout_s: kill the pool if fn has not returned on every rank by then (default: no limit;
        every wait between ranks inside fn is bounded by the pool's timeout_s)."""
        if not self.alive:
            raise TilecommError("RankPool: the pool is closed or a rank has died")
        for c in self._conns:
            c.send((fn, args, kwargs))
        try:
            return self._collect(timeout_s, getattr(fn, "__name__", "fn"))
        except TilecommError:
            raise  # every rank replied, or the pool was killed at the deadline (RankError is one too)
        except BaseException:  # interrupted (a test's time limit, Ctrl-C) while ranks still run fn: their late
            self.kill()  # replies would answer the next call, so the pool goes
            raise

    def _collect(self, timeout_s: Optional[float], what: str, expect: str = "ok") -> List[Any]:
        """One reply per rank; on failure the most likely culprit's RankError (see `_culprit`)."""
        n = self.world_size
        results: List[Any] = [None] * n
        errors: Dict[int, RankError] = {}
        pending = set(range(n))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            for r in sorted(pending):
                conn, proc = self._conns[r], self._procs[r]
                if conn.poll():
                    try:
                        tag, payload = conn.recv()
                    except (EOFError, OSError):
                        proc.join(1.0)
                        tag, payload = "died", None
                elif not proc.is_alive():
                    tag, payload = "died", None
                else:
                    continue
                pending.discard(r)
                if tag == expect:
                    results[r] = payload
                elif tag == "err":
                    errors[r] = RankError(r, f"{what} raised {payload[0]}", payload[1], payload[2])
                else:
                    errors[r] = RankError(r, f"rank process died ({_exit_text(proc.exitcode)}) during {what}")
                    errors[r].died = True
                if errors and (deadline is None or deadline > time.monotonic() + self.grace_s):
                    deadline = time.monotonic() + self.grace_s
            if not pending:
                break
            now = time.monotonic()
            if deadline is not None and now > deadline:
                self.kill()
                if not errors:
                    raise TilecommError(f"RankPool: ranks {sorted(pending)} did not finish {what} in {timeout_s:g} s")
                break
            waitables = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            mpc.wait(waitables, timeout=None if deadline is None else max(0.0, min(1.0, deadline - now)))
        if errors:
            raise _culprit(errors, sorted(pending))
        return results

    def kill(self) -> None:
        """Stop every rank now (SIGKILL: their shared memory is already unlinked, nothing leaks)."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []
        self._close_store()

    def _close_store(self) -> None:
        self._store = None  # its server stops listening

    def close(self) -> None:
        """Let every rank finalize (bounded by timeout_s), then kill what is left."""
        if not self._procs:
            self._close_store()
            return
        for c in self._conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + self.timeout_s + 10.0
        while any(p.is_alive() for p in self._procs) and time.monotonic() < deadline:
            # a short wait, then is_alive() again: waiting on the sentinels alone sometimes ran to the deadline
            # although every rank had finished (30 s closes in the CPU suite after test_moe_layer's
            # torch.compile cases; which process kept a sentinel's pipe open was not pinned down)
            mpc.wait([p.sentinel for p in self._procs if p.is_alive()], timeout=max(0.0, min(0.05, deadline - time.monotonic())))
        self.kill()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:  # Ctrl-C, a RankError or any other exception in the launcher: stop the ranks now
            self.kill()


def _culprit(errors: Dict[int, RankError], unfinished: List[int]) -> RankError:
    """The error to raise: a rank that died beats one that raised, and a rank's own error beats a
    timeout or lost peer that another rank's failure caused; the others are listed after it."""

    def order(item):
        r, err = item
        consequential = isinstance(err.original, _CONSEQUENTIAL) or any(
            name in str(err).split("\n", 1)[0] for name in ("HostWaitError", "HostTimeoutError", "WaitTimeoutError"))
        return (0 if getattr(err, "died", False) else 1 if not consequential else 2, r)

    ranked = sorted(errors.items(), key=order)
    first = ranked[0][1]
    others = [f"rank {r}: {str(e).splitlines()[0][len(f'rank {r}: '):][:300]}" for r, e in ranked[1:]]
    others += [f"rank {r}: killed by the pool (had not finished)" for r in unfinished]
    if others:
        first.args = (first.args[0] + "\n--- the other ranks ---\n" + "\n".join(others),)
    return first


def launch(fn: Callable, world_size: int, *args, backend: str = "cpu", env: Optional[Dict[str, str]] = None, **kwargs) -> List[Any]:
    """Start `world_size` ranks, run fn(*args, **kwargs) on each, shut down; results by rank."""
    with RankPool(world_size, backend=backend, env=env) as pool:
        return pool.run(fn, *args, **kwargs)
