"""Every environment variable tilecomm reads, in one place.

| variable                  | default   | meaning                                                        |
|---------------------------|-----------|----------------------------------------------------------------|
| TILECOMM_BACKEND          | auto      | "auto", "cuda" or "cpu"; `init(backend=...)` overrides it       |
| TILECOMM_TIMEOUT_S        | 60        | seconds any wait on another rank may take before it fails:     |
|                           |           | device-side spins, host barriers and object exchanges, the     |
|                           |           | rendezvous and process groups of RankPool / RANK/WORLD_SIZE    |
|                           |           | starts, RankPool joins (a finite number > 0)                   |
| TILECOMM_HEAP_BYTES       | 1 GiB GPU | size of each rank's symmetric heap (256 MiB on CPU ranks)      |
| TILECOMM_WORKSPACE_BYTES  | 1/4 heap  | staging space the collectives keep on the heap                 |
| TILECOMM_CHECK            | 0         | 1: GPU kernels check every tcl.put/get/symm_at/signal PE and    |
|                           |           | heap address (CPU ranks always do); read once at import         |
| TILECOMM_TRANSPORT        | nvlink    | GPU kernels: "nvlink" (direct loads/stores, NVSHMEM for peers  |
|                           |           | without a mapping) or "nvshmem" (NVSHMEM device calls always); |
|                           |           | read once at import, because kernels compile it in             |
| TILECOMM_CPU_JITTER_MS    | 0         | CPU ranks: a random pause of up to this many ms after every     |
|                           |           | tcl.signal and tcl.wait (tests: the interpreter runs programs  |
|                           |           | one after another, which hides ordering races; pauses widen    |
|                           |           | their windows); read once at import                            |

Nothing else in the package touches `os.environ`.
"""
from __future__ import annotations

import math
import os
from typing import Mapping, Optional

_MIB = 1 << 20


def _parse_bytes(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    text = raw.strip().lower()
    scale = 1
    for suffix, mult in (("gib", 1 << 30), ("mib", _MIB), ("kib", 1 << 10), ("g", 1 << 30), ("m", _MIB), ("k", 1 << 10)):
        if text.endswith(suffix):
            text, scale = text[: -len(suffix)], mult
            break
    try:
        number = float(text) * scale
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise ValueError(f"{name}={raw!r}: expected a byte count such as 268435456, 256MiB or 1GiB") from None
    value = int(number)
    if value <= 0:
        raise ValueError(f"{name}={raw!r}: expected a positive byte count")
    return value


def backend() -> str:
    value = os.environ.get("TILECOMM_BACKEND", "auto").strip().lower() or "auto"
    if value not in ("auto", "cuda", "cpu"):
        raise ValueError(f"TILECOMM_BACKEND={value!r}: expected 'auto', 'cuda' or 'cpu'")
    return value


def check_timeout(value, what: str) -> float:
    """value as float seconds if it is a finite number > 0, else ValueError naming `what`."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{what}={value!r}: expected a finite number of seconds > 0, such as 60")
    return seconds


def timeout_s(environ: Optional[Mapping[str, str]] = None) -> float:
    """TILECOMM_TIMEOUT_S of `environ` (default: this process's environment)."""
    raw = (os.environ if environ is None else environ).get("TILECOMM_TIMEOUT_S", "60")
    return check_timeout(raw.strip() if isinstance(raw, str) else raw, "TILECOMM_TIMEOUT_S")


def heap_bytes(on_gpu: bool = True) -> int:
    """GPUs: 1 GiB, whose quarter (the collectives' workspace) holds two rings of full chunks for two programs
    per SM (collectives/state.py); CPU ranks: 256 MiB of shared memory."""
    return _parse_bytes("TILECOMM_HEAP_BYTES", (1024 if on_gpu else 256) * _MIB)


def workspace_bytes(heap: int) -> int:
    return _parse_bytes("TILECOMM_WORKSPACE_BYTES", heap // 4)


def check() -> bool:
    raw = os.environ.get("TILECOMM_CHECK", "0").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"TILECOMM_CHECK={raw!r}: expected 0 or 1")
    return raw == "1"


def cpu_jitter_s() -> float:
    raw = os.environ.get("TILECOMM_CPU_JITTER_MS", "0").strip() or "0"
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"TILECOMM_CPU_JITTER_MS={raw!r}: expected a number of milliseconds >= 0")
    return value / 1e3


def transport() -> str:
    value = os.environ.get("TILECOMM_TRANSPORT", "nvlink").strip().lower() or "nvlink"
    if value not in ("nvlink", "nvshmem"):
        raise ValueError(f"TILECOMM_TRANSPORT={value!r}: expected 'nvlink' or 'nvshmem'")
    return value


def launcher_env() -> dict:
    """Rank variables set by torchrun, mpirun (Open MPI, MPICH/PMI) or by hand."""
    env = os.environ
    out = {}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if key in env:
            out[key] = env[key]
    out["under_mpi"] = any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE"))
    return out


def require_nvls_off() -> None:
    """NVLink multicast (NVLS) must stay off on shared multi-GPU hosts; refuse to start otherwise."""
    if os.environ.get("NVSHMEM_DISABLE_NVLS", "1") != "1":
        raise RuntimeError("tilecomm: NVSHMEM_DISABLE_NVLS must be 1 (NVLink multicast is not used and must stay off)")
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
