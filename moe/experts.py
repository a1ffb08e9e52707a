"""SwiGLU experts: `GroupedSwiGLUExperts` (this rank's E_l experts as one grouped GEMM pair) and
`SharedExpert` (a dense SwiGLU MLP every token goes through). Pure model math.

    experts = GroupedSwiGLUExperts(num_local_experts=4, hidden=64, ffn_hidden=128, dtype=torch.bfloat16)
    y = experts(x, tokens_per_expert)   # x [R, H] expert-major (rows of expert 0, then 1, ...) -> [R, H]

Per expert e: y = (silu(x @ Wg_e) * (x @ Wu_e)) @ Wd_e, with w_gate_up[e] = [Wg_e | Wu_e] ([H, 2F],
gate columns first) and w_down[e] = Wd_e ([F, H]). impl="auto" runs tilecomm.overlap.grouped_mm on Hopper
GPUs (sm_90 or later) in bf16 / fp16 outside torch.compile: the MoE layer forward + backward measured 1.21x
faster with it than with torch._grouped_mm on the DeepSeek-like layer and level on the pretraining one (one
H200, `python -m tilecomm.bench moe_layer`, "torch gemm" column, 2026-11-27, BENCHMARKS.md). Elsewhere "auto"
uses torch._grouped_mm where a one-time probe (forward and backward against the loop, per device / dtype /
shape) says it works, else the loop (torch.split by tokens_per_expert.tolist(): one host sync); "grouped" /
"loop" / "tilecomm" force one. x may hold
more rows than tokens_per_expert counts (a dispatcher's padding rows, last): their outputs are
unspecified (zero for the loop) and get no gradient. SwiGLU is the fused op of moe/ops/swiglu.py.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .ops.swiglu import swiglu

_PROBED: Dict[Tuple, bool] = {}


def expert_generator(seed: int, slot: int) -> torch.Generator:
    """CPU generator of one parameter block (global expert id, router, shared expert: see layer.py)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + slot) % (2 ** 63))


