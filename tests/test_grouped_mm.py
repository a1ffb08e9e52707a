"""tilecomm.overlap.grouped_mm against float64 references (the per-expert loop and torch._grouped_mm):
forward and both gradients, empty experts, odd sizes, three dtypes; bad input raises naming the argument."""
from __future__ import annotations

import pytest
import torch

from tilecomm.overlap import grouped_mm, grouped_mm_reference

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def dev():
    """A one-process op: the GPU when there is one, else the interpreter on CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _rel(got, want):
    return ((got.double().cpu() - want.cpu()).norm() / want.cpu().norm().clamp_min(1e-30)).item()


def _case(counts, K, N, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    R, E = sum(counts), len(counts)
    x = torch.randn(R, K, generator=g).to(dtype)
    w = torch.randn(E, K, N, generator=g).to(dtype)
    dy = torch.randn(R, N, generator=g).to(dtype)
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    return x, w, dy, offs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("counts,K,N", [([5, 0, 19, 1], 24, 40), ([17], 13, 33), ([0, 3, 0], 8, 7), ([0, 0], 16, 8)],
                         ids=["uneven", "odd-K-N", "empty-ends", "all-empty"])
def test_grouped_mm_forward_and_grads(dtype, counts, K, N):
    x, w, dy, offs = _case(counts, K, N, dtype, seed=len(counts) * 100 + K)
    xs, ws = x.to(dev()).clone().requires_grad_(), w.to(dev()).clone().requires_grad_()
    y = grouped_mm(xs, ws, offs.to(dev()))
    y.backward(dy.to(dev()))
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    want = grouped_mm_reference(xd, wd, offs)
    want.backward(dy.double())
    assert y.shape == (sum(counts), N) and y.dtype == dtype
    assert _rel(y.detach(), want.detach()) < TOL[dtype]
    assert _rel(xs.grad, xd.grad) < TOL[dtype]
    assert _rel(ws.grad, wd.grad) < TOL[dtype]
    for e, n in enumerate(counts):  # an expert with no rows gets a zero weight gradient
        if n == 0:
            assert not ws.grad[e].any()


@pytest.mark.parametrize("form", ["flat", "per_item"])
def test_weight_gradient_loop_forms(form):
    """Every kernel of dw[e] = x_e^T @ dy_e (the launcher picks one by rows per expert): experts longer than a
    row step (full steps and a tail, several steps of 16 rows on CPU ranks), empty ones (zero), one row."""
    from tilecomm.overlap.grouped import _wgrad

    x, _, dy, offs = _case([40, 0, 17, 70, 1, 0], 24, 40, torch.float32, seed=11)
    got = _wgrad(x.to(dev()), dy.to(dev()), offs.to(dev()), 6, None, form=form)
    starts = [0] + offs.tolist()[:-1]
    want = torch.stack([x[s:t].double().T @ dy[s:t].double() for s, t in zip(starts, offs.tolist())])
    assert _rel(got, want) < 1e-5 and not got[1].any() and not got[5].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("form", ["flat", "per_item"])
@pytest.mark.parametrize("counts", [[210, 3, 0, 380, 7], [5, 0, 300, 2, 0]], ids=["ends-mid-step", "short-first"])
def test_weight_gradient_reads_no_row_outside_its_expert(form, dtype, counts):
    """An expert's row steps go back from its end, so the first reaches before its start (into the previous
    expert's rows, or before row 0 for the first expert: a negative coordinate): those rows must count as
    zeros. Operands are views into NaN-filled storage (NaN rows before and after them, NaN padding rows
    past offs[-1]): any row read outside the experts' rows would poison dw. Uneven experts start mid-step
    everywhere; empty ones (also the last) give zeros."""
    from tilecomm.overlap.grouped import _wgrad

    x, _, dy, offs = _case(counts, 128, 112, torch.float32, seed=13)
    pad, before, after = 7, 70, 9  # padding rows in the operands; NaN storage rows around them

    def poisoned(t):
        buf = torch.full((before + t.shape[0] + pad + after, t.shape[1]), float("nan"), dtype=dtype, device=dev())
        buf[before:before + t.shape[0]] = t.to(dtype)
        return buf[before:before + t.shape[0] + pad]

    got = _wgrad(poisoned(x), poisoned(dy), offs.to(dev()), 5, None, form=form)
    starts = [0] + offs.tolist()[:-1]
    xr, dyr = x.to(dtype).double(), dy.to(dtype).double()
    want = torch.stack([xr[s:t].T @ dyr[s:t] for s, t in zip(starts, offs.tolist())])
    assert torch.isfinite(got.float()).all()
    assert _rel(got, want) < TOL[dtype]
    assert all(not got[e].any() for e, c in enumerate(counts) if c == 0)


def test_grouped_mm_matches_torch_grouped_mm():
    """The reference the MoE tests use (torch._grouped_mm), where this torch build runs it on CPU."""
    x, w, _, offs = _case([6, 2, 0, 9], 16, 24, torch.float32, seed=7)
    try:
        want = torch._grouped_mm(x.to(dev()), w.to(dev()), offs=offs.to(dev()))
    except (RuntimeError, AttributeError) as exc:
        pytest.skip(f"torch._grouped_mm not available here: {exc}")
    assert _rel(grouped_mm(x.to(dev()), w.to(dev()), offs.to(dev())), want.double()) < 1e-5


def test_grouped_mm_transposed_weight_read_in_place():
    x, w, _, offs = _case([4, 7], 16, 8, torch.float32, seed=3)
    wt = w.transpose(1, 2).contiguous().transpose(1, 2)  # column-major experts
    assert _rel(grouped_mm(x, wt, offs), grouped_mm_reference(x.double(), w.double(), offs)) < 1e-5


def test_grouped_mm_padding_rows_unchecked():
    """check_offs=False: rows past offs[-1] (a dispatcher's padding) give zero outputs and gradients."""
    x, w, dy, offs = _case([4, 0, 6, 3], 16, 24, torch.float32, seed=5)
    xs = torch.cat([x, torch.randn(5, 16)]).requires_grad_()
    ws = w.clone().requires_grad_()
    y = grouped_mm(xs, ws, offs, check_offs=False)
    y.backward(torch.cat([dy, torch.randn(5, 24)]))
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    want = grouped_mm_reference(xd, wd, offs)
    want.backward(dy.double())
    assert _rel(y[:13].detach(), want.detach()) < 1e-5 and not y[13:].any()
    assert _rel(xs.grad[:13], xd.grad) < 1e-5 and not xs.grad[13:].any()
    assert _rel(ws.grad, wd.grad) < 1e-5


def test_grouped_mm_bad_input():
    x, w, _, offs = _case([3, 5], 8, 8, torch.float32, seed=1)
    cases = [
        ((x[0], w, offs), ValueError, "x must be a 2-D"),
        ((x, w[0], offs), ValueError, "w must be a 3-D"),
        ((x, w, offs.view(1, 2)), ValueError, "offs must be a 1-D"),
        ((x, w.double(), offs), TypeError, "x and w must share a dtype"),
        ((x.long(), w.long(), offs), TypeError, "x and w must share a dtype"),
        ((x, w, offs.long()), TypeError, "offs must be int32"),
        ((x, w, offs[:1]), ValueError, "offs must have one entry per expert"),
        ((x[:, :4], w, offs), ValueError, "disagree on K"),
        ((x.t().contiguous().t(), w, offs), ValueError, "x must be contiguous"),
        ((x, w, torch.tensor([5, 3], dtype=torch.int32)), ValueError, "offs must be non-decreasing"),
        ((x, w, torch.tensor([3, 7], dtype=torch.int32)), ValueError, r"offs\[-1\] must equal"),
        ((x, w[:, :, ::2], offs), ValueError, "w must be row- or column-major"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            grouped_mm(*args)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="one device"):
            grouped_mm(x, w.cuda(), offs)
