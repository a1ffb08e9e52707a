"""The examples run end to end on CPU ranks, as the README says."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, timeout=300):
    env = dict(os.environ, TILECOMM_TIMEOUT_S="30", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.parametrize("world", ["2", "3"])
def test_custom_overlap_kernel_example(world):
    out = _run(["examples/custom_overlap_kernel.py", "--world-size", world])
    assert out.count("max rel err") == int(world), out


@pytest.mark.parametrize("op,size", [("all_to_all", ["--rows", "16,8", "--hidden", "32"]),
                                     ("all_to_all", ["--rows", "24", "--hidden", "16", "--uneven", "--symmetric",
                                                     "--world-size", "3"]),
                                     ("all_gather", ["--shape", "16x32"]), ("reduce_scatter", ["--shape", "16x32"]),
                                     ("dispatch", ["--tokens", "16", "--hidden", "32", "--experts", "8", "--topk", "2"]),
                                     ("dispatch", ["--mode", "low_latency", "--tokens", "8", "--hidden", "32",
                                                   "--experts", "6", "--topk", "2", "--world-size", "3"]),
                                     ("ag_gemm", ["--shapes", "16x16x16"]), ("gemm_rs", ["--shapes", "16x16x16"])])
def test_bench_cli_on_cpu_ranks(tmp_path, op, size):
    out = tmp_path / "rows.json"
    world = [] if "--world-size" in size else ["--world-size", "2"]
    _run(["-m", "tilecomm.bench", op, "--backend", "cpu", *world, "--dtype", "float32", *size, "--json", str(out)])
    rows = json.loads(out.read_text())
    assert rows and all(r["op"] == op and r["tilecomm_us"] > 0 and r["baseline_us"] > 0 for r in rows)


def test_bench_self_on_a_cpu_rank(tmp_path):
    """The world-1 benchmark runs every row on a CPU rank (toy sizes: a smoke test, not a measurement)."""
    out = tmp_path / "self.json"
    _run(["-m", "tilecomm.bench", "self", "--backend", "cpu", "--iters", "1", "--json", str(out)])
    rows = json.loads(out.read_text())
    ops = [r["op"] for r in rows]
    assert any(o.startswith("all_to_all_single") for o in ops) and any(o == "low_latency combine" for o in ops)
    assert sum("discard]" in o for o in ops) == 6, ops  # the ring's knobs (world1.RING_CONFIGS), results checked
    assert all("error" not in r and r["us"] > 0 and r["floor_us"] > 0 for r in rows), rows


def test_torch_a2av_bench_refuses_to_run_outside_torchrun_on_gpus():
    """torch's NVSHMEM all_to_all_vdev baseline has no CPU form: the module says how to run it, rc 2, no hang."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "tilecomm.bench.torch_a2av"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "run under torchrun on GPUs" in proc.stderr, proc.stderr


def _example_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_moe_example", os.path.join(ROOT, "examples", "pretrain_moe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pretrain_flags_are_checked_before_ranks_start(tmp_path):
    import argparse

    example = _example_module()
    base = dict(preset="cpu-tiny", steps=None, checkpoint_every=0, world_size=2, data=None, resume=False,
                out=str(tmp_path / "run"))
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "short.txt").write_bytes(b"abcd")
    cases = [(dict(steps=0), ValueError, "--steps 0: expected an int >= 1"),
             (dict(steps=-3), ValueError, "--steps -3: expected an int >= 1"),
             (dict(checkpoint_every=-1), ValueError, "--checkpoint-every -1: expected an int >= 0"),
             (dict(world_size=0), ValueError, "--world-size 0"),
             (dict(data=str(tmp_path / "odd.bin")), ValueError, "--data .*odd.bin.*odd size"),
             (dict(data=str(tmp_path / "empty.bin")), ValueError, "--data .*empty.bin.*at least 2 tokens"),
             (dict(data=str(tmp_path / "short.txt")), ValueError, "--data .*short.txt.*seq_len=32 needs"),
             (dict(data=str(tmp_path / "missing.bin")), FileNotFoundError, "--data .*missing.bin.*no such file"),
             (dict(resume=True), FileNotFoundError, "checkpoint .* not found")]
    for change, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            example.check_flags(argparse.Namespace(**{**base, **change}))
    example.check_flags(argparse.Namespace(**base))  # the defaults pass


