"""The dispatch kernels with launch-like signatures, for tests/gpu_compile.py (the sm_90 build check that
needs no GPU): a list of (kernel, {argument: Triton type or "constexpr"}, {constexpr: value}), bf16 data,
the shapes of the world-1 benchmark (4096 x 7168, top-8 of 256 experts; eight ranks' tiles)."""
from __future__ import annotations

import triton.language as tl

from . import low_latency as ll
from . import normal as nm

_P64, _P32, _F32, _BF16 = "*i64", "*i32", "*fp32", "*bf16"


def _case(kernel, pointers: dict, constexprs: dict, wide=("seq",)):
    """Every argument not named is an int32 scalar; `wide` ones are int64."""
    signature = {}
    for name in kernel.arg_names:
        signature[name] = "constexpr" if name in constexprs else pointers.get(name, "i64" if name in wide else "i32")
    return kernel, signature, constexprs


def gpu_compile_cases() -> list:
    sig = {"ready_ptr": _P64, "consumed_ptr": _P64, "counter_ptr": _P32}
    send = {"x_ptr": _BF16, "x2_ptr": _F32, "topk_ptr": _P64, "w_ptr": _F32, "counts_ptr": _P32, "rows_ptr": _BF16,
            "rows2_ptr": _F32, "route_ptr": _P32, "slot_ptr": _P32, "weight_ptr": _F32, "blocks_ptr": _P64,
            "consumed_ptr": _P64}
    send_consts = dict(K=8, BT=16, BLOCK_P=128, BLOCK_T=16, BLOCK_K=8, BLOCK_B=16, BLOCK_W=8, BLOCK_H=1024, ALIGN=8,
                       ALIGN2=4, WITH_META=True, HAS_X2=True, PDL=True)
    return [
        _case(nm._route_kernel, {"topk_ptr": _P64, "counts_ptr": _P32, "totals_ptr": _P64, "minmax_ptr": _P64,
                                 "counter_ptr": _P32, "notify_ptr": _P64, "nsig_ptr": _P64, "plan_ptr": _P64,
                                 "info_ptr": _P64, "ends_ptr": _P32},
              dict(K=8, BT=16, BLOCK_P=128, BLOCK_E=512, BLOCK_W=8, BLOCK_EL=32, ROW_ENDS=True)),
        _case(nm._send_kernel, send, dict(send_consts, TMA_PIECES=0)),
        _case(nm._send_kernel, send, dict(send_consts, HAS_X2=False, TMA_PIECES=64)),  # NormalConfig.send_tma
        _case(nm._expand_kernel, {"rows_ptr": _BF16, "rows2_ptr": _F32, "out_ptr": _BF16, "out2_ptr": _F32,
                                  "route_ptr": _P32, "slot_ptr": _P32, "weight_ptr": _F32, "out_w_ptr": _F32,
                                  "token_rows_ptr": _P32, "plan_ptr": _P64, "blocks_ptr": _P64, **sig},
              dict(K=8, BT=1, BLOCK_T=1, BLOCK_K=8, BLOCK_H=1024, FROM_META=True, HAS_X2=True, PDL=True)),
        _case(nm._combine_send_kernel, {"y_ptr": _BF16, "coef_ptr": _F32, "vals_ptr": _F32, "token_rows_ptr": _P32,
                                        "plan_ptr": _P64, "back_ptr": _BF16, "back_w_ptr": _F32, "landed_ptr": _P64,
                                        "done_ptr": _P32, **sig},
              dict(K=8, BT=1, BLOCK_T=1, BLOCK_K=8, BLOCK_H=1024, ALIGN=8, HAS_ROWS=True, HAS_COEF=True,
                   HAS_VALS=True, ACC=tl.float32, PDL=True)),
        _case(nm._combine_recv_kernel, {"back_ptr": _BF16, "back_w_ptr": _F32, "topk_ptr": _P64, "out_ptr": _BF16,
                                        "vals_out_ptr": _F32, "landed_ptr": _P64, **sig},
              dict(K=8, BT=1, BLOCK_T=1, BLOCK_K=8, BLOCK_H=1024, HAS_ROWS=True, HAS_VALS=True, ACC=tl.float32, PDL=True)),
        *(_case(ll._dispatch_kernel, {"x_ptr": _BF16, "topk_ptr": _P64, "w_ptr": _F32, "recv_ptr": _BF16,
                                      "recv_w_ptr": _F32, "recv_src_ptr": _P32, "count_ptr": _P64, "epoch_ptr": _P64,
                                      "err_ptr": _P64, "pairs_ptr": _P32, "out_ptr": _BF16, "out_w_ptr": _F32,
                                      "maps_ptr": _P32, "per_expert_ptr": _P64, "trace_ptr": _P64, **sig},
                dict(K=8, BLOCK_K=8, BLOCK_C=1024, BLOCK_EL=256, BLOCK_W=8, BLOCK_R=2, BLOCK_H=4096, ALIGN=8,
                     TRACE=trace))
          for trace in (False, True)),  # traced: LowLatencyConfig.trace
        *(_case(ll._combine_kernel, {"y_ptr": _BF16, "w_ptr": _F32, "maps_ptr": _P32, "back_ptr": _BF16,
                                     "out_ptr": _BF16, "epoch_ptr": _P64, "trace_ptr": _P64, **sig},
                dict(K=8, BLOCK_K=8, BLOCK_W=8, BLOCK_H=4096, ALIGN=8, ACC=tl.float32, TRACE=trace))
          for trace in (False, True)),
    ]
