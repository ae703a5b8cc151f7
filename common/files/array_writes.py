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
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

# out, block: a strided 2-D block copied into the C-contiguous buffer of its shape.
CopyBlock = Callable[[np.ndarray, np.ndarray], None]

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
    copy_block: CopyBlock | None = None,
) -> int | None:
    """Write `a`'s bytes (C order, as they are in memory) into `fd` at `offset`. With
    `checksum`, the CRC-32 of those bytes (zlib's, what a zip member carries), else None.
    `copy_block(out, block)` copies a strided block into a C-contiguous buffer (a framework's
    own transposing copy); numpy's, a tile at a time, by default."""
    sums = write_arrays(fd, [(a, offset)], checksum=checksum, copy_block=copy_block)
    return sums[0] if sums is not None else None


def write_arrays(
    fd: int,
    placed: Iterable[tuple[np.ndarray, int]],
    *,
    checksum: bool = False,
    copy_block: CopyBlock | None = None,
) -> list[int] | None:
    """write_array for each (array, offset) in turn, where one thread writes (and, with
    `checksum`, sums) each piece while this one puts the next strided block into C order (pwrite,
    zlib and the copies let go of the GIL). With `checksum`, each array's CRC-32, in order."""
    writer = _writer()
    crcs: list[int] = []

    def write(data: memoryview, at: int, index: int) -> None:
        crc = _write_summed(fd, data, at, crcs[index] if checksum else None)
        crcs[index] = crc or 0

    pending: Future[None] | None = None
    try:
        for index, (a, offset) in enumerate(placed):
            crcs.append(0)
            for data, at in _c_order_pieces(a, offset, copy_block):
                if writer is None:
                    write(data, at, index)
                    continue
                if pending is not None:
                    pending.result()  # one piece at a time: the next block's buffer is free
                pending = writer.submit(write, data, at, index)
    finally:
        if pending is not None:
            pending.result()
    return crcs if checksum else None


def _c_order_pieces(
    a: np.ndarray, offset: int, copy_block: CopyBlock | None
) -> Iterator[tuple[memoryview, int]]:
    """`a`'s bytes in C order as (bytes, file offset) pieces: a contiguous array whole, from its
    own memory (a mapped file's pages); a strided view (a transposed kernel of a torch
    checkpoint) a block of its leading rows at a time, rather than a contiguous copy of the whole
    tensor, each block in the next of two buffers in turn. So the caller may still be writing one
    piece while it asks for the next, never two."""
    if a.flags.c_contiguous or a.ndim == 0:
        yield np.ascontiguousarray(a).reshape(-1).view(np.uint8).data, offset
        return
    flat = _rows(a)
    if flat is None:  # no 2-D view: each item of the leading axis on its own
        for item in a:
            yield from _c_order_pieces(item, offset, copy_block)
            offset += item.nbytes
        return
    rows = max(1, _BLOCK_BYTES // max(1, flat[0].nbytes))
    shape = (min(rows, flat.shape[0]), flat.shape[1])
    for begin in range(0, flat.shape[0], rows):
        buffer = _block_buffer(math.prod(shape) * a.dtype.itemsize).view(a.dtype).reshape(shape)
        block = buffer[: min(rows, flat.shape[0] - begin)]
        (copy_block or _copy_tiled)(block, flat[begin : begin + rows])
        yield block.reshape(-1).view(np.uint8).data, offset + begin * flat[0].nbytes


def _rows(a: np.ndarray) -> np.ndarray | None:
    """A 2-D view of `a` whose rows, in order, hold `a`'s C order: its trailing axes merged (a
    query kernel's heads, (d, h, d_k) over torch's (h * d_k, d)), else its leading ones (an
    output kernel's, (h, d_k, d)); None where neither merges without a copy, which reshape would
    otherwise make of the whole tensor, silently."""

    def merge(axes: range) -> bool:
        return all(
            a.shape[i] == 1
            or a.shape[i + 1] == 1
            or a.strides[i] == a.shape[i + 1] * a.strides[i + 1]
            for i in axes[:-1]
        )

    if merge(range(1, a.ndim)):
        return a.reshape(a.shape[0], -1)
    if merge(range(0, a.ndim - 1)):
        return a.reshape(-1, a.shape[-1])
    return None


def _write_summed(fd: int, data: memoryview, offset: int, crc: int | None) -> int | None:
    """write_at, and with a running `crc` (not None) the CRC-32 continued over `data`, summed on
    another core while this one writes (zlib and pwrite both let go of the GIL): 0.2 s of an
    857 MB .pt's 1.0 s when done one after the other."""
    if crc is None:
        write_at(fd, data, offset)
        return None
    workers = _workers()
    if workers is None:
        write_at(fd, data, offset)
        return zlib.crc32(data, crc)
    summed = workers.submit(zlib.crc32, data, crc)
    write_at(fd, data, offset)
    return summed.result()


_BUFFERS = threading.local()


def _block_buffer(nbytes: int) -> np.ndarray:
    """A buffer of `nbytes` for a strided array's blocks: two kept buffers (per thread) in turn,
    so that one can be written while the other is filled. Fresh buffers each time would be fresh
    pages each time, and on a virtual machine that hands freed memory back to its host, each
    first touch of a page costs several times a copy."""
    turn = getattr(_BUFFERS, "turn", 0)
    _BUFFERS.turn = 1 - turn
    kept = getattr(_BUFFERS, f"buffer{turn}", None)
    if kept is None or kept.nbytes < nbytes:
        kept = np.empty(max(nbytes, 1), dtype=np.uint8)
        setattr(_BUFFERS, f"buffer{turn}", kept)
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
_WRITER: list[ThreadPoolExecutor] = []


def _writer() -> ThreadPoolExecutor | None:
    """The one thread write_arrays writes from, made once; None on one core."""
    if not _WRITER and _workers() is not None:
        _WRITER.append(ThreadPoolExecutor(1, thread_name_prefix="rosetta-write"))
    return _WRITER[0] if _WRITER else None


def _workers() -> ThreadPoolExecutor | None:
    """One thread per core this process may use (at most 8), made once; None on one core."""
    if not _POOL:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if (cores or 1) < 2:
            return None
        _POOL.append(ThreadPoolExecutor(min(cores or 1, 8), thread_name_prefix="rosetta-copy"))
    return _POOL[0]
