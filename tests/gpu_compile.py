"""Compile tilecomm's GPU kernels for sm_90 on any machine (no GPU, no driver): Triton lowers them
to PTX, links libnvshmem_device.bc and runs ptxas. Prints one JSON line per kernel with facts
read from the PTX. Run as a script (the transport is read at import: set TILECOMM_TRANSPORT first).
"""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton._C.libtriton import ir
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_language as lang  # noqa: E402
from tilecomm.collectives import _exchange as ex, _reduce as er, state as st  # noqa: E402
from tilecomm.dispatch import layout as dl  # noqa: E402
from tilecomm.dispatch.compile_cases import gpu_compile_cases  # noqa: E402
from tilecomm.language import _gpu  # noqa: E402
from tilecomm.overlap import team as ov_team  # noqa: E402
from tilecomm.overlap.moe_compile_cases import gpu_compile_cases as moe_compile_cases  # noqa: E402
from tilecomm.overlap import tiles as ot  # noqa: E402

og = importlib.import_module("tilecomm.overlap.ag_gemm")  # the package re-exports functions of these names
rs = importlib.import_module("tilecomm.overlap.gemm_rs")
gr = importlib.import_module("tilecomm.overlap.grouped")

I64P, I64 = "*i64", "i64"
# the tile GEMM's constexprs (tiles.GemmConfig's fields and the operand layout flags) as compiled on GPUs
GEMM = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "EPILOGUE_SPLIT": 2, "WARP_SPECIALIZE": False,
        "B_TRANS": False, "C_TMA": True, "PRECISION": "tf32"}
GEMM_SIG = {k: "constexpr" for k in GEMM}
# constexpr flags whose True variant is a case of its own (named kernel+FLAG)
LABELLED = ("WAIT_LATE", "OUT_HEAP", "TMA_PUSH", "TMA_READ", "OWN_IN_PLACE", "DISCARD", "TRACE")
# gemm_rs's fused kernel, compiled with its own tiles' waits before (push="kernel") and after (WAIT_LATE) the main loop
RS_SIG = {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "recv_ptr": "*bf16", "flags_ptr": I64P,
          "consumed_ptr": I64P, "pes_ptr": "*i32", "epoch": I64, "mb": "i32", "N": "i32", "K": "i32", "me": "i32",
          "W": "i32", "tile_begin": "i32", "tile_end": "i32", "stride_am": "i32", "stride_b": "i32", "stride_om": "i32",
          "slot_stride": I64, "flag_stride": "i32", "flag_span": "i32", **GEMM_SIG, "WAIT_LATE": "constexpr"}
# grouped's weight-gradient kernels: GEMM's constexprs but B_TRANS and WARP_SPECIALIZE, and the accumulator type
WGRAD = dict({k: v for k, v in GEMM.items() if k not in ("B_TRANS", "WARP_SPECIALIZE")}, ACC=triton.language.float32)
WGRAD_SIG = {"x_ptr": "*bf16", "dy_ptr": "*bf16", "dw_ptr": "*bf16", "offs_ptr": "*i32", "R": "i32", "K": "i32",
             "N": "i32", "E": "i32", "stride_xm": "i32", "stride_dym": "i32", "stride_dwe": I64, "stride_dw": "i32",
             **{k: "constexpr" for k in WGRAD}}
PAIRS_SIG = {"in_ptr": "*bf16", "out_ptr": "*bf16", "heap_ptr": "*u8", "words_ptr": I64P, "table_ptr": I64P,
             "err_ptr": I64P, "ring_off": I64, "in_heap_off": I64, "out_heap_off": I64, "n_even": I64, "P": "i32",
             **{f"t{p}": I64 for p in range(8)},
             **{k: "constexpr" for k in ("EVEN", "GATHER", "IN_PLACE", "OPEN", "OUT_HEAP", "MOVE", "TAG", "CHUNK",
                                         "DEPTH", "BLOCK", "VEC", "TABLE_ARGS", "STREAM", "KEEP", "TMA_PUSH",
                                         "TMA_READ", "BALANCED", "DISCARD")}}
_OPTIONS = ("num_warps", "maxnreg")  # launch options a case may carry among its constexprs (ptxas's, not the kernel's)


