"""Checkpoints through torch.distributed.checkpoint (DCP): model, AdamW state and the step.

Replicated tensors keep their name; tensors that differ per rank get a suffix from the caller's
`key_of(name, param)`: `@ep<rank>` for experts (per expert-parallel rank), `@tp<rank>` for
tensor-parallel shards. DCP stores each distinct tensor once. A checkpoint records its config
(including the tensor-parallel size when > 1); loading one from another config raises with the
first difference.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Dict

import torch
import torch.distributed.checkpoint as dcp
from torch import nn


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


def save(path: str, step: int, model: nn.Module, opt, key_of, config: dict) -> None:
    """key_of(name, param) -> the parameter's checkpoint key (its name, plus a per-rank suffix)."""
    state = _flat_state(model, opt, key_of)
    state["meta/step"] = torch.tensor(step)
    dcp.save(state, checkpoint_id=path)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        with open(os.path.join(path, "tilecomm_config.json"), "w") as f:
            json.dump(config, f, indent=1, sort_keys=True)


def load(path: str, model: nn.Module, opt, key_of, config: dict) -> int:
    """Load in place; returns the step to continue from. key_of as for `save`."""
    meta = os.path.join(path, "tilecomm_config.json")
    if not os.path.exists(meta):
        raise FileNotFoundError(f"checkpoint {path!r}: not found (no tilecomm_config.json)")
    with open(meta) as f:
        saved = json.load(f)
    current = json.loads(json.dumps(config, sort_keys=True))
    for key in sorted(set(saved) | set(current)):
        if saved.get(key) != current.get(key):
            raise ValueError(f"checkpoint {path!r} is from another config: {key} = {saved.get(key)!r} there, "
                             f"{current.get(key)!r} here")
    state = _flat_state(model, opt, key_of)
    state["meta/step"] = torch.tensor(0)
    dcp.load(state, checkpoint_id=path)
    return int(state["meta/step"])
