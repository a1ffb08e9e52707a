"""Checkpoints are crash-safe and verified: a kill -9 at any moment of a save leaves a loadable
checkpoint (the previous one until the new one is whole); a truncated, corrupted, added or
missing file fails with an error naming it before torch reads anything; the example's
--checkpoint-every run killed with kill -9 resumes on the same loss curve with no duplicated log lines."""
from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from tilecomm.moe import checkpoint
from tilecomm.moe.checkpoint import CheckpointError

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import checkpoint_job as job  # noqa: E402


def _save(path, step):
    model, opt = job.model_at(step)
    checkpoint.save(str(path), step, model, opt, job.key_of, job.CONFIG)


def _load(path):
    """(step, model) loaded into a model filled with -1 (so a load that skips a tensor shows)."""
    model, opt = job.model_at(-1)
    step = checkpoint.load(str(path), model, opt, job.key_of, job.CONFIG)
    return step, model


def _assert_whole(path, step):
    got, model = _load(path)
    assert got == step
    for p in model.parameters():
        assert torch.equal(p, torch.full_like(p, step)), (step, p.flatten()[:4])


def _folder(path):
    return checkpoint.latest(str(path))


def _shard(path):
    folder = _folder(path)
    return max((os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".distcp")), key=os.path.getsize)


def test_save_load_round_trip_keeps_only_the_latest(tmp_path):
    for step in (3, 4):
        _save(tmp_path, step)
    _assert_whole(tmp_path, 4)
    assert sorted(os.listdir(tmp_path)) == ["LATEST", os.path.basename(_folder(tmp_path))]
    manifest = json.load(open(os.path.join(_folder(tmp_path), "MANIFEST.json")))
    assert manifest["step"] == 4 and {".metadata", "tilecomm_config.json"} <= set(manifest["files"])


def _garbage(name, data: bytes, where: int):
    with open(name, "r+b") as f:
        f.seek(where)
        f.write(data)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "config", "metadata"])
