"""tilecomm.language primitives inside @tilecomm.jit kernels, on 2, 3 and 4 CPU ranks."""
from __future__ import annotations

import pytest
import torch
import triton.language as tl

import tilecomm
import tilecomm.language as tcl
from _reference import dev, gather_all
from tilecomm.language.abi import take_ticket


@tilecomm.jit
def _rank_kernel(out_ptr):
    tl.store(out_ptr, tcl.rank())
    tl.store(out_ptr + 1, tcl.num_ranks())


def rank_and_world():
    out = torch.full((2,), -1, dtype=torch.int32, device=dev())
    _rank_kernel[(1,)](out)
    assert out.tolist() == [tilecomm.rank(), tilecomm.world_size()]


@tilecomm.jit
def _put_ring_kernel(dst_ptr, src_ptr, sig_ptr, n, epoch):
    """Program p puts n elements to rank (me + 1 + p) % W, slot me, then signals it."""
    me = tcl.rank()
    world = tcl.num_ranks()
    pe = (me + 1 + tl.program_id(0)) % world
    tcl.put(dst_ptr + me * n, src_ptr, n, pe)
    tcl.signal(sig_ptr + me, epoch, pe, tcl.SIGNAL_SET)


@tilecomm.jit
def _wait_all_kernel(sig_ptr, epoch, world):
    for pe in range(0, world):
        tcl.wait(sig_ptr + pe, epoch, tcl.CMP_GE)


def put_signal_wait(seed, dtype, n):
    rank, world = tilecomm.rank(), tilecomm.world_size()
    dst = tilecomm.empty((world, n), dtype)
    sig = tilecomm.zeros((world,), torch.int64)
    dst.fill_(-3)
    src = torch.randn(n, generator=torch.Generator().manual_seed(seed + rank)).to(dev()).to(dtype)
    tilecomm.barrier()
    for epoch in (1, 2):  # twice: epochs, not resets, separate the rounds
        _put_ring_kernel[(world,)](dst, src, sig, n, epoch)
        _wait_all_kernel[(1,)](sig, epoch, world)
        tilecomm.barrier()
    expect = torch.stack(gather_all(src))
    assert torch.equal(dst.cpu(), expect)
    tilecomm.free(sig)
    tilecomm.free(dst)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rank_and_num_ranks(ranks, world):
    ranks(world).run(rank_and_world)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype,n", [(torch.float32, 1), (torch.float32, 20001), (torch.bfloat16, 777), (torch.float64, 5)])
def test_put_signal_wait(ranks, world, dtype, n):
    ranks(world).run(put_signal_wait, 4, dtype, n)


@tilecomm.jit
def _get_kernel(dst_ptr, src_ptr, n):
    me = tcl.rank()
    world = tcl.num_ranks()
    pe = (me + world - 1) % world
    tcl.get(dst_ptr, src_ptr, n, pe)


def get_from_left(n):
    rank, world = tilecomm.rank(), tilecomm.world_size()
    src = tilecomm.empty((n,), torch.float32)
    src.copy_(torch.randn(n, device=dev()))
    tilecomm.barrier()
    out = torch.full((n,), -1.0, device=dev())
    _get_kernel[(1,)](out, src, n)
    assert torch.equal(out.cpu(), gather_all(src)[(rank - 1) % world])
    tilecomm.barrier()
    tilecomm.free(src)


@pytest.mark.parametrize("world", [2, 3])
def test_get(ranks, world):
    ranks(world).run(get_from_left, 4099)


@tilecomm.jit
def _symm_store_kernel(buf_ptr, BLOCK: tl.constexpr):
    """Store straight into every peer's copy through symm_at (the NVLink-style path)."""
    me = tcl.rank()
    world = tcl.num_ranks()
    offs = tl.arange(0, BLOCK)
    for pe in range(0, world):
        remote = tcl.symm_at(buf_ptr, pe)
        tl.store(remote + me * BLOCK + offs, (offs + 1000 * me).to(tl.float32))
    tcl.barrier_all()


def symm_at_stores():
    rank, world = tilecomm.rank(), tilecomm.world_size()
    buf = tilecomm.zeros((world, 16), torch.float32)
    _symm_store_kernel[(1,)](buf, BLOCK=16)
    expect = torch.stack([torch.arange(16, dtype=torch.float32, device=dev()) + 1000 * p for p in range(world)])
    assert torch.equal(buf, expect)
    assert torch.equal(tilecomm.peer(buf, (rank + 1) % world), expect)
    tilecomm.free(buf)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_symm_at_and_barrier_all(ranks, world):
    ranks(world).run(symm_at_stores)


@tilecomm.jit
def _add_kernel(sig_ptr, root):
    tcl.signal(sig_ptr, tcl.rank() + 1, root, tcl.SIGNAL_ADD)


