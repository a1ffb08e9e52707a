"""ag_gemm, gemm_rs and the TP layers against float64 references, on 2, 3 and 4 CPU ranks."""
from __future__ import annotations

import contextlib
import importlib
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tilecomm
from _reference import dev, gather_all
from tilecomm import _env
from tilecomm.errors import PeerMismatchError
from tilecomm.overlap import (AgGemmWorkspace, ColumnParallelLinear, GemmRsWorkspace, RowParallelLinear, ag_gemm,
                              gemm_rs, matmul)
from tilecomm.overlap.tiles import GemmConfig

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _rel(got, want):
    return ((got.double().cpu() - want).norm() / want.norm().clamp_min(1e-30)).item()


def _rand(shape, seed, dtype):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(dev())


@contextlib.contextmanager
def _patched(module, **attrs):
    """Set module attributes for the block, then put the old ones back (also when the block raises)."""
    saved = {name: getattr(module, name) for name in attrs}
    for name, value in attrs.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _late(fn, seconds=0.3):
    """fn, called after a sleep (a reader that falls behind its peers)."""
    return lambda *args, **kw: (time.sleep(seconds), fn(*args, **kw))[1]


def _workspace(make, push):
    """make(push), or None after checking that push="copy" is refused under NVSHMEM: the copy engine pushes only
    where every peer's heap is mapped (CPU ranks, GPUs over NVLink). The workspace's push is checked too."""
    nvshmem = tilecomm.current().device.type == "cuda" and _env.transport() == "nvshmem"
    if push == "copy" and nvshmem:
        with pytest.raises(ValueError, match="push='copy' is not available on rank 0: TILECOMM_TRANSPORT=nvshmem"):
            make(push)
        return None
    ws = make(push)
    assert ws.push == ("kernel" if push == "kernel" or nvshmem else "copy")
    return ws


def ag_gemm_body(m, K, n, dtype, calls, push="auto", slow_wait=False, own="auto"):
    rank = tilecomm.rank()
    module = importlib.import_module("tilecomm.overlap.ag_gemm")  # (the package binds a function of that name)
    ws = _workspace(lambda p: AgGemmWorkspace(K, dtype, m + 3, push=p), push)  # owned, made up front, reused
    if ws is None:
        return
    # rank 0 reads late (slow_wait): the others' next call must not overwrite what it reads
    patches = dict(OWN_SHARD=own)  # the copy push's forms of the own shard
    if slow_wait and rank == 0:
        patches["launch_gemm"] = _late(module.launch_gemm)
    calls_made = []  # every call first, then the checks: no collective between calls holds a rank back
    with _patched(module, **patches):
        for call in range(calls):  # fresh data each call: the gather buffer and flags are reused
            rows = m - call  # fewer rows than the workspace holds
            a = _rand((rows, K), 100 * call + rank, dtype)
            b = _rand((K, n), 100 * call + 77, dtype)
            if call % 2:  # a column-major b (a transposed weight) is read in place
                b = b.t().contiguous().t()
            calls_made.append((a, b, *ag_gemm(a, b, return_gathered=True, workspace=ws)))
    for call, (a, b, c, gathered) in enumerate(calls_made):
        full = torch.cat([t.double() for t in gather_all(a)])
        assert torch.equal(gathered.cpu(), full.to(dtype)), "gathered A differs"
        err = _rel(c, full @ b.double().cpu())
        assert err < TOL[dtype], f"call {call}: rel err {err}"
    c = ag_gemm(a, b)  # a temporary workspace
    assert _rel(c, full @ b.double().cpu()) < TOL[dtype]
    ws.free()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_ag_gemm(ranks, world, dtype):
    ranks(world).run(ag_gemm_body, 19, 23, 37, dtype, 2)  # odd sizes: rows, K, n multiples of no tile


@pytest.mark.parametrize("world,push", [(1, "kernel"), (3, "kernel"), (1, "copy"), (2, "copy"), (4, "copy")])
def test_ag_gemm_push_modes(ranks, world, push):
    """Both pushes over 4 calls (the gather buffer's two halves each reused), 70 rows: several row tiles."""
    ranks(world).run(ag_gemm_body, 70, 16, 24, torch.float32, 4, push)


@pytest.mark.parametrize("own", ["auto", "cublas", "in_place", "copied"])
def test_ag_gemm_copy_slow_reader(ranks, own):
    """push="copy" with rank 0 waiting late for every shard: its peers run ahead into their next call, whose
    copies go to the other half of its gather buffer. Every form of the own shard."""
    ranks(3).run(ag_gemm_body, 21, 16, 24, torch.float32, 4, "copy", True, own)


