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
    in_splits = [2, 2]
    out_splits = [2, 2] if rank == 0 else [3, 2]
    x, out = torch.randn(4, 2, device=dev()), torch.empty(sum(out_splits), 2, device=dev())
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


# -- environment and configs: invalid values fail at once, naming the variable or field ----------------
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "abc", ""])
def test_invalid_timeouts_are_rejected(monkeypatch, value):
    from tilecomm import _env

    monkeypatch.setenv("TILECOMM_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=r"TILECOMM_TIMEOUT_S=.*: expected a finite number of seconds > 0"):
        _env.timeout_s()
    with pytest.raises(ValueError, match="TILECOMM_TIMEOUT_S"):
        tilecomm.RankPool(2)  # before any process starts
    monkeypatch.setenv("TILECOMM_TIMEOUT_S", "5")
    for bad in (float("nan"), float("inf"), 0, -2.5):
        with pytest.raises(ValueError, match="tilecomm.init: timeout_s="):
            tilecomm.init(backend="cpu", timeout_s=bad)
    assert not tilecomm.is_initialized()


def set_bad_timeouts():
    for bad in (float("nan"), float("inf"), 0, -1, "5"):
        with pytest.raises(ValueError, match="set_timeout: seconds="):
            tilecomm.set_timeout(bad)


def test_set_timeout_rejects_invalid_values(ranks):
    ranks(2).run(set_bad_timeouts)


@pytest.mark.parametrize("name", ["TILECOMM_HEAP_BYTES", "TILECOMM_WORKSPACE_BYTES"])
@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "infGiB", "-1", "0", "lots"])
def test_invalid_byte_counts_are_rejected(monkeypatch, name, value):
    from tilecomm import _env

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"{name}=.*byte count"):
        _env.heap_bytes() if name == "TILECOMM_HEAP_BYTES" else _env.workspace_bytes(1 << 20)


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "abc"])
def test_invalid_cpu_jitter_is_rejected(monkeypatch, value):
    from tilecomm import _env

    monkeypatch.setenv("TILECOMM_CPU_JITTER_MS", value)
    with pytest.raises(ValueError, match=r"TILECOMM_CPU_JITTER_MS=.*milliseconds >= 0"):
        _env.cpu_jitter_s()
    monkeypatch.setenv("TILECOMM_CPU_JITTER_MS", "2.5")
    assert _env.cpu_jitter_s() == 0.0025


def test_heap_larger_than_free_shared_memory_is_refused():
    from tilecomm.backend_cpu import _SHM_DIR, shm_shortfall

    st = os.statvfs(_SHM_DIR)
    free = st.f_bavail * st.f_frsize
    assert shm_shortfall(1 << 20, 2) is None
    heap = max(64 << 30, free)  # the case (64 GiB) where /dev/shm is smaller, else just too big
    with pytest.raises(RankError) as info:
        tilecomm.RankPool(2, env={"TILECOMM_HEAP_BYTES": str(heap), "TILECOMM_TIMEOUT_S": "20"})
    text = str(info.value)
    assert "MemoryError" in text and "GiB free" in text and "TILECOMM_HEAP_BYTES" in text, text


def test_configs_reject_impossible_values(tmp_path):
    from tilecomm.moe import MoEConfig, TokenFile, TrainConfig

    good = dict(hidden=8, ffn_hidden=8, num_experts=4, topk=2)
    for field, value in (("topk", 5), ("topk", 0), ("num_experts", 0), ("hidden", 0), ("max_tokens_per_rank", 0)):
        with pytest.raises(ValueError, match=f"MoEConfig: {field}={value}"):
            MoEConfig(**{**good, field: value})
    for field, value in (("steps", 0), ("steps", -3), ("batch_size", 0), ("seq_len", 0), ("checkpoint_every", -1)):
        with pytest.raises(ValueError, match=f"TrainConfig: {field}={value}"):
            TrainConfig(**{"steps": 4, "batch_size": 2, "seq_len": 8, field: value})
    cases = {"empty.bin": b"", "odd.bin": b"\x01\x00\x02", "one.bin": b"\x01\x00", "one.txt": b"a"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=rf"--data '.*{name}': .*(odd size|at least 2 tokens)"):
            TokenFile(str(tmp_path / name))
    (tmp_path / "short.txt").write_bytes(b"abcdef")
    with pytest.raises(ValueError, match=r"--data '.*short.txt': 6 tokens, but seq_len=8 needs at least 10"):
        TokenFile(str(tmp_path / "short.txt")).check_seq_len(8)
