"""tilecomm.overlap.fused_moe and MoELayer(dispatcher="fused") on 2, 3 and 4 CPU ranks, float64, against the
unfused path (a dispatcher="tilecomm" Dispatcher + the experts + combine): outputs, input gradients, every
parameter gradient and the routing-weight gradients within 1e-9. Routing: random, skewed onto one rank's
experts (others get none), -1 entries, a token naming one expert twice, ranks with no tokens, top-k 1..8.
One spawn per world size runs all of its cases (the CPU suite's time budget)."""
from __future__ import annotations

import pytest
import torch

import tilecomm
from tilecomm.dispatch import Dispatcher
from tilecomm.moe.layer import MoEConfig, MoELayer, make_dispatcher
from tilecomm.overlap import FusedMoEWorkspace, fused_moe, fused_moe_reference
from tilecomm.overlap.moe_config import FusedGemm, FusedMoEConfig
from tilecomm.overlap.tiles import GemmConfig

H, F, M = 32, 16, 24  # hidden, ffn hidden, max tokens per rank
TOL = dict(rtol=1e-9, atol=1e-9)


def _routing(kind: str, T: int, E: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """[T, K] expert ids. random: K distinct experts; skewed: experts 0..K-1 (the first ranks' experts) with
    some -1 entries and, in token 0, one expert named twice."""
    if kind == "random":
        return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else torch.zeros(0, K).long()
    idx = torch.arange(K).repeat(T, 1)
    idx[torch.rand(T, K, generator=gen) < 0.3] = -1
    if T and K > 1:
        idx[0, 1] = idx[0, 0] = 0
    return idx


def _inputs(case, rank: int, world: int):
    E, K, tokens, kind = case
    T = tokens[rank % len(tokens)]
    gen = torch.Generator().manual_seed(100 * rank + 7 * K + E)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    w = torch.rand(T, K, generator=gen)
    wgen = torch.Generator().manual_seed(1000 + rank)
    w_gate_up = torch.randn(E // world, H, 2 * F, generator=wgen, dtype=torch.float64) * 0.3
    w_down = torch.randn(E // world, F, H, generator=wgen, dtype=torch.float64) * 0.3
    grad_out = torch.randn(T, H, generator=gen, dtype=torch.float64)
    dev = tilecomm.current().device  # CPU ranks, or GPU ranks (TILECOMM_TEST_BACKEND=cuda)
    return [t.to(dev) for t in (x, w, w_gate_up, w_down)], _routing(kind, T, E, K, gen).to(dev), grad_out.to(dev)


def _run(op, leaves, idx, grad_out, comm):
    leaves = [t.clone().requires_grad_() for t in leaves]
    out = op(leaves[0], idx, leaves[1], leaves[2], leaves[3], comm)
    (out * grad_out).sum().backward()
    return [out] + [t.grad for t in leaves]


def _split_columns_config() -> FusedMoEConfig:
    """The device's config with items that split a row tile's columns, in bands of 2 row tiles: scatter 16 of
    H = 32 columns an item, gate_up and down_grad 8 of F = 16 (their rows gathered by a launch of their own,
    with 3 programs per SM: another grid than the GEMM's)."""
    cfg = FusedMoEConfig.for_device(tilecomm.current().device, H, torch.float64)

    def split(launch: FusedGemm, cols: int) -> FusedGemm:
        t = launch.tiles
        return FusedGemm(GemmConfig(t.BLOCK_M, cols, t.BLOCK_K, 2, t.num_warps, t.num_stages, 1, False),
                         launch.programs_per_sm, launch.copy_cols, item_cols=cols, gather_per_sm=3)

    return FusedMoEConfig(split(cfg.gate_up, 8), split(cfg.down_grad, 8), split(cfg.scatter, 16), cfg.block_h,
                          cfg.wgrad)


def functional_body(cases):
    """fused_moe against fused_moe_reference over a tilecomm Dispatcher, case by case; the fused workspace
    runs each case twice (its channels' second call); the first case also with items of the three fused GEMMs
    that split a row tile's columns (the item finishing a row tile sets its flags)."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    for i, case in enumerate(cases):
        E, K = case[0], case[1]
        leaves, idx, grad_out = _inputs(case, rank, world)
        d = Dispatcher(E, H, M, K, torch.float64)
        expect = _run(fused_moe_reference, leaves, idx, grad_out, d)
        d.free()
        for config, calls in ((None, 2),) + (((_split_columns_config(), 2),) if i == 0 else ()):
            ws = FusedMoEWorkspace(E, H, F, M, K, torch.float64, config=config)
            for _ in range(calls):
                got = _run(fused_moe, leaves, idx, grad_out, ws)
                for name, a, b in zip(("out", "x", "topk_weights", "w_gate_up", "w_down"), got, expect):
                    torch.testing.assert_close(a, b.to(a.dtype), **TOL, msg=lambda m: f"{case} {name}: {m}")
            ws.free()


def layer_body(E, K):
    """Two MoE layers in a row (sharing one fused workspace, as a model's layers do) with dispatcher "fused"
    against the same layers with "tilecomm": outputs, aux loss, input and every parameter gradient."""
    rank = tilecomm.rank()
    c = MoEConfig(hidden=H, ffn_hidden=F, num_experts=E, topk=K, num_shared_experts=1, seed=5, init_std=0.3,
                  dtype=torch.float64, max_tokens_per_rank=M, router=dict(aux_loss_coeff=1e-2))
    x = torch.randn(2, 4 + rank, H, generator=torch.Generator().manual_seed(rank), dtype=torch.float64).to(
        tilecomm.current().device)
    results = []
    for kind in ("tilecomm", "fused"):
        first = make_dispatcher(c, kind)
        layers = [MoELayer(c, dispatcher=first), MoELayer(c, dispatcher=make_dispatcher(c, kind, share_with=first))]
        xi = x.clone().requires_grad_()
        y, aux = layers[0](xi)
        y2, aux2 = layers[1](y)
        (y2.square().sum() + aux + aux2).backward()
        results.append([y2, aux + aux2, xi.grad] + [p.grad for layer in layers for p in layer.parameters()])
        first.free()
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, **TOL)


def bad_inputs_body():
    """Shapes and dtypes are checked before any kernel runs (on every rank: nobody is left waiting)."""
    E, K = 4, 2
    ws = FusedMoEWorkspace(E, H, F, M, K, torch.float64)
    leaves, idx, _ = _inputs((E, K, [3], "random"), tilecomm.rank(), tilecomm.world_size())
    x, w, w_gate_up, w_down = leaves
    with pytest.raises(ValueError, match="w_down"):
        fused_moe(x, idx, w, w_gate_up, w_down[:, :, :-1], ws)
    with pytest.raises(TypeError, match="dtype"):
        fused_moe(x.float(), idx, w, w_gate_up, w_down, ws)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        fused_moe(x.new_zeros(M + 1, H), idx.new_zeros(M + 1, K), w.new_zeros(M + 1, K), w_gate_up, w_down, ws)
    with pytest.raises(ValueError, match="topk_idx values"):  # found on the device: raised after the call
        fused_moe(x, idx.clamp(max=0) - 2, w, w_gate_up, w_down, ws)
    d = Dispatcher(E, H, M, K, torch.float64)
    torch.testing.assert_close(fused_moe(x, idx, w, w_gate_up, w_down, ws),  # the workspace still works
                               fused_moe_reference(x, idx, w, w_gate_up, w_down, d), **TOL)
    d.free()
    ws.free()


# (num_experts, topk, tokens per rank (cycled), routing)
CASES = {
    2: [(8, 1, [9, 6], "random"), (8, 8, [5, 7], "skewed")],
    3: [(6, 2, [8, 5, 0], "random"), (12, 5, [4, 0, 6], "skewed")],
    4: [(8, 3, [5, 0, 9, 3], "random"), (8, 7, [6, 4, 0, 2], "skewed"), (16, 4, [0, 3, 5, 2], "skewed")],
}


@pytest.mark.timeout(600)  # on GPUs the first case compiles every fp64 kernel of two configs (~90 s each on one core)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_fused_moe_matches_unfused(ranks, world):
    ranks(world).run(functional_body, CASES[world])


@pytest.mark.parametrize("world,experts,topk", [(2, 4, 1), (3, 6, 2), (4, 8, 6)])
def test_fused_moe_layer_matches_tilecomm_layer(ranks, world, experts, topk):
    ranks(world).run(layer_body, experts, topk)


def test_fused_moe_bad_inputs(ranks):
    ranks(2).run(bad_inputs_body)


def test_fused_gemm_item_cols_and_gather_programs_checked():
    tiles = GemmConfig(64, 128, 64, 8, 4, 3, 1, False)
    for bad in (-128, 100):
        with pytest.raises(ValueError, match="item_cols"):
            FusedGemm(tiles, item_cols=bad)
    assert FusedGemm(tiles, item_cols=256).item_cols == 256
    with pytest.raises(ValueError, match="gather_per_sm=-1"):
        FusedGemm(tiles, item_cols=128, gather_per_sm=-1)


def test_wide_layers_get_split_column_items():
    """On GPUs, an expert whose w_gate_up is at least WIDE_EXPERT_BYTES gets items that split the columns (the
    DeepSeek-V3-like layer), a narrow one whole-row items (the pretraining layer); fp32 and CPU ranks keep their own."""
    from tilecomm.overlap.moe_config import WIDE_EXPERT_BYTES, WIDE_LAYER

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert FusedMoEConfig.for_device(gpu, 7168, torch.bfloat16, 2048) == WIDE_LAYER
    assert FusedMoEConfig.for_device(gpu, 1536, torch.bfloat16, 768) == FusedMoEConfig()
    edge = WIDE_EXPERT_BYTES // (2 * 2 * 1024)  # hidden 1024: ffn at the threshold, and one below it
    assert FusedMoEConfig.for_device(gpu, 1024, torch.bfloat16, edge) == WIDE_LAYER
    assert FusedMoEConfig.for_device(gpu, 1024, torch.bfloat16, edge - 1) == FusedMoEConfig()
    assert all(g.item_cols > 0 for g in (WIDE_LAYER.gate_up, WIDE_LAYER.down_grad, WIDE_LAYER.scatter))
    assert FusedMoEConfig.for_device(gpu, 7168, torch.float32, 2048).gate_up.tiles.BLOCK_N == 64
    assert FusedMoEConfig.for_device(cpu, 7168, torch.bfloat16, 2048).gate_up.item_cols == 0
