"""The fused MoE experts' launch configuration (moe_fused.py): per fused GEMM kernel, its tiles and work items,
and the choice per device, data type and layer width (FusedMoEConfig.for_device)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton

from .tiles import GemmConfig

_P2 = triton.next_power_of_2


@dataclass(frozen=True)
class FusedGemm:
    """One fused GEMM kernel's launch: tiles (BLOCK_M rows per item, BLOCK_N output / BLOCK_K reduction columns
    per step, warps, pipeline stages; GROUP_M: row tiles per band when items split the columns; EPILOGUE_SPLIT and
    WARP_SPECIALIZE are not used) and persistent programs per SM (2: one program's row gathers, pipeline fills
    and epilogue run beside another's main loop; only where two fit in an SM's registers and shared memory,
    else the second half of the grid waits). item_cols > 0 splits a row tile's output columns over items, so
    that the programs running at one time share an expert's weight columns in L2 (wide layers: whole-row
    items each stream all of their expert's weights); gate_up and down_grad then gather the rows in a launch
    of their own first (`_gather_kernel`, gather_per_sm programs per SM: a copy wants more loads in flight
    than one 4-warp program per SM keeps; 0: programs_per_sm)."""

    tiles: GemmConfig
    programs_per_sm: int = 1
    copy_cols: int = 64  # gate_up / down_grad: columns per step of the row copy into x_rows / g_rows
    item_cols: int = 0  # output columns per work item (a multiple of BLOCK_N); 0: all of a row tile's
    gather_per_sm: int = 0  # programs per SM of the separate gather launch (item_cols > 0); 0: programs_per_sm

    def __post_init__(self):
        if self.item_cols < 0 or self.item_cols % self.tiles.BLOCK_N:
            raise ValueError(f"FusedGemm: item_cols={self.item_cols}; expected 0 or a positive multiple of "
                             f"BLOCK_N={self.tiles.BLOCK_N}")
        if self.gather_per_sm < 0:
            raise ValueError(f"FusedGemm: gather_per_sm={self.gather_per_sm}; expected 0 (programs_per_sm) or more")


@dataclass(frozen=True)
class FusedMoEConfig:
    """gate_up (forward GEMM1 + SwiGLU), down_grad (backward of GEMM2 + SwiGLU: its epilogue also loads h's gate
    and up tiles), scatter (forward GEMM2 and backward GEMM1: rows stored into their sources): the fused GEMM
    kernels' launches. wgrad: the weight gradients' grouped GEMM (None: grouped.py's default; fp32 / fp64
    need smaller tiles). block_h: columns per step of the row copies (send, reduce).

    bf16 on GPUs, from tests/fused_moe_profile.py on one H100 at the pretraining preset's layer (BENCHMARKS.md;
    µs of both calls, each kernel timed in the same layer run): 128 x 128 tiles everywhere ran gate_up 2082,
    down_grad 2348 (64 columns), scatter 2443. gate_up (gate and up products in one loop since 97e0760):
    64 x 128, 8 warps, 4 stages, row copies 128 columns a step: 1263 (4 warps, 64 columns: 1368; 128 x 128,
    8 warps: 1475; the two-loop kernel before: 1661). down_grad: 64 x 128, 4 warps, 3 stages, two per SM 1399
    (128 x 128, one: 1528; 8 warps with 128-column copies: 1502). scatter: 128 x 256, 8 warps, 3 stages 1630
    (128 x 128, 4 stages: 2209); items of whole row tiles (item_cols 0): items of 256 columns (for wide hidden
    sizes, where whole-row items stream an expert's weights once per row tile) are not measured yet."""

    gate_up: FusedGemm = FusedGemm(GemmConfig(64, 128, 64, 8, 8, 4, 1, False), copy_cols=128)
    down_grad: FusedGemm = FusedGemm(GemmConfig(64, 128, 64, 8, 4, 3, 1, False), 2)
    scatter: FusedGemm = FusedGemm(GemmConfig(128, 256, 64, 8, 8, 3, 1, False))
    block_h: int = 256
    wgrad: Optional[GemmConfig] = None  # the weight gradients' grouped GEMM (None: grouped.py's default)

    @staticmethod
    def for_device(device: torch.device, hidden: int, dtype: torch.dtype = torch.bfloat16,
                   ffn_hidden: int = 0) -> "FusedMoEConfig":
        """The launches for a layer: on GPUs, items that split the output columns where an expert's w_gate_up
        (hidden x 2 ffn_hidden) is at least WIDE_EXPERT_BYTES (whole-row items would each stream all of it)."""
        if device.type == "cuda":
            if dtype in (torch.float32, torch.float64):  # IEEE FMA path: small tiles (shared memory, registers)
                small = GemmConfig(64, 64, 32, 8, 4, 3, 1, False)
                return FusedMoEConfig(*(FusedGemm(small),) * 3, wgrad=small)
            if hidden * 2 * ffn_hidden * dtype.itemsize >= WIDE_EXPERT_BYTES:
                return WIDE_LAYER
            return FusedMoEConfig()
        # the interpreter: few, large programs and small tiles
        tiny = GemmConfig(16, 32, 32, 1, 1, 1, 1, False)
        return FusedMoEConfig(*(FusedGemm(tiny),) * 3, block_h=min(256, _P2(hidden)))


# Split-column items (one H200, tests/fused_moe_profile.py, BENCHMARKS.md): on the DeepSeek-V3-like layer (7168,
# ffn 2048, 256 experts: 58.7 MB of w_gate_up per expert) gate_up 7978 -> 4534 µs, down_grad 5931 -> 2976,
# scatter 9805 -> 8267 (both calls), the layer 37227 -> 30599 µs; whole-row items stay the default of the
# pretraining layer (1536, ffn 768: 4.7 MB per expert; split items not measured there). In between: not measured.
# gate_up's gather with two programs per SM (its 4-warp program: 255 registers under Triton 3.6, so two fit):
# both gathers 625 -> 546 µs, the layer 30470 -> 30315 µs (2026-11-27, one H200).
WIDE_EXPERT_BYTES = 16 << 20
_SPLIT = lambda m, n, warps, stages: GemmConfig(m, n, 64, 8, warps, stages, 1, False)  # noqa: E731
WIDE_LAYER = FusedMoEConfig(gate_up=FusedGemm(_SPLIT(64, 128, 8, 4), copy_cols=128, item_cols=128, gather_per_sm=2),
                            down_grad=FusedGemm(_SPLIT(64, 128, 4, 3), 2, item_cols=128),
                            scatter=FusedGemm(_SPLIT(128, 256, 8, 3), item_cols=256))
