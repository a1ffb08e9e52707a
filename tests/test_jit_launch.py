"""tilecomm.jit's hot-path launchers: BoundLaunch (a call site with fixed arguments) hands Triton's launcher
exactly the values and specialisation bits CachedLaunch computes for the full argument list, and launches the
same kernel (here on CPU, interpreted; the GPU path differs only in the compiled launch these values feed)."""
import random

import pytest
import torch
import triton.language as tl

import tilecomm
from tilecomm.jit import BoundLaunch, CachedLaunch


@tilecomm.jit(do_not_specialize=["n_dyn"])
def _axpy(x_ptr, y_ptr, out_ptr, scale_ptr, n, n_dyn, offset, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    a = tl.load(scale_ptr)
    v = a * tl.load(x_ptr + i, mask=m) + tl.load(y_ptr + i, mask=m) + offset + n_dyn
    tl.store(out_ptr + i, v, mask=m)


def _random_arg(gen: random.Random, base: torch.Tensor):
    """A tensor view at a random element offset (16-byte aligned or not), or an int of every class Triton
    specialises (1, multiples of 16, beyond int32, negative)."""
    if gen.random() < 0.5:
        return base[gen.randrange(0, 8):]
    return gen.choice([0, 1, 2, 15, 16, 17, 32, -16, 2 ** 31 - 1, 2 ** 31, 2 ** 40, -2 ** 31, -2 ** 31 - 1])


@pytest.mark.parametrize("seed", range(4))
def test_bound_values_and_spec_equal_the_full_computation(seed):
    gen = random.Random(seed)
    launcher = CachedLaunch(_axpy)
    base = torch.zeros(64, dtype=torch.float32)
    for _ in range(50):
        full = [_random_arg(gen, base) for _ in range(7)]
        varying = tuple(sorted(gen.sample(range(7), gen.randrange(0, 8))))
        bound = launcher.bind("k", full, varying, BLOCK=16)
        assert all(bound.args[i] is None for i in varying)  # a call's tensors are not kept
        now = [_random_arg(gen, base) for _ in varying]
        for i, a in zip(varying, now):
            full[i] = a
        assert bound.values_and_spec(now) == launcher.values_and_spec(full)
        assert all(a is b for a, b in zip(bound.full_args(now), full))


def test_bound_launch_runs_the_kernel_with_each_calls_arguments():
    x, y = torch.randn(13, dtype=torch.float64), torch.randn(13, dtype=torch.float64)
    scale = torch.tensor([1.5], dtype=torch.float64)
    first = torch.full((13,), float("nan"), dtype=torch.float64)
    bound = CachedLaunch(_axpy).bind("k", [x, y, first, scale, 13, 0, 2], (2, 5), BLOCK=16)
    assert isinstance(bound, BoundLaunch)
    for n_dyn in (0, 3, 7):
        out = torch.full((13,), float("nan"), dtype=torch.float64)  # poisoned: every element must be written
        bound.launch((1,), out, n_dyn)
        torch.testing.assert_close(out, 1.5 * x + y + 2 + n_dyn, rtol=0, atol=1e-12)
    assert torch.isnan(first).all()  # the binding's own tensor at a varying place is not written


@tilecomm.jit
def _row_sums(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr, tl.sum(tl.load(x_ptr + i, mask=i < n, other=0.0), axis=0))  # tl.sum: a helper of tl.core's


def test_interpreted_launch_leaves_the_language_modules_as_it_found_them():
    """Triton's interpreter patches the language modules of each helper it calls and never undoes it; tilecomm
    restores them after the launch, or a GPU process that ran a kernel on CPU tensors cannot compile any kernel
    afterwards (found on one H200, 2026-11-27: "'ir.value' object has no attribute 'dtype'")."""
    modules = (tl, tl.core, tl.core.tensor, tl.math, tl.core.tensor_descriptor_base)
    before = [dict(vars(m)) for m in modules]
    x, out = torch.arange(10, dtype=torch.float32), torch.zeros(1)
    _row_sums[(1,)](x, out, 10, BLOCK=16)
    assert out.item() == 45.0
    for m, was in zip(modules, before):
        now = dict(vars(m))
        changed = sorted(n for n in set(now) | set(was) if now.get(n) is not was.get(n))
        assert not changed, f"{m.__name__}: {changed[:10]}"
