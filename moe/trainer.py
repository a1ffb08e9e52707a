"""Training loop: AdamW (fused, fp32 masters of bf16 parameters on GPUs) with warm-up + cosine,
gradient clipping, gradient reduction in buckets by parameter role, DCP checkpoints, a progress bar,
a JSONL log, a loss-curve PNG, an optional torch.profiler window and torch.compile of the blocks.

The Trainer takes the model (a Transformer after `parallelize`), the data and the ProcessGroups of
this rank (moe/parallel.py; None for one process). The objective is the mean of the W ranks' losses,
W = dp(-cp) size x tp size (every rank holds as many tokens; each rank's loss is the mean over its
tokens); moe/grads.py says over which groups each parameter role's gradients are summed, and how the
global norm counts every distinct value once.

One step on a GPU, with no host sync until its end: forward in the parameters' dtype (the fused LM
head + cross-entropy gives the loss without materialising logits), backward, bucketed all-reduces
(skipped for groups of one rank), the norm and the gradient scale (1/W times the clip factor) as
device scalars, one AdamW kernel per parameter reading bf16 gradients and writing fp32 masters,
moments and the bf16 weights.
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
from torch import nn

from . import checkpoint
from .grads import GradReducer, clip_scale
from .model import compile_blocks
from .optim import AdamW, cast_parameters
from .parallelize import EXPERT, REPLICATED, TENSOR_PARALLEL, roles_of
from .profiling import StepProfiler
from .tensor_parallel import sequence_shard

PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def param_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype a Trainer gives the model's parameters (TrainConfig.precision; "auto": bf16 on GPUs, else fp32):
    the dtype to build the MoE layers' dispatchers for (MoEConfig.dtype)."""
    if precision == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return PRECISIONS[precision]


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
    precision: str = "auto"  # parameters' dtype: "bf16" (fp32 masters in the optimizer), "fp32"; auto: bf16 on GPUs
    compile: bool = False  # torch.compile each transformer block (model.compile_blocks)
    profile: bool = False  # torch.profiler over steps 5-7 of the run: trace.json.gz in out_dir, top kernels printed
    save: bool = True  # write checkpoints (False: benchmark runs)
    bucket_mb: int = 64  # gradient all-reduce bucket size
    summary_from: int = 10  # the closing summary averages tokens/s and MFU from this step of the run on

    def __post_init__(self):
        for name, low in (("steps", 1), ("batch_size", 1), ("seq_len", 1), ("warmup_steps", 0), ("checkpoint_every", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"TrainConfig: {name}={value!r}; expected an int >= {low}")
        if self.precision not in ("auto", *PRECISIONS):
            raise ValueError(f"TrainConfig: precision={self.precision!r}; expected 'auto', 'bf16' or 'fp32'")


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


# TrainConfig fields that do not change the loss curve (a checkpoint need not agree on them)
_NOT_RECORDED = ("out_dir", "resume", "progress", "checkpoint_every", "compile", "profile", "save", "bucket_mb",
                 "summary_from")


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class Trainer:
    """model(tokens, targets) -> (mean loss, aux_loss); data.batch(step, dp_rank, B, S) -> tokens [B, S+1].
    groups: this rank's ProcessGroups (ParallelLayout.create_groups), or None for one process."""

    def __init__(self, model: nn.Module, data, cfg: TrainConfig, *, groups=None, flops_per_token: float = 0.0,
                 config_record: Optional[dict] = None, log: Callable[[str], None] = print):
        self.model, self.data, self.cfg = model, data, cfg
        g = groups
        self.dp_group = g.dp_cp if g else None  # dense gradients and the logged loss: averaged over dp x cp
        self.edp_group, self.ep_group = (g.edp, g.ep) if g else (None, None)
        self.cp_group = g.cp if g and _size(g.cp) > 1 else None
        self.tp_group = g.tp if g and _size(g.tp) > 1 else None
        self.dp_rank = g.ranks["dp"].index(g.rank) if g else 0  # ranks of one CP x TP group read the same data
        self.ep_rank = g.ranks["ep"].index(g.rank) if g else 0
        self.cp_rank, self.cp_size = (dist.get_rank(self.cp_group), _size(self.cp_group)) if self.cp_group else (0, 1)
        self.tp_rank, self.tp_size = (dist.get_rank(self.tp_group), _size(self.tp_group)) if self.tp_group else (0, 1)
        self._check(model, cfg)
        self.dp_size = _size(self.dp_group) if dist.is_initialized() else 1
        self.num_loss_terms = self.dp_size * self.tp_size  # ranks whose mean loss is the objective
        self.flops_per_token, self.log = flops_per_token, log
        self.device = next(model.parameters()).device
        # what a checkpoint must agree on to resume (not where it is, how it reports or that it resumes)
        curve = {k: v for k, v in asdict(cfg).items() if k not in _NOT_RECORDED}
        self.config_record = dict(config_record or {}, train=curve)
        if self.tp_size > 1:  # shards differ per TP size (absent for T = 1: older checkpoints stay valid)
            self.config_record["tensor_parallel"] = self.tp_size
        self.roles = roles_of(model)
        self.named_params = list(model.named_parameters())
        self.norm_groups = {TENSOR_PARALLEL: self.tp_group, EXPERT: self.ep_group}
        self.param_dtype = self._param_dtype()
        masters = cast_parameters(model, self.param_dtype)
        tp = [self.tp_group] if self.tp_group else []
        # buckets by the cast parameters' dtypes (one bucket flattens to one dtype; bf16 and fp32 parameters
        # must not share one, or the bf16 ones would be handed back fp32 gradients)
        self.reducer = GradReducer(self.named_params, self.roles, {
            EXPERT: [self.edp_group], TENSOR_PARALLEL: [self.dp_group], REPLICATED: [self.dp_group, *tp]},
            bucket_bytes=cfg.bucket_mb << 20)
        decay = [p for n, p in self.named_params if p.dim() >= 2]
        rest = [p for n, p in self.named_params if p.dim() < 2]
        self.opt = AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                         lr=cfg.lr, betas=(0.9, 0.95), masters=masters)
        if cfg.compile:
            compile_blocks(model)
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0
        self.step = 0
        if cfg.resume:
            self.step = checkpoint.load(self._ckpt_dir(), model, self.opt, self._ckpt_key, self.config_record)

    def _check(self, model: nn.Module, cfg: TrainConfig) -> None:
        if cfg.seq_len % self.cp_size:
            raise ValueError(f"TrainConfig: seq_len={cfg.seq_len} must divide by the context-parallel size {self.cp_size}")
        if (cfg.batch_size * cfg.seq_len // self.cp_size) % self.tp_size:
            raise ValueError(f"TrainConfig: batch_size x seq_len / cp = {cfg.batch_size} x {cfg.seq_len} / "
                             f"{self.cp_size} tokens per rank must divide by the tensor-parallel size {self.tp_size}")
        if getattr(model, "tp_size", 1) != self.tp_size:
            raise ValueError(f"Trainer: the groups' tensor-parallel size is {self.tp_size} but the model was built with "
                             f"tensor-parallel size {getattr(model, 'tp_size', 1)}; parallelize(model, tp_group=groups.tp)")
        if (getattr(model, "cp_group", None) is not None) != (self.cp_size > 1):
            raise ValueError(f"Trainer: the groups' context-parallel size is {self.cp_size} but the model was "
                             "parallelized differently; parallelize(model, cp_group=groups.cp)")

    def _param_dtype(self) -> torch.dtype:
        return param_dtype(self.cfg.precision, self.device)

    def _ckpt_dir(self) -> str:
        return os.path.join(self.cfg.out_dir, "checkpoint")

    def _ckpt_key(self, name: str, p: torch.Tensor) -> str:
        """Checkpoint key: experts differ per EP rank, TP shards per TP rank; the rest is replicated."""
        role = self.roles[name]
        if role == EXPERT:
            return f"{name}@ep{self.ep_rank}"
        return f"{name}@tp{self.tp_rank}" if role == TENSOR_PARALLEL else name

    def _batch(self):
        """(inputs [B, S/C], targets [B*S/C] or this rank's [B*S/C/T] under TP) of this step."""
        cfg = self.cfg
        tokens = self.data.batch(self.step, self.dp_rank, cfg.batch_size, cfg.seq_len).to(self.device)
        if self.cp_size > 1:  # this rank's positions, plus the next token as the last target
            chunk = cfg.seq_len // self.cp_size
            tokens = tokens[:, self.cp_rank * chunk:(self.cp_rank + 1) * chunk + 1]
        targets = tokens[:, 1:].reshape(-1)
        if self.tp_size > 1:  # the model's loss covers this rank's slice of the flattened tokens
            targets = sequence_shard(targets, self.tp_rank, self.tp_size, "targets")
        return tokens[:, :-1], targets

    def train_step(self) -> dict:
        cfg, start = self.cfg, time.perf_counter()
        inputs, targets = self._batch()
        loss, aux = self.model(inputs, targets)
        (loss + aux).backward()
        self.reducer.reduce()
        norm, scale = clip_scale(self.named_params, self.roles, self.norm_groups, self.num_loss_terms, cfg.grad_clip,
                                 self.device)
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, cfg)
        self.opt.step(grad_scale=scale)
        self.opt.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()  # -> the mean over all W ranks (every token counted once)
        if dist.is_initialized():
            for group in (self.dp_group, self.tp_group):
                if group is not None and _size(group) > 1:
                    dist.all_reduce(mean_loss, group=group)
            mean_loss /= self.num_loss_terms
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tok_s = cfg.batch_size * cfg.seq_len * self.dp_size / self.cp_size / seconds
        mfu = tok_s * self.flops_per_token / (cfg.peak_flops * self.num_loss_terms) if self.flops_per_token and cfg.peak_flops else None
        record = dict(step=self.step, loss=float(mean_loss), aux_loss=float(aux.detach()), grad_norm=float(norm),
                      lr=lr_at(self.step, cfg), tokens_per_s=tok_s, mfu=mfu, seconds=seconds)
        if self.device.type == "cuda":
            record["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2 ** 30
        self.step += 1
        return record

    def summary(self, history: List[dict]) -> str:
        """Tokens/s and MFU averaged over the run's steps from cfg.summary_from on (all if fewer), peak memory."""
        if not history:
            return "no steps trained"
        window = history[self.cfg.summary_from:] or history
        seconds = sum(r["seconds"] for r in window)
        tok_s = len(window) * self.cfg.batch_size * self.cfg.seq_len * self.dp_size / self.cp_size / seconds
        text = f"steps {window[0]['step']}-{window[-1]['step']}: {tok_s:.0f} tokens/s, {1e3 * seconds / len(window):.1f} ms/step"
        if window[0]["mfu"] is not None:
            mfu = tok_s * self.flops_per_token / (self.cfg.peak_flops * self.num_loss_terms)
            text += f", MFU {100 * mfu:.1f}% ({mfu * self.cfg.peak_flops / 1e12:.0f} TFLOP/s of {self.cfg.peak_flops / 1e12:.0f})"
        if "peak_mem_gib" in history[-1]:
            text += f", peak GPU memory {history[-1]['peak_mem_gib']:.1f} GiB"
        return text

    def train(self, stop_at: Optional[int] = None) -> List[dict]:
        """Train to cfg.steps (or stop early at step `stop_at`, as an interrupted run would), then checkpoint."""
        cfg = self.cfg
        last = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
        os.makedirs(cfg.out_dir, exist_ok=True)
        history: List[dict] = []
        bar = _progress(last - self.step, enabled=self.is_main and cfg.progress)
        log_path = os.path.join(cfg.out_dir, "log.jsonl")
        if cfg.resume and self.is_main:  # a killed run logged steps past its checkpoint: they are redone
            checkpoint.truncate_log(log_path, self.step)
        prof = StepProfiler(cfg.out_dir) if cfg.profile and self.is_main else None
        with open(log_path, "a" if cfg.resume else "w") if self.is_main else open(os.devnull, "w") as log_file:
            while self.step < last:
                rec = self.train_step()
                if prof is not None:
                    prof.step()
                history.append(rec)
                log_file.write(json.dumps(rec) + "\n")
                log_file.flush()
                bar.update(rec)
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < last:
                    self.save()
        bar.close()
        if prof is not None:
            self.log(prof.close())
        if self.is_main:
            self.log(self.summary(history))
        self.save()
        if self.is_main:
            plot_losses(log_path, os.path.join(cfg.out_dir, "loss.png"), getattr(self.data, "entropy_floor", None))
        return history

    def save(self) -> None:
        if not self.cfg.save:
            return
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
