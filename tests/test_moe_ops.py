"""The fused ops of tilecomm.moe.ops: each Triton kernel (interpreted on CPU tensors, compiled on GPUs)
and each torch reference against float64 math written out here, over uneven sizes, forward and
backward; the AdamW kernel and optimizer against torch.optim.AdamW."""
from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from tilecomm.moe import AdamW, cast_parameters
from tilecomm.moe.ops import adamw as adamw_mod
from tilecomm.moe.ops import cross_entropy as ce_mod
from tilecomm.moe.ops.permute import PermuteFn, UnpermuteFn, permute_ref, unpermute_ref
from tilecomm.moe.ops.rms_norm import RMSNormFn, rms_norm_ref
from tilecomm.moe.ops.rope import RopeQKVFn, rope_qkv_ref
from tilecomm.moe.ops.swiglu import SwiGLUFn, swiglu_ref

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _leaves(*ts, dtype=torch.float32):
    """Two sets of leaves with the same values: kernel inputs (dtype, on DEVICE) and float64 ones (CPU)."""
    a = [t.to(DEVICE, dtype).clone().requires_grad_() if t.is_floating_point() else t.to(DEVICE) for t in ts]
    b = [t.double().clone().requires_grad_() if t.is_floating_point() else t for t in ts]
    return a, b


def _close(got, want, tol=2e-5):
    torch.testing.assert_close(got.detach().double().cpu(), want.detach().double().cpu(), rtol=tol, atol=tol)


def _check_grads(out, out_ref, ins, ins_ref, seed=0, tol=2e-5):
    g = torch.randn(out_ref.shape, generator=_gen(seed), dtype=torch.float64)
    (out.float() * g.to(out.device, torch.float32)).sum().backward()
    (out_ref * g).sum().backward()
    _close(out, out_ref, tol)
    for a, b in zip(ins, ins_ref):
        if b.requires_grad:
            _close(a.grad, b.grad, tol)


@pytest.mark.parametrize("n,h", [(7, 24), (1, 5), (33, 64)])
def test_rms_norm_kernel(n, h):
    x, w = torch.randn(n, h, generator=_gen(1)), torch.randn(h, generator=_gen(2))
    (xa, wa), (xb, wb) = _leaves(x, w)
    ms = (xb * xb).mean(-1, keepdim=True)
    _check_grads(RMSNormFn.apply(xa, wa, 1e-6), xb / torch.sqrt(ms + 1e-6) * wb, (xa, wa), (xb, wb))


def test_rms_norm_reference():
    x, w = torch.randn(4, 9, generator=_gen(3)), torch.randn(9, generator=_gen(4))
    want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    _close(rms_norm_ref(x, w, 1e-6), want)


def _rope_tables(seq, hd):
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2).double() / hd)
    ang = torch.outer(torch.arange(seq).double(), inv)
    return ang.cos(), ang.sin()


