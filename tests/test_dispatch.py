"""Dispatcher against an independent global reference, on 2, 3 and 4 CPU ranks, both backends; random
routing loops against the torch reference (bit for bit); device-side errors; buffer reuse.

TILECOMM_TEST_ITERS sets the random-loop iterations per world size and mode (CPU default: 6; a GPU run
can afford 1000)."""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

import tilecomm
from _reference import dev
from tilecomm.dispatch import Dispatcher, compute_layout, layout_reference
from tilecomm.errors import PeerMismatchError

ITERS = int(os.environ.get("TILECOMM_TEST_ITERS", "6"))


def _sync():
    if tilecomm.current().backend == "cuda":
        torch.cuda.synchronize()


def _routing(T, K, E, gen, drop=0.2, only_expert=None):
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.int64)
    if only_expert is not None:
        idx[:, 0] = only_expert
        idx[:, 1:] = -1
    elif drop:
        idx[torch.rand(T, K, generator=gen) < drop] = -1
    return idx


def _inputs(seed, T, H, K, E, dtype, **routing):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    idx = _routing(T, K, E, gen, **routing)
    w = torch.rand(T, K, generator=gen)
    return x.to(dev()), idx.to(dev()), w.to(dev())


def _global_reference(xs, idxs, ws, rank, E, W):
    """Rows and weights `rank` must hold: local expert, then source rank, then token, from all inputs."""
    e_local = E // W
    rows, weights, counts = [], [], []
    for e in range(rank * e_local, (rank + 1) * e_local):
        n = 0
        for src in range(W):
            hit = (idxs[src] == e)
            for t in torch.nonzero(hit.any(1)).flatten().tolist():
                k = int(torch.nonzero(hit[t])[0])
                rows.append(xs[src][t])
                weights.append(ws[src][t, k])
                n += 1
        counts.append(n)
    H = xs[0].shape[1]
    x_ref = torch.stack(rows) if rows else torch.empty(0, H, dtype=xs[0].dtype)
    return x_ref, torch.tensor(weights, dtype=torch.float32), torch.tensor(counts)


def _expert_of_rows(res, rank, e_local):
    return torch.repeat_interleave(torch.arange(e_local, device=res.x.device) + rank * e_local, res.tokens_per_expert)


