"""AdamW over fp32 master weights for a model that computes in bf16 (or in fp32: then the
parameters are their own masters), one fused kernel per parameter (moe/ops/adamw.py).

    masters = cast_parameters(model, torch.bfloat16)     # the fp32 tensors the parameters held
    opt = AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                lr=3e-4, betas=(0.9, 0.95), masters=masters)
    ... loss.backward(); opt.step(grad_scale=scale); opt.zero_grad()

No weight is cast during forward or backward: the model holds bf16 parameters (gradients arrive in
bf16), the optimizer holds the fp32 masters and fp32 moments and writes the new bf16 weights in the
same pass. `grad_scale` (a device scalar) multiplies every gradient inside the kernel, so clipping
and averaging over ranks need no pass of their own and no host sync.

State per parameter (what checkpoints store): step (CPU float32 scalar, as torch's AdamW),
exp_avg, exp_avg_sq (fp32), and master (fp32) where the parameter is not fp32. The state exists
from construction on, so a checkpoint can be loaded into a fresh optimizer.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch
from torch import nn

from .ops.adamw import adamw_step_


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> Dict[nn.Parameter, torch.Tensor]:
    """Give every floating parameter of `model` the compute dtype, except those of modules that set
    `keep_fp32_params = True` (the router's gate); then modules with `follow_parameter_dtype()` (the
    tensor-parallel linears: their workspaces) take it too. Returns {parameter: the fp32 tensor it held}
    for the parameters cast (no copy: those tensors become the optimizer's master weights)."""
    masters: Dict[nn.Parameter, torch.Tensor] = {}
    if dtype == torch.float32:
        return masters
    for module in model.modules():
        if getattr(module, "keep_fp32_params", False):
            continue
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != dtype and p not in masters:
                if p.dtype != torch.float32:
                    raise ValueError(f"cast_parameters: parameters must start in float32 to keep as masters, got {p.dtype}")
                masters[p] = p.data
                p.data = p.data.to(dtype)
    for module in model.modules():  # e.g. tensor-parallel linears: their workspaces take the new dtype (collective)
        if hasattr(module, "follow_parameter_dtype"):
            module.follow_parameter_dtype()
    return masters


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay) with fp32 masters; see the module docstring.
    masters: {parameter: fp32 tensor} from `cast_parameters` (parameters not in it must be fp32)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, masters: Optional[Dict[nn.Parameter, torch.Tensor]] = None):
        if not 0.0 <= lr or not 0.0 <= eps or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamW: lr={lr}, eps={eps}, betas={betas} out of range")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        masters = masters or {}
        for group in self.param_groups:
            for p in group["params"]:
                master = masters.get(p)
                if master is None and p.dtype != torch.float32:
                    raise ValueError(f"AdamW: a {p.dtype} parameter of shape {tuple(p.shape)} has no fp32 master "
                                     "(use cast_parameters)")
                state = self.state[p]
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                if master is not None:
                    state["master"] = master
        self._ones: Dict[torch.device, torch.Tensor] = {}

    def _unit(self, device: torch.device) -> torch.Tensor:
        if device not in self._ones:
            self._ones[device] = torch.ones((), dtype=torch.float32, device=device)
        return self._ones[device]

    @torch.no_grad()
    def step(self, closure=None, grad_scale: Optional[torch.Tensor] = None):
        """One update of every parameter that has a gradient (others keep their state, as in torch).
        grad_scale: fp32 scalar tensor on the parameters' device multiplying every gradient."""
        if closure is not None:
            raise ValueError("AdamW.step: closures are not supported")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                master = state.get("master", p.data)
                scale = grad_scale if grad_scale is not None else self._unit(p.device)
                adamw_step_(master, p.grad, state["exp_avg"], state["exp_avg_sq"],
                            p.data if "master" in state else None, scale, step=int(state["step"]), lr=group["lr"],
                            beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
