"""The examples run end to end on CPU ranks, as the README says."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, timeout=300):
    env = dict(os.environ, TILECOMM_TIMEOUT_S="30", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.parametrize("world", ["2", "3"])
def test_custom_overlap_kernel_example(world):
    out = _run(["examples/custom_overlap_kernel.py", "--world-size", world])
    assert out.count("max rel err") == int(world), out
