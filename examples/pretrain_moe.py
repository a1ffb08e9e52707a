"""
MoE pretraining on tilecomm: the main job
=========================================

A small decoder-only transformer whose MLPs (after a dense prefix) are mixture-of-experts layers,
trained with expert parallelism: every rank holds E/W experts, tokens travel to their experts and
back through `tilecomm.dispatch` (or the NCCL/gloo path, `--dispatcher nccl`; or `--dispatcher fused`:
dispatch fused into the experts' first grouped GEMM and combine into the second, tilecomm.overlap.fused_moe,
also at world size 1), attention runs data
parallel over the same ranks (MoE Parallel Folding: attention tp x cp x dp = W, experts ep = W with
etp = edp = 1, pp = 1; `--cp C` splits every sequence over C ranks, attention all-gathering K/V inside
each CP group; `--tp T` splits attention heads and the dense MLP over T ranks with sequence
parallelism, their all-gather / reduce-scatter fused into the GEMMs by tilecomm.overlap).

    python examples/pretrain_moe.py                       # 2 CPU ranks, tiny model, ~2 minutes
    python examples/pretrain_moe.py --world-size 3 --steps 20 --dispatcher nccl
    python examples/pretrain_moe.py --world-size 2 --steps 20 --dispatcher fused
    python examples/pretrain_moe.py --world-size 4 --tp 2 --cp 2
    torchrun --nproc-per-node 4 examples/pretrain_moe.py --preset h200x4   # GPUs, unchanged code

Data: a synthetic Markov source whose entropy floor is known, so the printed loss can be compared
with the best achievable; `--data FILE` trains on a real corpus (text as bytes, or a .bin of uint16
tokens). Output in --out: log.jsonl (one line per step), loss.png, and a DCP checkpoint at the end
and every `--checkpoint-every N` steps (`--resume` continues from the last one and reproduces the
same loss curve, also after a kill -9: checkpoints are written aside and switched to atomically, and
verified against their sha256 manifest before torch reads them; they are trusted input all the same,
as DCP's metadata is a pickle). The ranks stop with this launcher (Ctrl-C, SIGTERM, SIGKILL).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

import tilecomm
from tilecomm.moe import (MarkovSource, ModelConfig, MoEConfig, MoELayer, ParallelLayout, TokenFile, TrainConfig,
                          Trainer, Transformer, dispatcher_heap_bytes, make_dispatcher, parallelize)
from tilecomm.moe.trainer import param_dtype
from tilecomm.moe import checkpoint
from tilecomm.overlap import TensorParallelWorkspaces

PRESETS = {
    # 2 CPU cores: ~50k parameters, 12 experts (splits over 2, 3, 4 or 6 ranks) of which 2 per token
    "cpu-tiny": dict(model=dict(vocab_size=64, hidden=32, num_layers=2, num_heads=4, ffn_hidden=64, num_dense_layers=1,
                                max_seq_len=32),
                     moe=dict(num_experts=12, topk=2, ffn_hidden=16),
                     train=dict(batch_size=8, seq_len=32, steps=60, lr=1e-2, warmup_steps=5)),
    # 4 x H200: ~2.5B parameters (~0.45B active), 64 fine-grained experts, top-6
    "h200x4": dict(model=dict(vocab_size=32768, hidden=1536, num_layers=12, num_heads=12, ffn_hidden=6144,
                              num_dense_layers=1, max_seq_len=4096),
                   moe=dict(num_experts=64, topk=6, ffn_hidden=768),
                   train=dict(batch_size=4, seq_len=4096, steps=100, lr=3e-4, warmup_steps=10)),
}


def check_parallel_sizes(args, world: int) -> None:
    """ValueError naming the flag when --tp / --cp cannot split this preset over `world` ranks."""
    preset = PRESETS[args.preset]
    model, train = preset["model"], preset["train"]
    for flag, size in (("--tp", args.tp), ("--cp", args.cp)):
        if size < 1:
            raise ValueError(f"{flag} {size}: expected a positive int")
    if world % (args.tp * args.cp):
        raise ValueError(f"--tp {args.tp} x --cp {args.cp} = {args.tp * args.cp} must divide the world size {world}")
    if train["seq_len"] % args.cp:
        raise ValueError(f"--cp {args.cp}: preset {args.preset!r} has seq_len {train['seq_len']}, which must divide by it")
    for name in ("num_heads", "ffn_hidden"):
        if model[name] % args.tp:
            raise ValueError(f"--tp {args.tp}: preset {args.preset!r} has {name}={model[name]}, which must divide by it")
    if train["batch_size"] * train["seq_len"] // args.cp % args.tp:
        raise ValueError(f"--tp {args.tp}: the {train['batch_size']} x {train['seq_len'] // args.cp} tokens per rank "
                         "must divide by it (sequence parallelism splits them)")


def check_flags(args) -> None:
    """ValueError / FileNotFoundError naming the flag for --steps, --checkpoint-every, --world-size,
    --data and --resume (checked once in the launcher, before any rank starts)."""
    for flag, value, low in (("--steps", args.steps, 1), ("--checkpoint-every", args.checkpoint_every, 0),
                             ("--world-size", args.world_size, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} {value}: expected an int >= {low}")
    if args.data:
        TokenFile(args.data).check_seq_len(PRESETS[args.preset]["train"]["seq_len"])
    if args.resume and "RANK" not in os.environ:  # (under torchrun every rank verifies its share when it loads)
        checkpoint.verify(os.path.join(args.out, "checkpoint"))  # sizes and sha256, before any rank reads it


def moe_config(args) -> MoEConfig:
    """The preset's MoE layer (built in fp32; the Trainer casts it, keeping fp32 masters)."""
    preset = PRESETS[args.preset]
    moe, train = preset["moe"], preset["train"]
    return MoEConfig(hidden=preset["model"]["hidden"], ffn_hidden=moe["ffn_hidden"], num_experts=moe["num_experts"],
                     topk=moe["topk"], router=dict(aux_loss_coeff=1e-2), seed=args.seed,
                     max_tokens_per_rank=train["batch_size"] * train["seq_len"])


