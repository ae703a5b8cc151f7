"""Arrays written into a file at an offset, one at a time, in bounded memory.

A weight file is read by mapping it (weights/format.py): each tensor is a numpy view of the
file's pages, and a checkpoint reader may hand out transposed views (a torch kernel). Writing
them into another file must neither copy a whole model nor a whole tensor into memory:
`write_array` writes a contiguous array straight from its pages (one pwrite), and a strided one
a block of rows at a time through one reused buffer, each block copied in cache-sized tiles (or
by a framework's own transposing copy). With `checksum` it returns the bytes' CRC-32, for a zip
member (torch's checkpoint).

Measured on ext4 (2-core VM): writing an 857 MB model from its already mapped pages took
0.66 s, where copy_file_range (the kernel's copy, what cp does) took 0.95 s, since the finite
check has brought every page in before the write; so the bytes go through this process.
"""

from __future__ import annotations

import math
import os
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# One pwrite writes at most this much: the kernel caps a call near 2 GiB anyway.
_CHUNK = 1 << 30
# A strided array is written a block of rows of about this size at a time.
_BLOCK_BYTES = 32 << 20
_TILE = 256  # the side of a tile that _copy_tiled copies at once


def write_at(fd: int, data: memoryview | bytes, offset: int) -> None:
    """All of `data` into `fd` at `offset` (os.pwrite may write less than it was given)."""
    view = memoryview(data).cast("B")
    while view:
        done = os.pwrite(fd, view[:_CHUNK], offset)
        view, offset = view[done:], offset + done


def write_array(
    a: np.ndarray,
    fd: int,
    offset: int,
    *,
    checksum: bool = False,
    copy_block: Callable[[np.ndarray, np.ndarray], None] | None = None,
) -> int | None:
    """Write `a`'s bytes (C order, as they are in memory) into `fd` at `offset`. With
    `checksum`, the CRC-32 of those bytes (zlib's, what a zip member carries), else None.
    `copy_block(out, block)` copies a strided block into a C-contiguous buffer (a framework's
    own transposing copy); numpy's, a tile at a time, by default."""
    if a.flags.c_contiguous or a.ndim == 0:
        data = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        write_at(fd, data.data, offset)
        return zlib.crc32(data.data) if checksum else None
    # A strided view (a transposed kernel of a torch checkpoint): a block of its leading rows at
    # a time through one buffer, rather than a contiguous copy of the whole tensor.
    flat = a.reshape(a.shape[0], -1)  # a view where the trailing axes merge (a kernel's heads do)
    rows = max(1, _BLOCK_BYTES // max(1, flat[0].nbytes))
    shape = (min(rows, flat.shape[0]), flat.shape[1])
    buffer = _block_buffer(math.prod(shape) * a.dtype.itemsize).view(a.dtype).reshape(shape)
    crc = 0
    for begin in range(0, flat.shape[0], rows):
        block = buffer[: min(rows, flat.shape[0] - begin)]
        (copy_block or _copy_tiled)(block, flat[begin : begin + rows])
        data = block.reshape(-1).view(np.uint8)
        write_at(fd, data.data, offset + begin * flat[0].nbytes)
        if checksum:
            crc = zlib.crc32(data.data, crc)
    return crc if checksum else None


_BUFFERS = threading.local()


def _block_buffer(nbytes: int) -> np.ndarray:
    """A buffer of `nbytes` for write_array's blocks, the same one call after call (per thread):
    a fresh one each time would be fresh pages each time, and on a virtual machine that hands
    freed memory back to its host, each first touch of a page costs several times a copy."""
    kept = getattr(_BUFFERS, "buffer", None)
    if kept is None or kept.nbytes < nbytes:
        kept = _BUFFERS.buffer = np.empty(max(nbytes, 1), dtype=np.uint8)
    return kept[:nbytes]


def _copy_tiled(out: np.ndarray, a: np.ndarray) -> None:
    """np.copyto(out, a) for 2-D arrays, a square tile at a time, the rows split among the
    cores: a transposed source read whole strides through memory a column at a time, and tiles
    that fit the cache copy it about 2.4x faster (measured: 1024 x 4096 float32, 29 ms whole,
    12 ms in 256 x 256 tiles; 8 ms on two cores, numpy's copy letting go of the GIL)."""
    workers = _workers()
    if workers is None or out.nbytes < _BLOCK_BYTES // 4:
        _copy_tiles(out, a)
        return
    step = -(-a.shape[0] // workers._max_workers)
    parts = [slice(r, r + step) for r in range(0, a.shape[0], step)]
    list(workers.map(lambda rows: _copy_tiles(out[rows], a[rows]), parts))


def _copy_tiles(out: np.ndarray, a: np.ndarray) -> None:
    for r in range(0, a.shape[0], _TILE):
        for c in range(0, a.shape[1], _TILE):
            np.copyto(out[r : r + _TILE, c : c + _TILE], a[r : r + _TILE, c : c + _TILE])


_POOL: list[ThreadPoolExecutor] = []


def _workers() -> ThreadPoolExecutor | None:
    """One thread per core this process may use (at most 8), made once; None on one core."""
    if not _POOL:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if (cores or 1) < 2:
            return None
        _POOL.append(ThreadPoolExecutor(min(cores or 1, 8), thread_name_prefix="rosetta-copy"))
    return _POOL[0]
