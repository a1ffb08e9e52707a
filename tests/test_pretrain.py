"""The MoE training stack: EP=2 trains exactly like EP=1, checkpoints resume the same curve, the
example runs end to end, bad configs fail clearly."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import tilecomm
from _reference import MODEL, ConcatRanks as _Concat
from tilecomm.moe import (MarkovSource, ModelConfig, MoEConfig, MoELayer, ParallelLayout, TrainConfig, Trainer,
                          Transformer, parallelize)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(world: int, dispatcher: str):
    moe = MoEConfig(hidden=16, ffn_hidden=8, num_experts=4, topk=2, router=dict(aux_loss_coeff=0.0), seed=1,
                    max_tokens_per_rank=64, experts_impl="loop")
    torch.manual_seed(0)
    return Transformer(ModelConfig(**MODEL), moe_layer=lambda i: MoELayer(moe, dispatcher=dispatcher))


def _train_cfg(out_dir, steps, resume=False):
    return TrainConfig(steps=steps, batch_size=2, seq_len=16, lr=3e-3, warmup_steps=2, out_dir=out_dir, resume=resume,
                       progress=False, peak_flops=None, precision="fp32")


def ep_train(out_dir, steps, dispatcher, stop_at=None, resume=False):
    world, rank = tilecomm.world_size(), tilecomm.rank()
    groups = ParallelLayout(world, ep=world).create_groups()
    trainer = Trainer(_model(world, dispatcher), MarkovSource(vocab=32, seed=3), _train_cfg(out_dir, steps, resume),
                      groups=groups)
    assert (trainer.dp_rank, trainer.ep_rank) == (rank, rank)
    return [r["loss"] for r in trainer.train(stop_at=stop_at)]


@pytest.mark.parametrize("dispatcher", ["tilecomm", "nccl"])
def test_ep2_training_matches_ep1(ranks, tmp_path, dispatcher):
    losses_ep2 = ranks(2).run(ep_train, str(tmp_path / "ep2"), 20, dispatcher)
    assert losses_ep2[0] == losses_ep2[1]  # the logged loss is the mean over ranks
    one = Trainer(_model(1, "local"), _Concat(MarkovSource(vocab=32, seed=3), 2), _train_cfg(str(tmp_path / "ep1"), 20))
    one.cfg = TrainConfig(**{**one.cfg.__dict__, "batch_size": 4})
    losses_ep1 = [r["loss"] for r in one.train()]
    assert losses_ep1[-1] < losses_ep1[0] - 0.3, losses_ep1  # it learns
    torch.testing.assert_close(torch.tensor(losses_ep2[0]), torch.tensor(losses_ep1), rtol=2e-4, atol=2e-4)


def test_checkpoint_resume_reproduces_the_loss_curve(ranks, tmp_path):
    full = ranks(2).run(ep_train, str(tmp_path / "full"), 8, "tilecomm")[0]
    ranks(2).run(ep_train, str(tmp_path / "cut"), 8, "tilecomm", 5)  # interrupted after 5 of 8 steps
    resumed = ranks(2).run(ep_train, str(tmp_path / "cut"), 8, "tilecomm", None, True)[0]
    assert resumed == full[5:], (resumed, full)  # bit-identical continuation
    with open(tmp_path / "cut" / "log.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == list(range(8))


def test_checkpoint_from_another_config_is_refused(tmp_path):
    Trainer(_model(1, "local"), MarkovSource(vocab=32, seed=3), _train_cfg(str(tmp_path), 1)).train()
    with pytest.raises(ValueError, match="another config"):
        other = TrainConfig(**{**_train_cfg(str(tmp_path), 1, resume=True).__dict__, "lr": 1e-3})
        Trainer(_model(1, "local"), MarkovSource(vocab=32, seed=3), other)


def test_markov_entropy_floor_matches_samples():
    src = MarkovSource(vocab=16, branching=3, seed=0)
    batch = src.batch(0, 0, 256, 64)
    counts = torch.zeros(16, 16)
    counts.index_put_((batch[:, :-1].flatten(), batch[:, 1:].flatten()), torch.ones(batch[:, 1:].numel()), accumulate=True)
    p = counts / counts.sum(1, keepdim=True).clamp_min(1)
    h = -(counts * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum() / counts.sum()
    assert abs(float(h) - src.entropy_floor) < 0.05, (float(h), src.entropy_floor)


def test_bad_configs():
    with pytest.raises(ValueError, match="num_heads"):
        ModelConfig(**{**MODEL, "num_heads": 3})
    with pytest.raises(ValueError, match="num_dense_layers"):
        ModelConfig(**{**MODEL, "num_dense_layers": 5})
    from tilecomm.moe import TokenFile
    with pytest.raises(FileNotFoundError, match="no such file"):
        TokenFile("/nonexistent/corpus.txt")


def test_pretrain_example_end_to_end(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, TILECOMM_TIMEOUT_S="60")
    proc = subprocess.run([sys.executable, "examples/pretrain_moe.py", "--steps", "6", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "entropy floor" in proc.stdout and (out / "loss.png").exists()
    rows = [json.loads(line) for line in open(out / "log.jsonl")]
    assert [r["step"] for r in rows] == list(range(6)) and all(r["loss"] > 0 for r in rows)


def test_activation_recompute_gives_the_same_gradients():
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        moe = MoEConfig(hidden=16, ffn_hidden=8, num_experts=4, topk=2, seed=1, experts_impl="loop")
        model = Transformer(ModelConfig(**MODEL, recompute=recompute), moe_layer=lambda i: MoELayer(moe, "local"))
        tokens = MarkovSource(vocab=32, seed=3).batch(0, 0, 2, 16)
        logits, aux = model(tokens[:, :-1])
        (logits.float().square().mean() + aux).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def cp_attention_body(seed):
    """A transformer with context parallelism over the world equals the full-sequence model: logits
    of this rank's chunk, and parameter gradients once summed over the CP group."""
    import torch.distributed as dist

    rank, world = tilecomm.rank(), tilecomm.world_size()
    cfg = ModelConfig(**MODEL)
    torch.manual_seed(seed)
    full = Transformer(cfg)
    torch.manual_seed(seed)
    cp = parallelize(Transformer(cfg), cp_group=dist.group.WORLD)
    tokens = MarkovSource(vocab=32, seed=seed).batch(0, 0, 2, 16)[:, :16]
    chunk = 16 // world
    mine = tokens[:, rank * chunk:(rank + 1) * chunk]
    logits_full, _ = full(tokens)
    logits_cp, _ = cp(mine)
    torch.testing.assert_close(logits_cp, logits_full[:, rank * chunk:(rank + 1) * chunk], rtol=1e-5, atol=1e-5)
    weight = torch.randn(logits_full.shape, generator=torch.Generator().manual_seed(seed))
    (logits_full * weight).sum().backward()
    (logits_cp * weight[:, rank * chunk:(rank + 1) * chunk]).sum().backward()
    for (name, a), b in zip(full.named_parameters(), cp.parameters()):
        g = b.grad.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(g, a.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_model_init_does_not_depend_on_where_the_moe_layer_lives():
    """Transformer's init draws every parameter from the CPU generator: an MoE layer built on another device (a
    GPU dispatcher builds its router on the GPU) takes the same draws there, and every parameter after it too.
    (Drawn on the parameter's device, the GPU's generator gave a TP x EP run on 2 GPUs another router and head
    than the one-process model, BENCHMARKS 2026-11-26.)"""
    moe = MoEConfig(hidden=16, ffn_hidden=8, num_experts=4, topk=2, seed=1, experts_impl="loop")
    other = "cuda" if torch.cuda.is_available() else "meta"  # meta: no values, but the draws are made as on a GPU

    def build(device):
        torch.manual_seed(0)
        return Transformer(ModelConfig(**MODEL), moe_layer=lambda i: MoELayer(moe, "local", device=device))

    here, there = build(None), build(other)
    assert there.blocks[1].mlp.router.weight.device.type == other
    for (name, a), (_, b) in zip(here.named_parameters(), there.named_parameters()):
        if b.device.type != "meta":
            assert torch.equal(a, b.cpu()), name
    assert torch.equal(here.head.weight, there.head.weight.cpu())  # a parameter made after the MoE layer


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_matches_full_sequence(ranks, world):
    ranks(world).run(cp_attention_body, 5)


def cp_train(out_dir, steps):
    """Context parallel over both ranks (dp = 1), experts over both ranks (ep = 2)."""
    world = tilecomm.world_size()
    groups = ParallelLayout(world, cp=world, ep=world).create_groups()
    torch.manual_seed(0)
    moe = MoEConfig(hidden=16, ffn_hidden=8, num_experts=4, topk=2, router=dict(aux_loss_coeff=0.0), seed=1,
                    max_tokens_per_rank=64, experts_impl="loop")
    model = parallelize(Transformer(ModelConfig(**MODEL), moe_layer=lambda i: MoELayer(moe, dispatcher="tilecomm")),
                        cp_group=groups.cp)
    trainer = Trainer(model, MarkovSource(vocab=32, seed=3), _train_cfg(out_dir, steps), groups=groups)
    return [r["loss"] for r in trainer.train()]


def test_context_parallel_training_matches_one_process(ranks, tmp_path):
    losses_cp = ranks(2).run(cp_train, str(tmp_path / "cp"), 10)[0]
    one = Trainer(_model(1, "local"), MarkovSource(vocab=32, seed=3), _train_cfg(str(tmp_path / "one"), 10))
    losses_one = [r["loss"] for r in one.train()]
    torch.testing.assert_close(torch.tensor(losses_cp), torch.tensor(losses_one), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_blocks_match_eager(dtype):
    """compile_blocks (torch.compile of each transformer block; inductor on GPUs, aot_eager on CPU
    where inductor's C++ build takes minutes): loss, aux loss and every gradient as eager."""
    from tilecomm.moe import cast_parameters, compile_blocks

    torch._dynamo.reset()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    moe = MoEConfig(hidden=16, ffn_hidden=8, num_experts=4, topk=2, seed=1, router=dict(aux_loss_coeff=1e-2))
    tokens = MarkovSource(vocab=32, seed=3).batch(0, 0, 2, 16).to(device)
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**{**MODEL, "num_layers": 3}), moe_layer=lambda i: MoELayer(moe, "local"))
        model = model.to(device)
        cast_parameters(model, dtype)
        if compiled:
            compile_blocks(model, backend="inductor" if device == "cuda" else "aot_eager")
        loss, aux = model(tokens[:, :-1], tokens[:, 1:].reshape(-1))
        (loss + aux).backward()
        results.append([loss, aux] + [p.grad for p in model.parameters()])
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-3)
    for a, b in zip(*results):
        torch.testing.assert_close(b.float(), a.float(), **tol)