@pytest.mark.parametrize("world,own", [(1, "copied"), (2, "copied"), (1, "in_place"), (2, "in_place"), (3, "in_place")])
def test_ag_gemm_copy_own_shard_forms(ranks, world, own):
    """push="copy" with every shard through the persistent GEMM, the own one copied into its gather slot or read
    in place (a_shard itself: bf16 with K = 23 has unaligned rows, so the GEMM reads tma_operand's padded copy);
    padded gather rows: torch's strided copies."""
    ranks(world).run(ag_gemm_body, 19, 23, 37, torch.bfloat16, 3, "copy", False, own)


def test_ag_gemm_own_shard_form_by_waves():
    """OWN_SHARD="auto": "in_place" only where one GEMM over every shard runs fewer waves of tiles than the own
    shard's GEMM and the peer shards' (CPU: 4 programs, 16x16 tiles; GPU: one program per SM)."""
    form = importlib.import_module("tilecomm.overlap.ag_gemm").own_shard_form
    cfg, cpu = GemmConfig(16, 16, 16, 2, 1, 1, 1, False), torch.device("cpu")
    assert form(16, 16, 3, cfg, cpu) == "in_place"  # 1 tile a shard: 1 + 1 waves against 1
    assert form(16, 80, 2, cfg, cpu) == "in_place"  # 5 tiles: 2 + 2 against 3
    assert form(32, 32, 2, cfg, cpu) == "cublas"  # 4 tiles: 1 + 1 against 2
    assert form(16, 16, 1, cfg, cpu) == "cublas"  # W = 1: cuBLAS's GEMM of the whole product
    if torch.cuda.is_available():  # the bar shapes at W = 4 on 132 SMs: 224 tiles a shard (2 + 6 against 7), 448
        big = GemmConfig(128, 256, 64, 4, 8, 3, 1, False)
        if torch.cuda.get_device_properties(0).multi_processor_count == 132:
            assert form(2048, 3584, 4, big, torch.device("cuda", 0)) == "in_place"
            assert form(4096, 7168, 2, big, torch.device("cuda", 0)) == "cublas"  # 896: 7 + 7 against 14


def test_ag_gemm_own_shard_form_checked(ranks):
    """A misspelt ag_gemm.OWN_SHARD raises before anything is queued."""
    ranks(1).run(_bad_own_shard_form)


def _bad_own_shard_form():
    module = importlib.import_module("tilecomm.overlap.ag_gemm")
    ws = AgGemmWorkspace(16, torch.float32, 8, push="copy")
    a = _rand((8, 16), 0, torch.float32)
    with _patched(module, OWN_SHARD="inplace"), pytest.raises(ValueError, match="ag_gemm.OWN_SHARD = 'inplace'"):
        ag_gemm(a, _rand((16, 8), 1, torch.float32), workspace=ws)
    ws.free()


class _SlowLaunch:
    """A CachedLaunch stand-in that sleeps before each launch (a reader that falls behind its peers)."""

    def __init__(self, inner, seconds):
        self.inner, self.seconds = inner, seconds

    def launch_keyed(self, *args, **kwargs):
        time.sleep(self.seconds)
        self.inner.launch_keyed(*args, **kwargs)


def gemm_rs_body(mb, K, N, dtype, calls, push="auto", slow_add=False, fused_own=False, slow_copy=False):
    rank, world = tilecomm.rank(), tilecomm.world_size()
    module = importlib.import_module("tilecomm.overlap.gemm_rs")
    ws = _workspace(lambda p: GemmRsWorkspace(N, dtype, mb + 2, push=p), push)  # more rows than the calls use
    if ws is None:
        return
    if slow_copy and rank == 1:  # rank 1 issues each row chunk of its blocks late: the owners' tiles wait for theirs
        ws.issuer.copy = _late(ws.issuer.copy, 0.15)
    # rank 0 adds late (slow_add): the others' next call must not overwrite what it reads
    patches = dict(FUSED_OWN_BLOCK=fused_own)  # the copy push's two forms of the own block (GEMM and slots' sum)
    if slow_add and rank == 0:
        patches.update(_ADD_SLOTS=_SlowLaunch(module._ADD_SLOTS, 0.3), launch_gemm=_late(module.launch_gemm))
    calls_made = []  # every call first, then the checks: no collective between calls holds a rank back
    with _patched(module, **patches):
        for call in range(calls):  # fresh data each call: both halves of the copy push's recv buffer are reused
            a = _rand((world * mb, K), 10 * call + rank, dtype)
            b = _rand((K, N), 10 * call + 5 + rank, dtype)
            if call % 2:
                b = b.t().contiguous().t()
            calls_made.append((a, b, gemm_rs(a, b, workspace=ws) if call < calls - 1 else gemm_rs(a, b)))
    for call, (a, b, out) in enumerate(calls_made):
        parts = [x.double() @ y.double() for x, y in zip(gather_all(a), gather_all(b))]
        want = sum(parts)[rank * mb:(rank + 1) * mb]
        err = _rel(out, want)
        assert out.shape == (mb, N) and err < TOL[dtype], f"call {call}: rel err {err}"
    ws.free()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gemm_rs(ranks, world, dtype):
    # odd sizes; bf16 with N = 40 (16-byte rows): partial tiles then reach the owner by TMA loads
    ranks(world).run(gemm_rs_body, 17, 29, 40 if dtype == torch.bfloat16 else 21, dtype, 3)


