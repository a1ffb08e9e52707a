"""tilecomm.language on CPU ranks checks its PEs and symmetric addresses: a bad put/get/symm_at/
signal/wait raises OutOfBoundsError naming the primitive and the value, and writes nothing."""
from __future__ import annotations

import re

import pytest
import torch
import triton.language as tl

import tilecomm
import tilecomm.language as tcl
from tilecomm.errors import OutOfBoundsError


@tilecomm.jit
def _put_kernel(dst_ptr, src_ptr, n, pe):
    tcl.put(dst_ptr, src_ptr, n, pe)


@tilecomm.jit
def _get_kernel(dst_ptr, src_ptr, n, pe):
    tcl.get(dst_ptr, src_ptr, n, pe)


@tilecomm.jit
def _symm_at_kernel(out_ptr, ptr, pe):
    tl.store(out_ptr, tl.load(tcl.symm_at(ptr, pe)))


@tilecomm.jit
def _signal_kernel(sig_ptr, pe):
    tcl.signal(sig_ptr, 7, pe, tcl.SIGNAL_SET)


@tilecomm.jit
def _wait_kernel(sig_ptr):
    tcl.wait(sig_ptr, 0, tcl.CMP_GE)


def _raises(pattern, kernel, *args):
    with pytest.raises(OutOfBoundsError) as info:
        kernel[(1,)](*args)
    assert re.search(pattern, str(info.value)), str(info.value)
    assert str(info.value).startswith(f"rank {tilecomm.rank()}: tcl."), str(info.value)


def _draws(seed, rank, world, n):
    """(poison for the heap tensor, the put source) of `rank`."""
    gen = torch.Generator().manual_seed(seed + rank)
    return torch.randn(world, n, generator=gen), torch.randn(n, generator=gen)


def bad_pes_and_addresses(seed, n):
    rank, world = tilecomm.rank(), tilecomm.world_size()
    dst = tilecomm.empty((world, n), torch.float32)
    sig = tilecomm.zeros((world,), torch.int64)
    poison, src = _draws(seed, rank, world, n)
    dst.copy_(poison)
    local = torch.zeros(n)  # not on the heap
    heap_bytes = tilecomm.current().heap.nbytes
    tilecomm.barrier()
    for pe in (-1, world, 5 + world, 100000):
        _raises(rf"put: pe={pe} is out of range; expected 0 <= pe < num_ranks\(\) = {world}", _put_kernel, dst, src, n, pe)
        _raises(rf"get: pe={pe} is out of range", _get_kernel, local, dst, n, pe)
        _raises(rf"symm_at: pe={pe} is out of range", _symm_at_kernel, local, dst, pe)
        _raises(rf"signal: pe={pe} is out of range", _signal_kernel, sig, pe)
    peer = (rank + 1) % world
    _raises(r"put: dst spans .* outside the symmetric heap", _put_kernel, local, src, n, peer)
    _raises(r"put: dst spans .* outside the symmetric heap", _put_kernel, dst, src, heap_bytes, peer)  # runs off its end
    _raises(r"put: nelems=-1; expected >= 0", _put_kernel, dst, src, -1, peer)
    _raises(r"get: src spans .* outside the symmetric heap", _get_kernel, local, torch.ones(n), n, peer)
    _raises(r"symm_at: ptr spans .*\(not on the symmetric heap\)", _symm_at_kernel, local, torch.ones(1), peer)
    _raises(r"signal: sig spans .* outside the symmetric heap", _signal_kernel, torch.zeros(1, dtype=torch.int64), peer)
    _raises(r"wait: sig spans .* outside the symmetric heap", _wait_kernel, torch.zeros(1, dtype=torch.int64))
    tilecomm.barrier()
    # nothing above wrote anywhere: every rank's heap tensors hold what they held
    assert torch.equal(dst, poison) and torch.equal(sig, torch.zeros(world, dtype=torch.int64))
    tilecomm.barrier()  # every rank has looked before any good put lands
    # and the checks let good calls through: a put to the next rank lands there
    _put_kernel[(1,)](dst[rank], src, n, peer)
    tilecomm.barrier()
    prev = (rank - 1) % world
    assert torch.equal(dst[prev], _draws(seed, prev, world, n)[1])
    assert torch.equal(dst[rank], poison[rank])
    tilecomm.free(sig)
    tilecomm.free(dst)


@pytest.mark.parametrize("world", [2, 3])
def test_out_of_range_pe_and_non_heap_addresses_raise(ranks, world):
    ranks(world).run(bad_pes_and_addresses, 11 * world, 3 + 2 * world)
