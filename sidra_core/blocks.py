"""Element-wise kernels over arrays of any size in fixed-size blocks.

Cell arrays come in every size (one per weight shape, shrinking as ISPP
finishes cells); calling a jitted kernel on each would compile it once per
size. Fixed blocks compile once, and two blocks in flight keep both cores
busy (XLA:CPU runs one element-wise fusion on one core).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

BLOCK = 1 << 17  # elements per kernel call
_POOL = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)))


def map_blocks(fn, arrays, fills, size: int = BLOCK):
    """Apply `fn` (a jitted element-wise kernel) to equally shaped arrays, block by block.

    Blocks are `size` elements, or for a smaller input the smallest of 4096 x 8^k
    that holds it, so a shrinking input does not pay for a full block and few
    block sizes (each a kernel to trace and compile) are
    used; the last block is padded with `fills`. The outputs come back with the
    inputs' shape, as a list (one per kernel output).
    """
    shape = np.shape(arrays[0])
    flat = [np.ravel(a) for a in arrays]
    n = flat[0].size
    block = 4096
    while block < min(n, size):
        block *= 8
    size = min(size, block)

    def run(lo):
        part = [a[lo:lo + size] for a in flat]
        k = part[0].size
        if k < size:
            part = [np.concatenate([a, np.full(size - k, f, a.dtype)]) for a, f in zip(part, fills)]
        res = fn(*part)
        res = res if isinstance(res, tuple) else (res,)
        return [np.asarray(r)[:k] for r in res]

    outs = list(_POOL.map(run, range(0, max(n, 1), size)))  # an empty input still yields typed outputs
    return [(np.concatenate(cols) if len(cols) > 1 else cols[0]).reshape(shape) for cols in zip(*outs)]
