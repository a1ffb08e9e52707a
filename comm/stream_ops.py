"""Stream memory operations: a word written in stream order by the GPU's front end, with no kernel.

A signal that follows a copy-engine transfer (`tensor.copy_` into a peer's heap view) must not need an SM:
while a persistent kernel holds every SM and spins on that signal, a signal *kernel* queued behind the copy
could never start. `write_word` enqueues CUDA's stream write (cuStreamWriteValue64, from cuda-python's
`cuda.bindings.driver`), which the front end performs once the stream's earlier work (the copy) is done,
after a memory barrier (CU_STREAM_WRITE_VALUE_DEFAULT), so a reader that sees the word sees the data. On CPU
ranks there is no stream: the word is stored at once, after the (synchronous) copy.

    tilecomm.stream_ops.write_word(tilecomm.peer(flags, pe)[i], epoch)   # on the current stream
    tilecomm.stream_ops.write_words(tilecomm.peer(flags, pe)[i:j], epoch) # every word of a range

A caller that issues many copies and words per call (ag_gemm's copy-engine push) works out their addresses
itself and issues them through a `StreamIssuer` made once: no tensor slicing and no torch op per copy (on
4 H200s the push's host calls, ~20 torch ops and 12 stream writes per call, left the copy engine idle for most
of a small ag_gemm: BENCHMARKS.md, 2026-11-27 from 16:11 UTC).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch


_PROBED: dict = {}  # device index -> None or why write_word does not work there (probed once per process)


def available(device: torch.device) -> Optional[str]:
    """None where write_word works on `device`, else why not (CPU ranks: always available). On a GPU the first
    call probes it: one stream write into a local word, then a synchronize (call it at setup, not per step)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROBED:
        try:
            from cuda.bindings import driver  # noqa: F401  (cuda-python; the GPU image has it)
        except ImportError as exc:
            _PROBED[index] = f"cuda-python is not installed ({exc}); pip install 'tilecomm[gpu]'"
        else:
            word = torch.zeros(1, dtype=torch.int64, device=torch.device("cuda", index))
            try:
                write_word(word[0], 12345)
                torch.cuda.synchronize(word.device)
                _PROBED[index] = None if int(word.item()) == 12345 else "a stream write did not land"
            except RuntimeError as exc:
                _PROBED[index] = f"stream writes fail here ({exc})"
    return _PROBED[index]


def write_word(word: torch.Tensor, value: int, stream: Optional[torch.cuda.Stream] = None) -> None:
    """word: one int64 element (a local tensor or a peer's heap view); value: what to store. CUDA: enqueued on
    `stream` (default: the current stream) behind its earlier work; CPU: stored now."""
    if word.dtype != torch.int64 or word.numel() != 1:
        raise ValueError(f"write_word: word must be one int64 element, got {word.dtype} of {word.numel()} elements")
    _write(word, value, stream)


def write_words(words: torch.Tensor, value: int, stream: Optional[torch.cuda.Stream] = None) -> None:
    """write_word on every element of `words` (a contiguous 1-D int64 range), in one Python call: one stream
    write per word, each behind the stream's earlier work (their order among themselves does not matter)."""
    if words.dtype != torch.int64 or words.dim() != 1 or not words.is_contiguous():
        raise ValueError(f"write_words: words must be a contiguous 1-D int64 tensor, got {words.dtype} of shape "
                         f"{tuple(words.shape)}")
    _write(words, value, stream)


def _write(words: torch.Tensor, value: int, stream: Optional[torch.cuda.Stream]) -> None:
    if words.device.type != "cuda":
        words.fill_(value)
        return
    issuer, base = StreamIssuer(words.device, stream), words.data_ptr()
    for i in range(words.numel()):
        issuer.write(base + 8 * i, value)


class StreamIssuer:
    """Copies and int64 word writes by address, in the order of one stream, for a caller that computes the
    addresses itself (a peer's heap view's data_ptr() included). CUDA: `copy` is cuMemcpyDtoDAsync (the copy
    engine; a peer's address is an NVLink copy) and `write` cuStreamWriteValue64 with its memory barrier, both
    enqueued on `stream`, so a word written after a copy is seen only after the copy's data. CPU ranks: both
    done at once, in program order (ctypes.memmove, then the store; x86 keeps stores in order)."""

    def __init__(self, device: torch.device, stream: Optional[torch.cuda.Stream] = None):
        self.cuda = device.type == "cuda"
        if self.cuda:
            from cuda.bindings import driver

            self._driver, self._ok = driver, driver.CUresult.CUDA_SUCCESS
            self._stream = driver.CUstream((stream or torch.cuda.current_stream(device)).cuda_stream)
            self._flags = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """nbytes from address src to address dst (device memory of this GPU or a mapped peer's)."""
        if not self.cuda:
            ctypes.memmove(dst, src, nbytes)
            return
        d = self._driver
        err, = d.cuMemcpyDtoDAsync(d.CUdeviceptr(dst), d.CUdeviceptr(src), nbytes, self._stream)
        if err != self._ok:
            raise RuntimeError(f"stream_ops: cuMemcpyDtoDAsync of {nbytes} bytes failed: {err}")

    def write(self, address: int, value: int) -> None:
        """Store int64 `value` at `address` (8-byte aligned) behind the stream's earlier work."""
        if not self.cuda:
            ctypes.c_int64.from_address(address).value = value
            return
        d = self._driver
        err, = d.cuStreamWriteValue64(self._stream, d.CUdeviceptr(address), int(value), self._flags)
        if err != self._ok:
            raise RuntimeError(f"stream_ops: cuStreamWriteValue64 failed: {err}")
