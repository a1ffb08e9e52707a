"""
Replacing NCCL all-to-all in an expert-parallel MoE layer with tilecomm.dispatch
================================================================================

A plain PyTorch mixture-of-experts layer: a linear router scores E experts per token, each token
goes to its top-k experts (softmax weights), and the outputs come back weighted. With expert
parallelism each of the W ranks owns E/W experts, so tokens travel to the ranks that own their
experts and the results travel back. That exchange is the only communication in the layer, and
it all goes through one object:

    Dispatcher(num_experts, hidden, max_tokens_per_rank, topk, dtype, backend=...)

backend="nccl" is the usual torch path (permute, torch.distributed.all_to_all_single, unpermute);
backend="tilecomm" runs the same dispatch and combine on tilecomm's kernels and collectives.
Switching is that one argument (--dispatcher); the model, the optimizer and the training loop
do not change. Both are autograd-aware, so loss.backward() sends gradients back through the
all-to-alls on its own.

Gradients under expert parallelism: the shared parameters (projections, router) are replicated,
so their gradients are averaged over the ranks with torch.distributed.all_reduce. Each expert lives
on one rank only, and combine's backward has already brought it the gradients from every rank's
tokens; it is divided by W so that both follow the same objective, the mean of the ranks' losses.

By default the script trains with both dispatchers from the same seeds, prints the losses side
by side and checks that they agree.

Run:  python examples/replace_nccl_all_to_all.py [--world-size 2] [--steps 10]
                                                 [--dispatcher both|tilecomm|nccl] [--backend cpu|cuda]
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

import tilecomm
from tilecomm.dispatch import Dispatcher

HIDDEN, TOPK, TOKENS, FEATURES, FFN = 16, 2, 32, 8, 32  # TOKENS per rank per step


def num_experts(world):
    """8 experts, rounded up to a multiple of the world size (every rank owns E/W of them)."""
    return -(-8 // world) * world


class MoE(nn.Module):
    """Router + this rank's experts (each a small relu MLP); tokens move through the Dispatcher."""

    def __init__(self, dispatcher):
        super().__init__()
        self.d = dispatcher
        self.router = nn.Linear(HIDDEN, dispatcher.num_experts, bias=False)  # shared: the same on every rank
        first = dispatcher.rank * dispatcher.num_local_experts
        w_in, w_out = [], []
        for e in range(first, first + dispatcher.num_local_experts):  # seeded by global expert id
            gen = torch.Generator().manual_seed(100 + e)
            w_in.append(torch.randn(HIDDEN, FFN, generator=gen) / HIDDEN ** 0.5)
            w_out.append(torch.randn(FFN, HIDDEN, generator=gen) / FFN ** 0.5)
        self.w_in, self.w_out = nn.Parameter(torch.stack(w_in)), nn.Parameter(torch.stack(w_out))

    def forward(self, x):
        probs = torch.softmax(self.router(x), dim=-1)
        weights, idx = probs.topk(TOPK, dim=-1)
        res = self.d.dispatch(x, idx, weights)  # res.x: this rank's rows, grouped by local expert
        chunks = res.x.split(res.tokens_per_expert.tolist())
        y = torch.cat([torch.relu(c @ self.w_in[e]) @ self.w_out[e] for e, c in enumerate(chunks)])
        return self.d.combine(y, res.handle)  # sum_k weights[t, k] * expert_k(x[t]), back on x's rank


class Model(nn.Module):
    def __init__(self, dispatcher):
        super().__init__()
        self.inp, self.out = nn.Linear(FEATURES, HIDDEN), nn.Linear(HIDDEN, FEATURES)
        self.moe = MoE(dispatcher)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.moe(h))

    def expert_parameters(self):
        return [self.moe.w_in, self.moe.w_out]


def batch(step, rank, device):
    """Synthetic regression data, the same on every run: target = sin(x @ A), A fixed."""
    a = torch.randn(FEATURES, FEATURES, generator=torch.Generator().manual_seed(7))
    x = torch.randn(TOKENS, FEATURES, generator=torch.Generator().manual_seed(1000 * step + rank))
    return x.to(device), torch.sin(x @ a).to(device)


def train(which, steps, device):
    """One dispatcher, `steps` AdamW steps; returns the mean loss over ranks at every step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dispatcher = Dispatcher(num_experts(world), HIDDEN, TOKENS, TOPK, torch.float32, backend=which)  # <- the one switch
    torch.manual_seed(0)  # shared parameters: identical on every rank
    model = Model(dispatcher).to(device)
    experts = {id(p) for p in model.expert_parameters()}
    shared = [p for p in model.parameters() if id(p) not in experts]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, target = batch(step, rank, device)
        loss = nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        for p in shared:  # replicated: average over ranks
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        for p in model.expert_parameters():  # local, already summed over every rank's tokens
            p.grad.div_(world)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def run_rank(dispatchers, steps):
    """Runs on every rank (module-level, so tilecomm.launch can pickle it)."""
    device = tilecomm.current().device
    return {which: train(which, steps, device) for which in dispatchers}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dispatcher", choices=("both", "tilecomm", "nccl"), default="both")
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    names = ("tilecomm", "nccl") if args.dispatcher == "both" else (args.dispatcher,)
    results = tilecomm.launch(run_rank, args.world_size, names, args.steps, backend=args.backend)
    losses = results[0]  # every rank holds the same (all-reduced) losses
    print(f"{args.world_size} ranks, {num_experts(args.world_size)} experts, top-{TOPK}, hidden {HIDDEN}, {TOKENS} tokens per rank")
    print("step  " + "".join(f"{n:>12}" for n in names))
    for step in range(args.steps):
        print(f"{step:4d}  " + "".join(f"{losses[n][step]:12.6f}" for n in names))
    if len(names) == 2:
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses["tilecomm"], losses["nccl"]))
        assert worst <= 1e-5, f"losses differ: max relative difference {worst:.2e} > 1e-5"
        print(f"same losses (max relative difference {worst:.1e})")
