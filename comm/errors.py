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


class PeerMismatchError(TilecommError):
    """Ranks disagreed on something that must match across the group (shapes, split sizes)."""


def require(cond: bool, message: str, exc: type = ValueError) -> None:
    """Raise `exc(message)` unless cond holds: the launchers' one-line argument checks."""
    if not cond:
        raise exc(message)
