"""Collectives built only from `tilecomm.language` kernels, mirroring torch.distributed's signatures.

    all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False)
    all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False)
    reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False)

Same arguments, same results, same in-place output as torch.distributed. Autograd: when the
input requires grad, `output` records the op (backward is the adjoint collective). The
`tilecomm.collectives.functional` forms return new tensors instead.

Streams: on GPUs every kernel runs on the current stream, in order; `async_op=True` returns a
`Work` whose `wait()` makes the current stream wait for the call's last kernel (the call itself
is already asynchronous to the host). A call returns once its kernels are queued; its staging
space is reusable by the next call at once (each call ends by waiting for every peer's reads).
Only the world group is supported (`group` None or a group holding every rank, in order).

torch.compile: the calls trace (fullgraph=True too) as one custom op each (`torch.ops.tilecomm.*`,
ops.py), with fake implementations and autograd; split sizes are specialised on.
"""
from . import ops  # noqa: F401  (registers torch.ops.tilecomm.*: torch.compile calls the collectives through them)
from .api import Work, all_gather_into_tensor, all_to_all_single, reduce_scatter_tensor

__all__ = ["Work", "all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor"]