def tokens_dtype(args, device_type: str) -> torch.dtype:
    """The dtype the MoE layers' tokens have in training: the Trainer's parameter dtype (--precision; auto: bf16
    on GPUs, fp32 on CPUs)."""
    return param_dtype(args.precision, torch.device(device_type))


def dispatcher_kind(args, world: int) -> str:
    return args.dispatcher if world > 1 or args.dispatcher == "fused" else "local"


def tokens_per_forward(args) -> int:
    """Batch x sequence tokens one forward on a rank sees, after context parallelism (the TP workspaces' size)."""
    train = PRESETS[args.preset]["train"]
    return train["batch_size"] * train["seq_len"] // args.cp


def heap_bytes(args, world: int, device_type: str) -> int:
    """Symmetric heap per rank: room for the MoE layers' one set of dispatcher buffers and, with --tp, the TP
    layers' one set of workspaces (made in fp32 where the model is built, re-made when the Trainer casts it)
    beside the runtime's own (tilecomm.heap_bytes_for); at least TILECOMM_HEAP_BYTES (default 1 GiB on GPUs,
    256 MiB on CPU ranks)."""
    need = dispatcher_heap_bytes(moe_config(args), dispatcher_kind(args, world), world, tokens_dtype(args, device_type))
    if args.tp > 1:
        need += TensorParallelWorkspaces.heap_bytes(PRESETS[args.preset]["model"]["hidden"], torch.float32,
                                                    tokens_per_forward(args), args.tp)
    default = (1 << 30) if device_type == "cuda" else 256 << 20
    return max(int(os.environ.get("TILECOMM_HEAP_BYTES", default)), tilecomm.heap_bytes_for(need))


def build(args, world: int, rank: int, device: torch.device, cp_group=None, tp_group=None):
    preset = PRESETS[args.preset]
    data = TokenFile(args.data) if args.data else MarkovSource(vocab=preset["model"]["vocab_size"], seed=args.seed)
    mcfg = ModelConfig(**dict(preset["model"], vocab_size=data.vocab), recompute=args.recompute)
    moe = preset["moe"]
    if moe["num_experts"] % world:
        raise ValueError(f"preset {args.preset!r}: num_experts={moe['num_experts']} does not split over {world} ranks "
                         "(expert parallelism needs num_experts divisible by the world size)")
    tcfg = TrainConfig(**dict(preset["train"], **({"steps": args.steps} if args.steps is not None else {})),
                       out_dir=args.out, resume=args.resume, checkpoint_every=args.checkpoint_every, progress=rank == 0,
                       peak_flops=989e12 if device.type == "cuda" else None, compile=args.compile, profile=args.profile,
                       save=not args.no_checkpoint, precision=args.precision)
    moe_cfg = moe_config(args)
    torch.manual_seed(args.seed)  # the same dense weights on every rank
    first: list = []  # the MoE layers share one dispatcher's symmetric buffers (they dispatch one after another)

    def moe_layer(i: int) -> MoELayer:
        d = make_dispatcher(moe_cfg, dispatcher_kind(args, world), share_with=first[0] if first else None,
                            dtype=tokens_dtype(args, device.type))
        first.append(d)
        return MoELayer(moe_cfg, dispatcher=d, device=device)

    model = Transformer(mcfg, moe_layer=moe_layer)
    model = parallelize(model, tp_group=tp_group, cp_group=cp_group, max_tokens=tokens_per_forward(args)).to(device)
    return data, mcfg, moe_cfg, tcfg, model


def dense_numel(p: torch.nn.Parameter, tp: int) -> int:
    """Elements of the whole (unsharded) parameter: a tensor-parallel shard is 1/tp of it."""
    return p.numel() * (tp if getattr(p, "tensor_parallel", False) else 1)