@tilecomm.jit
def _wait_cmp_kernel(sig_ptr, value, out_ptr, CMP: tl.constexpr):
    tok = tcl.wait(sig_ptr, value, CMP)
    tl.store(tcl.consume_token(out_ptr, tok), tok)


def signal_add_and_compares():
    rank, world = tilecomm.rank(), tilecomm.world_size()
    sig = tilecomm.zeros((1,), torch.int64)
    _add_kernel[(1,)](sig, 0)
    tilecomm.barrier()
    total = world * (world + 1) // 2
    if rank == 0:
        out = torch.zeros(1, dtype=torch.int64, device=dev())
        for cmp, value in ((tcl.CMP_EQ, total), (tcl.CMP_NE, total + 1), (tcl.CMP_GT, total - 1),
                           (tcl.CMP_GE, total), (tcl.CMP_LT, total + 1), (tcl.CMP_LE, total)):
            out.zero_()
            _wait_cmp_kernel[(1,)](sig, value, out, CMP=cmp)
            assert out.item() == total
    tilecomm.barrier()
    tilecomm.free(sig)


@pytest.mark.parametrize("world", [2, 4])
def test_signal_add_and_every_compare(ranks, world):
    ranks(world).run(signal_add_and_compares)


def _timeout_of(launch, what: str):
    """The WaitTimeoutError a launch's wait raises (GPUs: recorded, raised at the check after it)."""
    from tilecomm.errors import WaitTimeoutError

    try:
        launch()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        tilecomm.check_errors()
    except WaitTimeoutError as err:
        return err
    raise AssertionError(f"{what} returned")


@tilecomm.jit
def _wait_block_kernel(sig_ptr, value, out_ptr, n, N: tl.constexpr):
    lanes = tl.arange(0, N)
    words = tcl.wait(sig_ptr + tl.minimum(lanes, n - 1), value, tcl.CMP_GE)  # words 0 .. n - 1, each
    tl.store(out_ptr + lanes, words, mask=lanes < n)


def wait_on_blocks():
    """tcl.wait on a block of words returns once every word holds, with the words; past the timeout it names
    the first word that does not hold."""
    rank, world = tilecomm.rank(), tilecomm.world_size()
    sig = tilecomm.zeros((8,), torch.int64)
    _add_kernel[(1,)](sig[rank:], 0)  # rank r adds r + 1 to word r of rank 0
    tilecomm.barrier()
    if rank == 0:
        out = torch.full((world,), -7, dtype=torch.int64, device=dev())
        _wait_block_kernel[(1,)](sig, 1, out, world, N=4)
        assert out.tolist() == [r + 1 for r in range(world)]
        old = tilecomm.current().timeout_s
        tilecomm.set_timeout(0.5)
        try:  # words 0 .. world - 1 hold, word `world` is never written
            err = _timeout_of(lambda: _wait_block_kernel[(1,)](
                sig, 1, torch.zeros(8, dtype=torch.int64, device=dev()), world + 1, N=8),
                "a wait on a block with an unwritten word")
            assert err.signal_addr == sig[world:].data_ptr(), (err.signal_addr, sig.data_ptr())
        finally:
            tilecomm.set_timeout(old)
    tilecomm.barrier()
    tilecomm.free(sig)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_wait_on_a_block_of_words(ranks, world):
    ranks(world).run(wait_on_blocks)


def wait_times_out():
    """A wait nobody signals must raise WaitTimeoutError naming this rank and the word, in time."""
    import time

    ctx = tilecomm.current()
    sig = tilecomm.zeros((2,), torch.int64)
    old = ctx.timeout_s
    for bad in (0, -1.0, "1"):
        try:
            tilecomm.set_timeout(bad)
        except ValueError as err:
            assert "seconds=" in str(err)
        else:
            raise AssertionError(f"set_timeout({bad!r}) was accepted")
    tilecomm.set_timeout(0.5)
    start = time.monotonic()
    try:
        err = _timeout_of(lambda: _wait_cmp_kernel[(1,)](
            sig[1:], 1, torch.zeros(1, dtype=torch.int64, device=dev()), CMP=tcl.CMP_EQ), "wait without a signal")
        elapsed = time.monotonic() - start
        assert err.rank == ctx.rank and err.signal_addr == sig[1:].data_ptr()
        assert f"rank {ctx.rank}" in str(err) and "heap offset" in str(err)
        assert elapsed < 5, elapsed
    finally:
        tilecomm.set_timeout(old)
    tilecomm.barrier()
    tilecomm.free(sig)


def test_wait_without_signal_times_out(ranks):
    ranks(2).run(wait_times_out)


@tilecomm.jit
def _read_then_discard_kernel(buf_ptr, out_ptr, start, n, BLOCK: tl.constexpr):
    """out = buf[start : start + n], then that range dropped (tcl.discard)."""
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(buf_ptr + start + offs, mask=mask), mask=mask)
    tcl.discard(buf_ptr + start, n)


