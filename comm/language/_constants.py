"""Signal operations and comparisons, with NVSHMEM's values (from its headers)."""
from __future__ import annotations

import numpy as np

SIGNAL_SET = 9
SIGNAL_ADD = 10

CMP_EQ, CMP_NE, CMP_GT, CMP_LE, CMP_LT, CMP_GE = 0, 1, 2, 3, 4, 5
CMP_NAMES = {CMP_EQ: "==", CMP_NE: "!=", CMP_GT: ">", CMP_LE: "<=", CMP_LT: "<", CMP_GE: ">="}


def compare_numpy(words, value, cmp: int):
    ops = {CMP_EQ: np.equal, CMP_NE: np.not_equal, CMP_GT: np.greater, CMP_LE: np.less_equal,
           CMP_LT: np.less, CMP_GE: np.greater_equal}
    return ops[cmp](words, value)
