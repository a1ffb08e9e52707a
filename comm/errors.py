"""Exceptions tilecomm raises. All derive from `TilecommError`."""
from __future__ import annotations


class TilecommError(RuntimeError):
    """Base class of every tilecomm runtime error."""


class NotInitializedError(TilecommError):
    """A call needed the runtime before `tilecomm.init()` (or after `finalize()`)."""


class WaitTimeoutError(TilecommError, TimeoutError):
    """A device-side wait saw no matching signal within TILECOMM_TIMEOUT_S.

    Attributes: rank (who waited), signal_addr (address of the local signal word),
    expected (the value compared against), cmp (comparison name), last_seen (the word's last value).
    """

    def __init__(self, rank: int, signal_addr: int, expected: int, cmp: str, last_seen: int, timeout_s: float, where: str = ""):
        self.rank, self.signal_addr, self.expected, self.cmp = rank, signal_addr, expected, cmp
        self.last_seen, self.timeout_s = last_seen, timeout_s
        label = f" ({where})" if where else ""
        super().__init__(
            f"rank {rank}: wait on signal word at 0x{signal_addr:x}{label} for value {cmp} {expected} "
            f"timed out after {timeout_s:g} s (last value seen: {last_seen}); a peer rank failed, "
            f"never signalled, or TILECOMM_TIMEOUT_S is too small"
        )


class HostWaitError(TilecommError):
    """A host-side exchange between ranks (a barrier, `tilecomm.empty`, init, finalize) failed: a peer
    rank exited or closed its connection. The runtime cannot continue after it: finalize and exit.
    Attributes: rank (who waited), what (the call)."""

    def __init__(self, rank: int, what: str, message: str):
        self.rank, self.what = rank, what
        super().__init__(f"rank {rank}: {what}: {message}")


class HostTimeoutError(HostWaitError, TimeoutError):
    """A host-side wait for the other ranks took longer than TILECOMM_TIMEOUT_S (`.timeout_s`)."""

    def __init__(self, rank: int, what: str, timeout_s: float, detail: str = ""):
        self.timeout_s = timeout_s
        super().__init__(rank, what, f"the other ranks did not join within {timeout_s:g} s (TILECOMM_TIMEOUT_S): "
                                     f"a peer rank failed, skipped this call or made another collective call first"
                                     + (f" ({detail})" if detail else ""))


class OutOfBoundsError(TilecommError, IndexError):
    """A device primitive was given a PE out of range or an address outside the symmetric heap
    (checked on CPU ranks always, on GPUs with TILECOMM_CHECK=1)."""


class PeerMismatchError(TilecommError):
    """Ranks disagreed on something that must match across the group (shapes, split sizes)."""


def require(cond: bool, message: str, exc: type = ValueError) -> None:
    """Raise `exc(message)` unless cond holds: the launchers' one-line argument checks."""
    if not cond:
        raise exc(message)
