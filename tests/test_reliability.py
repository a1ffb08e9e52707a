"""Nothing waits forever and nothing is orphaned: every host-side wait honours TILECOMM_TIMEOUT_S and
names the call; ranks die with their launcher (SIGTERM, SIGINT, SIGKILL); the rank that died is the
one named; local pools listen on 127.0.0.1 only."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import tilecomm
from tilecomm.errors import HostTimeoutError, HostWaitError
from tilecomm.spawn import RankError

HERE = os.path.dirname(os.path.abspath(__file__))
LINUX = sys.platform.startswith("linux")
T = 3.0  # TILECOMM_TIMEOUT_S of the pools below: every failure here comes after about this long


def _skip(call: str):
    """Rank 0 makes `call`, rank 1 does not: rank 0 must raise a timeout naming it, within T."""
    if tilecomm.rank() != 0:
        return None
    start = time.monotonic()
    try:
        if call == "barrier":
            tilecomm.barrier()
        elif call == "empty":
            tilecomm.empty((4,), torch.float32)
        elif call == "zeros":
            tilecomm.zeros((4,), torch.float32)
        elif call == "collective":
            tilecomm.all_gather_into_tensor(torch.empty(2 * tilecomm.world_size()), torch.ones(2))
        elif call == "finalize":
            tilecomm.finalize()
    except TimeoutError as err:  # HostTimeoutError (host waits) or WaitTimeoutError (device waits)
        again = None
        if isinstance(err, HostTimeoutError) and call != "finalize":
            try:  # the exchange is broken now: the next call says so at once
                tilecomm.barrier()
            except HostWaitError as later:
                again = str(later)
        return type(err).__name__, str(err), time.monotonic() - start, again
    raise AssertionError(f"{call} skipped by rank 1 returned on rank 0")


def _fresh_runtime():
    """Drop this rank's runtime without a collective step and start a new one (new heap, new
    bootstrap group): the way back after a failure, for the next case of the same pool."""
    ctx = tilecomm.runtime._CTX
    if ctx is not None:
        tilecomm.runtime._finalize_at_exit()
        ctx.boot.close()
    tilecomm.init(backend="cpu")


@pytest.fixture(scope="module")
def pool():
    with tilecomm.RankPool(2, env={"TILECOMM_TIMEOUT_S": str(T), "TILECOMM_HEAP_BYTES": "16MiB"}) as p:
        yield p


@pytest.mark.parametrize("call,label", [("barrier", "tilecomm.barrier"), ("empty", "tilecomm.empty"),
                                        ("zeros", "tilecomm.empty"), ("finalize", "tilecomm.finalize"),
                                        ("collective", None)])
def test_a_rank_that_skips_a_call_times_the_others_out(pool, call, label):
    try:
        (kind, text, seconds, again), skipped = pool.run(_skip, call, timeout_s=60 + 2 * T)
    finally:
        pool.run(_fresh_runtime)
    assert skipped is None
    assert text.startswith("rank 0: "), text
    if label is not None:  # host waits: the call and the limit are named
        assert kind == "HostTimeoutError" and label in text and f"within {T:g} s (TILECOMM_TIMEOUT_S)" in text, text
        assert call == "finalize" or "an earlier host-side exchange failed" in again, again
    assert seconds >= T * 0.9, seconds  # it did wait for the others (the only bound is RankPool's hang guard)


def _barrier_on_rank_0():
    if tilecomm.rank() == 0:
        tilecomm.barrier()


def test_a_rank_whose_host_exchange_broke_leaves_the_pool():
    """After a host-side failure the runtime cannot continue: the rank exits, the pool is seen dead
    (test harnesses replace it) instead of failing every later call."""
    with tilecomm.RankPool(2, env={"TILECOMM_TIMEOUT_S": str(T), "TILECOMM_HEAP_BYTES": "16MiB"}) as p:
        with pytest.raises(RankError, match="HostTimeoutError") as info:
            p.run(_barrier_on_rank_0, timeout_s=60 + 2 * T)
        assert info.value.rank == 0
        p._procs[0].join(30)
        assert not p.alive and p._procs[0].exitcode is not None


def _sleep_and_return_rank(seconds: float) -> int:
    time.sleep(seconds)
    return tilecomm.rank()


class _Interrupted(Exception):
    pass


def test_a_pool_interrupted_while_its_ranks_run_goes_away():
    """A caller interrupted inside run() (a test's time limit, Ctrl-C) while the ranks still run fn: the pool
    is killed, so the ranks' late replies cannot answer the next call (on 2 GPUs a timed-out test's replies
    were taken as the next test's results); later calls raise, and a test harness makes a new pool."""
    def interrupt(signum, frame):
        raise _Interrupted()

    with tilecomm.RankPool(2, env={"TILECOMM_TIMEOUT_S": str(T), "TILECOMM_HEAP_BYTES": "16MiB"}) as p:
        assert p.run(_sleep_and_return_rank, 0.0) == [0, 1]
        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            with pytest.raises(_Interrupted):
                p.run(_sleep_and_return_rank, 30.0)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert not p.alive
        with pytest.raises(tilecomm.TilecommError, match="closed or a rank has died"):
            p.run(_sleep_and_return_rank, 0.0)


def _finalize_with_an_error_recorded_on_rank_0():
    """(raised, seconds) of tilecomm.finalize() when rank 0 holds an unraised device-side error."""
    from tilecomm.errors import PeerMismatchError

    if tilecomm.rank() == 0:
        tilecomm.current().device_state.error[:4] = torch.tensor([6, 0, 1, 0])  # ranks in different collectives
    start = time.monotonic()
    try:
        tilecomm.finalize()
    except PeerMismatchError:
        return True, time.monotonic() - start
    return False, time.monotonic() - start


def test_finalize_with_an_unraised_device_error_does_not_hold_the_peers():
    """The error is raised on its rank after the finalize barrier, so the peers do not wait out the timeout
    there (a pool whose rank held one took the whole timeout to close)."""
    with tilecomm.RankPool(2, env={"TILECOMM_TIMEOUT_S": "30", "TILECOMM_HEAP_BYTES": "16MiB"}) as p:
        (raised0, took0), (raised1, took1) = p.run(_finalize_with_an_error_recorded_on_rank_0, timeout_s=120)
    assert raised0 and not raised1
    assert max(took0, took1) < 10, (took0, took1)


def test_rendezvous_under_rank_env_honours_the_timeout(tmp_path):
    """RANK/WORLD_SIZE say 2 ranks, one starts: init gives up after TILECOMM_TIMEOUT_S, naming the rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               TILECOMM_TIMEOUT_S="2")
    code = ("import tilecomm\nfrom tilecomm.errors import HostTimeoutError\ntry:\n    tilecomm.init(backend='cpu')\n"
            "except HostTimeoutError as e:\n    print('TIMEOUT', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "TIMEOUT rank 0: tilecomm.init (rendezvous" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "within 2 s" in proc.stdout


def _suicide_on_rank_1():
    tilecomm.barrier()
    if tilecomm.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    tilecomm.barrier()  # the peers lose rank 1 here


def test_the_rank_that_died_is_named():
    with tilecomm.RankPool(3, env={"TILECOMM_TIMEOUT_S": "5", "TILECOMM_HEAP_BYTES": "16MiB"}) as p:
        with pytest.raises(RankError) as info:
            p.run(_suicide_on_rank_1, timeout_s=120)
    text = str(info.value)
    assert info.value.rank == 1 and "rank process died (killed by SIGKILL)" in text, text
    assert "--- the other ranks ---" in text and "rank 0:" in text and "rank 2:" in text, text


def _rank_pids(piddir, world, proc):
    deadline = time.monotonic() + 240
    while len(glob.glob(os.path.join(piddir, "rank*.pid"))) < world:
        assert proc.poll() is None, f"the launcher exited ({proc.returncode}) before its ranks started"
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.05)
    return [int(open(p).read()) for p in sorted(glob.glob(os.path.join(piddir, "rank*.pid")))]


def _shell_like_signals():
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM])


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not LINUX, reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_ranks_stop_with_their_launcher(tmp_path, sig):
    before = set(glob.glob("/dev/shm/tilecomm-*"))
    # The launcher starts as from a shell: SIGINT at its default and unblocked (a test process may have
    # ignored or blocked it, and exec keeps both), and its stderr in a file (a full pipe would block it).
    err_file = open(tmp_path / "launcher.err", "w+")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "launcher_job.py"), str(tmp_path), "2"],
                            stdout=subprocess.DEVNULL, stderr=err_file, text=True, preexec_fn=_shell_like_signals)
    try:
        pids = _rank_pids(str(tmp_path), 2, proc)
        assert all(_running(p) for p in pids)
        proc.send_signal(sig)
        proc.wait(timeout=150)  # seconds on an idle machine; CI's two loaded cores once took over 60
        deadline = time.monotonic() + 60  # a hang guard: without the fix they run forever
        while any(_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_running(p) for p in pids), f"ranks {pids} outlived their launcher ({sig.name})"
    finally:
        if proc.poll() is None:
            proc.kill()
        err_file.close()
    assert set(glob.glob("/dev/shm/tilecomm-*")) <= before


def _listening(pid):
    """(address, port) of every TCP socket `pid` listens on (Linux /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    addr, port = cols[1].rsplit(":", 1)
                    out.append((addr, int(port, 16)))
    return out


def _my_listening():
    return os.getpid(), _listening(os.getpid()), os.environ["MASTER_PORT"]


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_local_pool_listens_on_loopback_only(pool):
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::ffff:127.0.0.1
    ranks = pool.run(_my_listening)
    port = int(ranks[0][2])
    store = [addr for addr, p in _listening(os.getpid()) if p == port]  # the store listens in the launcher
    assert store and all(addr in loopback for addr in store), (port, store)
    for pid, sockets, _ in ranks:  # and the ranks' own sockets (gloo) too
        for addr, p in sockets:
            assert addr in loopback, f"rank pid {pid} listens on {addr}:{p}, not 127.0.0.1"


def _low_latency_calls_rank_1_skips():
    """Rank 0 queues two low-latency dispatch + combine calls (no host sync between them) that rank 1 never
    makes: the first wait times out; the waits of the kernels queued behind it then give up at once (a wait
    that has lasted a millisecond watches the error record), so the error reaches the host after about one
    timeout, not one per queued kernel (four here). One call of both ranks first: the timed calls compile
    nothing (compiling took 8-13 s on an H200 and was counted as waiting, 2026-11-27)."""
    from tilecomm.dispatch import Dispatcher
    from tilecomm.errors import WaitTimeoutError

    d = Dispatcher(8, 64, 4, 2, torch.float32, mode="low_latency")  # (collective: both ranks)
    x, idx, w = torch.randn(4, 64, device="cuda"), torch.tensor([[0, 5], [1, 6], [2, 7], [3, 4]], device="cuda"), \
        torch.rand(4, 2, device="cuda")
    with torch.no_grad():  # both ranks: the kernels compile here, outside the timed calls
        res = d.dispatch(x, idx, w)
        d.combine(res.x, res.handle)
    torch.cuda.synchronize()
    tilecomm.barrier()
    if tilecomm.rank() != 0:
        return None
    start = time.monotonic()
    try:
        with torch.no_grad():
            for _ in range(2):
                res = d.dispatch(x, idx, w)
                d.combine(res.x, res.handle)
        torch.cuda.synchronize()
        tilecomm.check_errors()
    except WaitTimeoutError as err:
        return time.monotonic() - start, str(err)
    raise AssertionError("rank 0's calls returned without a timeout")


def test_kernels_queued_behind_a_timeout_give_up_at_once():
    from conftest import BACKEND

    if BACKEND != "cuda":
        pytest.skip("device-side waits that time out into the error record: GPU ranks (TILECOMM_TEST_BACKEND=cuda)")
    with tilecomm.RankPool(2, backend="cuda", env={"TILECOMM_TIMEOUT_S": str(T), "TILECOMM_HEAP_BYTES": "64MiB"}) as p:
        try:
            (seconds, text), skipped = p.run(_low_latency_calls_rank_1_skips, timeout_s=60 + 8 * T)
        finally:
            p.kill()  # rank 0's runtime waits for a peer that is gone
    assert skipped is None and "rank 0" in text, text
    assert T * 0.9 <= seconds < 2 * T, f"the error took {seconds:.1f} s to reach the host (timeout {T} s)"
