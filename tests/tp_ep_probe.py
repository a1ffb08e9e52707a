"""Where the TP x EP model goes wrong on GPUs (a diagnostic for the open TP = 2 x EP = 2 failure, BENCHMARKS.md
2026-11-26 from 19:20 UTC):

    torchrun --nproc-per-node 2 tests/tp_ep_probe.py        (CPU ranks: python tests/tp_ep_probe.py --cpu)

test_tensor_parallel's model (2 blocks: dense, then MoE), TP over every rank, one forward of 2 x 16 tokens,
against the one-rank model from the same seed. For each variant rank 0 prints the largest difference of
(a) the logits of its token slice, and of the MoE layer's output (b) against the one-rank model's MoE layer
run on the same input (every rank's MoE input gathered), so a wrong MoE output is told apart from a wrong
input reaching it (the TP layers before it). Variants: the tilecomm dispatcher (EP over the TP ranks) and the
local one, each with the model's shared TP workspaces, with ag_gemm pushing by kernel instead of the copy
engine, with a temporary workspace per TP GEMM (the layers given none), and with a device synchronize after
every TP linear and MoE layer. Not a test (no assertions).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tilecomm  # noqa: E402
from tilecomm.moe import MarkovSource, MoELayer, ParallelLayout  # noqa: E402
from tilecomm.overlap import AgGemmWorkspace, ColumnParallelLinear, RowParallelLinear  # noqa: E402

from test_tensor_parallel import _model  # noqa: E402

TP_LAYERS = (ColumnParallelLinear, RowParallelLinear)


def _variant(model, name: str) -> None:
    """Change the TP x EP model in place for the variant `name`."""
    layers = [m for m in model.modules() if isinstance(m, TP_LAYERS)]
    if name == "kernel push":
        ws = model.tp_workspaces
        ws.ag.free()
        ws.ag = AgGemmWorkspace(ws.cols, ws.dtype, ws.ag.max_rows, ws.group, push="kernel")
    elif name == "temporary workspaces":
        for m in layers:
            m.workspaces = None
    elif name == "synchronize":
        sync = (lambda *_: torch.cuda.synchronize()) if torch.cuda.is_available() else (lambda *_: None)
        for m in model.modules():
            if isinstance(m, TP_LAYERS + (MoELayer,)):
                m.register_forward_hook(sync)


def run(dispatcher: str, variant: str, dev: torch.device):
    world, rank = tilecomm.world_size(), tilecomm.rank()
    groups = ParallelLayout(world, tp=world, ep=1 if dispatcher == "local" else world).create_groups()
    full = _model().to(dev)
    par = _model(dispatcher, tp_group=groups.tp).to(dev)
    _variant(par, variant)
    seen = {}
    par.blocks[1].mlp.register_forward_hook(lambda m, args, out: seen.update(x=args[0].detach(), y=out))
    tokens = MarkovSource(vocab=32, seed=7).batch(0, 0, 2, 16)[:, :16].to(dev)
    with torch.no_grad():
        want, _ = full(tokens)
        got, _ = par(tokens)
        n = got.shape[0]
        logits = (got - want.reshape(-1, want.shape[-1])[rank * n:(rank + 1) * n]).abs().max().item()
        x, y = seen["x"], seen["y"][0] if isinstance(seen["y"], tuple) else seen["y"]
        xs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(xs, x.contiguous())
        ref, _ = full.blocks[1].mlp(torch.cat(xs))
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        moe = (y.reshape(-1, y.shape[-1]) - ref.reshape(-1, ref.shape[-1])[rank * rows:(rank + 1) * rows]).abs().max()
    return logits, moe.item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", action="store_true", help="2 CPU ranks (a smoke run of the probe itself)")
    args = p.parse_args()
    if args.cpu:
        pool = tilecomm.RankPool(2, backend="cpu")
        rows = pool.run(_all)
        pool.close()
        _print(rows[0])
        return
    tilecomm.init()
    rows = _all()
    if tilecomm.rank() == 0:
        _print(rows)
    tilecomm.finalize()


def _all():
    dev = tilecomm.current().device
    rows = []
    for dispatcher in ("tilecomm", "local"):
        for variant in ("shared workspaces", "kernel push", "temporary workspaces", "synchronize"):
            try:
                rows.append((dispatcher, variant) + run(dispatcher, variant, dev))
            except Exception as err:  # one variant's failure does not hide the others
                rows.append((dispatcher, variant, f"{type(err).__name__}: {str(err)[:200]}", ""))
    return rows


def _print(rows):
    print(f"{'dispatcher':10s} {'variant':22s} {'max |logits - one rank|':>24s} {'max |MoE out - one rank|':>25s}")
    for d, v, a, b in rows:
        print(f"{d:10s} {v:22s} {a if isinstance(a, str) else f'{a:24.3e}'} {b if isinstance(b, str) else f'{b:25.3e}'}")


if __name__ == "__main__":
    main()
