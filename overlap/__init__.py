"""tilecomm.overlap: tile-level fused compute + communication (TileLink style).

    ag_gemm(a_shard [m, K], b [K, n])  = all_gather(a_shard) @ b            -> [W*m, n]
    gemm_rs(a [M, k], b [k, N])        = my row block of sum_r a_r @ b_r     -> [M/W, N]
    ColumnParallelLinear / RowParallelLinear: sequence-parallel TP layers built on the two.
All take `group=` (a torch.distributed group of W ranks; None = the world), see team.py.
    grouped_mm(x [R, K], w [E, K, N], offs [E] int32) = per expert x[rows of e] @ w[e] -> [R, N]
    matmul(a, b): the persistent tile GEMM alone (to compare with cuBLAS).
    fused_moe(x, topk_idx, topk_weights, w_gate_up, w_down, FusedMoEWorkspace(...)) = an EP MoE layer's SwiGLU
        experts with dispatch fused into the gate_up grouped GEMM and combine into the down one -> [T, H]
"""
from .ag_gemm import AgGemmWorkspace, ag_gemm, ag_gemm_reference
from .gemm_rs import GemmRsWorkspace, gemm_rs, gemm_rs_reference
from .grouped import grouped_mm, grouped_mm_reference
from .layers import ColumnParallelLinear, RowParallelLinear, TensorParallelWorkspaces
from .moe_config import FusedGemm, FusedMoEConfig
from .moe_fused import FusedMoEWorkspace, fused_moe, fused_moe_reference
from .tiles import GemmConfig, GemmTuner, matmul

__all__ = ["ag_gemm", "ag_gemm_reference", "AgGemmWorkspace", "gemm_rs", "gemm_rs_reference", "GemmRsWorkspace",
           "grouped_mm", "grouped_mm_reference", "ColumnParallelLinear", "RowParallelLinear",
           "TensorParallelWorkspaces", "GemmConfig",
           "GemmTuner", "matmul", "FusedGemm", "FusedMoEConfig", "FusedMoEWorkspace", "fused_moe", "fused_moe_reference"]