def read_then_discard(programs):
    """tcl.discard after the program's reads of the range: they got the data (GPU: its barrier comes before any
    line is dropped), nothing outside the range changed (an unaligned range: the GPU drops only the whole lines
    inside it), and on CPU ranks the range holds the poison value."""
    from tilecomm.language._cpu import DISCARD_POISON

    n, size = 5000, 8192
    buf = tilecomm.empty((programs, size), torch.float32)
    buf.copy_(torch.randn(programs, size, device=dev()))
    before = buf.clone()
    out = torch.full((programs, n), -1.0, device=dev())
    for p in range(programs):  # each program its own row, from an odd element on
        _read_then_discard_kernel[(1,)](buf[p], out[p], 37 + p, n, BLOCK=1024)
    for p in range(programs):
        start = 37 + p
        assert torch.equal(out[p], before[p, start:start + n]), p
        outside = torch.ones(size, dtype=torch.bool, device=dev())
        outside[start:start + n] = False
        assert torch.equal(buf[p][outside], before[p][outside]), p
        if dev().type == "cpu":
            assert bool((buf[p, start:start + n] == DISCARD_POISON).all()), p
    tilecomm.free(buf)


@pytest.mark.parametrize("world", [2, 3])
def test_discard_keeps_what_was_read_and_what_lies_outside(ranks, world):
    ranks(world).run(read_then_discard, 3)


@tilecomm.jit
def _clock_around_wait_kernel(sig_ptr, out_ptr):
    tl.store(out_ptr, tcl.clock())
    tcl.wait(sig_ptr, 2, tcl.CMP_GE)  # rank 1's SIGNAL_ADD of 2
    tl.store(out_ptr + 1, tcl.clock())


def clock_measures_a_wait(pause_s):
    """tcl.clock around a wait that lasts as long as rank 1 sleeps before it signals: the two readings are
    nanoseconds apart by at least most of that pause, and no more than the time the host saw pass."""
    import time

    sig, ready = tilecomm.zeros((1,), torch.int64), tilecomm.zeros((1,), torch.int64)
    out = torch.zeros(2, dtype=torch.int64, device=dev())
    if tilecomm.rank() == 0:  # built (GPU: compiled) before the timed launch, on a word that already holds
        ready.fill_(2)
        _clock_around_wait_kernel[(1,)](ready, out)
        out.tolist()
    tilecomm.barrier()
    if tilecomm.rank() == 0:
        started = time.monotonic_ns()
        _clock_around_wait_kernel[(1,)](sig, out)
        t0, t1 = out.tolist()  # (waits for the kernel)
        ended = time.monotonic_ns()
        assert t0 > 0 and 0.5 * pause_s * 1e9 <= t1 - t0 <= ended - started, (t0, t1, started, ended)
    elif tilecomm.rank() == 1:
        time.sleep(pause_s)
        _add_kernel[(1,)](sig, 0)
    tilecomm.barrier()
    tilecomm.free(ready)
    tilecomm.free(sig)


def test_clock_measures_a_wait(ranks):
    ranks(2).run(clock_measures_a_wait, 0.2)


def test_kernel_runs_on_cpu_without_runtime():
    """A plain @tilecomm.jit kernel (no primitives) runs on CPU tensors with no init, no TRITON_INTERPRET."""

    x = torch.randn(100)
    y = torch.empty(100)
    _copy_kernel[(2,)](x, y, 100, BLOCK=64)
    assert torch.equal(x, y)


def test_take_ticket_numbers_each_launch_from_zero():
    """abi.take_ticket: every launch's programs get 0 .. n - 1, each once, and the counter is 0 again after it
    (the collectives and low-latency dispatch take their program index from it). On a GPU (when there is one)
    with a grid far larger than the GPU holds at once, so programs start out of block order."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = 8192 if device == "cuda" else 7
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    for _ in range(3):
        got = torch.full((n,), -1, dtype=torch.int64, device=device)
        _ticket_kernel[(n,)](counter, got)
        assert sorted(got.tolist()) == list(range(n)) and counter.item() == 0


@tilecomm.jit
def _ticket_kernel(counter_ptr, out_ptr):
    tl.store(out_ptr + tl.program_id(0), take_ticket(counter_ptr, tl.num_programs(0)))


@tilecomm.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@tilecomm.jit
def _stdlib_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Triton's own jit helpers (tl.zeros, tl.sum, tl.cdiv) must work on CPU ranks too."""
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(0, tl.cdiv(n, BLOCK)):
        offs = i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr, tl.sum(acc, axis=0))


def test_triton_stdlib_helpers_run_interpreted():
    x = torch.randn(1000, dtype=torch.float32)
    out = torch.zeros(1)
    _stdlib_kernel[(1,)](x, out, 1000, BLOCK=128)
    torch.testing.assert_close(out[0].double(), x.double().sum(), rtol=1e-5, atol=1e-5)
