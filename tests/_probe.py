"""What the probes share: running one body per config variant (ll_probe.py, dispatch_probe.py), routed tokens,
a collective's bf16 input and output (collective_sweep.py, comm_profile.py), and a torchrun rank's start with NCCL
beside tilecomm (collective_sweep.py, rs_trace.py)."""
import os

import torch
import torch.distributed as dist

import tilecomm


def sweep_configs(config_cls, variants, hidden, body, world=1):
    """For each variant (a dict of fields over config_cls.for_device(cuda, hidden, world)), make
    config_cls.for_device return that config while body(variant) runs, and print what body returns; a variant
    that raises prints its error and the sweep goes on. body returns False to stop the sweep, "" or None to
    print nothing."""
    default = config_cls.for_device
    try:
        for over in variants:
            try:
                cfg = config_cls(**{**default(torch.device("cuda"), hidden, world).__dict__, **over})
                config_cls.for_device = staticmethod(lambda device, hidden, world=1, cfg=cfg: cfg)
                line = body(over)
            except Exception as err:  # keep sweeping
                line = f"{str(over):55s} failed: {type(err).__name__}: {str(err)[:200]}"
            finally:
                config_cls.for_device = default
            if line is False:
                return
            if line:  # (ranks other than 0 of a multi-rank probe return "" or None)
                print(line, flush=True)
    finally:
        config_cls.for_device = default


def routed_tokens(tokens, hidden, experts, topk, seed=0):
    """(x [T, H] bf16, topk_idx [T, K], topk_weights [T, K] float32) on the GPU, random top-k routing."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    idx = torch.rand(tokens, experts, device="cuda", generator=gen).topk(topk, dim=1).indices
    w = torch.softmax(torch.randn(tokens, topk, device="cuda", generator=gen), dim=1)
    return x, idx, w


def collective_tensors(op, shape, world, heap_input=False, heap_output=False):
    """(input, output) bf16 on the GPU for `op` ("all_to_all", "all_gather", "reduce_scatter") of the gathered
    `shape` over `world` ranks, random input; either on the symmetric heap (tilecomm.empty) where asked."""
    rows, cols = shape
    part = (rows // world, cols)
    in_shape, out_shape = {"all_to_all": (shape, shape), "all_gather": (part, shape),
                           "reduce_scatter": (shape, part)}[op]
    x = torch.randn(in_shape, device="cuda").to(torch.bfloat16)
    if heap_input:
        x = tilecomm.empty(in_shape, torch.bfloat16).copy_(x)
    out = tilecomm.empty(out_shape, torch.bfloat16) if heap_output else \
        torch.empty(out_shape, dtype=torch.bfloat16, device="cuda")
    return x, out


def start_rank(heap_bytes: int):
    """Under torchrun: this rank's GPU, NCCL's process group (the baseline) and tilecomm's runtime with a heap of
    heap_bytes; (context, world size, rank, local GPU index)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    tilecomm.init(heap_bytes=heap_bytes)
    return tilecomm.current(), dist.get_world_size(), dist.get_rank(), local
