"""A launcher whose ranks never finish on their own, for the orphan tests of test_reliability.py.

    python launcher_job.py PIDDIR WORLD

Each rank writes its pid to PIDDIR/rank<r>.pid and then sleeps forever: only the launcher (Ctrl-C,
an exception) or its death (SIGTERM, SIGKILL) can stop it.
"""
from __future__ import annotations

import os
import sys
import time

import tilecomm


def forever(piddir: str) -> None:
    path = os.path.join(piddir, f"rank{tilecomm.rank()}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    tilecomm.launch(forever, int(sys.argv[2]), sys.argv[1])