def test_fused_loss_equals_logits_loss():
    """model(tokens, targets) (chunked LM head + cross-entropy) = cross-entropy of model(tokens)'s logits."""
    import torch.nn.functional as F

    tokens = MarkovSource(vocab=32, seed=3).batch(0, 0, 2, 16)
    results = []
    for fused in (False, True):
        model = _model(1, "local")
        if fused:
            loss, aux = model(tokens[:, :-1], tokens[:, 1:].reshape(-1))
        else:
            logits, aux = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))
        (loss + aux).backward()
        results.append([loss] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="targets"):
        _model(1, "local")(tokens[:, :-1], tokens[:, 1:])


def test_profile_writes_a_trace_and_prints_tables(tmp_path):
    printed = []
    cfg = TrainConfig(**{**_train_cfg(str(tmp_path), 9).__dict__, "profile": True, "save": False})
    Trainer(_model(1, "local"), MarkovSource(vocab=32, seed=3), cfg, log=printed.append).train()
    text = "\n".join(printed)
    assert "top operators" in text and "aten::" in text, text
    assert (tmp_path / "trace.json.gz").stat().st_size > 0 and not (tmp_path / "checkpoint").exists()
    assert "steps 0-8" in printed[-1]  # the summary (fewer steps than summary_from: all of them)
