"""Crash-safe checkpoints through torch.distributed.checkpoint (DCP): model, AdamW state and the step.

Replicated tensors keep their name; tensors that differ per rank get a suffix from the caller's
`key_of(name, param)`: `@ep<rank>` for experts (per expert-parallel rank), `@tp<rank>` for
tensor-parallel shards. DCP stores each distinct tensor once. A checkpoint records its config
(including the tensor-parallel size when > 1); loading one from another config raises with the
first difference.

Layout of `path` (e.g. runs/pretrain_moe/checkpoint):

    LATEST                    name of the current checkpoint folder (replaced atomically)
    step-00000040-<id>/       .metadata, __<rank>_<i>.distcp (DCP), tilecomm_config.json, MANIFEST.json

`save` writes a new checkpoint into `.tmp-<id>/`, adds MANIFEST.json (size and sha256 of every file;
each rank hashes its share), renames the folder to `step-...` and only then points LATEST at it;
older folders are deleted after that. A kill at any moment leaves LATEST naming a complete
checkpoint: the previous one until the new one is whole.

Trust: DCP's `.metadata` is a pickle, so loading a checkpoint can run code: load only checkpoints
you (or someone you trust) wrote. `load` checks every file against MANIFEST.json (no file missing
or extra, sizes, sha256) before torch reads any of them, so a truncated, corrupted or swapped file
fails with `CheckpointError` naming it instead of training on garbage.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

LATEST = "LATEST"
MANIFEST = "MANIFEST.json"
CONFIG = "tilecomm_config.json"
_NAME = re.compile(r"^step-\d{8,}-[0-9a-f]{16}$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted or not a tilecomm checkpoint (names the file)."""


def _flat_state(model: nn.Module, opt: torch.optim.Optimizer, key_of: Callable[[str, torch.Tensor], str]) -> Dict:
    flat = {}
    for name, p in model.named_parameters():
        key = key_of(name, p)
        flat[f"model/{key}"] = p.data
        state = opt.state[p]
        if not state:  # a fresh optimizer: make AdamW's state so that loading has tensors to fill
            state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                         exp_avg_sq=torch.zeros_like(p))
        for k, v in state.items():
            flat[f"optim/{key}/{k}"] = v
    return flat


# -- the ranks (DCP's default group; one process without torch.distributed) -------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world():
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _all_gather(obj) -> List:
    if not _distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj):
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if _distributed():
        dist.barrier()


# -- files --------------------------------------------------------------------------------------------
def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _hash_share(folder: str, names: List[str]) -> Dict[str, dict]:
    """{name: {bytes, sha256}} of this rank's share of `names` (every W-th file from its rank)."""
    rank, world = _rank_world()
    out = {}
    for name in names[rank::world]:
        full = os.path.join(folder, name)
        out[name] = {"bytes": os.path.getsize(full), "sha256": _sha256(full)}
    return out


# -- save ---------------------------------------------------------------------------------------------
def save(path: str, step: int, model: nn.Module, opt, key_of, config: dict) -> None:
    """Collective. key_of(name, param) -> the parameter's checkpoint key (its name, plus a per-rank suffix)."""
    rank, _ = _rank_world()
    ident = None
    if rank == 0:
        ident = uuid.uuid4().hex[:16]
        os.makedirs(os.path.join(path, f".tmp-{ident}"))
    ident = _broadcast(ident)
    tmp = os.path.join(path, f".tmp-{ident}")
    state = _flat_state(model, opt, key_of)
    state["meta/step"] = torch.tensor(step)
    dcp.save(state, checkpoint_id=tmp)
    if rank == 0:
        _write_durably(os.path.join(tmp, CONFIG), json.dumps(config, indent=1, sort_keys=True))
    _barrier()  # every rank's files, .metadata and the config are written
    names = sorted(os.listdir(tmp))
    shares = _all_gather(_hash_share(tmp, names))
    if rank == 0:
        _commit(path, tmp, f"step-{step:08d}-{ident}", step, names, shares)
    _barrier()


def _commit(path: str, tmp: str, name: str, step: int, names: List[str], shares: List[Dict[str, dict]]) -> None:
    files = {k: v for share in shares for k, v in share.items()}
    if sorted(files) != names:
        raise CheckpointError(f"checkpoint {tmp!r}: the ranks saw different files ({sorted(files)} vs {names}); "
                              "checkpoints need a folder every rank shares")
    _write_durably(os.path.join(tmp, MANIFEST), json.dumps({"format": 1, "step": step, "files": files}, indent=1,
                                                           sort_keys=True))
    _fsync(tmp)
    final = os.path.join(path, name)
    os.rename(tmp, final)  # complete: now it may become LATEST
    _write_durably(os.path.join(path, LATEST + ".tmp"), name + "\n")
    os.replace(os.path.join(path, LATEST + ".tmp"), os.path.join(path, LATEST))
    _fsync(path)
    for old in os.listdir(path):  # earlier checkpoints and folders of interrupted saves
        if old != name and (old.startswith(".tmp-") or _NAME.match(old)):
            shutil.rmtree(os.path.join(path, old), ignore_errors=True)


