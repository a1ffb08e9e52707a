"""tilecomm.moe: router pieces against hand-computed references, grouped experts against the loop,
and the MoE layer on 2 and 3 CPU ranks (both dispatcher backends) against the single-process layer."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import tilecomm
from tilecomm.moe.experts import GroupedSwiGLUExperts, grouped_mm_works
from tilecomm.moe.layer import LocalDispatcher, MoEConfig, MoELayer, shard_expert_state
from tilecomm.moe.router import Router, RouterConfig
from _reference import dev


def identity_router(**cfg) -> Router:
    """A router whose gate is the identity (hidden = E), so the logits are the input rows."""
    r = Router(RouterConfig(**cfg), hidden=cfg["num_experts"])
    with torch.no_grad():
        r.weight.copy_(torch.eye(cfg["num_experts"]))
    return r


def logit(p):
    return [math.log(q / (1 - q)) for q in p]


# ---------------------------------------------------------------- router

@pytest.mark.parametrize("pre_softmax", [True, False])
def test_softmax_topk(pre_softmax):
    r = identity_router(num_experts=4, topk=2, pre_softmax=pre_softmax, scaling_factor=2.0)
    out = r(torch.tensor([[1.0, 2.0, 3.0, 0.0]]))
    assert out.topk_idx.tolist() == [[2, 1]] and out.topk_idx.dtype == torch.int64
    e = [math.exp(v) for v in (1.0, 2.0, 3.0, 0.0)]
    denom = sum(e) if pre_softmax else e[2] + e[1]
    torch.testing.assert_close(out.topk_weights, 2.0 * torch.tensor([[e[2] / denom, e[1] / denom]]))
    assert out.tokens_per_expert.tolist() == [0, 1, 1, 0] and float(out.aux_loss) == 0.0


@pytest.mark.parametrize("pre_softmax", [True, False])
def test_sigmoid_topk(pre_softmax):
    p = [0.2, 0.7, 0.4, 0.9]
    r = identity_router(num_experts=4, topk=2, score="sigmoid", pre_softmax=pre_softmax)
    out = r(torch.tensor([logit(p)]))
    assert out.topk_idx.tolist() == [[3, 1]]
    expect = [0.9, 0.7] if pre_softmax else [0.9 / 1.6, 0.7 / 1.6]
    torch.testing.assert_close(out.topk_weights, torch.tensor([expect]))


def test_group_limited_topk():
    # groups of 2: sums of top-2 = .95, 1.15, .8, .9 -> groups 1 and 0; expert 4 (0.7) is excluded.
    # (By group max, groups 0 and 2 would win and give [0, 4], as plain top-2 does.)
    p = [0.9, 0.05, 0.6, 0.55, 0.7, 0.1, 0.5, 0.4]
    x = torch.tensor([logit(p)])
    plain = identity_router(num_experts=8, topk=2, score="sigmoid", pre_softmax=True)
    assert plain(x).topk_idx.tolist() == [[0, 4]]
    r = identity_router(num_experts=8, topk=2, score="sigmoid", pre_softmax=True, num_groups=4, group_topk=2)
    out = r(x)
    assert out.topk_idx.tolist() == [[0, 2]]
    torch.testing.assert_close(out.topk_weights, torch.tensor([[0.9, 0.6]]))


def _random_router(E, H, K, seed=0, **cfg):
    gen = torch.Generator().manual_seed(seed)
    r = Router(RouterConfig(num_experts=E, topk=K, **cfg), hidden=H, generator=gen, init_std=1.0)
    return r, torch.randn(12, H, generator=gen)


def test_aux_loss_value_and_gradient():
    E, H, K, T, coeff = 6, 5, 2, 12, 0.3
    r, x = _random_router(E, H, K, aux_loss_coeff=coeff)
    out = r(x)
    out.aux_loss.backward()
    with torch.no_grad():
        z = x @ r.weight.t()
        p = torch.softmax(z, -1)
        idx = p.topk(K, -1).indices
        f = torch.zeros(E).index_add_(0, idx.flatten(), torch.ones(T * K)) / (T * K)
        value = coeff * E * (f * p.mean(0)).sum()
        g = coeff * E * f / T  # dL/dp[t, e], the same for every t
        dz = p * (g - (p * g).sum(-1, keepdim=True))  # softmax Jacobian
        grad_w = dz.t() @ x
    torch.testing.assert_close(out.aux_loss, value)
    torch.testing.assert_close(r.weight.grad, grad_w)


def test_seq_aux_and_z_loss_values():
    E, H, K, S = 4, 3, 2, 6
    r, x = _random_router(E, H, K, seed=1, score="sigmoid", seq_aux_loss_coeff=0.5, z_loss_coeff=0.1)
    out = r(x, seq_len=S)
    with torch.no_grad():
        z = x @ r.weight.t()
        s = torch.sigmoid(z)
        idx = s.topk(K, -1).indices
        losses = []
        for b in range(2):  # per sequence: E * sum_e f_e P_e with P from normalised scores
            sb, ib = s[b * S:(b + 1) * S], idx[b * S:(b + 1) * S]
            f = torch.tensor([(ib == e).sum().item() for e in range(E)]) / (S * K)
            P = (sb / sb.sum(-1, keepdim=True)).mean(0)
            losses.append(E * (f * P).sum())
        zl = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in z.tolist()) / z.shape[0]
    torch.testing.assert_close(out.aux_loss, 0.5 * sum(losses) / 2 + 0.1 * torch.tensor(zl))
    with pytest.raises(ValueError):
        r(x)  # no seq_len


@pytest.mark.parametrize("policy,kept", [("probs", [1, 3]), ("position", [0, 1])])
def test_capacity_dropping(policy, kept):
    # 4 tokens, all on expert 0 with softmax weights .6 .9 .7 .8; capacity = ceil(1.0 * 4 * 1 / 2) = 2
    p = torch.tensor([0.6, 0.9, 0.7, 0.8])
    x = torch.stack([torch.log(p), torch.log(1 - p)], 1)
    r = identity_router(num_experts=2, topk=1, pre_softmax=True, capacity_factor=1.0, drop_policy=policy)
    out = r(x)
    assert out.topk_idx.flatten().tolist() == [0 if t in kept else -1 for t in range(4)]
    torch.testing.assert_close(out.topk_weights.flatten(), torch.where(out.topk_idx.flatten() >= 0, p, 0.0))
    assert out.tokens_per_expert.tolist() == [2, 0]


def test_capacity_topk2_keeps_other_pairs():
    # E=2, K=2: every token picks both experts; capacity ceil(0.5 * 3 * 2 / 2) = 2 keeps 2 per expert.
    x = torch.tensor([[0.0, 3.0], [2.0, 1.0], [1.0, 0.0]])
    r = identity_router(num_experts=2, topk=2, pre_softmax=True, capacity_factor=0.5, drop_policy="probs")
    out = r(x)
    # expert 0 probs: .047 .731 .731 -> tokens 1, 2; expert 1: .953 .269 .269 -> tokens 0, 1 (tie: earlier)
    assert out.topk_idx.tolist() == [[1, -1], [0, 1], [0, -1]]
    assert out.tokens_per_expert.tolist() == [2, 2]


def test_expert_bias_update_and_selection():
    r = identity_router(num_experts=4, topk=1, score="sigmoid", pre_softmax=True, expert_bias=True,
                        bias_update_rate=0.1).eval()
    x = torch.tensor([logit([0.6, 0.5, 0.1, 0.1])])
    assert r(x).topk_idx.tolist() == [[0]]
    r.update_expert_bias(torch.tensor([5, 1, 1, 1]))  # mean 2: expert 0 overloaded
    torch.testing.assert_close(r.expert_bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    out = r(x)  # 0.6 - 0.1 < 0.5 + 0.1: expert 1 now; its weight is still the unbiased score
    assert out.topk_idx.tolist() == [[1]]
    torch.testing.assert_close(out.topk_weights, torch.tensor([[0.5]]))
    r.train()
    r(torch.tensor([logit([0.1, 0.1, 0.1, 0.9])] * 3))  # counts accumulate: expert 3 gets 3
    r.update_expert_bias()
    torch.testing.assert_close(r.expert_bias, torch.tensor([0.0, 0.2, 0.2, 0.0]))
    assert r.tokens_since_update.sum() == 0 and not r.expert_bias.requires_grad


# ---------------------------------------------------------------- experts

def _swiglu_reference(x, wgu, wd, counts):
    out, start = [], 0
    F = wd.shape[1]
    for e, n in enumerate(counts):
        xe = x[start:start + n].double()
        h = xe @ wgu[e].double()
        out.append((torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ wd[e].double())
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("impl", ["grouped", "loop", "auto", "tilecomm"])
def test_grouped_experts_match_reference(impl):
    H, F, counts = 8, 12, [3, 0, 5, 2]
    if impl == "grouped" and not grouped_mm_works(torch.device("cpu"), torch.float32, H, F):
        pytest.skip("torch._grouped_mm is not usable here")
    ex = GroupedSwiGLUExperts(4, H, F, torch.float32, impl=impl, seed=3, init_std=0.3)
    x = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(4), requires_grad=True)
    y = ex(x, torch.tensor(counts))
    (y * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in (x, ex.w_gate_up, ex.w_down)]
    y_ref = _swiglu_reference(*leaves, counts)
    (y_ref * torch.arange(y.numel()).view_as(y).sin().double()).sum().backward()
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-6)
    for got, ref in zip((x, ex.w_gate_up, ex.w_down), leaves):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-5, atol=1e-6)
    expanded = ex(x, torch.tensor(counts)).sum()  # an expanded (stride-0) output gradient
    expanded.backward()


@pytest.mark.parametrize("capability, dtype, device, picked", [
    ((9, 0), torch.bfloat16, "cuda", "tilecomm"), ((10, 0), torch.float16, "cuda", "tilecomm"),
    ((8, 0), torch.bfloat16, "cuda", "torch"), ((9, 0), torch.float32, "cuda", "torch"),
    ((9, 0), torch.bfloat16, "cpu", "torch")])
def test_auto_experts_take_tilecomm_grouped_mm_on_hopper_in_16_bits(monkeypatch, capability, dtype, device, picked):
    """impl="auto": tilecomm's grouped_mm (TMA) on sm_90+ in bf16/fp16, torch._grouped_mm elsewhere (probe stubbed)."""
    from tilecomm.moe import experts

    monkeypatch.setattr(experts, "_PROBED", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    monkeypatch.setattr(experts, "grouped_mm_works", lambda *a: True)
    ex = GroupedSwiGLUExperts(2, 8, 4, torch.float32, impl="auto")
    assert ex.grouped_mm_impl(dtype, torch.device(device, 0) if device == "cuda" else torch.device("cpu")) == picked
    ex.impl = "tilecomm"
    assert ex.grouped_mm_impl(dtype, torch.device("cpu")) == "tilecomm"
    ex.impl = "loop"
    assert ex.grouped_mm_impl(dtype, torch.device("cpu")) is None


def test_shared_expert_and_local_layer_match_dense_reference():
    c = MoEConfig(hidden=8, ffn_hidden=4, num_experts=4, topk=2, num_shared_experts=2, seed=5, init_std=0.3,
                  router=dict(capacity_factor=0.75, drop_policy="position"))
    layer = MoELayer(c)
    assert isinstance(layer.dispatcher, LocalDispatcher) and layer.shared.w_down.shape == (8, 8)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(6))
    y, _ = layer(x)
    t = x.reshape(-1, 8)
    r = layer.router(t, seq_len=5)
    assert (r.topk_idx < 0).any(), "the example should drop some pairs"
    sh = layer.shared
    expect = torch.nn.functional.silu(t @ sh.w_gate_up[:, :8]) * (t @ sh.w_gate_up[:, 8:]) @ sh.w_down
    ex = layer.experts
    for i in range(t.shape[0]):
        for k in range(2):
            e = int(r.topk_idx[i, k])
            if e >= 0:
                h = t[i] @ ex.w_gate_up[e]
                expect[i] += r.topk_weights[i, k] * (torch.nn.functional.silu(h[:4]) * h[4:]) @ ex.w_down[e]
    torch.testing.assert_close(y.reshape(-1, 8), expect, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        layer.dispatcher = LocalDispatcher(8, 8, 2)


# ---------------------------------------------------------------- expert parallelism

def _ep_config():
    return MoEConfig(hidden=8, ffn_hidden=4, num_experts=6, topk=2, num_shared_experts=1, seed=11, init_std=0.3,
                     router=dict(aux_loss_coeff=0.01, seq_aux_loss_coeff=0.01, z_loss_coeff=1e-3,
                                 num_groups=3, group_topk=2))


def _tp_model_moe_config():
    """test_tensor_parallel's MoE layer (no shared expert, 4 experts, hidden 16): the EP layer alone at the TP x EP
    model's shapes, so that a failure of that model's test tells the layer apart from the model around it."""
    return MoEConfig(hidden=16, ffn_hidden=8, num_experts=4, topk=2, router={"aux_loss_coeff": 0.0}, seed=1,
                     max_tokens_per_rank=64, experts_impl="loop")


def ep_equivalence_body(backend, B, S, config=_ep_config):
    """Each rank: B sequences of the global batch through the EP layer; compare with the EP = 1 layer
    run on the whole batch (built from the same seed) for outputs, aux losses and all gradients."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    c = config()
    gen = torch.Generator().manual_seed(21)
    x_all = torch.randn(world * B, S, c.hidden, generator=gen).to(dev())
    g_all = torch.randn(world * B, S, c.hidden, generator=gen).to(dev())
    mine = slice(rank * B, (rank + 1) * B)

    ref = MoELayer(c, dispatcher="local").to(dev())
    xr = x_all.clone().requires_grad_()
    y_ref, _ = ref(xr)
    (y_ref * g_all).sum().backward()

    layer = MoELayer(c, dispatcher=backend).to(dev())
    E = c.num_experts
    assert layer.ep_size == world and list(layer.local_experts) == list(range(rank * E // world, (rank + 1) * E // world))
    own = shard_expert_state(ref.state_dict(), rank, world, c.num_experts)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, own[k]), f"{k}: EP layer initialised differently from the EP = 1 slice"
    x = x_all[mine].clone().requires_grad_()
    y, aux = layer(x)
    (y * g_all[mine]).sum().backward()

    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, y_ref[mine], **tol)
    torch.testing.assert_close(x.grad, xr.grad[mine], **tol)
    with torch.no_grad():
        aux_mine = ref.router(x_all[mine].reshape(-1, c.hidden), seq_len=S).aux_loss
    torch.testing.assert_close(aux, aux_mine, **tol)
    shared = ("shared.w_gate_up", "shared.w_down") if c.num_shared_experts else ()
    for name in ("router.weight",) + shared:  # replicated: sum over ranks
        grad = layer.get_parameter(name).grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, ref.get_parameter(name).grad, **tol)
    lo, hi = layer.local_experts.start, layer.local_experts.stop
    for name in ("experts.w_gate_up", "experts.w_down"):  # local: already every rank's tokens
        torch.testing.assert_close(layer.get_parameter(name).grad, ref.get_parameter(name).grad[lo:hi], **tol)
    return int(layer.experts.use_grouped())


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", ["tilecomm", "nccl"])
def test_ep_layer_matches_single_process(ranks, world, backend):
    ranks(world).run(ep_equivalence_body, backend, 2, 5)


def test_ep_layer_at_the_tp_models_shapes(ranks):
    ranks(2).run(ep_equivalence_body, "tilecomm", 1, 16, _tp_model_moe_config)


def test_ep_default_dispatcher_is_tilecomm(ranks):
    ranks(2).run(_default_dispatcher_body)


def _default_dispatcher_body():
    from tilecomm.dispatch import Dispatcher
    layer = MoELayer(_ep_config())
    assert isinstance(layer.dispatcher, Dispatcher) and layer.dispatcher.backend == "tilecomm"
    assert layer.experts.w_down.shape[0] == 3


# ---------------------------------------------------------------- torch.compile

COMPILE_BACKEND = "inductor" if torch.cuda.is_available() else "aot_eager"  # CPU inductor builds C++: minutes


def _compiled_vs_eager(make_layer, x, dtype):
    """(eager, compiled) results of a layer built twice: output, aux loss, input and parameter grads."""
    results = []
    for compiled in (False, True):
        layer = make_layer()
        if dtype != torch.float32:
            from tilecomm.moe import cast_parameters
            cast_parameters(layer, dtype)
        fn = torch.compile(layer, backend=COMPILE_BACKEND) if compiled else layer
        xi = x.detach().to(dtype).clone().requires_grad_()
        y, aux = fn(xi)
        (y.float().square().sum() + aux).backward()
        results.append([y, aux, xi.grad] + [p.grad for p in layer.parameters()])
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_moe_layer_matches_eager(dtype):
    """torch.compile of MoELayer (local dispatcher traced; fp32 experts run the loop, a graph break)."""
    torch._dynamo.reset()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    c = MoEConfig(hidden=16, ffn_hidden=8, num_experts=4, topk=2, seed=3, init_std=0.3,
                  router=dict(aux_loss_coeff=1e-2, z_loss_coeff=1e-3))
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(4)).to(device)
    eager, compiled = _compiled_vs_eager(lambda: MoELayer(c, "local", device=device), x, dtype)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b.float(), a.float(), **tol)


def compiled_ep_layer_body(backend):
    """torch.compile of an EP layer: the tilecomm / NCCL dispatcher runs eagerly between graphs."""
    torch._dynamo.reset()
    c = _ep_config()
    x = torch.randn(2, 5, c.hidden, generator=torch.Generator().manual_seed(30 + tilecomm.rank())).to(
        tilecomm.current().device)
    eager, compiled = _compiled_vs_eager(lambda: MoELayer(c, dispatcher=backend, device=x.device), x, torch.float32)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_compiled_ep_layer_matches_eager(ranks):
    ranks(2).run(compiled_ep_layer_body, "tilecomm")


def _heap_bytes_body(dtype):
    """make_dispatcher takes exactly what dispatcher_heap_bytes says from this rank's heap (the example sizes
    tilecomm.init by it: a gap would show first as a MemoryError on GPUs), and a shared one takes nothing."""
    from tilecomm.moe.layer import dispatcher_heap_bytes, make_dispatcher

    heap, world = tilecomm.current().heap, tilecomm.world_size()
    cfg = MoEConfig(hidden=24, ffn_hidden=8, num_experts=6, topk=2, max_tokens_per_rank=40)
    for kind in ("tilecomm", "fused", "nccl"):
        before = heap.bytes_free()
        d = make_dispatcher(cfg, kind, dtype=dtype)
        taken = before - heap.bytes_free()
        assert taken == dispatcher_heap_bytes(cfg, kind, world, dtype), (kind, taken)
        assert (taken > 0) == (kind != "nccl")
        shared = make_dispatcher(cfg, kind, share_with=d, dtype=dtype)
        assert heap.bytes_free() == before - taken, f"{kind}: a dispatcher sharing buffers allocated"
        assert getattr(shared, "dtype", dtype) == dtype
        if hasattr(d, "free"):
            d.free()
        assert heap.bytes_free() == before


@pytest.mark.parametrize("world", [2, 3])
def test_dispatcher_heap_bytes_is_what_the_dispatcher_takes(ranks, world):
    ranks(world).run(_heap_bytes_body, torch.bfloat16)
