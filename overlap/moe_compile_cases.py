"""The fused MoE kernels (moe_comm.py, moe_gemm.py) with launch-like signatures, for tests/gpu_compile.py (the
sm_90 build check that needs no GPU): (kernel, {argument: Triton type or "constexpr"}, {constexpr: value}),
bf16 data, the GPU tiles of moe_fused.FusedMoEConfig."""
from __future__ import annotations

import triton.language as tl

from . import moe_comm as mc
from . import moe_gemm as mg

_P64, _P32, _F32, _BF16 = "*i64", "*i32", "*fp32", "*bf16"
_GEMM = dict(E_PAD=64, ACC=tl.float32, PRECISION="tf32")
_GATE_UP, _DOWN_GRAD, _SCATTER = (dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=64) for m, n in ((64, 128), (64, 128), (128, 256)))


# int arguments that are multiples of 16 at the bench's shapes (hidden, ffn, max tokens, slots, strides): Triton
# specialises them so at launch, and the gathers' vector width (16-byte cp.async, pipelined) depends on it
_ALIGNED = ("H", "F", "M", "S", "KA", "N", "ITEM_N", "UP", "stride_xm", "stride_gm", "stride_we", "stride_wk", "stride_wf",
            "stride_am", "stride_w")


def _case(kernel, pointers: dict, constexprs: dict, wide=("seq", "stride_we")):
    """Every argument not named is an int32 scalar; `wide` ones are int64. The fourth element: the int
    arguments compiled as multiples of 16 (gpu_compile.py)."""
    signature = {}
    for name in kernel.arg_names:
        signature[name] = "constexpr" if name in constexprs else pointers.get(name, "i64" if name in wide else "i32")
    return kernel, signature, constexprs, tuple(n for n in _ALIGNED if n in signature and n not in constexprs)


def gpu_compile_cases() -> list:
    gather = {"stage_ptr": _BF16, "words_ptr": _P64, "plan_ptr": _P64, "offs_ptr": _P32, "w_ptr": _BF16}
    rows = {"row_pair_ptr": _P32, "row_src_ptr": _P32, "row_w_ptr": _F32}
    return [
        _case(mc._send_kernel, {"x_ptr": _BF16, "topk_ptr": _P64, "w_ptr": _F32, "counts_ptr": _P32, "slots_ptr": _P32,
                                "stage_ptr": _BF16, "pair_w_ptr": _F32, "words_ptr": _P64, "consumed_ptr": _P64},
              dict(K=8, BT=16, BLOCK_P=128, BLOCK_T=16, BLOCK_K=8, BLOCK_B=16, BLOCK_W=8, BLOCK_H=256, ALIGN=8,
                   WITH_META=True)),
        _case(mc._reduce_kernel, {"back_ptr": _BF16, "back_w_ptr": _F32, "flags_ptr": _P64, "topk_ptr": _P64,
                                  "coef_ptr": _F32, "out_ptr": _BF16, "values_ptr": _F32, "consumed_ptr": _P64,
                                  "counter_ptr": _P32},
              dict(K=8, BT=16, BLOCK_P=128, BLOCK_T=16, BLOCK_K=8, BLOCK_H=256, HAS_COEF=True, HAS_VALUES=True,
                   ACC=tl.float32)),
        *(_case(mg._gate_up_kernel, {**gather, "pair_w_ptr": _F32, "h_ptr": _BF16, "act_ptr": _BF16,
                                     "x_rows_ptr": _BF16, **rows},
                dict(_GEMM, **_GATE_UP, GROUP_M=8, GATHER=gather_here, BLOCK_W=8, COPY_N=128))
          for gather_here in (True, False)),
        *(_case(mg._gather_kernel, {**gather, "pair_w_ptr": _F32, "x_rows_ptr": _BF16, **rows},
                dict(BLOCK_M=64, BLOCK_W=8, COPY_N=128, E_PAD=64, RECORD=record)) for record in (True, False)),
        *(_case(mg._down_grad_kernel, {**gather, "row_w_ptr": _F32, "h_ptr": _BF16, "dh_ptr": _BF16,
                                       "g_rows_ptr": _BF16, "act_w_ptr": _BF16, "row_gw_ptr": _F32},
                dict(_GEMM, **_DOWN_GRAD, GROUP_M=8, GATHER=gather_here, BLOCK_W=8, COPY_N=64))
          for gather_here in (True, False)),
        _case(mg._scatter_kernel, {"a_ptr": _BF16, "w_ptr": _BF16, "offs_ptr": _P32, "row_pair_ptr": _P32,
                                   "row_src_ptr": _P32, "vals_ptr": _F32, "back_ptr": _BF16,
                                   "back_w_ptr": _F32, "flags_ptr": _P64, "consumed_ptr": _P64, "done_ptr": _P32},
              dict(_GEMM, **_SCATTER, GROUP_M=8, B_TRANS=True, HAS_VALS=True, ALIGN=8)),
    ]
