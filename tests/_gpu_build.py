"""tests/gpu_compile.py's sm_90 builds as child processes, one per transport. conftest starts them as soon as the
session's tests are collected, at the lowest CPU priority, so that they use the CPU time the other tests leave idle
(CI has two cores, kept ~70% busy by the rank processes; from a cold Triton cache the builds take ~95 s of both
cores) instead of holding the whole machine when test_gpu_compile's turn comes. test_gpu_compile reads their rows.
Their output goes to temporary files (a pipe nobody reads yet would fill and stall them)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TRANSPORTS = ("nvlink", "nvshmem")
_builds: dict = {}  # transport -> (process, stdout file, stderr file)


def start(env_update: dict, background: bool = False):
    """(process, stdout file, stderr file) of gpu_compile.py under os.environ + env_update; background: niced."""
    out, err = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "gpu_compile.py")], env=dict(os.environ, **env_update),
                            stdout=out, stderr=err, text=True, preexec_fn=(lambda: os.nice(19)) if background else None)
    return proc, out, err


def finish(build, timeout: float = 900) -> tuple:
    """(return code, stdout, stderr) of a started build, once it exits."""
    proc, out, err = build
    proc.wait(timeout=timeout)
    out.seek(0)
    err.seek(0)
    result = proc.returncode, out.read(), err.read()
    out.close()
    err.close()
    return result


def start_builds() -> None:
    """Both transports' builds, in the background (conftest, once the tests that read them are collected)."""
    for transport in TRANSPORTS:
        if transport not in _builds:
            _builds[transport] = start({"TILECOMM_TRANSPORT": transport}, background=True)


def rows(transport: str) -> tuple:
    """(return code, stdout, stderr) of the transport's build (started now if conftest did not)."""
    if transport not in _builds:
        _builds[transport] = start({"TILECOMM_TRANSPORT": transport})
    return finish(_builds.pop(transport))


def stop() -> None:
    """End the builds no test read (a session stopped early)."""
    while _builds:
        proc, out, err = _builds.popitem()[1]
        proc.kill()
        proc.wait()
        out.close()
        err.close()


def parse(stdout: str) -> list:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
