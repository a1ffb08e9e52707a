"""The launch shapes `NormalConfig.for_device` gives each device and world size (no GPU needed: the GPU branch
reads only the SM count, faked here). Over links the send runs fewer programs than blocks, so that blocks land in
rounds the expand copies while the send goes on; at world 1 one program per block (BENCHMARKS.md, 2026-11-27).
And the send's TMA knob (NormalConfig.send_tma) against the global reference on CPU ranks."""
import dataclasses
import types

import pytest
import torch

from test_dispatch import dispatch_combine_body
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
