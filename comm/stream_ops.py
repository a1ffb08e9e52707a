"""Stream memory operations: a word written in stream order by the GPU's front end, with no kernel.

A signal that follows a copy-engine transfer (`tensor.copy_` into a peer's heap view) must not need an SM:
while a persistent kernel holds every SM and spins on that signal, a signal *kernel* queued behind the copy
could never start. `write_word` enqueues CUDA's stream write (cuStreamWriteValue64, from cuda-python's
`cuda.bindings.driver`), which the front end performs once the stream's earlier work (the copy) is done,
after a memory barrier (CU_STREAM_WRITE_VALUE_DEFAULT), so a reader that sees the word sees the data. On CPU
ranks there is no stream: the word is stored at once, after the (synchronous) copy.

    tilecomm.stream_ops.write_word(tilecomm.peer(flags, pe)[i], epoch)   # on the current stream
    tilecomm.stream_ops.write_words(tilecomm.peer(flags, pe)[i:j], epoch) # every word of a range
"""
from __future__ import annotations

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
    from cuda.bindings import driver

    stream = driver.CUstream((stream or torch.cuda.current_stream(words.device)).cuda_stream)
    flags, base = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT, words.data_ptr()
    for i in range(words.numel()):
        err, = driver.cuStreamWriteValue64(stream, driver.CUdeviceptr(base + 8 * i), int(value), flags)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"stream_ops: cuStreamWriteValue64 failed: {err}")
