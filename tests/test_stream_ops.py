"""tilecomm.stream_ops on CPU ranks (the GPU path, cuStreamWriteValue64, runs in the GPU suite's ag_gemm)."""
from __future__ import annotations

import pytest
import torch

from tilecomm import stream_ops


def test_write_word_on_cpu_stores_at_once():
    words = torch.full((3,), -1, dtype=torch.int64)
    stream_ops.write_word(words[1], 7)
    assert words.tolist() == [-1, 7, -1]
    assert stream_ops.available(torch.device("cpu")) is None


@pytest.mark.parametrize("word,what", [(torch.zeros(2, dtype=torch.int64), "2 elements"),
                                       (torch.zeros(1, dtype=torch.int32), "torch.int32")])
def test_write_word_rejects_other_words(word, what):
    with pytest.raises(ValueError, match=f"one int64 element, got .*{what}"):
        stream_ops.write_word(word, 1)


def test_write_words_on_cpu_stores_every_word_of_the_range():
    words = torch.full((6,), -1, dtype=torch.int64)
    stream_ops.write_words(words[1:4], 9)
    assert words.tolist() == [-1, 9, 9, 9, -1, -1]
    stream_ops.write_words(words[5:5], 3)  # an empty range writes nothing
    assert words.tolist() == [-1, 9, 9, 9, -1, -1]


@pytest.mark.parametrize("words,what", [(torch.zeros(4, dtype=torch.int32), "torch.int32 of shape \\(4,\\)"),
                                        (torch.zeros(2, 2, dtype=torch.int64), "shape \\(2, 2\\)"),
                                        (torch.zeros(6, dtype=torch.int64)[::2], "shape \\(3,\\)")])
def test_write_words_rejects_other_ranges(words, what):
    with pytest.raises(ValueError, match=f"contiguous 1-D int64 tensor, got .*{what}"):
        stream_ops.write_words(words, 1)


def test_stream_issuer_on_cpu_copies_and_writes_by_address():
    """The by-address calls ag_gemm's copy push makes (CUDA: cuMemcpyDtoDAsync, cuStreamWriteValue64)."""
    src = torch.arange(10, dtype=torch.float32)
    dst = torch.full((12,), -1.0)
    words = torch.full((4,), -1, dtype=torch.int64)
    issuer = stream_ops.StreamIssuer(torch.device("cpu"))
    issuer.copy(dst.data_ptr() + 2 * 4, src.data_ptr() + 3 * 4, 5 * 4)  # src[3:8] -> dst[2:7]
    issuer.write(words.data_ptr() + 2 * 8, 2**40 + 3)
    assert dst.tolist() == [-1, -1, 3, 4, 5, 6, 7, -1, -1, -1, -1, -1]
    assert words.tolist() == [-1, -1, 2**40 + 3, -1]
    issuer.copy(dst.data_ptr(), src.data_ptr(), 0)  # an empty copy moves nothing
    assert dst[0].item() == -1
