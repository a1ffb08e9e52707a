"""The optional native part: CMake builds tilecomm_probe with nvcc against NVSHMEM's headers (no GPU
needed), and the constants tilecomm.language hard-codes equal the headers'."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tilecomm.language import abi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_probe_constants_match_nvshmem_headers(tmp_path):
    for tool in ("cmake", "nvcc"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed: the native part is optional and is skipped without it")
    nvshmem = pytest.importorskip("nvidia.nvshmem", reason="the test extra installs nvidia-nvshmem-cu13 (headers)")
    home = list(nvshmem.__path__)[0]
    build = tmp_path / "build"
    cfg = subprocess.run(["cmake", "-S", ROOT, "-B", str(build), f"-DNVSHMEM_HOME={home}"], capture_output=True,
                         text=True, timeout=300)
    assert cfg.returncode == 0, cfg.stdout[-2000:] + cfg.stderr[-2000:]
    made = subprocess.run(["cmake", "--build", str(build), "--target", "tilecomm_probe"], capture_output=True,
                          text=True, timeout=600)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    out = subprocess.run([str(build / "tilecomm_probe")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    header = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    for name in ("SIGNAL_SET", "SIGNAL_ADD", "CMP_EQ", "CMP_NE", "CMP_GT", "CMP_LE", "CMP_LT", "CMP_GE"):
        assert int(header[name]) == getattr(abi, name), (name, header[name])
    assert header["VERSION"].startswith("3.")