def _rope_math(x, cos, sin, offset):
    """x [B, S, nh, hd] float64: pair (2i, 2i+1) at position offset + s turned by that angle."""
    S = x.shape[1]
    c, s = cos[offset:offset + S][None, :, None], sin[offset:offset + S][None, :, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = even * c - odd * s, even * s + odd * c
    return out.transpose(1, 2)


@pytest.mark.parametrize("B,S,nh,hd,offset", [(2, 5, 3, 8, 3), (1, 7, 2, 6, 0)])
def test_rope_kernel_and_reference(B, S, nh, hd, offset):
    cos, sin = _rope_tables(16, hd)
    qkv = torch.randn(B, S, 3, nh, hd, generator=_gen(5))
    weights = [torch.randn(B, nh, S, hd, generator=_gen(6 + i), dtype=torch.float64) for i in range(3)]
    want = [_rope_math(qkv[:, :, 0].double(), cos, sin, offset), _rope_math(qkv[:, :, 1].double(), cos, sin, offset),
            qkv[:, :, 2].double().transpose(1, 2)]
    for fn in (RopeQKVFn.apply, rope_qkv_ref):
        x = qkv.to(DEVICE).clone().requires_grad_()
        outs = fn(x, cos.float().to(DEVICE), sin.float().to(DEVICE), offset)
        loss = sum((o.double() * w.to(DEVICE)).sum() for o, w in zip(outs, weights))
        loss.backward()
        for o, w in zip(outs, want):
            assert o.shape == (B, nh, S, hd)
            _close(o, w)
        xb = qkv.double().clone().requires_grad_()
        sum((_rope_math(xb[:, :, i], cos, sin, offset) * weights[i]).sum() for i in range(2)).add(
            (xb[:, :, 2].transpose(1, 2) * weights[2]).sum()).backward()
        _close(x.grad, xb.grad)


@pytest.mark.parametrize("m,f", [(5, 300), (17, 8), (1, 1)])
def test_swiglu_kernel(m, f):
    h = torch.randn(m, 2 * f, generator=_gen(7)) * 3
    (ha,), (hb,) = _leaves(h)
    g, u = hb[:, :f], hb[:, f:]
    _check_grads(SwiGLUFn.apply(ha), g / (1 + torch.exp(-g)) * u, (ha,), (hb,))
    _close(swiglu_ref(h), F.silu(h[:, :f].double()) * h[:, f:].double())


def _routing(T, K, E, seed, dropped=()):
    """(row_pair, pair_row) of random top-K choices with some pairs dropped, written out with loops."""
    gen = _gen(seed)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    for t, k in dropped:
        idx[t, k] = -1
    pairs = sorted((int(idx[t, k]), t * K + k) for t in range(T) for k in range(K) if idx[t, k] >= 0)
    row_pair = [p for _, p in pairs] + [-1] * (T * K - len(pairs))
    pair_row = [[-1] * K for _ in range(T)]
    for r, p in enumerate(row_pair):
        if p >= 0:
            pair_row[p // K][p % K] = r
    return torch.tensor(row_pair), torch.tensor(pair_row)


@pytest.mark.parametrize("T,K,E,H,dropped", [(7, 2, 3, 20, [(2, 1), (5, 0)]), (9, 3, 5, 513, []), (1, 1, 1, 3, [])])
def test_permute_unpermute_kernels(T, K, E, H, dropped):
    row_pair, pair_row = _routing(T, K, E, T + H, dropped)
    x, w = torch.randn(T, H, generator=_gen(8)), torch.rand(T, K, generator=_gen(9))
    scale = torch.randn(T * K, 1, generator=_gen(10))  # what experts do to each row in between
    want_rows = torch.stack([x[p // K].double() if p >= 0 else torch.zeros(H, dtype=torch.float64)
                             for p in row_pair.tolist()])
    for permute_fn, unpermute_fn in ((PermuteFn.apply, UnpermuteFn.apply),
                                     (permute_ref, lambda y, w_, pr, rp: unpermute_ref(y, w_, pr))):
        (xa, wa, rpa, pra), (xb, wb, _, _) = _leaves(x, w, row_pair, pair_row)
        rows = permute_fn(xa, rpa, pra)
        _close(rows, want_rows)
        out = unpermute_fn(rows * scale.to(DEVICE), wa, pra, rpa)
        rows_b = torch.stack([xb[p // K] if p >= 0 else xb.new_zeros(H) for p in row_pair.tolist()]) * scale.double()
        out_b = torch.stack([sum((wb[t, k] * rows_b[pair_row[t, k]] for k in range(K) if pair_row[t, k] >= 0),
                                 xb.new_zeros(H)) for t in range(T)])
        _check_grads(out, out_b, (xa, wa), (xb, wb))
        for t, k in dropped:
            assert float(wa.grad[t, k]) == 0.0


def _ce_math(h, w, targets):
    return F.cross_entropy(h @ w.t(), targets)


@pytest.mark.parametrize("n,hid,v,chunk", [(10, 8, 37, 4), (6, 5, 5000, 6), (3, 4, 9, 1)])
def test_linear_cross_entropy(n, hid, v, chunk, monkeypatch):
    h, w = torch.randn(n, hid, generator=_gen(11)), torch.randn(v, hid, generator=_gen(12))
    targets = torch.randint(0, v, (n,), generator=_gen(13))
    for kernel in (True, False):
        if kernel:  # the row kernel also on CPU tensors (interpreted)
            monkeypatch.setattr(ce_mod, "use_triton", lambda *t: True)
        (ha, wa, ta), (hb, wb, tb) = _leaves(h, w, targets)
        loss = ce_mod.linear_cross_entropy(ha, wa, ta, chunk_rows=chunk)
        (2.5 * loss).backward()
        want = _ce_math(hb, wb, tb)
        (2.5 * want).backward()
        _close(loss, want)
        _close(ha.grad, hb.grad)
        _close(wa.grad, wb.grad)
        monkeypatch.undo()
    with pytest.raises(ValueError, match="targets"):
        ce_mod.linear_cross_entropy(h, w, targets[:-1])


def _torch_adamw_steps(p0, grads, **kw):
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], foreach=False, **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_adamw_step_matches_torch(impl):
    n = 3000  # more than one block, not a multiple
    p0 = torch.randn(n, generator=_gen(14))
    grads = [torch.randn(n, generator=_gen(15 + i)) * 3 for i in range(3)]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    want = _torch_adamw_steps(p0, grads, **kw)
    master, m, v = p0.clone().to(DEVICE), torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE)
    out = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=DEVICE)  # poisoned: must be written
    for step, g in enumerate(grads, 1):
        adamw_mod.adamw_step_(master, (g / 4).to(DEVICE), m, v, out, torch.tensor(4.0, device=DEVICE), step=step,
                              lr=kw["lr"], beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, impl=impl)
    _close(master, want, 1e-5)
    _close(out, master, 2 ** -7)  # master in bf16 (the interpreter truncates where GPUs round)


def test_adamw_optimizer_with_bf16_masters():
    """A bf16 model's optimizer keeps fp32 masters: equal to torch's AdamW on fp32 parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5)).to(DEVICE)
    ref = [p.detach().clone() for p in model.parameters()]
    masters = cast_parameters(model, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()) and len(masters) == 4
    opt = AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, masters=masters)
    ref_params = [torch.nn.Parameter(r) for r in ref]
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for i in range(3):
        grads = [torch.randn(p.shape, generator=_gen(20 + i)) for p in ref_params]
        for p, rp, g in zip(model.parameters(), ref_params, grads):
            p.grad, rp.grad = g.to(DEVICE, torch.bfloat16), g.to(torch.bfloat16).float()
        opt.step()
        ref_opt.step()
    for p, rp in zip(model.parameters(), ref_params):
        _close(opt.state[p]["master"], rp, 1e-5)
        assert torch.equal(p.detach().cpu(), opt.state[p]["master"].cpu().to(torch.bfloat16))
        assert float(opt.state[p]["step"]) == 3
    with pytest.raises(ValueError, match="master"):
        AdamW([torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))])


def test_cast_parameters_keeps_router_fp32():
    from tilecomm.moe import MoEConfig, MoELayer
    layer = MoELayer(MoEConfig(hidden=8, ffn_hidden=4, num_experts=4, topk=2), dispatcher="local")
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    masters = cast_parameters(layer, torch.bfloat16)
    dtypes = {n: p.dtype for n, p in layer.named_parameters()}
    assert dtypes["router.weight"] == torch.float32 and dtypes["experts.w_down"] == torch.bfloat16
    for n, p in layer.named_parameters():
        if p in masters:
            assert torch.equal(masters[p], before[n]) and masters[p].dtype == torch.float32
    assert math.isclose(sum(m.numel() for m in masters.values()), 4 * 8 * 8 + 4 * 4 * 8)


def test_model_with_kernels_equals_model_with_references(monkeypatch):
    """The whole model (every fused op on its Triton path, interpreted here) against the same model on
    the torch references: loss, aux loss and every gradient, with capacity dropping in the router."""
    from _reference import MODEL
    from tilecomm.moe import MarkovSource, ModelConfig, MoEConfig, MoELayer, Transformer
    ops = [importlib.import_module(f"tilecomm.moe.ops.{m}") for m in ("permute", "rms_norm", "rope", "swiglu")]

    moe = MoEConfig(hidden=16, ffn_hidden=8, num_experts=4, topk=2, seed=1, experts_impl="loop",
                    router=dict(aux_loss_coeff=1e-2, capacity_factor=0.75))
    tokens = MarkovSource(vocab=32, seed=3).batch(0, 0, 2, 16)
    results = []
    for kernels in (False, True):
        if kernels:
            for mod in ops + [ce_mod]:
                monkeypatch.setattr(mod, "use_triton", lambda *t: True)
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**MODEL), moe_layer=lambda i: MoELayer(moe, "local"))
        loss, aux = model(tokens[:, :-1], tokens[:, 1:].reshape(-1))
        (loss + aux).backward()
        results.append([loss, aux] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