def dispatch_combine_body(seed, T_by_rank, H, K, E, dtype, backend, routing, tma_pieces=None):
    """tma_pieces: the send's TMA tile of pieces it must have launched with (NormalConfig.send_tma)."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    T = T_by_rank[rank]
    x, idx, w = _inputs(seed * 31 + rank, T, H, K, E, dtype, **routing)
    d = Dispatcher(E, H, max_tokens_per_rank=max(T_by_rank) + 1, topk=K, dtype=dtype, backend=backend)
    res = d.dispatch(x, idx, w, async_op=bool(seed % 2))
    if tma_pieces is not None:
        assert [b.constexprs["TMA_PIECES"] for k, b in d._engine._bound.items() if k[0] == "send"] == [tma_pieces]
    if res.work is not None:
        assert res.work.wait()
    if x.is_cuda:  # a wait that timed out on the GPU is recorded there: raise it rather than compare
        torch.cuda.synchronize()
    tilecomm.check_errors()
    gathered = [None] * world
    dist.all_gather_object(gathered, (x.cpu(), idx.cpu(), w.cpu()))
    xs, idxs, ws = zip(*gathered)
    x_ref, w_ref, counts = _global_reference(xs, idxs, ws, rank, E, world)
    assert torch.equal(res.x.cpu(), x_ref), "dispatched rows differ from the reference (values or order)"
    assert torch.equal(res.weights.cpu(), w_ref)
    assert torch.equal(res.tokens_per_expert.cpu(), counts)
    # experts: y = x * (1 + expert id), so combine must give sum_k w[t,k] * x[t] * (1 + idx[t,k])
    scale = 1.0 + _expert_of_rows(res, rank, E // world).to(torch.float32)
    y = (res.x.float() * scale[:, None]).to(dtype)
    out = d.combine(y, res.handle)
    valid = idx >= 0
    coef = torch.where(valid, w * (1.0 + idx.float()), 0.0).sum(1)
    expect = x.double() * coef.double()[:, None]
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double().cpu(), expect.cpu(), rtol=tol, atol=tol)
    d.free()
    return res.x.shape[0]


CASES = {  # T per rank (by world size) is uneven, with a rank that has no tokens where world > 2
    "topk2-E8": dict(H=16, K=2, E=8, routing={}),
    "topk8-E24": dict(H=8, K=8, E=24, routing={"drop": 0.3}),
    "topk1-E6": dict(H=12, K=1, E=6, routing={"drop": 0.0}),
    "all-to-one-expert": dict(H=8, K=3, E=12, routing={"only_expert": 5}),
}
TOKENS = {2: [9, 5], 3: [7, 0, 11], 4: [3, 8, 0, 6]}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["tilecomm", "nccl"])
def test_dispatch_combine_match_global_reference(ranks, world, case, backend):
    c = CASES[case]
    experts = math.lcm(c["E"], world)  # E must split over the ranks; 6, 12, 24 keep it off powers of two
    ranks(world).run(dispatch_combine_body, 1, TOKENS[world], c["H"], c["K"], experts, torch.float32, backend, c["routing"])


@pytest.mark.parametrize("world", [2, 3])
def test_dispatch_combine_bf16(ranks, world):  # (4 send blocks of 64 tokens: CPU ranks' 3 send programs loop)
    many = {2: [200, 77], 3: [150, 0, 233]}[world]
    ranks(world).run(dispatch_combine_body, 2, many, 32, 4, 6 * world, torch.bfloat16, "tilecomm", {})


def gradients_body(seed, T, H, K, E, backend):
    """Gradients of x and topk_weights through dispatch -> experts -> combine, against local autograd."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    x, idx, w = _inputs(seed + rank, T, H, K, E, torch.float64)
    x.requires_grad_()
    w.requires_grad_()
    d = Dispatcher(E, H, T, K, torch.float64, backend=backend)
    res = d.dispatch(x, idx, w)
    scale = 1.0 + _expert_of_rows(res, rank, E // world).double()
    out = d.combine(res.x * scale[:, None], res.handle)
    g = torch.randn(T, H, generator=torch.Generator().manual_seed(seed * 7 + rank), dtype=torch.float64).to(x.device)
    (out * g).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    coef = torch.where(idx >= 0, w2 * (1.0 + idx.double()), 0.0).sum(1)
    ((x2 * coef[:, None]) * g).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", ["tilecomm", "nccl"])
def test_gradients_match_local_autograd(ranks, world, backend):
    ranks(world).run(gradients_body, 5, 6, 8, 3, 3 * world, backend)


def _random_inputs(own, T, H, K, E, distinct, device=None):
    """x [T, H]; topk_idx with -1s and (unless distinct) repeated experts; weights (on `device`, default dev())."""
    x = torch.randn(T, H, generator=own)
    if distinct:
        idx = torch.stack([torch.randperm(E, generator=own)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.int64)
    else:
        idx = torch.randint(0, E, (T, K), generator=own)
    idx[torch.rand(T, K, generator=own) < 0.25] = -1
    device = dev() if device is None else device
    return x.to(device), idx.to(device), torch.rand(T, K, generator=own).to(device)


def _reference_device() -> torch.device:
    """Where the reference Dispatcher (backend="nccl") computes: on CPU when the process group is gloo
    (ranks sharing a GPU): gloo on CUDA tensors syncs the device at every exchange, which time-sliced
    ranks pay for in milliseconds."""
    return torch.device("cpu") if dist.get_backend() == "gloo" else dev()


def _check_normal(fast, ref, x, idx, w, it, async_op):
    """x, idx, w on the reference's device; the tilecomm Dispatcher gets copies on the runtime's."""
    on = dev()
    a, b = fast.dispatch(x.to(on), idx.to(on), w.to(on), async_op=async_op), ref.dispatch(x, idx, w)
    if a.work is not None:
        a.work.wait()
    for name in ("x", "weights", "tokens_per_expert"):
        assert torch.equal(getattr(a, name).to(x.device), getattr(b, name)), f"iteration {it}: dispatch res.{name} differs"
    y = b.x * 2 + 1
    assert torch.equal(fast.combine(y.to(on), a.handle).to(x.device), ref.combine(y, b.handle)), f"iteration {it}: combine differs"


def _packed(rows: torch.Tensor, counts) -> torch.Tensor:
    """[E_l, cap, ...] low-latency rows -> the first counts[e] rows of each expert, concatenated."""
    return torch.cat([rows[e, :n] for e, n in enumerate(counts)])


def _check_low_latency(fast, ref, x, idx, w, it, hook):
    """As _check_normal: inputs on the reference's device."""
    rank, on = tilecomm.rank(), dev()
    a, b = fast.dispatch(x.to(on), idx.to(on), w.to(on), return_recv_hook=hook), ref.dispatch(x, idx, w)
    if a.recv_hook is not None:
        a.recv_hook()
    counts = a.tokens_per_expert.tolist()
    assert counts == b.tokens_per_expert.tolist(), f"iteration {it}: counts differ"
    assert torch.equal(_packed(a.x, counts).to(x.device), b.x), f"iteration {it}: rows differ"
    assert torch.equal(_packed(a.weights, counts).to(x.device), b.weights)
    e_local = fast.num_local_experts
    scale = 1.0 + (torch.arange(e_local, device=on) + rank * e_local).float()
    y = (a.x.float() * scale[:, None, None]).to(x.dtype)  # expert e: x * (1 + e)
    y.masked_fill_(torch.arange(y.shape[1], device=on)[None, :, None] >= a.tokens_per_expert[:, None, None], float("nan"))
    out = fast.combine(y, a.handle)  # rows past the counts are never read: NaN there would show
    assert torch.equal(out.to(x.device), ref.combine(_packed(y, counts).to(x.device), b.handle)), f"iteration {it}: combine differs"


def random_loop_body(mode, iters, seed):
    """Random shapes (E, K, H, capacity per Dispatcher) and per call (uneven T, zero-token ranks, -1 ids;
    repeated experts in normal mode): the tilecomm kernels equal the torch reference bit for bit, over
    back-to-back calls that reuse the Dispatcher's buffers."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    shared = torch.Generator().manual_seed(seed)  # shapes agree across ranks; T and routing do not
    own = torch.Generator().manual_seed(seed * 1000 + rank)
    configs = 2 if iters < 100 else 1 + iters // 500  # GPU runs: few shapes (each compiles its kernels)
    for c in range(configs):
        E = world * int(torch.randint(1, 4, (1,), generator=shared))
        K = int(torch.randint(1, min(E, 6) + 1, (1,), generator=shared))
        H = 4 * int(torch.randint(1, 6, (1,), generator=shared))
        M = int(torch.randint(1, 7, (1,), generator=shared))
        fast = Dispatcher(E, H, M, K, torch.float32, mode=mode)
        ref = Dispatcher(E, H, M, K, torch.float32, backend="nccl")
        for it in range(c * iters // configs, (c + 1) * iters // configs):
            T = 0 if torch.rand(1, generator=own) < 0.2 else int(torch.randint(0, M + 1, (1,), generator=own))
            x, idx, w = _random_inputs(own, T, H, K, E, distinct=mode == "low_latency", device=_reference_device())
            if mode == "normal":
                _check_normal(fast, ref, x, idx, w, it, async_op=bool(it % 3 == 1))
            else:
                with torch.no_grad():
                    _check_low_latency(fast, ref, x, idx, w, it, hook=bool(it % 2))
        fast.free()
        ref.free()


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_random_routing_loop_matches_reference(ranks, world, mode):
    ranks(world).run(random_loop_body, mode, ITERS, 7 * world)


def outstanding_handles_body(mode):
    """Two dispatches before their combines, combined in reverse order (normal mode: the first twice)."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    E, H, K, M = 3 * world, 8, 2, 5
    own = torch.Generator().manual_seed(11 + rank)
    fast = Dispatcher(E, H, M, K, torch.float32, mode=mode)
    ref = Dispatcher(E, H, M, K, torch.float32, backend="nccl")
    calls = [_random_inputs(own, M - i, H, K, E, distinct=True) for i in range(2)]
    with torch.no_grad():
        got = [fast.dispatch(*c) for c in calls]
        want = [ref.dispatch(*c) for c in calls]
        for i in (1, 0, 0):
            if mode == "normal":
                assert torch.equal(fast.combine(got[i].x, got[i].handle), ref.combine(want[i].x, want[i].handle))
            else:
                counts = got[i].tokens_per_expert.tolist()
                want_out = ref.combine(_packed(got[i].x, counts), want[i].handle)
                assert torch.equal(fast.combine(got[i].x, got[i].handle), want_out)
    fast.free()
    ref.free()


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_outstanding_handles(ranks, mode):
    ranks(3).run(outstanding_handles_body, mode)


def layout_body():
    gen = torch.Generator().manual_seed(0)
    for T, K, E, W in [(0, 2, 4, 2), (1, 1, 2, 2), (150, 8, 24, 3), (77, 3, 9, 3), (64, 4, 8, 4)]:
        idx = _routing(T, K, E, gen)
        a, b = compute_layout(idx, E, W), layout_reference(idx, E, W)
        for name in ("is_token_in_rank", "send_slot", "num_tokens_per_rank", "num_tokens_per_expert"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (name, T, K, E, W)


def test_layout_kernel_matches_reference():
    layout_body()


def bad_dispatch_inputs():
    world = tilecomm.world_size()
    d = Dispatcher(4 * world, 8, 5, 2, torch.float32)
    x, idx, w = torch.randn(3, 8, device=dev()), torch.zeros(3, 2, dtype=torch.int64, device=dev()), torch.rand(3, 2, device=dev())
    cases = [
        (ValueError, "hidden=8", (torch.randn(3, 7, device=dev()), idx, w)),
        (TypeError, "made for", (x.double(), idx, w)),
        (ValueError, "max_tokens_per_rank", (torch.randn(6, 8, device=dev()), torch.zeros(6, 2, dtype=torch.int64, device=dev()),
                                             torch.rand(6, 2, device=dev()))),
        (ValueError, "topk=2", (x, idx[:, :1], w)),
        (TypeError, "int32 or int64", (x, idx.float(), w)),
        (ValueError, r"\[-1, ", (x, idx - 2, w)),
        (ValueError, r"\[-1, ", (x, idx + 4 * world, w)),
        (TypeError, "floating point", (x, idx, idx)),
    ]
    for exc, pattern, args in cases:
        with pytest.raises(exc, match=pattern):
            d.dispatch(*args)
    with pytest.raises(ValueError, match="divide"):
        Dispatcher(4 * world + 1, 8, 5, 2)
    with pytest.raises(ValueError, match="low_latency.*needs backend='tilecomm'"):
        Dispatcher(4 * world, 8, 5, 2, mode="low_latency", backend="nccl")
    with pytest.raises(ValueError, match="mode="):
        Dispatcher(4 * world, 8, 5, 2, mode="fast")
    res = d.dispatch(x, idx, w)  # the bad calls above left the Dispatcher in step with its peers
    torch.testing.assert_close(d.combine(res.x, res.handle), x * w.sum(1, keepdim=True) * (idx[:, :1] >= 0))
    with pytest.raises(ValueError, match="combine: y must be"):
        d.combine(torch.randn(res.x.shape[0] + 1, 8, device=dev()), res.handle)
    with pytest.raises(TypeError, match="no wider than"):
        d.combine(res.x.double(), res.handle)
    with pytest.raises(ValueError, match="handle"):
        d.combine(res.x, object())
    d.free()
    with pytest.raises(RuntimeError, match="freed"):
        d.dispatch(x, idx, w)
    other = 4 * world if tilecomm.rank() else 8 * world  # rank 0 disagrees with the others
    with pytest.raises(PeerMismatchError, match=r"rank \d has num_experts=\d+, rank \d has num_experts=\d+"):
        Dispatcher(other, 8, 5, 2, torch.float32)


def test_bad_dispatch_inputs(ranks):
    ranks(2).run(bad_dispatch_inputs)


def fp8_body(seed, T_by_rank, H, K, E, backend):
    """FP8 payload: the dispatched e4m3 bytes and scales are exactly the source-quantized rows."""
    from tilecomm.dispatch import fp8

    rank, world = tilecomm.rank(), tilecomm.world_size()
    x, idx, w = _inputs(seed + rank, T_by_rank[rank], H, K, E, torch.bfloat16)
    d = Dispatcher(E, H, max(T_by_rank), K, torch.bfloat16, backend=backend)
    with torch.no_grad():
        res = d.dispatch(x, idx, w, use_fp8=True)
    q, scales = fp8.quantize(x)
    gathered = [None] * world
    dist.all_gather_object(gathered, (q.view(torch.uint8).cpu(), idx.cpu(), w.cpu(), scales.cpu()))
    qs, idxs, ws, ss = zip(*gathered)
    want_q, want_w, _ = _global_reference(qs, idxs, ws, rank, E, world)
    want_s, _, _ = _global_reference(ss, idxs, ws, rank, E, world)
    assert res.x.dtype == torch.float8_e4m3fn and torch.equal(res.x.view(torch.uint8).cpu(), want_q)
    assert torch.equal(res.x_scales.cpu(), want_s) and torch.equal(res.weights.cpu(), want_w)
    approx = fp8.dequantize(res.x, res.x_scales)  # quantization error stays within e4m3's precision
    full = d.dispatch(x, idx, w).x.float()
    assert (approx - full).abs().max() <= 0.07 * full.abs().max() + 1e-6
    y = full.to(torch.bfloat16)
    torch.testing.assert_close(d.combine(y, res.handle).float(), d.combine(y, d.dispatch(x, idx, w).handle).float())


@pytest.mark.parametrize("backend", ["tilecomm", "nccl"])
def test_fp8_payload(ranks, backend):
    ranks(3).run(fp8_body, 8, [5, 0, 7], 256, 2, 6, backend)


def test_fp8_quantize_roundtrip_and_errors():
    from tilecomm.dispatch import fp8

    x = torch.randn(5, 256) * torch.logspace(-3, 3, 5)[:, None]
    x[2, :128] = 0
    q, s = fp8.quantize(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 2) and s[2, 0] == 1
    back = fp8.dequantize(q, s)
    assert ((back - x).abs() <= x.abs().view(5, 2, 128).amax(-1).repeat_interleave(128, 1) / 16 + 1e-12).all()
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.quantize(torch.randn(2, 100))
