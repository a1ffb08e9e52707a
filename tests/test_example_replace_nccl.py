"""examples/replace_nccl_all_to_all.py trains the same MoE layer with both dispatchers and gets the same losses."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_replace_nccl_all_to_all_example():
    env = dict(os.environ, TILECOMM_TIMEOUT_S="30", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "examples/replace_nccl_all_to_all.py", "--world-size", "2", "--steps", "5"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"example failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "same losses" in proc.stdout, proc.stdout