@pytest.mark.parametrize("world,push", [(3, "kernel"), (2, "copy"), (4, "copy"), (3, "copy")])
def test_gemm_rs_push_modes(ranks, world, push):
    """Both pushes over 5 calls (the copy push's two recv halves each reused twice), uneven sizes."""
    ranks(world).run(gemm_rs_body, 13, 19, 22, torch.float32, 5, push)


@pytest.mark.parametrize("world", [2, 3])
def test_gemm_rs_copy_fused_own_block(ranks, world):
    """push="copy" with FUSED_OWN_BLOCK: the own tiles wait after their main loop and add the slots by TMA (bf16,
    N = 40: 16-byte rows), over 3 calls."""
    ranks(world).run(gemm_rs_body, 17, 29, 40, torch.bfloat16, 3, "copy", False, True)


@pytest.mark.parametrize("world", [2, 3])
def test_gemm_rs_copy_fused_own_block_waits_per_chunk(ranks, world):
    """push="copy" with FUSED_OWN_BLOCK and rank 1 copying each row chunk of its blocks late: an own tile reads a
    member's slot only once the chunk holding its rows has landed (37 rows: three 16-row chunks on CPU ranks)."""
    ranks(world).run(gemm_rs_body, 37, 19, 50, torch.float32, 3, "copy", False, True, True)


@pytest.mark.parametrize("fused_own", [True, False], ids=["fused own block", "cuBLAS and add pass"])
def test_gemm_rs_copy_slow_reader(ranks, fused_own):
    """push="copy" with rank 0 adding its peers' blocks late in every call: its peers run ahead into their next call, whose
    copies go to the other half of its recv buffer (one half for every call failed this test). Both forms of the own
    block; 37 x 50 outputs: several row and column tiles (16 x 16 on CPU ranks)."""
    ranks(3).run(gemm_rs_body, 37, 19, 50, torch.float32, 4, "copy", True, fused_own)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("M,N,K", [(37, 29, 45), (33, 40, 24), (1, 1, 1), (0, 5, 3), (4, 6, 0)])
def test_matmul_alone(dtype, M, N, K):
    a, b = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
    want = a.double() @ b.double()
    for bb in (b, b.t().contiguous().t()):  # row- and column-major b
        got = matmul(a, bb)
        assert got.shape == (M, N) and got.is_contiguous()
        assert _rel(got, want) < TOL[dtype]


def test_matmul_table_buckets():
    """matmul's table entry by its whole output (a product of few 128x256 tiles takes the "tiny" tiles); the grouped
    kernels bucket by one expert's rows, so `bucket` itself has no "tiny"; fp32 keeps its FMA tiles; CPU ranks
    take the interpreter's tiles."""
    from tilecomm.overlap.tiles import _CPU, _TABLE, bucket, matmul_bucket, resolve_config

    bf16, gpu = torch.bfloat16, torch.device("cuda")  # (a device object: no GPU needed)
    want = {(1000, 1000): "tiny", (1024, 1024): "tiny", (256, 4096): "tiny", (2048, 2048): "mid",
            (8192, 8192): "large", (64, 16384): "narrow", (900, 900): "tiny"}
    for (m, n), name in want.items():
        assert matmul_bucket(m, n, bf16) == name, (m, n)
        assert resolve_config(None, m, n, bf16, gpu, None, bucket_of=matmul_bucket) == _TABLE[name]
    assert matmul_bucket(1000, 1000, torch.float32) == "fp32"
    assert bucket(1000, 1000, bf16) == "small" and bucket(1024, 1024, bf16) == "mid"
    assert resolve_config(None, 1000, 1000, bf16, torch.device("cpu"), None, bucket_of=matmul_bucket) == _CPU


def mismatched_shapes(op):
    """Ranks that disagree on m / M / N raise PeerMismatchError naming both ranks (no hang, no wrong data)."""
    rank = tilecomm.rank()
    if op == "ag_gemm":
        fn = lambda: ag_gemm(torch.randn(3 + rank, 8, device=dev()), torch.randn(8, 5, device=dev()))  # noqa: E731
    elif op == "gemm_rs":
        fn = lambda: gemm_rs(torch.randn(4 + 2 * rank, 8, device=dev()), torch.randn(8, 5, device=dev()))  # noqa: E731
    else:
        fn = lambda: gemm_rs(torch.randn(4, 8, device=dev()), torch.randn(8, 5 + rank, device=dev()))  # noqa: E731
    with pytest.raises(PeerMismatchError, match=r"rank 0 .*rank 1|rank 1 .*rank 0"):
        fn()


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_rs_N"])
def test_mismatched_shapes_across_ranks(ranks, op):
    ranks(2).run(mismatched_shapes, op)


