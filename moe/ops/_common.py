"""What the fused ops share: which path runs, and one kernel source for GPUs and CPU tensors.

Each op in this folder has a Triton kernel (with a launcher that checks its inputs) and a torch
reference. `use_triton` picks the kernel for CUDA tensors of a float dtype the kernels handle, the
reference otherwise: on CPU (the reference is faster there than the Triton interpreter, and keeps
the CPU numerics of the plain torch model) and while torch.compile traces (Inductor fuses the
reference itself). Tests run the kernels on CPU tensors through the interpreter (`Kernel`).
"""
from __future__ import annotations

import torch
import triton

import tilecomm

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton kernel should run on these tensors (see the module docstring)."""
    if torch.compiler.is_compiling():
        return False
    return all(t.is_cuda and (t.dtype in KERNEL_DTYPES or not t.is_floating_point()) for t in tensors)


class Kernel:
    """One kernel source launched as `kernel[grid](*args)`: compiled by plain `triton.jit` for CUDA
    tensors (no runtime hooks on the hot path), run by the Triton interpreter (`tilecomm.jit`) for
    CPU tensors. The first argument decides."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = triton.jit(fn)
        self.interpreted = tilecomm.jit(fn)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kernel = self.compiled if args[0].is_cuda else self.interpreted
            return kernel[grid](*args, **kwargs)
        return launch


def check_2d(name: str, t: torch.Tensor, cols: int = None) -> None:
    if t.dim() != 2 or (cols is not None and t.shape[1] != cols):
        want = f"[*, {cols}]" if cols is not None else "2-D"
        raise ValueError(f"{name} must be {want}, got {tuple(t.shape)}")
    if t.is_floating_point() and t.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} has no kernel (float32, bfloat16, float16)")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors on different devices: {devices}")
