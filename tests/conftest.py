"""Multi-rank test harness: one pool of ranks per world size, kept for the whole session.

`ranks(n)` gives a `tilecomm.RankPool` of n spawned processes with tilecomm initialised on the
backend named by TILECOMM_TEST_BACKEND ("cpu" by default; "cuda" on a GPU machine runs the same
test bodies on GPU ranks, one per GPU, skipping world sizes larger than the GPU count; with
TILECOMM_TEST_SHARE_GPUS=1 ranks share GPUs round-robin instead: a correctness run on a machine with
fewer GPUs, never a timing); `pool.run(fn, *args)` runs a module-level test body on every rank and returns the
results by rank (a rank's exception is re-raised as RankError naming the rank). A pool that
lost a rank is replaced on the next request. Each rank's heap is TILECOMM_TEST_HEAP_BYTES (64 MiB: small
rings, so transfers stream through them; on GPUs one program per SM. 1GiB gives GPU ranks the runtime's
default layout, two programs per SM).
"""
from __future__ import annotations

import glob
import importlib.util
import os

import pytest

import _gpu_build
import tilecomm

BACKEND = os.environ.get("TILECOMM_TEST_BACKEND", "cpu")
SHARE_GPUS = os.environ.get("TILECOMM_TEST_SHARE_GPUS", "0") == "1"
# device-side waits in tests fail after this long instead of hanging; ranks that share a GPU are
# time-sliced (a spinning kernel holds it for a slice), so they get longer
TEST_TIMEOUT_S = "120" if SHARE_GPUS else "20"
HEAP_BYTES = os.environ.get("TILECOMM_TEST_HEAP_BYTES", "64MiB")


class _Pools:
    def __init__(self):
        self.pools = {}

    def get(self, n: int) -> tilecomm.RankPool:
        if BACKEND == "cuda":
            import torch

            if n > torch.cuda.device_count() and not SHARE_GPUS:
                pytest.skip(f"{n} ranks need {n} GPUs; this machine has {torch.cuda.device_count()}")
        pool = self.pools.get(n)
        if pool is None or not pool.alive:
            if pool is not None:
                pool.kill()
            pool = tilecomm.RankPool(n, backend=BACKEND, env={"TILECOMM_TIMEOUT_S": TEST_TIMEOUT_S,
                                                           "TILECOMM_HEAP_BYTES": HEAP_BYTES}, grace_s=40)
            self.pools[n] = pool
        return pool

    def close(self):
        """Close the pools side by side (each lets its ranks finalize, bounded by its timeout); one that takes
        longer than a rank's usual exit (~1-6 s: the interpreter's teardown) is named in a warning."""
        import threading
        import time
        import warnings

        took = {}

        def close_one(n, pool):
            start = time.monotonic()
            pool.close()
            took[n] = time.monotonic() - start

        threads = [threading.Thread(target=close_one, args=item) for item in self.pools.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.pools.clear()
        slow = {n: round(s, 1) for n, s in sorted(took.items()) if s > 15}
        if slow:
            warnings.warn(f"rank pools slow to close at the end of the session (ranks: seconds): {slow}")


@pytest.fixture(scope="session")
def ranks():
    pools = _Pools()
    yield pools.get
    pools.close()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_leftovers():
    """After the whole session, no tilecomm segment may remain in /dev/shm."""
    before = set(glob.glob("/dev/shm/tilecomm-*"))
    yield
    left = set(glob.glob("/dev/shm/tilecomm-*")) - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"


def pytest_configure(config):
    os.environ.setdefault("TILECOMM_TIMEOUT_S", TEST_TIMEOUT_S)


def pytest_collection_modifyitems(session, config, items):
    """The sm_90 builds start now, niced, if their tests were selected (tests/_gpu_build.py)."""
    try:
        have_bitcode = importlib.util.find_spec("nvidia.nvshmem") is not None
    except ImportError:  # (no nvidia package at all)
        have_bitcode = False
    if have_bitcode and any(item.path.name == "test_gpu_compile.py" and "sm90" in item.name for item in items):
        _gpu_build.start_builds()


def pytest_unconfigure(config):
    _gpu_build.stop()
