"""Tensor parallelism (sequence parallel) in the transformer and trainer: TP=2 (and TP x CP, TP x EP)
equals the one-rank model and one-process training; checkpoints resume; bad setups fail clearly."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import tilecomm
from conftest import BACKEND
from _reference import MODEL, ConcatRanks as _Concat, dev
from tilecomm.moe import (MarkovSource, ModelConfig, MoEConfig, MoELayer, ParallelLayout, TrainConfig, Trainer,
                          Transformer, make_dispatcher, parallelize)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_TOKENS = 32  # the TP layers' workspaces: the tests' batches are 2 x 16 tokens


def _moe(router=None):
    return MoEConfig(hidden=16, ffn_hidden=8, num_experts=4, topk=2, router=router or {"aux_loss_coeff": 0.0},
                     seed=1, max_tokens_per_rank=64, experts_impl="loop")


def _model(dispatcher="local", router=None, **groups):
    """dispatcher: a kind for MoELayer, or a function making one dispatcher per layer."""
    moe = _moe(router)
    make = dispatcher if callable(dispatcher) else (lambda: dispatcher)
    torch.manual_seed(0)
    return parallelize(Transformer(ModelConfig(**MODEL), moe_layer=lambda i: MoELayer(moe, dispatcher=make())),
                       max_tokens=MAX_TOKENS, **groups)


def _shard_of_full(name: str, full_grad: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """The TP shard (in the Column/Row [in, out] layout) of a full nn.Linear gradient [out, in],
    written out here independently of moe/tensor_parallel.py."""
    H, nh = MODEL["hidden"], MODEL["num_heads"]
    if name.endswith("attn.qkv.weight"):  # rows: q heads, k heads, v heads; rank t owns heads t*nh/T ...
        per = nh // tp
        rows = [part * H + head * (H // nh) + d for part in range(3) for head in range(tp_rank * per, (tp_rank + 1) * per)
                for d in range(H // nh)]
        return full_grad[rows].t()
    if name.endswith("mlp.gate_up.weight"):  # rows: gate then up; rank t owns F/T of each
        F, per = full_grad.shape[0] // 2, full_grad.shape[0] // 2 // tp
        rows = list(range(tp_rank * per, (tp_rank + 1) * per)) + list(range(F + tp_rank * per, F + (tp_rank + 1) * per))
        return full_grad[rows].t()
    per = full_grad.shape[1] // tp  # proj / down: Row layers split the input features
    return full_grad[:, tp_rank * per:(tp_rank + 1) * per].t()


def tp_model_body(tp, cp, router, dispatcher="local"):
    """A TP (x CP) transformer equals the one-rank model: logits of this rank's token slice, the
    summed aux loss, and every gradient (shards against the full gradient's slice, replicated ones
    summed over the ranks). dispatcher "tilecomm": its MoE layer's experts are spread over the world
    (EP folded onto the TP ranks), each rank's expert gradients against the full model's for its experts."""
    world, rank = tilecomm.world_size(), tilecomm.rank()
    groups = ParallelLayout(world, tp=tp, cp=cp, ep=1 if dispatcher == "local" else world).create_groups()
    tp_rank, cp_rank = groups.ranks["tp"].index(rank), groups.ranks["cp"].index(rank)
    full = _model(router=router).to(dev())
    par = _model(dispatcher, router=router, tp_group=groups.tp, cp_group=groups.cp if cp > 1 else None).to(dev())
    experts = par.blocks[1].mlp.local_experts  # every expert, or this rank's share
    tokens = MarkovSource(vocab=32, seed=7).batch(0, 0, 2, 16)[:, :16].to(dev())
    chunk = 16 // cp
    mine = tokens[:, cp_rank * chunk:(cp_rank + 1) * chunk]
    logits_full, aux_full = full(tokens)
    logits_par, aux_par = par(mine)
    n = mine.numel() // tp
    want = logits_full[:, cp_rank * chunk:(cp_rank + 1) * chunk].reshape(-1, 32)[tp_rank * n:(tp_rank + 1) * n]
    assert logits_par.shape == (n, 32)
    torch.testing.assert_close(logits_par, want, rtol=1e-5, atol=1e-5)
    aux_sum = aux_par.detach().clone()
    dist.all_reduce(aux_sum)
    torch.testing.assert_close(aux_sum / world, aux_full.detach(), rtol=1e-5, atol=1e-7)
    weight = torch.randn(logits_full.shape, generator=torch.Generator().manual_seed(11)).to(dev())
    (logits_full * weight).sum().add(aux_full).backward()
    w_mine = weight[:, cp_rank * chunk:(cp_rank + 1) * chunk].reshape(-1, 32)[tp_rank * n:(tp_rank + 1) * n]
    ((logits_par * w_mine).sum() + aux_par / world).backward()
    full_params = dict(full.named_parameters())
    for name, p in par.named_parameters():
        g = p.grad.clone()
        if getattr(p, "tensor_parallel", False):
            if cp > 1:
                dist.all_reduce(g, group=groups.cp)
            torch.testing.assert_close(g, _shard_of_full(name, full_params[name].grad, tp_rank, tp), rtol=1e-4,
                                       atol=1e-5, msg=name)
        elif ".experts." in name and dispatcher != "local":  # this rank's experts, with every rank's tokens
            want_g = full_params[name].grad[experts.start:experts.stop]
            torch.testing.assert_close(g, want_g, rtol=1e-4, atol=1e-5, msg=name)
        else:
            dist.all_reduce(g)
            torch.testing.assert_close(g, full_params[name].grad, rtol=1e-4, atol=1e-5, msg=name)
    sharded = {n for n, p in par.named_parameters() if getattr(p, "tensor_parallel", False)}
    assert sharded == {f"blocks.{i}.attn.{w}.weight" for i in range(2) for w in ("qkv", "proj")} | {
        "blocks.0.mlp.gate_up.weight", "blocks.0.mlp.down.weight"}
    roles = par.param_roles  # recorded by parallelize from the modules holding the parameters
    assert {n for n, r in roles.items() if r == "tensor_parallel"} == sharded
    assert {n for n, r in roles.items() if r == "expert"} == {"blocks.1.mlp.experts.w_gate_up", "blocks.1.mlp.experts.w_down"}


@pytest.mark.parametrize("tp,cp,router,dispatcher", [
    (2, 1, {"z_loss_coeff": 1e-2, "seq_aux_loss_coeff": 1e-2}, "local"),  # per-slice losses that average exactly
    (2, 2, {"z_loss_coeff": 1e-2}, "local"),
    (2, 1, {"z_loss_coeff": 1e-2}, "tilecomm"),  # EP = 2 on the TP ranks (2 GPUs: training differed, 2026-11-26)
], ids=["tp2", "tp2xcp2", "tp2-ep2"])
def test_tp_model_matches_one_rank_model(ranks, tp, cp, router, dispatcher):
    ranks(tp * cp).run(tp_model_body, tp, cp, router, dispatcher)


def test_tp1_model_is_the_plain_model():
    plain, tp1 = _model(), _model(tp_group=None)
    assert [(n, p.shape) for n, p in plain.named_parameters()] == [(n, p.shape) for n, p in tp1.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), tp1.parameters()))


def _train_cfg(out_dir, steps, resume=False, batch_size=2):
    return TrainConfig(steps=steps, batch_size=batch_size, seq_len=16, lr=3e-3, warmup_steps=2, out_dir=out_dir,
                       resume=resume, progress=False, peak_flops=None, precision="fp32")


def tp_train(out_dir, steps, tp, ep, dispatcher, stop_at=None, resume=False):
    world = tilecomm.world_size()
    groups = ParallelLayout(world, tp=tp, ep=ep).create_groups()
    def over_ep_group():  # expert parallel over this rank's EP group only
        return make_dispatcher(_moe(), "nccl", group=groups.ep)

    model = _model(over_ep_group if dispatcher == "nccl" else dispatcher, tp_group=groups.tp).to(dev())
    trainer = Trainer(model, MarkovSource(vocab=32, seed=3), _train_cfg(out_dir, steps, resume), groups=groups)
    return [(r["loss"], r["grad_norm"]) for r in trainer.train(stop_at=stop_at)]


def _one_process(tmp_path, steps, dp):
    one = Trainer(_model(), _Concat(MarkovSource(vocab=32, seed=3), dp), _train_cfg(str(tmp_path / "one"), steps, batch_size=2 * dp))
    return [(r["loss"], r["grad_norm"]) for r in one.train()]


@pytest.mark.parametrize("world,tp,ep,dispatcher", [(2, 2, 2, "tilecomm"), (2, 2, 1, "local"), (4, 2, 2, "nccl")],
                         ids=["tp2-ep2", "tp2-experts-replicated", "tp2xep2xdp2"])
def test_tp_training_matches_one_process(ranks, tmp_path, world, tp, ep, dispatcher):
    steps = 8 if world == 2 else 5
    runs = ranks(world).run(tp_train, str(tmp_path / "tp"), steps, tp, ep, dispatcher)
    assert all(r == runs[0] for r in runs), runs  # the logged loss and norm are global: the same on every rank
    one = _one_process(tmp_path, steps, world // tp)
    assert one[-1][0] < one[0][0] - 0.1, one  # it learns
    torch.testing.assert_close(torch.tensor(runs[0]), torch.tensor(one), rtol=2e-4, atol=2e-4,
                               msg=lambda m: f"{m}\n(loss, grad norm) per step, {world} ranks: {runs[0]}\none process: {one}")


def test_tp_checkpoint_resume_and_refusal(ranks, tmp_path):
    full = ranks(2).run(tp_train, str(tmp_path / "full"), 6, 2, 2, "tilecomm")[0]
    ranks(2).run(tp_train, str(tmp_path / "cut"), 6, 2, 2, "tilecomm", 4)  # interrupted after 4 of 6 steps
    resumed = ranks(2).run(tp_train, str(tmp_path / "cut"), 6, 2, 2, "tilecomm", None, True)[0]
    assert resumed == full[4:], (resumed, full)  # bit-identical continuation
    with pytest.raises(ValueError, match="tensor_parallel"):  # a TP=2 checkpoint in a TP=1 run
        Trainer(_model(), MarkovSource(vocab=32, seed=3), _train_cfg(str(tmp_path / "cut"), 6, resume=True))


def bad_tp_setups():
    tp = dist.group.WORLD  # (errors come before any tensor meets a device)
    with pytest.raises(ValueError, match="num_heads"):
        parallelize(Transformer(ModelConfig(**{**MODEL, "num_heads": 1})), tp_group=tp)
    with pytest.raises(ValueError, match="ffn_hidden"):
        parallelize(Transformer(ModelConfig(**{**MODEL, "ffn_hidden": 33})), tp_group=tp)
    for bad in (None, 0, 31, "32"):
        with pytest.raises(ValueError, match="max_tokens must be a positive multiple of the tensor-parallel size 2"):
            parallelize(Transformer(ModelConfig(**MODEL)), tp_group=tp, max_tokens=bad)
    model = _model(tp_group=tp)
    with pytest.raises(ValueError, match="tensor-parallel size"):
        model(torch.zeros(1, 3, dtype=torch.long))  # 3 tokens over 2 ranks
    tp2, tp1 = ParallelLayout(2, tp=2).create_groups(), ParallelLayout(2).create_groups()
    with pytest.raises(ValueError, match="tensor-parallel size"):
        Trainer(model, MarkovSource(vocab=32, seed=3), TrainConfig(steps=1, batch_size=1, seq_len=3), groups=tp2)
    with pytest.raises(ValueError, match="model was built"):
        Trainer(model, MarkovSource(vocab=32, seed=3), _train_cfg("unused", 1), groups=tp1)
    with pytest.raises(ValueError, match="model was built"):
        Trainer(_model(), MarkovSource(vocab=32, seed=3), _train_cfg("unused", 1), groups=tp2)
    with pytest.raises(ValueError, match="already parallelized"):
        parallelize(model, tp_group=tp)
    with pytest.raises(ValueError, match="group"):
        parallelize(Transformer(ModelConfig(**MODEL)), tp_group="tp")


def _assert_workspace_bytes(used, ws, dtype, world):
    """The model's workspaces take exactly what their pushes' specs say, within the bound that
    TensorParallelWorkspaces.heap_bytes documents for sizing the heap (the larger push of gemm_rs: "auto"
    picks "kernel" on the nvshmem transport, whose buffers are smaller)."""
    from tilecomm.overlap import AgGemmWorkspace, GemmRsWorkspace, TensorParallelWorkspaces

    rows = MAX_TOKENS // world
    exact = AgGemmWorkspace.heap_bytes(MODEL["hidden"], dtype, rows, world) + \
        GemmRsWorkspace.heap_bytes_of(GemmRsWorkspace.specs(MODEL["hidden"], dtype, rows, world, ws.rs.push))
    assert used == exact, (used, exact, ws.rs.push)
    assert used <= TensorParallelWorkspaces.heap_bytes(MODEL["hidden"], dtype, MAX_TOKENS, world)


def tp_workspaces_body(out_dir):
    """The TP layers of a parallelized model share the model's one set of workspaces, which takes what its
    pushes' specs say (`_assert_workspace_bytes`); a bf16 Trainer's cast re-makes it in bf16 (the fp32 one is
    returned), and training steps then make no temporary workspace."""
    from tilecomm.overlap import AgGemmWorkspace, ColumnParallelLinear, GemmRsWorkspace, RowParallelLinear

    world, heap = tilecomm.world_size(), tilecomm.current().heap
    groups = ParallelLayout(world, tp=world).create_groups()
    before = heap.bytes_free()
    model = _model(tp_group=groups.tp).to(dev())
    _assert_workspace_bytes(before - heap.bytes_free(), model.tp_workspaces, torch.float32, world)
    layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert len(layers) == 6 and all(m.workspaces is model.tp_workspaces for m in layers)
    made, originals = [], {cls: cls.__init__ for cls in (AgGemmWorkspace, GemmRsWorkspace)}

    def counting(cls):
        def init(self, *args, **kwargs):
            made.append(cls.__name__)
            originals[cls](self, *args, **kwargs)
        return init

    cfg = replace(_train_cfg(out_dir, 2), precision="bf16", save=False)
    trainer = Trainer(model, MarkovSource(vocab=32, seed=3), cfg, groups=groups)
    ws = model.tp_workspaces
    assert (ws.dtype, ws.ag.dtype, ws.rs.dtype) == (torch.bfloat16,) * 3
    _assert_workspace_bytes(before - heap.bytes_free(), ws, torch.bfloat16, world)
    for cls in originals:
        cls.__init__ = counting(cls)
    try:
        losses = [r["loss"] for r in trainer.train()]
    finally:
        for cls, init in originals.items():
            cls.__init__ = init
    assert made == [], f"temporary workspaces made in training steps: {made}"
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    model.tp_workspaces.free()
    assert heap.bytes_free() == before


def test_tp_layers_share_the_models_workspaces(ranks, tmp_path):
    ranks(2).run(tp_workspaces_body, str(tmp_path / "ws"))


def test_bad_tp_setups(ranks):
    ranks(2).run(bad_tp_setups)


def _example(*flags, timeout=300):
    """The example on CPU ranks (its cpu-tiny preset) on any machine."""
    env = {**os.environ, "TILECOMM_TIMEOUT_S": "60"}
    return subprocess.run([sys.executable, "examples/pretrain_moe.py", "--backend", "cpu", *flags], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.mark.skipif(BACKEND == "cuda", reason="runs the example on CPU ranks only (its GPU run: run_gpu.sh train)")
def test_pretrain_example_with_tp(tmp_path):
    out = tmp_path / "run"
    proc = _example("--world-size", "2", "--tp", "2", "--steps", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] and rows[0]["loss"] > 0
    from tilecomm.moe.checkpoint import latest
    saved = os.path.join(latest(str(out / "checkpoint")), "tilecomm_config.json")
    assert json.loads(open(saved).read())["tensor_parallel"] == 2


@pytest.mark.parametrize("flags,message", [(["--tp", "3"], "must divide the world size"),
                                           (["--world-size", "3", "--tp", "3"], "num_heads=4")])
def test_pretrain_example_refuses_bad_tp(tmp_path, flags, message):
    proc = _example(*flags, "--out", str(tmp_path / "bad"), timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