def flops_per_token(model: torch.nn.Module, mcfg: ModelConfig, moe_cfg: MoEConfig, world: int, seq_len: int,
                    tp: int = 1) -> float:
    """6 x active parameters + attention (12 x layers x hidden x seq_len), per token."""
    dense = sum(dense_numel(p, tp) for n, p in model.named_parameters() if ".experts." not in n and "embed" not in n)
    local_experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active_experts = local_experts * world * moe_cfg.topk / moe_cfg.num_experts
    return 6 * (dense + active_experts) + 12 * mcfg.num_layers * mcfg.hidden * seq_len


def run_rank(args) -> dict:
    ctx = tilecomm.current()
    world, rank = ctx.world_size, ctx.rank
    check_parallel_sizes(args, world)
    layout = ParallelLayout(world, tp=args.tp, cp=args.cp, ep=world)  # attention: tp x cp x dp = W; MoE: ep = W
    layout.check_trainable()
    groups = layout.create_groups()
    cp_group, tp_group = groups.cp if args.cp > 1 else None, groups.tp if args.tp > 1 else None
    data, mcfg, moe_cfg, tcfg, model = build(args, world, rank, ctx.device, cp_group, tp_group)
    trainer = Trainer(model, data, tcfg, groups=groups,
                      flops_per_token=flops_per_token(model, mcfg, moe_cfg, world, tcfg.seq_len, args.tp),
                      config_record=dict(preset=args.preset, world=world, cp=args.cp, seed=args.seed, data=args.data,
                                         experts=moe_cfg.num_experts))
    history = trainer.train()
    params = sum(dense_numel(p, args.tp) for n, p in model.named_parameters() if ".experts." not in n)
    params += sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) * world
    return dict(first=history[0]["loss"] if history else None, last=history[-1]["loss"] if history else None,
                floor=getattr(data, "entropy_floor", None), steps=trainer.step, params=params,
                tokens_per_s=history[-1]["tokens_per_s"] if history else 0.0, mfu=history[-1]["mfu"] if history else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: h200x4 on GPUs, cpu-tiny on CPU")
    p.add_argument("--world-size", type=int, default=2, help="CPU ranks to spawn (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=None, help="steps to train to (default: the preset's)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="also checkpoint every N steps (default 0: only at the end)")
    p.add_argument("--dispatcher", choices=["tilecomm", "nccl", "fused"], default="tilecomm",
                   help="fused: the experts as tilecomm.overlap.fused_moe (dispatch and combine inside the grouped GEMMs)")
    p.add_argument("--data", default=None, help="text file (bytes) or .bin of uint16 tokens; default: Markov source")
    p.add_argument("--out", default="runs/pretrain_moe")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--recompute", action="store_true", help="activation recompute per block")
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    p.add_argument("--profile", action="store_true", help="profile steps 5-7: trace.json.gz in --out, top kernels printed")
    p.add_argument("--no-checkpoint", action="store_true", help="write no checkpoint (benchmark runs)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (divides the world size)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of attention and the dense MLP, with "
                   "sequence parallelism (tp x cp divides the world size; divides num_heads)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="parameters' dtype (fp32 masters in the optimizer for bf16); auto: bf16 on GPUs, fp32 on CPUs")
    p.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    args = p.parse_args()
    backend = args.backend if args.backend != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    args.preset = args.preset or ("h200x4" if backend == "cuda" else "cpu-tiny")
    try:  # bad flags fail here, before any rank starts
        check_flags(args)
        check_parallel_sizes(args, int(os.environ.get("WORLD_SIZE", args.world_size)))
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    if "RANK" in os.environ:  # torchrun: this process is one rank
        tilecomm.init(backend=backend, heap_bytes=heap_bytes(args, int(os.environ["WORLD_SIZE"]), backend))
        results = [run_rank(args)]
        tilecomm.finalize()
        if dist.is_initialized():
            dist.destroy_process_group()
    else:
        try:
            heap = heap_bytes(args, args.world_size, backend)
            results = tilecomm.launch(run_rank, args.world_size, args, backend=backend,
                                      env={"TILECOMM_HEAP_BYTES": str(heap)})
        except KeyboardInterrupt:  # the pool has already killed the ranks
            sys.exit(f"interrupted: the {args.world_size} ranks are stopped; --resume continues from the last checkpoint")
    r = results[0]
    if r is None or ("RANK" in os.environ and int(os.environ["RANK"]) != 0):
        return
    floor = f", entropy floor {r['floor']:.3f}" if r["floor"] else ""
    mfu = "n/a (CPU)" if r["mfu"] is None else f"{100 * r['mfu']:.2f}% of 989 TFLOP/s"
    if r["first"] is None:
        print(f"nothing to train: the checkpoint in {args.out} is already at step {r['steps']}")
        return
    print(f"{r['params'] / 1e6:.2f}M parameters, {r['steps']} steps: loss {r['first']:.3f} -> {r['last']:.3f}{floor}; "
          f"{r['tokens_per_s']:.0f} tokens/s, MFU {mfu}; log.jsonl, loss.png and checkpoint in {args.out}")


if __name__ == "__main__":
    main()
