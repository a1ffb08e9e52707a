"""The device-side error record both backends share (CPU: a tensor; GPU: pinned host memory)."""
from __future__ import annotations

import torch


class ErrorRecord:
    """int64 words [code, rank, a, b, c, d] a kernel fills once (first error wins: abi.record_error), the host
    reads; the codes are abi.ErrorCode's (code 4, the low-latency capacity, lives in the Dispatcher's own record)."""

    def __init__(self, words: torch.Tensor):
        self.error = words
        self.error.zero_()
        self._code = words.numpy()  # the same memory: a host read of word 0 costs no torch call

    def has_error(self) -> bool:
        return bool(self._code[0])

    heap = None  # the backend's SymmetricHeap, to say where a timed-out signal word lies

    def take_error(self, code=None):
        """(code, rank, a, b, c) of the recorded error, cleared; None if none (or another code)."""
        words = self.error.tolist()[:6]
        if words[0] == 0 or (code is not None and words[0] != code):
            return None
        self.error.zero_()
        self._cmp = words[5]
        return tuple(words[:5])

    def raise_if_error(self) -> None:
        from .errors import PeerMismatchError, WaitTimeoutError
        from .language.abi import CMP_NAMES, ErrorCode

        if not self._code[0]:
            return
        err = self.take_error()
        if err is None:
            return
        code, rank, a, b, c = err
        if code == ErrorCode.WAIT_TIMEOUT:
            where = self.heap.describe(a) if self.heap is not None else "address not described"
            raise WaitTimeoutError(rank, a, b, CMP_NAMES.get(self._cmp, f"cmp {self._cmp}"), c,
                                   getattr(self, "timeout_s", float("nan")), where=f"{where}, recorded on the device")
        if code == ErrorCode.BAD_EXPERT:
            raise ValueError(f"rank {rank}: token {a} has expert id {b}; expected -1 <= id < {c} (found on the device)")
        if code in (ErrorCode.BAD_PE, ErrorCode.OFF_HEAP):
            from .errors import OutOfBoundsError

            what = f"pe={a} is out of range [0, {b})" if code == ErrorCode.BAD_PE else \
                f"address 0x{a:x} (for pe {b}) is not on the symmetric heap"
            raise OutOfBoundsError(f"rank {rank}: a tcl primitive's {what} (TILECOMM_CHECK=1, found on the device; "
                                   "the operation was skipped)")
        if code == ErrorCode.OP_MISMATCH:
            from .collectives._exchange import describe_tag

            raise PeerMismatchError(f"rank {rank} called {describe_tag(b)} while rank {a} called {describe_tag(c)}: "
                                    "every rank must call the same collectives in the same order")
        raise PeerMismatchError(
            f"rank {rank} expected {b} elements from rank {a}, but rank {a} offers {c} (output_split_sizes on rank "
            f"{rank} and input_split_sizes on rank {a} disagree, or the ranks called different collectives)")
