"""The device-side error record both backends share (CPU: a tensor; GPU: pinned host memory)."""
from __future__ import annotations

import torch


class ErrorRecord:
    """int64 words [code, rank, a, b, c, d] a kernel fills once (first error wins), the host reads.
    Codes: 1 wait timed out (a = signal address, b = expected, c = last seen, d = comparison), 2 a collective's counts
    disagree (a = peer, b = expected, c = offered), 3 an expert id out of range (a = token, b = id, c = E),
    6 ranks in different collectives (a = peer, b = this rank's tag, c = the peer's; collectives/_exchange.py),
    7 / 8 a tcl primitive's PE out of range / address off the heap under TILECOMM_CHECK=1 (a = pe or address,
    b = world or pe; language/_gpu.py)."""

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
        from .language._constants import CMP_NAMES

        if not self._code[0]:
            return
        err = self.take_error()
        if err is None:
            return
        code, rank, a, b, c = err
        if code == 1:
            where = self.heap.describe(a) if self.heap is not None else "address not described"
            raise WaitTimeoutError(rank, a, b, CMP_NAMES.get(self._cmp, f"cmp {self._cmp}"), c,
                                   getattr(self, "timeout_s", float("nan")), where=f"{where}, recorded on the device")
        if code == 3:
            raise ValueError(f"rank {rank}: token {a} has expert id {b}; expected -1 <= id < {c} (found on the device)")
        if code in (7, 8):
            from .errors import OutOfBoundsError

            what = f"pe={a} is out of range [0, {b})" if code == 7 else \
                f"address 0x{a:x} (for pe {b}) is not on the symmetric heap"
            raise OutOfBoundsError(f"rank {rank}: a tcl primitive's {what} (TILECOMM_CHECK=1, found on the device; "
                                   "the operation was skipped)")
        if code == 6:
            from .collectives._exchange import describe_tag

            raise PeerMismatchError(f"rank {rank} called {describe_tag(b)} while rank {a} called {describe_tag(c)}: "
                                    "every rank must call the same collectives in the same order")
        raise PeerMismatchError(
            f"rank {rank} expected {b} elements from rank {a}, but rank {a} offers {c} (output_split_sizes on rank "
            f"{rank} and input_split_sizes on rank {a} disagree, or the ranks called different collectives)")
