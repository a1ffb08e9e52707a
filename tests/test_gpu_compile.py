"""The GPU build of every tilecomm kernel, checked on a machine without a GPU: each compiles for
sm_90 with NVSHMEM's device library linked, under both transports, and the PTX holds the
memory-ordering instructions the protocol relies on."""
from __future__ import annotations

import pytest

import _gpu_build


def _rows(transport: str) -> dict:
    code, out, err = _gpu_build.rows(transport)
    assert code == 0, err[-4000:]
    rows = _gpu_build.parse(out)
    cases = rows.pop(0)["cases"]
    assert len(rows) == cases and cases >= 26, (len(rows), cases)
    return {r["kernel"]: r for r in rows}


@pytest.fixture(scope="module")
def compiled():
    """Both transports' builds, compiled side by side (two processes: CI's two cores), started in the background
    by conftest when the session began (tests/_gpu_build.py)."""
    pytest.importorskip("nvidia.nvshmem", reason="nvidia-nvshmem-cu13 (the test extra) provides libnvshmem_device.bc")
    return {t: _rows(t) for t in _gpu_build.TRANSPORTS}


def _two_programs_per_sm(rows: dict) -> None:
    """The collectives run two 256-thread programs per SM (collectives/state.py): at most 128 registers a thread
    (ptxas is held there, state.PROGRAM_REGS; the GPU machine's ptxas gave reduce_scatter 198 unheld), without
    spilling: no local memory (a masked tail of unknown divisibility once made the pairs kernel's copies scalar: 255
    registers and 136 bytes of local memory); their program index is a ticket (abi.take_ticket), not the block
    index (3 programs per SM hung on 4 H200s with block indices). The same for reduce_scatter traced
    (CollectiveState.trace), so that the trace times the kernel that runs."""
    for kernel in ("_exchange._pairs_kernel", "_exchange._pairs_kernel+TMA_PUSH+TMA_READ", "_reduce._reduce_kernel",
                   "_exchange._pairs_kernel+OUT_HEAP", "_exchange._pairs_kernel+OUT_HEAP+TMA_PUSH",
                   "_exchange._pairs_kernel+DISCARD", "_reduce._reduce_kernel+DISCARD", "_reduce._reduce_kernel+TRACE"):
        # (the TMA variant keeps four descriptors' addresses live through its pipelined tile loops: Triton 3.6
        # spills 32 bytes, 24 under the nvshmem transport; it is off by default, CollectiveState.tma_push / tma_read)
        spill = 32 if "TMA" in kernel else 0
        assert rows[kernel]["regs"] <= 128 and rows[kernel]["local_bytes"] <= spill, rows[kernel]
        assert rows[kernel]["ticket"], rows[kernel]
    # TMA rows (collectives/_copy.py): tile loads and stores, each store complete before the signals after it,
    # and two programs' tiles fit an SM's 227 KiB of shared memory
    tma = rows["_exchange._pairs_kernel+TMA_PUSH+TMA_READ"]
    assert tma["tma"] and tma["bulk_wait"] and 2 * tma["shared_bytes"] <= 227 << 10, tma
    assert tma["proxy_fences"] >= 8, tma  # before and after the tiles of each of the four moves (_copy.move)
    assert not rows["_exchange._pairs_kernel"]["tma"]
    # CollectiveState.ring_discard: the ring's read chunks leave L2 unwritten (tcl.discard), here with the L2 hints
    for kernel in ("_exchange._pairs_kernel+DISCARD", "_reduce._reduce_kernel+DISCARD"):
        assert rows[kernel]["discard_l2"], rows[kernel]
    assert rows["_exchange._pairs_kernel+DISCARD"]["evict_last"]
    assert not rows["_exchange._pairs_kernel"]["discard_l2"] and not rows["_reduce._reduce_kernel"]["discard_l2"]


