"""Training loop: AdamW with warm-up + cosine, bf16 autocast on GPU, gradient clipping, expert-parallel
gradient reduction, DCP checkpoints, a progress bar, a JSONL log and a loss-curve PNG.

Gradient reduction under MoE Parallel Folding. The objective is the mean of the W ranks' losses,
W = dp(-cp) size x tp size (every rank holds as many tokens; each rank's loss is the mean over its
tokens). Every gradient is summed over the ranks holding a copy of that parameter and divided by W:
  - tensor-parallel shards (`p.tensor_parallel`): over the dp(-cp) group (the TP backward already
    brought every TP rank's tokens' contribution to the shard);
  - other dense parameters (norms, embedding, head, routers): over the dp(-cp) group and the TP group
    (each TP rank saw only its slice of the tokens, as Megatron's sequence-parallel norms);
  - expert parameters: over the expert-data-parallel group (combine's backward already brought every
    EP rank's tokens' gradients to the expert).
The gradient norm for clipping counts every distinct value once: squares of TP shards are summed over
the TP group, of experts over the EP group, replicated parameters are counted locally.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import checkpoint
from .tensor_parallel import sequence_shard, tp_rank_and_size


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int
    batch_size: int
    seq_len: int
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    out_dir: str = "runs/pretrain_moe"
    checkpoint_every: int = 0  # 0: only at the end
    resume: bool = False
    peak_flops: Optional[float] = 989e12  # bf16 dense peak of one H100/H200, for MFU (None: not reported)
    progress: bool = True


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def is_expert_param(name: str) -> bool:
    return ".experts." in name or name.startswith("experts.")


def is_tensor_parallel_param(p: torch.Tensor) -> bool:
    """True for a tensor-parallel shard (set by tilecomm.overlap's Column/RowParallelLinear)."""
    return bool(getattr(p, "tensor_parallel", False))


class Trainer:
    """model(tokens) -> (logits, aux_loss); data.batch(step, dp_rank, B, S) -> tokens [B, S+1]."""

    def __init__(self, model: nn.Module, data, cfg: TrainConfig, *, dp_group=None, edp_group=None, ep_group=None,
                 cp_group=None, tp_group=None, dp_rank: int = 0, ep_rank: int = 0, flops_per_token: float = 0.0,
                 config_record: Optional[dict] = None, log: Callable[[str], None] = print):
        """dp_group: the group dense gradients and the logged loss are averaged over (with context
        parallelism, the dp-cp group); cp_group: this rank then trains on its 1/C chunk of each sequence;
        tp_group: the model's tensor-parallel group (its logits are this rank's token slice, see
        moe/model.py); dp_rank: which data-parallel shard of the data this rank (and its CP and TP
        groups) reads."""
        self.model, self.data, self.cfg = model, data, cfg
        self.dp_group, self.edp_group, self.ep_group, self.tp_group = dp_group, edp_group, ep_group, tp_group
        self.dp_rank, self.ep_rank = dp_rank, ep_rank
        self.cp_rank, self.cp_size = (dist.get_rank(cp_group), dist.get_world_size(cp_group)) if cp_group else (0, 1)
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_group)
        if cfg.seq_len % self.cp_size:
            raise ValueError(f"TrainConfig: seq_len={cfg.seq_len} must divide by the context-parallel size {self.cp_size}")
        if (cfg.batch_size * cfg.seq_len // self.cp_size) % self.tp_size:
            raise ValueError(f"TrainConfig: batch_size x seq_len / cp = {cfg.batch_size} x {cfg.seq_len} / "
                             f"{self.cp_size} tokens per rank must divide by the tensor-parallel size {self.tp_size}")
        if self.tp_size > 1 and getattr(model, "tp_size", 1) != self.tp_size:
            raise ValueError(f"Trainer: tp_group has {self.tp_size} ranks but the model was built with tensor-parallel "
                             f"size {getattr(model, 'tp_size', 1)}; pass the same group to Transformer(tp_group=...)")
        self.dp_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        if self.tp_size > 1:
            shared = set(dist.get_process_group_ranks(tp_group)) & set(
                dist.get_process_group_ranks(dp_group) if dp_group is not None else range(dist.get_world_size()))
            if len(shared) > 1:
                raise ValueError(f"Trainer: dp_group shares ranks {sorted(shared)} with tp_group; with tensor "
                                 "parallelism pass the data-parallel (dp-cp) group, e.g. ProcessGroups.dp_cp")
        self.num_loss_terms = self.dp_size * self.tp_size  # ranks whose mean loss is the objective
        self.flops_per_token, self.log = flops_per_token, log
        self.device = next(model.parameters()).device
        # what a checkpoint must agree on to resume (not where it is, how it reports or that it resumes)
        curve = {k: v for k, v in asdict(cfg).items() if k not in ("out_dir", "resume", "progress", "checkpoint_every")}
        self.config_record = dict(config_record or {}, train=curve)
        if self.tp_size > 1:  # shards differ per TP size (absent for T = 1: older checkpoints stay valid)
            self.config_record["tensor_parallel"] = self.tp_size
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        rest = [p for n, p in model.named_parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0
        self.step = 0
        if cfg.resume:
            self.step = checkpoint.load(self._ckpt_dir(), model, self.opt, self._ckpt_key, self.config_record)

    def _ckpt_dir(self) -> str:
        return os.path.join(self.cfg.out_dir, "checkpoint")

    def _ckpt_key(self, name: str, p: torch.Tensor) -> str:
        """Checkpoint key: experts differ per EP rank, TP shards per TP rank; the rest is replicated."""
        if is_expert_param(name):
            return f"{name}@ep{self.ep_rank}"
        return f"{name}@tp{self.tp_rank}" if is_tensor_parallel_param(p) else name

    def _param_class(self, name: str, p: torch.Tensor) -> str:
        if is_expert_param(name):
            return "expert"
        return "tensor_parallel" if is_tensor_parallel_param(p) else "replicated"

    def _sync_grads(self) -> None:
        if not dist.is_initialized():
            return
        groups = {"expert": [self.edp_group], "tensor_parallel": [self.dp_group],
                  "replicated": [self.dp_group, *self._tp_groups()]}
        for name, p in self.model.named_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            for group in groups[self._param_class(name, p)]:
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(p.grad, group=group)
            p.grad.div_(self.num_loss_terms)

    def _tp_groups(self) -> list:
        return [self.tp_group] if self.tp_size > 1 else []

    def _clip(self) -> float:
        """Clip to cfg.grad_clip by the global norm; returns the norm before clipping."""
        squares = {c: torch.zeros((), device=self.device) for c in ("replicated", "tensor_parallel", "expert")}
        for name, p in self.model.named_parameters():
            squares[self._param_class(name, p)] += p.grad.float().pow(2).sum()
        for cls, group in (("tensor_parallel", self.tp_group), ("expert", self.ep_group)):
            if dist.is_initialized() and group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(squares[cls], group=group)
        norm = float(sum(squares.values()).sqrt())
        if self.cfg.grad_clip and norm > self.cfg.grad_clip:
            for p in self.model.parameters():
                p.grad.mul_(self.cfg.grad_clip / (norm + 1e-6))
        return norm

    def train_step(self) -> dict:
        cfg, start = self.cfg, time.perf_counter()
        tokens = self.data.batch(self.step, self.dp_rank, cfg.batch_size, cfg.seq_len).to(self.device)
        if self.cp_size > 1:  # this rank's positions, plus the next token as the last target
            chunk = cfg.seq_len // self.cp_size
            tokens = tokens[:, self.cp_rank * chunk:(self.cp_rank + 1) * chunk + 1]
        targets = tokens[:, 1:].reshape(-1)
        if self.tp_size > 1:  # the model's logits are this rank's slice of the flattened tokens
            targets = sequence_shard(targets, self.tp_rank, self.tp_size, "targets")
        use_bf16 = self.device.type == "cuda"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16):
            logits, aux = self.model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets)
        (loss + aux).backward()
        self._sync_grads()
        norm = self._clip()
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, cfg)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()  # -> the mean over all W ranks (every token counted once)
        if dist.is_initialized():
            for group in (self.dp_group, *self._tp_groups()):
                dist.all_reduce(mean_loss, group=group)
            mean_loss /= self.num_loss_terms
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tok_s = cfg.batch_size * cfg.seq_len * self.dp_size / self.cp_size / seconds
        mfu = tok_s * self.flops_per_token / (cfg.peak_flops * self.num_loss_terms) if self.flops_per_token and cfg.peak_flops else None
        record = dict(step=self.step, loss=float(mean_loss), aux_loss=float(aux.detach()), grad_norm=norm,
                      lr=lr_at(self.step, cfg), tokens_per_s=tok_s, mfu=mfu, seconds=seconds)
        self.step += 1
        return record

    def train(self, stop_at: Optional[int] = None) -> List[dict]:
        """Train to cfg.steps (or stop early at step `stop_at`, as an interrupted run would), then checkpoint."""
        cfg = self.cfg
        last = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
        os.makedirs(cfg.out_dir, exist_ok=True)
        history: List[dict] = []
        bar = _progress(last - self.step, enabled=self.is_main and cfg.progress)
        log_path = os.path.join(cfg.out_dir, "log.jsonl")
        with open(log_path, "a" if cfg.resume else "w") if self.is_main else open(os.devnull, "w") as log_file:
            while self.step < last:
                rec = self.train_step()
                history.append(rec)
                log_file.write(json.dumps(rec) + "\n")
                log_file.flush()
                bar.update(rec)
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < last:
                    self.save()
        bar.close()
        self.save()
        if self.is_main:
            plot_losses(log_path, os.path.join(cfg.out_dir, "loss.png"), getattr(self.data, "entropy_floor", None))
        return history

    def save(self) -> None:
        checkpoint.save(self._ckpt_dir(), self.step, self.model, self.opt, self._ckpt_key, self.config_record)


class _progress:
    """tqdm bar with loss / tokens per second / MFU (plain lines if tqdm is missing)."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, rec: dict) -> None:
        if not self.enabled:
            return
        mfu = "n/a" if rec["mfu"] is None else f"{100 * rec['mfu']:.2f}%"
        text = f"loss {rec['loss']:.4f} | {rec['tokens_per_s']:.0f} tok/s | MFU {mfu}"
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            self.bar.update(1)
        else:
            print(f"step {rec['step']:5d} | {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot_losses(log_path: str, png_path: str, floor: Optional[float]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no loss plot: matplotlib is not installed (pip install 'tilecomm[examples]'); the log is {log_path}")
        return
    rows = [json.loads(line) for line in open(log_path)]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="training loss")
    if floor is not None:
        ax.axhline(floor, color="gray", linestyle="--", label=f"entropy floor {floor:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
