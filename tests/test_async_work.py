"""`async_op=True`: the Work a call returns orders the caller after the call's kernels.

The Dispatcher runs async calls on its own communication stream; their Work must mark that stream's work,
not the caller's. Until 2026-11-27 it marked the caller's (the event was recorded after the stream block
was left), so `work.wait()` ordered nothing: on 2-3 GPU ranks sharing one H200 the 1000-iteration random
routing loop read res.x before the expand had written it ("iteration 61: dispatch res.x differs", every
failure on an async iteration). The GPU body below keeps the communication stream busy with a sleep, so
a Work that does not wait for it fails every time; CPU ranks have no streams (Work there is complete)."""
from __future__ import annotations

import pytest
import torch

import tilecomm
from _reference import dev
from tilecomm.collectives import Work
from tilecomm.dispatch import Dispatcher


def test_work_of_a_cpu_tensor_is_complete():
    work = Work(torch.zeros(3))
    assert work.is_completed() and work.wait()


def test_work_marks_the_stream_it_is_given():
    if not torch.cuda.is_available():
        pytest.skip("CUDA streams need a GPU")
    side = torch.cuda.Stream()
    tensor = torch.zeros(1, device="cuda")  # before the sleep: loading a kernel's module the first time
    torch.cuda.synchronize()  # (CUDA's lazy loading) synchronises the device, and the sleep with it
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of ms on the side stream only
    work = Work(tensor, side)
    assert not work.is_completed()  # the side stream is still asleep; the current one is idle
    work.wait()
    torch.cuda.current_stream().synchronize()
    assert side.query() and work.is_completed()


def async_calls_body(mode):
    """Each async call queued behind a sleep on the Dispatcher's stream: after work.wait() and a sync of the
    caller's stream the communication stream is idle, and the results equal the synchronous call's."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    E, H, M, K = 4 * world, 64, 16, 2
    gen = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(M - rank, H, generator=gen).to(dev())
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(M - rank)]).to(dev())
    w = torch.rand(M - rank, K, generator=gen).to(dev())
    d = Dispatcher(E, H, M, K, torch.float32, mode=mode)

    def rows(res):  # low-latency rows past each expert's count are not written
        if mode == "normal":
            return res.x.clone()
        return torch.cat([res.x[e, :n] for e, n in enumerate(res.tokens_per_expert.tolist())])

    with torch.no_grad():
        want = d.dispatch(x, idx, w)
        want_x, want_out = rows(want), d.combine(want.x * 2, want.handle).clone()
        d.dispatch(x, idx, w, async_op=True).work.wait()  # the communication stream exists from here on
        for step in ("dispatch", "combine"):
            with torch.cuda.stream(d._stream):
                torch.cuda._sleep(50_000_000)
            if step == "dispatch":
                res = d.dispatch(x, idx, w, async_op=True)
                work = res.work
            else:
                out, work = d.combine(res.x * 2, res.handle, async_op=True)
            work.wait()
            got = rows(res) if step == "dispatch" else out.clone()  # on the caller's stream, after wait()
            torch.cuda.current_stream().synchronize()
            assert d._stream.query(), f"{mode} {step}: work.wait() did not order the caller after the call"
            assert torch.equal(got, want_x if step == "dispatch" else want_out), f"{mode} {step}: result differs"
    d.free()


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_async_dispatch_and_combine_wait_for_their_stream(ranks, mode):
    from conftest import BACKEND

    if BACKEND != "cuda":
        pytest.skip("streams need GPU ranks (TILECOMM_TEST_BACKEND=cuda)")
    ranks(2).run(async_calls_body, mode)
