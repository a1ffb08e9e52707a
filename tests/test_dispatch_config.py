"""The launch shapes `NormalConfig.for_device` gives each device and world size (no GPU needed: the GPU branch
reads only the SM count, faked here). Over links the send runs fewer programs than blocks, so that blocks land in
rounds the expand copies while the send goes on; at world 1 one program per block (BENCHMARKS.md, 2026-11-27).
And the send's TMA knob (NormalConfig.send_tma) against the global reference on CPU ranks, and the low-latency
dispatch traced (LowLatencyConfig.trace)."""
import dataclasses
import types

import pytest
import torch

from test_dispatch import TOKENS, dispatch_combine_body
from test_low_latency import low_latency_body
from tilecomm.dispatch import low_latency as ll
from tilecomm.dispatch.normal import NormalConfig


@pytest.mark.parametrize("sms, programs", [(132, 96), (114, 82), (1, 1)])
def test_send_grid_follows_world_and_sm_count(monkeypatch, sms, programs):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        multi_processor_count=sms))
    gpu = torch.device("cuda", 0)
    assert NormalConfig.for_device(gpu, 7168, 1) == NormalConfig()  # one program per block: no link to wait for
    for world in (2, 3, 4):
        cfg = NormalConfig.for_device(gpu, 7168, world)
        assert cfg.send_programs == programs and cfg.trailing
        assert cfg == NormalConfig(send_programs=programs)  # nothing else differs from world 1's


def test_cpu_ranks_walk_blocks_with_few_programs():
    for world in (1, 2, 3):
        cfg = NormalConfig.for_device(torch.device("cpu"), 7168, world)
        assert cfg.send_programs == 3 and not cfg.trailing and cfg.send_block_h == 256


def send_tma_body(*args):
    """dispatch_combine_body with NormalConfig.send_tma on: the send's rows by TMA tiles of 256-byte pieces."""
    default = NormalConfig.for_device
    NormalConfig.for_device = staticmethod(lambda device, hidden, world=1: dataclasses.replace(
        default(device, hidden, world), send_tma=True))
    try:
        return dispatch_combine_body(*args)
    finally:
        NormalConfig.for_device = default


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype,H", [(torch.float32, 192), (torch.bfloat16, 384)], ids=["fp32", "bf16"])
def test_dispatch_combine_send_tma(ranks, world, dtype, H):
    """The send's TMA rows: 3 pieces of 256 bytes a row (a tile of 4 pieces: one past the row, loaded as zeros and
    not stored), uneven tokens with a rank that has none, several send blocks per program."""
    many = {2: [70, 9], 3: [0, 131, 66]}[world]
    ranks(world).run(send_tma_body, 3, many, H, 4, 6 * world, dtype, "tilecomm", {"drop": 0.3}, 4)


def _check_trace(tr: dict, n_send: int, n_recv: int) -> None:
    """A launch's trace: a row per program by ticket, n_send senders (exactly one that published, when there are
    any) then n_recv receivers, and each program's start <= ready <= end."""
    roles = tr["role"].tolist()
    assert len(roles) == n_send + n_recv and roles[n_send:] == [ll.RECEIVED] * n_recv, roles
    assert sorted(roles[:n_send]) == ([ll.SENT] * (n_send - 1) + [ll.PUBLISHED] if n_send else []), roles
    assert bool((tr["start"] > 0).all()) and bool((tr["start"] <= tr["ready"]).all())
    assert bool((tr["ready"] <= tr["end"]).all())


def check_low_latency_trace(fast, T, hooked):
    """The last dispatch launch's trace (LowLatencyConfig.trace; a recv_hook launch: receivers only), and the
    combine's of the call before (its reducers: one per source, token slot and column chunk; its summers)."""
    engine, cp = fast._engine, fast._engine.cfg.col_programs
    _check_trace(engine.trace("dispatch"), 0 if hooked else max(T, 1) * cp, engine._n_recv)
    if engine._traced[1]:  # (the first call has no combine before it)
        _check_trace(engine.trace("combine"), engine._n_back, engine._traced[1] - engine._n_back)


def low_latency_trace_body(*args):
    """low_latency_body with LowLatencyConfig.trace on: the same results, and every launch's trace checked."""
    default = ll.LowLatencyConfig.for_device
    ll.LowLatencyConfig.for_device = staticmethod(lambda device, hidden, world=1: dataclasses.replace(
        default(device, hidden, world), trace=True))
    try:
        return low_latency_body(*args, after=check_low_latency_trace)
    finally:
        ll.LowLatencyConfig.for_device = default


@pytest.mark.parametrize("world", [2, 3])
def test_low_latency_traced(ranks, world):
    ranks(world).run(low_latency_trace_body, 5, TOKENS[world], 8, 3, 4 * world, torch.float32, 4)