def init_swiglu(hidden: int, ffn_hidden: int, gen: torch.Generator, std: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(w_gate_up [H, 2F], w_down [F, H]) in fp32 on the CPU, normal(0, std), drawn in that order."""
    return torch.randn(hidden, 2 * ffn_hidden, generator=gen) * std, torch.randn(ffn_hidden, hidden, generator=gen) * std


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped GEMMs need real strides)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def grouped_swiglu(x, w_gate_up, w_down, offs, mm=None):
    """x [R, H], w_gate_up [E, H, 2F], w_down [E, F, H], offs [E] int32 cumulative row ends.
    mm(a, b, offs): the grouped GEMM (default torch._grouped_mm; impl="tilecomm": tilecomm's grouped_mm)."""
    mm = mm or (lambda a, b, offs: torch._grouped_mm(a, b, offs=offs))
    h = _ContiguousGrad.apply(mm(x.contiguous(), w_gate_up, offs))
    return _ContiguousGrad.apply(mm(swiglu(h).contiguous(), w_down, offs))


def tilecomm_grouped_mm(a, b, offs):
    """tilecomm.overlap.grouped_mm (persistent TMA kernels); offs built here, so unchecked (no host sync)."""
    from tilecomm.overlap import grouped_mm

    return grouped_mm(a, b, offs, check_offs=False)


def tilecomm_grouped_mm_fits(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether impl="auto" takes tilecomm's grouped_mm: a CUDA device with TMA (sm_90 or later), 16-bit
    floats (fp32 takes its slower IEEE path), and not under torch.compile (a Triton launch in an autograd
    Function, which Dynamo does not trace)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or torch.compiler.is_compiling():
        return False
    key = ("tma", device.index)
    if key not in _PROBED:
        _PROBED[key] = torch.cuda.get_device_capability(device)[0] >= 9
    return _PROBED[key]


def loop_swiglu(x, w_gate_up, w_down, counts: Sequence[int]):
    """Reference: one pair of matmuls per expert over its rows (rows past sum(counts): zero)."""
    counts = list(counts)
    chunks = x.split(counts + [x.shape[0] - sum(counts)])
    out = [swiglu(c @ w_gate_up[e]) @ w_down[e] for e, c in enumerate(chunks[:-1])]
    return torch.cat(out + [chunks[-1].new_zeros(chunks[-1].shape[0], w_down.shape[-1])])


def grouped_mm_works(device: torch.device, dtype: torch.dtype, hidden: int, ffn_hidden: int) -> bool:
    """Whether torch._grouped_mm runs forward and backward here and matches the loop (cached probe)."""
    key = (device.type, device.index, dtype, hidden, ffn_hidden)
    if key not in _PROBED:
        _PROBED[key] = _probe(device, dtype, hidden, ffn_hidden)
    return _PROBED[key]


def _probe(device, dtype, hidden, ffn_hidden) -> bool:
    if not hasattr(torch, "_grouped_mm") or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    try:
        with torch.inference_mode(False), torch.enable_grad():
            return _probe_once(device, dtype, hidden, ffn_hidden)
    except Exception:  # unsupported device / dtype / strides: use the loop
        return False


def _probe_once(device, dtype, hidden, ffn_hidden) -> bool:
    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 5]
    x = torch.randn(sum(counts), hidden, generator=gen).to(device, dtype)
    wgu = (torch.randn(3, hidden, 2 * ffn_hidden, generator=gen) / hidden ** 0.5).to(device, dtype)
    wd = (torch.randn(3, ffn_hidden, hidden, generator=gen) / ffn_hidden ** 0.5).to(device, dtype)
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    results = []
    for fn, arg in ((grouped_swiglu, offs), (loop_swiglu, counts)):
        leaves = [t.detach().clone().requires_grad_() for t in (x, wgu, wd)]
        fn(*leaves, arg).sum().backward()
        results.append(torch.cat([t.grad.float().flatten() for t in leaves]))
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    return bool(torch.allclose(results[0], results[1], rtol=tol, atol=tol))


class GroupedSwiGLUExperts(nn.Module):
    """E_l SwiGLU experts. Parameters: w_gate_up [E_l, H, 2F], w_down [E_l, F, H] (dtype)."""

    def __init__(self, num_local_experts: int, hidden: int, ffn_hidden: int, dtype: torch.dtype = torch.float32,
                 device=None, impl: str = "auto", first_expert: int = 0, seed: Optional[int] = None,
                 init_std: float = 0.02):
        """seed: initialise expert first_expert + i from expert_generator(seed, 1 + global id), so a
        rank's slice equals the matching slice of a single-process layer with the same seed."""
        super().__init__()
        if impl not in ("auto", "grouped", "loop", "tilecomm"):
            raise ValueError(f"GroupedSwiGLUExperts: impl={impl!r}; expected 'auto', 'grouped', 'tilecomm' or 'loop'")
        self.num_local_experts, self.hidden, self.ffn_hidden, self.impl = num_local_experts, hidden, ffn_hidden, impl
        gu, dn = [], []
        for e in range(first_expert, first_expert + num_local_experts):
            a, b = init_swiglu(hidden, ffn_hidden, expert_generator(seed or 0, 1 + e), init_std)
            gu.append(a)
            dn.append(b)
        self.w_gate_up = nn.Parameter(torch.stack(gu).to(device=device, dtype=dtype))
        self.w_down = nn.Parameter(torch.stack(dn).to(device=device, dtype=dtype))

    def grouped_mm_impl(self, dtype: torch.dtype, device: torch.device) -> Optional[str]:
        """Which grouped GEMM forward runs for inputs of `dtype` on `device`: "tilecomm", "torch", or None
        (the loop)."""
        if self.impl == "tilecomm" or (self.impl == "auto" and tilecomm_grouped_mm_fits(device, dtype)):
            return "tilecomm"
        return "torch" if self.use_grouped(dtype) else None

    def use_grouped(self, dtype: Optional[torch.dtype] = None) -> bool:
        """Whether forward runs torch._grouped_mm for inputs of `dtype` (default: the weights')."""
        if self.impl != "auto":
            return self.impl in ("grouped", "tilecomm")
        if torch.compiler.is_compiling() and (dtype or self.w_down.dtype) != torch.bfloat16:
            return False  # torch._grouped_mm's fake (tracing) version takes only bf16
        return grouped_mm_works(self.w_down.device, dtype or self.w_down.dtype, self.hidden, self.ffn_hidden)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [R, H] expert-major, tokens_per_expert [E_l] (sums to R) -> [R, H]."""
        if tuple(tokens_per_expert.shape) != (self.num_local_experts,):
            raise ValueError(f"experts: tokens_per_expert must be [{self.num_local_experts}], got {tuple(tokens_per_expert.shape)}")
        w_gate_up, w_down = self.w_gate_up, self.w_down
        if torch.is_autocast_enabled(x.device.type):  # grouped GEMMs are no autocast ops: cast as matmul would
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w_gate_up, w_down = x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype)
        impl = self.grouped_mm_impl(w_down.dtype, x.device)
        if impl is None:
            return loop_swiglu(x, w_gate_up, w_down, tokens_per_expert.tolist())
        offs = tokens_per_expert.to(device=x.device).cumsum(0).to(torch.int32)
        return grouped_swiglu(x, w_gate_up, w_down, offs, tilecomm_grouped_mm if impl == "tilecomm" else None)


class SharedExpert(nn.Module):
    """Dense SwiGLU MLP: w_gate_up [H, 2F], w_down [F, H]; forward x [T, H] -> [T, H]."""

    def __init__(self, hidden: int, ffn_hidden: int, dtype: torch.dtype = torch.float32, device=None,
                 generator: Optional[torch.Generator] = None, init_std: float = 0.02):
        super().__init__()
        a, b = init_swiglu(hidden, ffn_hidden, generator or torch.Generator().manual_seed(0), init_std)
        self.w_gate_up = nn.Parameter(a.to(device=device, dtype=dtype))
        self.w_down = nn.Parameter(b.to(device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x @ self.w_gate_up) @ self.w_down
