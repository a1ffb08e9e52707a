"""Profile a few training steps: a torch.profiler trace on disk and the top kernels and ops printed.

    prof = StepProfiler(out_dir, wait=4, active=3)   # steps 5, 6, 7 of the run (after 1 warm-up step)
    for ...: train_step(); prof.step()
    print(prof.close())                              # the tables; trace in out_dir/trace.json.gz

Tables (per profiled step, so they read against the step time): GPU kernels by device time, and
operators by the device time of the kernels they launch themselves ("self"), with their share of all
kernel time. Open the trace in https://ui.perfetto.dev or chrome://tracing.
"""
from __future__ import annotations

import gzip
import os
import shutil
from typing import List, Optional

import torch
from torch.autograd import DeviceType


def _device_time(e) -> float:
    """Self device time in µs (the attribute's name changed across torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(e, name, None)
        if value is not None:
            return float(value)
    return 0.0


def _is_annotation(e) -> bool:
    """A profiler/record_function range shown on the GPU timeline (ProfilerStep#, Optimizer.step#...), not a kernel."""
    return bool(getattr(e, "is_user_annotation", False)) or e.key.startswith("ProfilerStep") or "#" in e.key


def top_tables(events, steps: int, rows: int = 20) -> str:
    """The two tables of the module docstring from `prof.key_averages()`. Per-step figures divide by the
    steps the GPU timeline holds (its ProfilerStep ranges; `steps` where there are none)."""
    on_gpu = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA and _device_time(e) > 0]
    gpu_steps = sum(e.count for e in on_gpu if e.key.startswith("ProfilerStep"))
    steps = gpu_steps or steps
    kernels = [e for e in on_gpu if not _is_annotation(e)]
    ops = [e for e in events if getattr(e, "device_type", None) != DeviceType.CUDA and _device_time(e) > 0]
    if not kernels:  # a CPU run: operators by their own CPU time
        cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
        return "\n".join([f"no GPU kernels; top operators by self CPU time ({steps} step(s)):  ms/step  calls/step  name"] + [
            f"  {e.self_cpu_time_total / steps / 1e3:9.2f}  {e.count / steps:9.1f}  {e.key[:110]}" for e in cpu])
    total = sum(_device_time(e) for e in kernels) or 1.0
    lines: List[str] = [f"GPU kernel time per step: {total / steps / 1e3:.1f} ms ({steps} profiled step(s) on the GPU timeline)"]
    for title, group in (("kernels", kernels), ("operators (self: kernels they launch)", ops)):
        lines.append(f"top {title}:  ms/step   share  calls/step  name")
        for e in sorted(group, key=_device_time, reverse=True)[:rows]:
            t = _device_time(e)
            lines.append(f"  {t / steps / 1e3:9.2f}  {100 * t / total:5.1f}%  {e.count / steps:9.1f}  {e.key[:110]}")
    return "\n".join(lines)


class StepProfiler:
    """torch.profiler over `active` steps after `wait` + 1 warm-up steps; see the module docstring."""

    def __init__(self, out_dir: str, wait: int = 4, active: int = 3):
        if wait < 0 or active < 1:
            raise ValueError(f"StepProfiler: wait={wait} must be >= 0 and active={active} >= 1")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.out_dir, self.active = out_dir, active
        self.summary: Optional[str] = None
        self.trace_path = os.path.join(out_dir, "trace.json.gz")
        self.prof = torch.profiler.profile(activities=activities, on_trace_ready=self._ready,
                                           schedule=torch.profiler.schedule(wait=wait, warmup=1, active=active, repeat=1))
        self.prof.__enter__()

    def _ready(self, prof) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        plain = os.path.join(self.out_dir, "trace.json")
        prof.export_chrome_trace(plain)
        with open(plain, "rb") as src, gzip.open(self.trace_path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(plain)
        self.summary = top_tables(prof.key_averages(), self.active)

    def step(self) -> None:
        self.prof.step()

    def close(self) -> str:
        """Stop profiling; the tables (or why there are none)."""
        self.prof.__exit__(None, None, None)
        if self.summary is None:
            return "profile: the run ended before the profiled steps (use more --steps)"
        return f"{self.summary}\ntrace: {self.trace_path}"