def tp_mlp_body(s, h, f, seed, max_tokens=None):
    """Column -> ReLU -> Row with sequence parallelism equals a single-device two-layer MLP (workspaces
    made in the layers' __init__ with max_tokens, else per call)."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    torch.manual_seed(seed)
    lin1, lin2 = nn.Linear(h, f), nn.Linear(f, h)  # float32: the kernels' widest GEMM type
    x_full = torch.randn(s, h)
    g_full = torch.randn(s, h)
    rows = slice(rank * s // world, (rank + 1) * s // world)
    col = ColumnParallelLinear.from_linear(lin1, max_tokens=max_tokens)
    row = RowParallelLinear.from_linear(lin2, max_tokens=max_tokens)
    col, row = col.to(dev()), row.to(dev())
    x = x_full[rows].clone().to(dev()).requires_grad_()
    y = row(torch.relu(col(x)))
    (y * g_full[rows].to(dev())).sum().backward()
    y, xg = y.detach().cpu(), x.grad.cpu()
    x_ref = x_full.clone().requires_grad_()
    y_ref = lin2(torch.relu(lin1(x_ref)))
    (y_ref * g_full).sum().backward()
    torch.testing.assert_close(y, y_ref[rows].detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(xg, x_ref.grad[rows], rtol=1e-4, atol=1e-5)
    fb = f // world
    torch.testing.assert_close(col.weight.grad.cpu(), lin1.weight.grad.t()[:, rank * fb:(rank + 1) * fb], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(col.bias.grad.cpu(), lin1.bias.grad[rank * fb:(rank + 1) * fb], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(row.weight.grad.cpu(), lin2.weight.grad.t()[rank * fb:(rank + 1) * fb], rtol=1e-4, atol=1e-5)
    # the row layer's bias is replicated: its gradient is this rank's share; summed over ranks it is the full one
    total = row.bias.grad.clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total.cpu(), lin2.bias.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("world", [2, 3])
def test_tp_layers_match_single_device_mlp(ranks, world):
    ranks(world).run(tp_mlp_body, 6 * world, 10, 4 * world, 3, 8 * world)


def bad_overlap_inputs():
    world = tilecomm.world_size()

    def randn(*shape):  # on the runtime's device, so that each check below is the one that fails
        return torch.randn(*shape, device=dev())

    a, b = randn(4, 8), randn(8, 5)
    for fn in (ag_gemm, gemm_rs):
        with pytest.raises(ValueError, match="inner dimensions"):
            fn(randn(world * 2, 7), b)
        with pytest.raises(TypeError, match="share a dtype"):
            fn(a, b.half())
        with pytest.raises(ValueError, match="contiguous"):
            fn(randn(8, world * 4).t(), b)
        with pytest.raises(ValueError, match="2-D"):
            fn(randn(3), b)
    with pytest.raises(ValueError, match="multiple of the group size"):
        gemm_rs(randn(world * 2 + 1, 8), b)
    with pytest.raises(ValueError, match="divide by"):
        ColumnParallelLinear(8, world * 2 + 1)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        with pytest.raises(ValueError, match="in_features must be a positive int"):
            cls(0, 8)
        with pytest.raises(ValueError, match="out_features must be a positive int"):
            cls(8, -2)
        with pytest.raises(ValueError, match="max_tokens"):
            cls(8, 8, max_tokens=world + 1)
    with pytest.raises(ValueError, match="push='sideways'; expected one of"):
        AgGemmWorkspace(8, torch.float32, 4, push="sideways")
    with pytest.raises(ValueError, match="GemmRsWorkspace: push='sideways'; expected one of"):
        GemmRsWorkspace(8, torch.float32, 4, push="sideways")
    with pytest.raises(ValueError, match="AgGemmWorkspace: K must be a positive int, got 0"):
        AgGemmWorkspace(0, torch.float32, 4)
    with pytest.raises(ValueError, match="GemmRsWorkspace: max_rows must be a positive int, got True"):
        GemmRsWorkspace(8, torch.float32, True)
    ws = AgGemmWorkspace(8, torch.float32, 4)
    with pytest.raises(ValueError, match="does not fit the workspace"):
        ag_gemm(randn(5, 8), b, workspace=ws)  # more rows than max_rows
    with pytest.raises(ValueError, match="workspace must be"):
        gemm_rs(randn(world * 2, 8), b, workspace=ws)
    ws.free()


def test_bad_overlap_inputs(ranks):
    ranks(2).run(bad_overlap_inputs)