def test_damaged_file_is_named_before_torch_reads_it(tmp_path, damage):
    _save(tmp_path, 2)
    folder, shard = _folder(tmp_path), _shard(tmp_path)
    if damage == "garbage":  # 4 KiB of garbage in the middle of a shard: same size, other bytes
        target, pattern = shard, "is corrupted: its sha256 differs"
        _garbage(shard, os.urandom(4096), os.path.getsize(shard) // 2)
    elif damage == "truncated":
        target, pattern = shard, "is truncated"
        os.truncate(shard, os.path.getsize(shard) // 3)
    elif damage == "empty":  # what a kill -9 used to leave
        target, pattern = shard, "is truncated: 0 bytes"
        os.truncate(shard, 0)
    elif damage == "config":
        target, pattern = os.path.join(folder, "tilecomm_config.json"), "is truncated"
        with open(target, "w") as f:
            f.write("{not json")
    else:  # a crafted .metadata (DCP unpickles it): never opened
        target, pattern = os.path.join(folder, ".metadata"), "is (corrupted|truncated|longer than written)"
        marker = tmp_path / "pwned"
        with open(target, "wb") as f:
            pickle.dump(_Crafted(str(marker)), f)
    with pytest.raises(CheckpointError, match=pattern) as info:
        _load(tmp_path)
    assert repr(target) in str(info.value), str(info.value)
    if damage == "metadata":
        assert not (tmp_path / "pwned").exists()


class _Crafted:
    """Unpickling this creates a file: the check must refuse the file before any unpickling."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_config_json_that_matches_its_manifest_but_does_not_parse(tmp_path):
    _save(tmp_path, 1)
    folder = _folder(tmp_path)
    config = os.path.join(folder, "tilecomm_config.json")
    with open(config, "w") as f:
        f.write("{oops")
    manifest_path = os.path.join(folder, "MANIFEST.json")
    manifest = json.load(open(manifest_path))
    manifest["files"]["tilecomm_config.json"] = {"bytes": 5, "sha256": checkpoint._sha256(config)}
    json.dump(manifest, open(manifest_path, "w"))
    with pytest.raises(CheckpointError, match="tilecomm_config.json.*cannot read the config"):
        _load(tmp_path)


def test_missing_added_and_pointer_problems_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        _load(tmp_path)
    _save(tmp_path, 1)
    folder = _folder(tmp_path)
    extra = os.path.join(folder, "__9_0.distcp")
    open(extra, "wb").write(b"x")
    with pytest.raises(CheckpointError, match=r"__9_0.distcp.*not in the manifest"):
        _load(tmp_path)
    os.remove(extra)
    shard = _shard(tmp_path)
    os.rename(shard, shard + ".moved")
    with pytest.raises(CheckpointError, match=rf"{os.path.basename(shard)}.*is missing"):
        _load(tmp_path)
    os.rename(shard + ".moved", shard)
    for text, pattern in (("{", "MANIFEST.json.*not a valid manifest"), ('{"files": {}, "step": "x"}', "not a valid")):
        saved = open(os.path.join(folder, "MANIFEST.json")).read()
        open(os.path.join(folder, "MANIFEST.json"), "w").write(text)
        with pytest.raises(CheckpointError, match=pattern):
            _load(tmp_path)
        open(os.path.join(folder, "MANIFEST.json"), "w").write(saved)
    open(tmp_path / "LATEST", "w").write("../../etc\n")
    with pytest.raises(CheckpointError, match="LATEST.*expected the name of a step"):
        _load(tmp_path)


def _run_job(path, first, last, crash_at=None):
    return subprocess.run([sys.executable, os.path.join(HERE, "checkpoint_job.py"), str(path), str(first), str(last)]
                          + ([crash_at] if crash_at else []), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("crash_at,survivor", [("shards", 2), ("manifest", 2), ("latest", 2), ("cleanup", 3)])
def test_kill_9_at_each_stage_of_a_save(tmp_path, crash_at, survivor):
    proc = _run_job(tmp_path, 1, 3, crash_at)  # steps 1, 2 saved; killed while saving 3
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert proc.stdout.split() == ["saved", "1", "saved", "2"]
    _assert_whole(tmp_path, survivor)
    _save(tmp_path, 4)  # the next save clears what the killed one left
    assert sorted(os.listdir(tmp_path)) == ["LATEST", os.path.basename(_folder(tmp_path))]


def test_kill_9_at_random_moments(tmp_path):
    """Saves in a loop, killed at random times: every time, the checkpoint loads whole."""
    rng, first = random.Random(), 1
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, "checkpoint_job.py"), str(tmp_path), str(first),
                                 "1000000"], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().startswith("saved")  # at least one save of this round is complete
        time.sleep(rng.uniform(0.0, 0.3))
        proc.kill()
        proc.wait()
        proc.stdout.close()
        step, _ = _load(tmp_path)
        assert step >= first
        _assert_whole(tmp_path, step)
        first = step + 1


def _children(pid):
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _gone(pids, limit_s=60.0):
    """True once none of pids runs (polled; limit_s only guards against a hang)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _log(out):
    with open(out / "log.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_example_killed_with_kill_9_resumes_the_same_curve(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, TILECOMM_TIMEOUT_S="60", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "examples/pretrain_moe.py", "--steps", "4", "--checkpoint-every", "2", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 400
    while not (out / "log.jsonl").exists() or len(open(out / "log.jsonl").readlines()) < 3:  # past the step-2 checkpoint
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:] if proc.poll() else "hang"
        time.sleep(0.02)
    ranks = _children(proc.pid)
    proc.kill()  # kill -9 the launcher: its ranks die with it
    proc.wait()
    proc.stderr.close()
    assert ranks and _gone(ranks), f"rank processes {ranks} outlived their launcher"
    killed = _log(out)
    start = checkpoint._read_manifest(checkpoint.latest(str(out / "checkpoint")))["step"]
    redone = [r for r in killed if r["step"] >= start]  # logged after the checkpoint: redone after resume
    assert start >= 2 and redone, (start, killed)
    resumed = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = _log(out)
    assert [r["step"] for r in rows] == list(range(4))  # no step twice, none missing
    assert checkpoint._read_manifest(checkpoint.latest(str(out / "checkpoint")))["step"] == 4
    for old in killed:  # the same curve: the redone steps give the very same losses
        assert old["loss"] == rows[old["step"]]["loss"], (old, rows[old["step"]])