def test_pretrain_bad_flag_exits_with_usage_error(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    for flags, text in ((["--steps", "0"], "--steps 0"), (["--data", str(tmp_path / "odd.bin")], "odd size")):
        proc = subprocess.run([sys.executable, "examples/pretrain_moe.py", *flags, "--out", str(tmp_path / "run")],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and text in proc.stderr and "usage:" in proc.stderr, proc.stderr[-2000:]
        assert not (tmp_path / "run").exists()  # nothing started


def test_pretrain_sizes_the_heap_for_its_dispatchers(monkeypatch):
    """Under torchrun the example asks tilecomm.init for a heap that holds its MoE layers' dispatcher buffers
    beside the collectives' quarter (the 256 MiB default does not hold the h200x4 preset's: MemoryError on 2 GPUs),
    with the tokens in the parameters' dtype (bf16 on GPUs: the Dispatcher checks it)."""
    import argparse

    import torch

    from tilecomm import _env
    from tilecomm.moe import dispatcher_heap_bytes

    monkeypatch.delenv("TILECOMM_HEAP_BYTES", raising=False)
    example = _example_module()
    for dispatcher in ("tilecomm", "fused", "nccl"):
        args = argparse.Namespace(preset="h200x4", dispatcher=dispatcher, seed=0, precision="auto", tp=1, cp=1)
        cfg = example.moe_config(args)
        assert example.tokens_dtype(args, "cuda") == torch.bfloat16 and example.tokens_dtype(args, "cpu") == torch.float32
        for world in (2, 4):
            need = dispatcher_heap_bytes(cfg, dispatcher, world, torch.bfloat16)
            heap = example.heap_bytes(args, world, "cuda")
            assert heap - _env.workspace_bytes(heap) >= need and heap % (2 << 20) == 0
            old = 256 << 20  # the GPU default until 2026-11-26
            assert (need > old - _env.workspace_bytes(old)) == (dispatcher != "nccl")  # it failed
            assert heap >= _env.heap_bytes(on_gpu=True) == 1 << 30 and example.heap_bytes(args, world, "cpu") >= 256 << 20
    # --tp: also the TP layers' one set of workspaces, in fp32 (the dtype the model is built in)
    from tilecomm.overlap import TensorParallelWorkspaces
    for tp, cp in ((2, 1), (2, 2)):
        args = argparse.Namespace(preset="h200x4", dispatcher="tilecomm", seed=0, precision="auto", tp=tp, cp=cp)
        train, hidden = example.PRESETS["h200x4"]["train"], example.PRESETS["h200x4"]["model"]["hidden"]
        tokens = train["batch_size"] * train["seq_len"] // cp
        need = dispatcher_heap_bytes(example.moe_config(args), "tilecomm", 4, torch.bfloat16) + \
            TensorParallelWorkspaces.heap_bytes(hidden, torch.float32, tokens, tp)
        heap = example.heap_bytes(args, 4, "cuda")
        assert heap - _env.workspace_bytes(heap) >= need
    monkeypatch.setenv("TILECOMM_HEAP_BYTES", str(64 << 30))  # a larger heap asked for is kept
    assert example.heap_bytes(argparse.Namespace(preset="h200x4", dispatcher="fused", seed=0, precision="auto", tp=1,
                                                 cp=1), 2, "cuda") == 64 << 30


@pytest.mark.parametrize("dispatcher,world", [("tilecomm", "3"), ("fused", "2")])
def test_pretrain_bf16_parameters_on_several_ranks(tmp_path, dispatcher, world):
    """--precision bf16 (what GPUs get by default) over several ranks: the dispatcher takes bf16 tokens and the
    gradient buckets hold one dtype each (bf16 experts beside fp32 parameters)."""
    out = tmp_path / "run"
    _run(["examples/pretrain_moe.py", "--world-size", world, "--steps", "2", "--dispatcher", dispatcher,
          "--precision", "bf16", "--no-checkpoint", "--out", str(out)], timeout=600)
    steps = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(steps) == 2 and all(0 < s["loss"] < 10 for s in steps), steps


def test_bench_moe_layer_on_two_cpu_ranks(tmp_path):
    """The MoE layer bench under a launcher: fused, tilecomm (experts on torch._grouped_mm and on tilecomm's
    grouped_mm) and the NCCL path (gloo here) on 2 ranks, their outputs and gradients compared before timing
    (toy sizes: a smoke test, not a measurement)."""
    out = tmp_path / "moe.json"
    _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "tilecomm.bench",
          "moe_layer", "--backend", "cpu", "--iters", "1", "--json", str(out)], timeout=900)
    rows = json.loads(out.read_text())
    assert [r["op"] for r in rows] == ["moe_layer toy"], rows
    r = rows[0]
    assert r["world"] == 2 and min(r["fused_us"], r["tilecomm_us"], r["nccl_us"], r["torch_gemm_us"]) > 0, r
    assert r["max_rel_diff"] < 1e-5, r