def _collective_config(key: tuple, world: int) -> dict:
    """What CollectiveState._launch_config gives a GPU launch of `key` at `world` ranks with the default chunk and
    step sizes (constexprs, num_warps and maxnreg): the collectives' cases build the sizes and register limit that
    run, not copies of them (the reduce case once compiled half the steps it launched: 128 registers here, 198 on
    the GPU)."""
    return dict(st.CollectiveState.sizes_only("cuda", world, st._GPU_CHUNK_BYTES)._launch_config(key))


# all_to_all of bf16 (moved as int16), 16-byte aligned; reduce_scatter of bf16 into fp32 at 4 ranks
PAIRS = _collective_config(("pairs", 2, True, False, False, False, False, False, False, False), 4)
REDUCE = _collective_config(("reduce", 2, True, 0, False, False, triton.language.float32), 4)
REDUCE_SIG = {"in_ptr": "*bf16", "out_ptr": "*bf16", "heap_ptr": "*bf16", "words_ptr": I64P, "err_ptr": I64P,
              "ring_off": I64, "in_heap_off": I64, "n": I64, "P": "i32", "trace_ptr": I64P,
              **{k: "constexpr" for k in er._reduce_kernel.arg_names[10:]}}  # (in the kernel's order)
CASES = [
    # an uneven all_to_all: split table in pinned memory (more than 8 ranks), then the row counts as arguments
    (ex._pairs_kernel, PAIRS_SIG, dict(PAIRS, TABLE_ARGS=False)),
    (ex._pairs_kernel, PAIRS_SIG, dict(PAIRS, TABLE_ARGS=True)),
    # equal chunks per program (CollectiveState.balanced_chunks)
    (ex._pairs_kernel, PAIRS_SIG, dict(PAIRS, EVEN=True, TABLE_ARGS=False, BALANCED=True)),
    # staged ring chunks dropped from L2 once read (CollectiveState.ring_discard), with the ring's L2 hints
    (ex._pairs_kernel, PAIRS_SIG, dict(PAIRS, EVEN=True, TABLE_ARGS=False, DISCARD=True, STREAM="evict_first",
                                       KEEP="evict_last")),
    # a large pair's pushes and reads by TMA (CollectiveState.tma_push / tma_read)
    (ex._pairs_kernel, PAIRS_SIG, dict(PAIRS, EVEN=True, TABLE_ARGS=False, TMA_PUSH=True, TMA_READ=True)),
    # DIRECT pairs (CollectiveState.direct, off by default): by vector stores, and by TMA with one completion wait
    (ex._pairs_kernel, PAIRS_SIG, dict(PAIRS, OPEN=True, OUT_HEAP=True, TABLE_ARGS=True)),
    (ex._pairs_kernel, PAIRS_SIG, dict(PAIRS, EVEN=True, TABLE_ARGS=False, OPEN=True, OUT_HEAP=True, TMA_PUSH=True)),
    (er._reduce_kernel, REDUCE_SIG, REDUCE),
    (er._reduce_kernel, REDUCE_SIG, dict(REDUCE, DISCARD=True)),  # CollectiveState.ring_discard
    (er._reduce_kernel, REDUCE_SIG, dict(REDUCE, TRACE=True)),  # CollectiveState.trace: its steps' clock reads
    (lang._put_ring_kernel, {"dst_ptr": "*fp32", "src_ptr": "*fp32", "sig_ptr": I64P, "n": "i32", "epoch": I64}, {}),
    (lang._get_kernel, {"dst_ptr": "*fp32", "src_ptr": "*fp32", "n": "i32"}, {}),
    (lang._symm_store_kernel, {"buf_ptr": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": 16}),
    (lang._add_kernel, {"sig_ptr": I64P, "root": "i32"}, {}),
    (lang._wait_cmp_kernel, {"sig_ptr": I64P, "value": I64, "out_ptr": I64P, "CMP": "constexpr"}, {"CMP": 5}),
    (dl._layout_kernel, {"topk_ptr": I64P, "in_rank_ptr": "*i8", "send_slot_ptr": I64P, "per_rank_ptr": I64P,
                         "per_expert_ptr": I64P, "T": "i32", "K": "i32", "E_LOCAL": "i32", "W": "i32",
                         "BLOCK_T": "constexpr", "BLOCK_K": "constexpr", "BLOCK_W": "constexpr"},
     {"BLOCK_T": 64, "BLOCK_K": 8, "BLOCK_W": 4}),
    (og._push_kernel, {"a_ptr": "*bf16", "gather_ptr": "*bf16", "flags_ptr": I64P, "pes_ptr": "*i32", "epoch": I64, "m": "i32", "K": "i32", "stride_gm": "i32", "slot_stride": I64,
                       "flag_stride": "i32", "me": "i32", "W": "i32", "BLOCK_M": "constexpr", "PDL": "constexpr"},
     {"BLOCK_M": 128, "PDL": True}),
    *((og._gemm_kernel, {"gather_ptr": "*bf16", "own_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16",
                         "flags_ptr": I64P, "epoch": I64, "m": "i32", "N": "i32", "K": "i32", "me": "i32", "W": "i32",
                         "first_step": "i32", "stride_gm": "i32", "stride_om": "i32", "slot_stride": I64,
                         "flag_stride": "i32", "flag_rows": "i32", "stride_b": "i32", "stride_cm": "i32", **GEMM_SIG,
                         "PDL": "constexpr", "OWN_IN_PLACE": "constexpr"}, dict(GEMM, PDL=not own, OWN_IN_PLACE=own))
      for own in (False, True)),
    *((rs._gemm_rs_kernel, RS_SIG, dict(GEMM, WAIT_LATE=late)) for late in (False, True)),
    (rs._add_slots_kernel, {"recv_ptr": "*bf16", "out_ptr": "*bf16", "flags_ptr": I64P, "epoch": I64, "me": "i32",
                            "W": "i32", "numel": "i32", "slot_stride": "i32", "flag_stride": "i32", "BLOCK": "constexpr"},
     {"BLOCK": 4096}),
    (gr._rows_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "offs_ptr": "*i32", "R": "i32", "K": "i32",
                       "N": "i32", "E": "i32", "stride_xm": "i32", "stride_we": I64, "stride_w": "i32",
                       "stride_ym": "i32", **GEMM_SIG, "FLATTEN": "constexpr", "E_PAD": "constexpr"},
     dict(GEMM, FLATTEN=True, E_PAD=256)),
    (gr._wgrad_kernel, WGRAD_SIG, WGRAD),
    (gr._wgrad_flat_kernel, dict(WGRAD_SIG, E_PAD="constexpr"), dict(WGRAD, E_PAD=256)),
    (ov_team._release_kernel, {"consumed_ptr": I64P, "pes_ptr": "*i32", "epoch": I64, "me": "i32", "W": "i32"}, {}),
    (ot._matmul_kernel, {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
                         "stride_am": "i32", "stride_b": "i32", "stride_cm": "i32", **GEMM_SIG}, GEMM),
]
CASES += gpu_compile_cases()  # the dispatch kernels (dispatch/compile_cases.py)
CASES += moe_compile_cases()  # the fused MoE experts (overlap/moe_compile_cases.py)


def _resources(cubin: bytes) -> dict:
    """Registers per thread and local-memory bytes (ptxas's spills and stack frames: PTX without `.local` can
    still spill) of the cubin, from `cuobjdump -res-usage`; None where Triton ships no cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    found = None
    if os.path.exists(tool):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)",
                              subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout)
    return {"regs": int(found[1]) if found else None, "local_bytes": int(found[2]) + int(found[3]) if found else None}


def _split_options(consts: dict, options: dict) -> tuple:
    """(a case's constexprs, the compile options with the launch options it carries among them)."""
    return ({k: v for k, v in consts.items() if k not in _OPTIONS},
            dict(options, **{k: v for k, v in consts.items() if k in _OPTIONS}))


def _as_ones(case):
    """The case with every integer scalar argument equal to 1: Triton compiles an int argument of value 1 as
    the constexpr 1 (on which a method such as `.to()` fails), so each kernel must build that way too."""
    fn, sig, consts, *_ = case
    ints = [name for name, t in sig.items() if t in ("i32", "i64")]
    return fn, {name: "constexpr" if name in ints else t for name, t in sig.items()}, dict(consts, **{n: 1 for n in ints})


def _frontend(src: ASTSource, target: GPUTarget, options: dict) -> str:
    """Triton's first stage only (Python AST to TTIR), where a constexpr argument meets the kernel's code."""
    backend = make_backend(target)
    opts = backend.parse_options(dict(options, **src.parse_options()))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    return str(src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context))


def main() -> None:
    _gpu.set_state_address(0x7F0000001000)
    target = GPUTarget("cuda", 90, 32)
    libs = (("libnvshmem_device", _gpu.nvshmem_bitcode(arch=90)),)
    options = {"extern_libs": libs, "num_warps": 8, "num_stages": 3}
    if os.environ.get("TILECOMM_COMPILE_ONES") == "1":  # the non-GEMM kernels with every int argument 1, to TTIR
        # (not the TMA send: it runs only where hidden is a multiple of its 256-byte pieces, never 1)
        cases = [_as_ones(c) for c in CASES if "GROUP_M" not in c[1] and not c[2].get("TMA_PIECES")]
        print(json.dumps({"cases": len(cases)}))
        for fn, sig, consts in cases:
            consts, case_options = _split_options(consts, options)
            src = ASTSource(fn=fn, signature=sig, constexprs={(list(sig).index(k),): v for k, v in consts.items()})
            ttir = _frontend(src, target, case_options)
            print(json.dumps({"kernel": f"{fn.fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}", "ttir_bytes": len(ttir)}))
        return
    print(json.dumps({"cases": len(CASES)}))  # every case must come back as a row
    for fn, sig, consts, *aligned in CASES:
        consts, case_options = _split_options(consts, options)
        names = list(sig)
        # pointers 16-byte aligned and the ints a case names (a 4th element) multiples of 16, as Triton
        # specializes them at launch
        ints16 = set(aligned[0]) if aligned else set()
        attrs = {(i,): [["tt.divisibility", 16]] for i, (name, t) in enumerate(sig.items())
                 if t.startswith("*") or name in ints16}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
        kernel = triton.compile(src, target=target, options=case_options)
        ptx = kernel.asm["ptx"]
        # a variant compiled beside the kernel's main case is named by its flag (LABELLED)
        label = "".join(f"+{k}" for k in LABELLED if consts.get(k))
        print(json.dumps({
            "kernel": f"{fn.fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}{label}", "cubin_bytes": len(kernel.asm["cubin"]),
            "release_sys_atomic": "sys.release" in ptx, "acquire_sys": "sys.acquire" in ptx or "ld.acquire.sys" in ptx,
            "globaltimer": "%globaltimer" in ptx, "nvshmem_calls": "nvshmem" in ptx,
            "state_addr_inlined": str(0x7F0000001000) in ptx, "wgmma": "wgmma" in ptx,
            "local_memory": ".local" in ptx, "shared_bytes": kernel.metadata.shared, **_resources(kernel.asm["cubin"]),
            # one thread of the program issues a one-word signal (nvshmemx_signal_op is thread-level)
            "thread0_guard": re.search(r"mov\.u32\s+(%r\d+), %tid\.x;[\s\S]{0,600}?setp\.ne\.b32\s+%p\d+, \1, 0;", ptx) is not None,
            "tma": "cp.async.bulk.tensor" in ptx, "bulk_wait": "cp.async.bulk.wait_group 0" in ptx,
            "proxy_fences": ptx.count("fence.proxy.async.global"), "vector_16B": "ld.global.cg.v4" in ptx or "ld.global.v4" in ptx,
            # abi.take_ticket: a relaxed GPU-scope atomic add hands out the program index
            "ticket": "atom.global.gpu.relaxed.add" in ptx,
            # tcl.discard: L2 lines dropped unwritten; L2 eviction policies (CollectiveState.ring_hints)
            "discard_l2": "discard.global.L2" in ptx, "evict_last": "evict_last" in ptx,
            # programmatic dependent launch: a primary lets its dependent start, a dependent waits for its primary
            "pdl_trigger": "griddepcontrol.launch_dependents" in ptx, "pdl_wait": "griddepcontrol.wait" in ptx,
        }))


if __name__ == "__main__":
    main()