def test_kernels_compile_for_sm90_nvlink_transport(compiled):
    rows = compiled["nvlink"]
    assert all(r["cubin_bytes"] > 0 for r in rows.values())
    assert rows["_exchange._pairs_kernel"]["release_sys_atomic"]  # signal: release at system scope
    assert rows["_exchange._pairs_kernel"]["vector_16B"] and rows["_reduce._reduce_kernel"]["vector_16B"]
    _two_programs_per_sm(rows)
    assert rows["team._release_kernel"]["release_sys_atomic"]  # to PEs read from the team's table
    assert rows["test_language._wait_cmp_kernel"]["acquire_sys"] and rows["test_language._wait_cmp_kernel"]["globaltimer"]
    assert rows["test_language._symm_store_kernel"]["state_addr_inlined"]
    for gemm in ("ag_gemm._gemm_kernel", "ag_gemm._gemm_kernel+OWN_IN_PLACE", "gemm_rs._gemm_rs_kernel", "gemm_rs._gemm_rs_kernel+WAIT_LATE",
                 "tiles._matmul_kernel", "grouped._rows_kernel", "grouped._wgrad_kernel"):  # Hopper tensor-core MMA fed by TMA, no local memory (spills)
        assert rows[gemm]["wgmma"] and rows[gemm]["tma"] and not rows[gemm]["local_memory"], rows[gemm]
        assert rows[gemm]["local_bytes"] in (0, None), rows[gemm]  # ptxas spilled nothing (cuobjdump -res-usage)
    for gemm in ("moe_gemm._gate_up_kernel", "moe_gemm._down_grad_kernel", "moe_gemm._scatter_kernel"):
        assert rows[gemm]["wgmma"] and rows[gemm]["tma"] and not rows[gemm]["local_memory"], rows[gemm]
        assert rows[gemm]["local_bytes"] in (0, None), rows[gemm]  # compiled as launched (ints multiples of 16)
    assert rows["moe_gemm._scatter_kernel"]["release_sys_atomic"] and rows["moe_comm._send_kernel"]["release_sys_atomic"]
    for kernel in ("low_latency._dispatch_kernel", "low_latency._combine_kernel"):  # traced: no local memory added
        plain, traced = rows[kernel], rows[kernel + "+TRACE"]  # (CI's Triton 3.9 gives the plain dispatch a .local)
        assert traced["local_memory"] <= plain["local_memory"], (plain, traced)
        assert traced["local_bytes"] in (None, 0) or traced["local_bytes"] <= (plain["local_bytes"] or 0), traced
    for primary, dependent in (("normal._send", "normal._expand"), ("normal._combine_send", "normal._combine_recv"),
                               ("ag_gemm._push", "ag_gemm._gemm")):  # the PDL pairs (primary, dependent)
        assert rows[f"{primary}_kernel"]["pdl_trigger"] and rows[f"{dependent}_kernel"]["pdl_wait"]


def test_kernels_compile_for_sm90_nvshmem_transport(compiled):
    rows = compiled["nvshmem"]
    assert rows["_exchange._pairs_kernel"]["nvshmem_calls"] and rows["test_language._put_ring_kernel"]["nvshmem_calls"]
    _two_programs_per_sm(rows)
    # a one-word signal is issued by one thread (each thread's SIGNAL_ADD added num_warps * 32 times on 2 H200s)
    assert rows["test_language._add_kernel"]["nvshmem_calls"] and rows["test_language._add_kernel"]["thread0_guard"]


def test_kernels_build_with_int_arguments_of_one():
    """Triton turns an int argument equal to 1 into a constexpr at launch; a method call on it (`M.to(...)`) then
    fails to compile. It did on 4 H200s: low-latency dispatch with at most one token per rank, whose capacity
    check passes M to record_error. Every non-GEMM kernel must get through Triton's front end that way."""
    pytest.importorskip("nvidia.nvshmem", reason="nvidia-nvshmem-cu13 (the test extra) provides libnvshmem_device.bc")
    code, out, err = _gpu_build.finish(_gpu_build.start({"TILECOMM_TRANSPORT": "nvlink", "TILECOMM_COMPILE_ONES": "1"}),
                                       timeout=300)
    assert code == 0, err[-4000:]
    rows = _gpu_build.parse(out)
    assert len(rows) - 1 == rows[0]["cases"] >= 20 and all(r["ttir_bytes"] > 0 for r in rows[1:]), rows
