"""A few staged collectives at world 1 for ncu to profile (`bash tests/run_gpu.sh collncu`; a diagnostic, not a test):

    python tests/staged_once.py [--op all_gather|reduce_scatter|copy] [--calls 4] [--config 2/32/32/2/1/1]

Ordinary (non-heap) tensors, 8192 x 8192 bf16, so every byte goes through the ring: at world 1 such a call costs two
copies' time (BENCHMARKS.md), and the profile tells whether the time goes to HBM traffic (the ring written back) or to
the per-chunk handshake. --config: a CollectiveState made with those knobs instead of the default (the format of
tests/collective_sweep.py's --configs, e.g. 2/32/32/2/1/1: a 16.5 MiB ring with its L2 hints). --op copy: the same bytes
copied by torch's elementwise kernel (`torch.mul(x, 1, out=out)`: a device `copy_` is a memcpy, which ncu does not
profile), the floor the staged calls are measured against: its L2 and DRAM rates beside theirs (its copies are the 3rd
elementwise kernel on, after randn's and the bf16 conversion's).
"""
import argparse

import torch

import tilecomm

from collective_sweep import state_for


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", default="all_gather", choices=("all_gather", "reduce_scatter", "copy"))
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--config", default="")
    parser.add_argument("--size", type=int, default=8192, help="rows and columns (a CPU smoke run: 64)")
    args = parser.parse_args()
    ctx = tilecomm.init()
    on_gpu = ctx.device.type == "cuda"
    if args.config:
        sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count if on_gpu else 1
        ctx.collectives = state_for(ctx, args.config, sms)
    x = torch.randn(args.size, args.size, device=ctx.device).to(torch.bfloat16)
    out = torch.empty_like(x)
    op = {"all_gather": tilecomm.all_gather_into_tensor, "reduce_scatter": tilecomm.reduce_scatter_tensor,
          "copy": lambda out, x: torch.mul(x, 1, out=out)}[args.op]
    for _ in range(args.calls):
        op(out, x)
    if on_gpu:
        torch.cuda.synchronize()
    torch.testing.assert_close(out, x)
    tilecomm.finalize()


if __name__ == "__main__":
    main()