# -- load ---------------------------------------------------------------------------------------------
def latest(path: str) -> str:
    """The folder LATEST names inside `path` (CheckpointError / FileNotFoundError if there is none)."""
    pointer = os.path.join(path, LATEST)
    if not os.path.exists(pointer):
        if os.path.exists(os.path.join(path, CONFIG)):
            raise CheckpointError(f"checkpoint {path!r} has no {LATEST}: it was written by an older tilecomm, without "
                                  "a manifest, and cannot be verified; train again from scratch")
        raise FileNotFoundError(f"checkpoint {path!r}: not found (no {LATEST} file)")
    with open(pointer) as f:
        name = f.read().strip()
    if not _NAME.match(name):
        raise CheckpointError(f"checkpoint file {pointer!r}: expected the name of a step-<step>-<id> folder, got {name[:80]!r}")
    folder = os.path.join(path, name)
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint file {pointer!r} names {name!r}, which does not exist")
    return folder


def _read_manifest(folder: str) -> dict:
    where = os.path.join(folder, MANIFEST)
    if not os.path.exists(where):
        raise CheckpointError(f"checkpoint {folder!r}: no {MANIFEST} (incomplete, or not a tilecomm checkpoint)")
    try:
        with open(where) as f:
            manifest = json.load(f)
        files = manifest["files"]
        ok = isinstance(manifest["step"], int) and all(
            isinstance(v["bytes"], int) and re.fullmatch(r"[0-9a-f]{64}", v["sha256"]) for v in files.values())
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"checkpoint file {where!r} is not a valid manifest ({err})") from None
    if not ok:
        raise CheckpointError(f"checkpoint file {where!r} is not a valid manifest (bad step, size or sha256)")
    return manifest


def _problems(folder: str, files: Dict[str, dict], names: List[str]) -> List[str]:
    """What is wrong with this rank's share of the files (empty when they match the manifest)."""
    rank, world = _rank_world()
    out = []
    for name in names[rank::world]:
        full, want = os.path.join(folder, name), files[name]
        size = os.path.getsize(full)
        if size != want["bytes"]:
            kind = "truncated" if size < want["bytes"] else "longer than written"
            out.append(f"checkpoint file {full!r} is {kind}: {size} bytes, the manifest says {want['bytes']}")
        elif _sha256(full) != want["sha256"]:
            out.append(f"checkpoint file {full!r} is corrupted: its sha256 differs from the manifest's")
    return out


def verify(path: str) -> dict:
    """Collective. Check the checkpoint LATEST names, file by file, against its manifest, before
    anything parses them; returns the manifest (with 'folder'). Raises CheckpointError naming the file."""
    folder = latest(path)
    manifest = _read_manifest(folder)
    files = manifest["files"]
    present = sorted(n for n in os.listdir(folder) if n != MANIFEST)
    missing, extra = sorted(set(files) - set(present)), sorted(set(present) - set(files))
    if missing:
        raise CheckpointError(f"checkpoint file {os.path.join(folder, missing[0])!r} is missing (listed in the manifest)")
    if extra:
        raise CheckpointError(f"checkpoint file {os.path.join(folder, extra[0])!r} is not in the manifest "
                              "(added after the checkpoint was written)")
    found = [p for share in _all_gather(_problems(folder, files, present)) for p in share]
    if found:
        raise CheckpointError(found[0] + (f" (and {len(found) - 1} more)" if len(found) > 1 else ""))
    return dict(manifest, folder=folder)


def load(path: str, model: nn.Module, opt, key_of, config: dict) -> int:
    """Collective. Verify, then load in place; returns the step to continue from. key_of as for `save`."""
    manifest = verify(path)
    folder = manifest["folder"]
    meta = os.path.join(folder, CONFIG)
    try:
        with open(meta) as f:
            saved = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint file {meta!r}: cannot read the config ({err})") from None
    current = json.loads(json.dumps(config, sort_keys=True))
    for key in sorted(set(saved) | set(current)):
        if saved.get(key) != current.get(key):
            raise ValueError(f"checkpoint {path!r} is from another config: {key} = {saved.get(key)!r} there, "
                             f"{current.get(key)!r} here")
    state = _flat_state(model, opt, key_of)
    state["meta/step"] = torch.tensor(0)
    dcp.load(state, checkpoint_id=folder)
    step = int(state["meta/step"])
    if step != manifest["step"]:
        raise CheckpointError(f"checkpoint {folder!r}: holds step {step}, its manifest says {manifest['step']}")
    for key, t in state.items():
        if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"checkpoint {folder!r}: {key} holds non-finite values (saved from a diverged run?)")
    return step


def truncate_log(log_path: str, step: int) -> int:
    """Keep the JSONL log's records of steps < `step` (a resumed run rewrites the rest); drops torn
    lines a kill left. Atomic (rewritten beside, then renamed). Returns the number of lines dropped."""
    if not os.path.exists(log_path):
        return 0
    kept, dropped = [], 0
    with open(log_path) as f:
        for line in f:
            try:
                ok = json.loads(line)["step"] < step
            except (ValueError, KeyError, TypeError):
                ok = False
            if ok and line.endswith("\n"):
                kept.append(line)
            else:
                dropped += 1
    _write_durably(log_path + ".tmp", "".join(kept))
    os.replace(log_path + ".tmp", log_path)
    return dropped
