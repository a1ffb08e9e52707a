"""Saves checkpoints of a small model in a loop, one per step, for the crash tests of test_checkpoint.py.

    python checkpoint_job.py PATH FIRST LAST [CRASH_AT]

Step s's checkpoint holds parameters filled with s, so a loaded checkpoint tells which step it is
and whether it is whole. CRASH_AT kills this process (SIGKILL, as kill -9) during the save of LAST:
"shards" once DCP has written the files, "manifest" before the folder is renamed, "latest" before
LATEST is switched, "cleanup" before the older checkpoints are deleted.
"""
from __future__ import annotations

import os
import signal
import sys

import torch
from torch import nn

from tilecomm.moe import checkpoint

CONFIG = {"job": "checkpoint_job"}


def model_at(step: int):
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 128))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(step)
    return model, torch.optim.AdamW(model.parameters())


def key_of(name, p):
    return name


def _die(*_, **__):
    os.kill(os.getpid(), signal.SIGKILL)


def arm(crash_at: str) -> None:
    """Make the next save die at `crash_at` (see the module docstring)."""
    if crash_at == "shards":
        checkpoint._write_durably = _die  # the config json: after every DCP file
    elif crash_at == "manifest":
        real_fsync = checkpoint._fsync
        checkpoint._fsync = lambda path: _die() if os.path.basename(path).startswith(".tmp-") else real_fsync(path)
    elif crash_at == "latest":
        checkpoint.os.replace = _die
    elif crash_at == "cleanup":
        checkpoint.shutil.rmtree = _die
    else:
        raise ValueError(f"CRASH_AT={crash_at!r}")


def main() -> None:
    path, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    crash_at = sys.argv[4] if len(sys.argv) > 4 else None
    for step in range(first, last + 1):
        model, opt = model_at(step)
        if crash_at and step == last:
            arm(crash_at)
        checkpoint.save(path, step, model, opt, key_of, CONFIG)
        print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main()
