"""The launch shapes `NormalConfig.for_device` gives each device and world size (no GPU needed: the GPU branch
reads only the SM count, faked here). Over links the send runs fewer programs than blocks, so that blocks land in
rounds the expand copies while the send goes on; at world 1 one program per block (BENCHMARKS.md, 2026-11-27)."""
import types

import pytest
import torch

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
