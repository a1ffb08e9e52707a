"""Bad input raises a clear error before any kernel runs; failures never hang; nothing leaks."""
from __future__ import annotations

import glob
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

import tilecomm
from tilecomm.errors import NotInitializedError, PeerMismatchError
from _reference import dev
from tilecomm.spawn import RankError


def test_calls_before_init_raise():
    assert not tilecomm.is_initialized()
    with pytest.raises(NotInitializedError, match="tilecomm.init"):
        tilecomm.empty((4,), torch.float32)
    with pytest.raises(NotInitializedError):
        tilecomm.all_to_all_single(torch.empty(2), torch.empty(2))
    with pytest.raises(NotInitializedError):
        tilecomm.rank()


def _expect(exc, pattern, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as err:
        assert re.search(pattern, str(err)), str(err)
        return
    raise AssertionError(f"{fn.__name__}{args} did not raise {exc.__name__}")


def bad_inputs():
    world = tilecomm.world_size()
    a2a, ag, rs = tilecomm.all_to_all_single, tilecomm.all_gather_into_tensor, tilecomm.reduce_scatter_tensor
    x = torch.randn(world * 2, 3, device=dev())
    out = torch.empty_like(x)
    _expect(ValueError, "input_split_sizes.*sums to", a2a, out, x, None, [1] * world)
    _expect(ValueError, "output_split_sizes.*one per rank", a2a, out, x, [2] * (world + 1), None)
    _expect(ValueError, "negative", a2a, out, x, None, [-1, 2 * world + 1] + [0] * (world - 2))
    _expect(TypeError, "dtype", a2a, out.double(), x)
    _expect(ValueError, "input must be contiguous", a2a, out, torch.randn(3, world * 2, device=dev()).t())
    _expect(TypeError, "torch.Tensor", a2a, out, [1, 2])
    _expect(ValueError, "agree past dim 0", a2a, torch.empty(world * 2, 4, device=dev()), x)
    _expect(ValueError, "must divide by the world size", a2a, torch.empty(world * 2 + 1, 3, device=dev()), torch.empty(world * 2 + 1, 3, device=dev()))
    _expect(ValueError, "expected world_size", ag, torch.empty(world * 5, device=dev()), torch.empty(4, device=dev()))
    _expect(ValueError, "expected world_size", rs, torch.empty(3, device=dev()), torch.empty(world * 4, device=dev()))
    _expect(TypeError, "cannot be reduced", rs, torch.empty(2, dtype=torch.bool, device=dev()), torch.empty(world * 2, dtype=torch.bool, device=dev()))
    sub = dist.new_group([0])
    _expect(ValueError, "world group only", a2a, out, x, group=sub)
    _expect(ValueError, "pe=", tilecomm.peer, tilecomm.empty((2,)), world)
    _expect(ValueError, "not on the symmetric heap", tilecomm.peer, torch.empty(2, device=dev()), 0)
    _expect(ValueError, "shape=", tilecomm.empty, (-1, 2))
    _expect(MemoryError, "staging workspace", a2a, torch.empty(world * (1 << 21) * 3, device=dev()), torch.empty(world * (1 << 21) * 3, device=dev()))
    _expect(MemoryError, "heap exhausted", tilecomm.empty, (1 << 40,), torch.uint8)
    # nothing above launched a kernel, so the ranks are still in step:
    ref = torch.empty_like(x)
    tilecomm.all_to_all_single(out, x)
    dist.all_to_all_single(ref, x)
    assert torch.equal(out, ref)


def test_bad_inputs_raise_before_any_kernel(ranks):
    ranks(3).run(bad_inputs)


def mismatched_empty():
    with pytest.raises(PeerMismatchError, match="different tensors"):
        tilecomm.empty((4 + tilecomm.rank(),), torch.float32)


def test_empty_with_different_shapes_across_ranks(ranks):
    ranks(2).run(mismatched_empty)


def split_disagreement():
    """Rank 1 expects 3 rows from rank 0, but rank 0 sends it 2: rank 1 must say so."""
    rank = tilecomm.rank()
    in_splits = [2, 2] if rank == 0 else [2, 2]
    out_splits = [2, 2] if rank == 0 else [3, 1]
    x, out = torch.randn(4, 2, device=dev()), torch.empty(4, 2, device=dev())
    try:
        tilecomm.all_to_all_single(out, x, out_splits, in_splits)
    except PeerMismatchError as err:
        return str(err)
    return None


def test_split_sizes_that_disagree_across_ranks(ranks):
    results = ranks(2).run(split_disagreement)
    assert results[0] is None
    assert results[1] is not None and "rank 1 expected 6 elements from rank 0" in results[1], results[1]


def raise_on_one_rank():
    if tilecomm.rank() == 1:
        raise ValueError("rank 1 gives up before the collective")
    x = torch.randn(4, device=dev())
    tilecomm.all_to_all_single(torch.empty(4, device=dev()), x)


def test_a_failing_rank_does_not_hang_the_others():
    start = time.monotonic()
    with tilecomm.RankPool(2, env={"TILECOMM_TIMEOUT_S": "2"}, grace_s=30) as pool:
        with pytest.raises(RankError) as info:
            pool.run(raise_on_one_rank)
    assert info.value.rank == 1 and "gives up" in str(info.value)
    assert time.monotonic() - start < 90


def segment_names():
    return sorted(glob.glob("/dev/shm/tilecomm-*")), os.getpid()


def test_no_segments_while_running_or_after_kill():
    before = set(glob.glob("/dev/shm/tilecomm-*"))
    pool = tilecomm.RankPool(3)
    try:
        names, _ = zip(*pool.run(segment_names))
        assert all(set(n) <= before for n in names), names
        for proc in pool._procs:
            os.kill(proc.pid, signal.SIGKILL)
    finally:
        pool.kill()
    assert set(glob.glob("/dev/shm/tilecomm-*")) <= before


def heap_reuse():
    a = tilecomm.empty((100,), torch.float32)
    off = a.data_ptr()
    tilecomm.free(a)
    b = tilecomm.empty((50,), torch.float64)
    assert b.data_ptr() == off
    with pytest.raises(ValueError, match="freed already"):
        tilecomm.free(a)
    tilecomm.free(b)


def test_heap_free_and_reuse(ranks):
    ranks(2).run(heap_reuse)
