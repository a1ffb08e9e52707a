"""tilecomm.init() finds its ranks from mpirun (mpi4py), torchrun (env) and a plain python call."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap_job.py")


def _run(cmd, n):
    env = dict(os.environ, TILECOMM_TIMEOUT_S="30")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    lines = sorted(re.findall(r"bootstrap=\w+ rank=\d+ world=\d+ ok", proc.stdout))  # ranks' lines may interleave
    assert len(lines) == n, proc.stdout
    return lines


def test_plain_python_is_one_rank():
    assert _run([sys.executable, JOB], 1) == ["bootstrap=single rank=0 world=1 ok"]


def test_torchrun_env():
    lines = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", JOB], 3)
    assert lines == [f"bootstrap=torch rank={r} world=3 ok" for r in range(3)]


def test_mpirun():
    pytest.importorskip("mpi4py", reason="the test extra installs mpi4py and mpich")
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun on PATH (the test extra's mpich provides one)")
    lines = _run([mpirun, "-n", "2", sys.executable, JOB], 2)
    assert lines == [f"bootstrap=mpi rank={r} world=2 ok" for r in range(2)]


_SKIP_BARRIER = """
import time
import tilecomm
from tilecomm.errors import HostTimeoutError
tilecomm.init(backend="cpu")
if tilecomm.rank() == 0:
    try:
        tilecomm.barrier()
    except HostTimeoutError as err:
        print("TIMEOUT", err, flush=True)
else:
    time.sleep(4)  # well past rank 0's limit, then join the barrier rank 0 left, so MPI shuts down cleanly
    tilecomm.current().boot.barrier()
"""


def test_mpi_barrier_honours_the_timeout():
    """MPI's blocking barrier cannot time out: tilecomm's polls a non-blocking one against TILECOMM_TIMEOUT_S."""
    pytest.importorskip("mpi4py", reason="the test extra installs mpi4py and mpich")
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("no mpirun on PATH (the test extra's mpich provides one)")
    env = dict(os.environ, TILECOMM_TIMEOUT_S="1")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    proc = subprocess.run([mpirun, "-n", "2", sys.executable, "-c", _SKIP_BARRIER], env=env, capture_output=True,
                          text=True, timeout=300)
    assert "TIMEOUT rank 0: tilecomm.barrier: the other ranks did not join within 1 s" in proc.stdout, (
        proc.stdout + proc.stderr[-3000:])
