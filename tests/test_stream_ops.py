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
