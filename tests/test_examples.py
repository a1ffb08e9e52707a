"""The examples run end to end on CPU ranks, as the README says."""
from __future__ import annotations

import json
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


@pytest.mark.parametrize("op,size", [("all_to_all", ["--rows", "16,8", "--hidden", "32"]),
                                     ("all_gather", ["--shape", "16x32"]), ("reduce_scatter", ["--shape", "16x32"]),
                                     ("dispatch", ["--tokens", "16", "--hidden", "32", "--experts", "8", "--topk", "2"]),
                                     ("ag_gemm", ["--shapes", "16x16x16"]), ("gemm_rs", ["--shapes", "16x16x16"])])
def test_bench_cli_on_cpu_ranks(tmp_path, op, size):
    out = tmp_path / "rows.json"
    _run(["-m", "tilecomm.bench", op, "--backend", "cpu", "--world-size", "2", "--dtype", "float32", *size,
          "--json", str(out)])
    rows = json.loads(out.read_text())
    assert rows and all(r["op"] == op and r["tilecomm_us"] > 0 and r["baseline_us"] > 0 for r in rows)
