"""The fast paths of a conversion give the same bytes as the slow ones: files/array_writes.py
writes a mapped tensor from its pages and a strided one a tiled block at a time (with the
CRC-32 a zip member needs); the finite check reads a sum first and decides exactly; the
source's digest is read in a thread and stops when asked."""

from __future__ import annotations

import hashlib
import threading
import zlib

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from transformer_rosetta.files import array_writes
from transformer_rosetta.porting import verify
from transformer_rosetta.weights import format as fmt


def write_each(arrays, path, **kwargs):
    """write_array of every array into one file, back to back: the file's bytes, and the
    CRC-32s write_array returned."""
    crcs = []
    with open(path, "wb", buffering=0) as f:
        offset = 0
        for a in arrays:
            crcs.append(array_writes.write_array(a, f.fileno(), offset, **kwargs))
            offset += a.nbytes
    return path.read_bytes(), crcs


def test_a_mapped_weight_files_tensors_are_written_as_they_are(tmp_path):
    """load_weights's tensors (views of the mapped file): each written from its pages, the same
    bytes, and with `checksum` the CRC-32 of those bytes."""
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((37, 5)).astype(np.float32),
        "b": rng.standard_normal((300,)).astype(np.float32),
        "c": rng.standard_normal((6, 7, 9)).astype(np.float32),
    }
    path = tmp_path / "source.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    part = fmt._read_part(path)
    data = fmt._map_data(part, str(path))
    views = [fmt._tensor_view(data, part.header[name]) for name in tensors]
    assert not any(v.flags.writeable for v in views)  # the file's pages, not copies
    out, crcs = write_each(views, tmp_path / "out.bin", checksum=True)
    assert out == b"".join(t.tobytes() for t in tensors.values())
    assert crcs == [zlib.crc32(t.tobytes()) for t in tensors.values()]
    assert write_each(views, tmp_path / "again.bin")[1] == [None, None, None]


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float64])
def test_a_strided_tensor_is_written_in_tiled_blocks(tmp_path, monkeypatch, dtype):
    """A torch kernel's canonical view: (d, h, d_k) over (h * d_k, d) storage. Small blocks
    and tiles, so that rows and columns both end in partial tiles."""
    monkeypatch.setattr(array_writes, "_BLOCK_BYTES", 200)
    monkeypatch.setattr(array_writes, "_TILE", 3)
    rng = np.random.default_rng(1)
    storage = rng.standard_normal((4 * 5, 11)).astype(dtype)  # (out, in), as nn.Linear keeps it
    canonical = storage.T.reshape(11, 4, 5)
    assert not canonical.flags.c_contiguous and np.shares_memory(canonical, storage)
    want = [np.ascontiguousarray(canonical).tobytes(), np.ascontiguousarray(storage.T).tobytes()]
    out, crcs = write_each([canonical, storage.T], tmp_path / "out.bin", checksum=True)
    assert out == b"".join(want)
    assert crcs == [zlib.crc32(b) for b in want]  # over the blocks, in order
    # torch's copy (or any framework's) in place of numpy's tiles: the same bytes
    calls = []

    def copy_block(dst, src):
        calls.append(src.shape)
        np.copyto(dst, src)

    assert write_each([canonical], tmp_path / "o2.bin", copy_block=copy_block)[0] == want[0]
    assert len(calls) > 1  # several blocks of at most _BLOCK_BYTES


def test_writes_of_many_arrays_overlap_and_keep_every_byte(tmp_path, monkeypatch):
    """write_arrays writes a block while the next strided one is copied into the other of two
    buffers. Each write is slowed down here, so that a buffer filled again before its write
    ended would show in the bytes; blocks of three rows, so each kernel is several blocks."""
    monkeypatch.setattr(array_writes, "_TILE", 4)
    real_write = array_writes.write_at

    def slow_write(fd, data, offset):
        threading.Event().wait(0.002)
        real_write(fd, data, offset)

    monkeypatch.setattr(array_writes, "write_at", slow_write)
    rng = np.random.default_rng(2)
    storages = [rng.standard_normal((8 * k, 10)).astype(np.float32) for k in (1, 2, 3)]
    arrays = [storages[0].T, rng.standard_normal(17).astype(np.float32), storages[1].T]
    arrays += [storages[2].T, storages[2].T.reshape(10, 4, 6)]
    # an output kernel's canonical view (h, d_k, d) of torch's (d, h * d_k), and a permutation
    # with no 2-D view at all (written an item of its leading axis at a time)
    arrays += [storages[1].reshape(4, 4, 10), np.arange(120.0).reshape(4, 5, 6).transpose(1, 0, 2)]
    monkeypatch.setattr(array_writes, "_BLOCK_BYTES", 3 * arrays[0][0].nbytes)
    placed, offset = [], 0
    for a in arrays:
        placed.append((a, offset))
        offset += a.nbytes
    path = tmp_path / "out.bin"
    with open(path, "wb", buffering=0) as f:
        array_writes.write_arrays(f.fileno(), iter(placed))
    assert path.read_bytes() == b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


def test_a_kernel_s_view_is_written_through_a_2d_view_never_copied_whole():
    """A strided kernel is written by rows of a 2-D view of it: for a query kernel (d, h, d_k)
    its heads merge, for an output kernel (h, d_k, d) its leading axes do. numpy's reshape would
    silently copy the whole tensor where the axes do not merge."""
    # nn.Linear keeps (out, in); here d = 8, h = 2, d_k = 3
    query = np.zeros((6, 8), np.float32).T.reshape(8, 2, 3)  # (d, h, d_k) over (h * d_k, d)
    output = np.zeros((8, 6), np.float32).T.reshape(2, 3, 8)  # (h, d_k, d) over (d, h * d_k)
    for kernel, shape in ((query, (8, 6)), (output, (6, 8))):
        rows = array_writes._rows(kernel)
        assert rows is not None and rows.shape == shape and np.shares_memory(rows, kernel)
    assert array_writes._rows(np.zeros((4, 5, 6)).transpose(1, 0, 2)) is None


def test_the_finite_check_decides_exactly(monkeypatch):
    monkeypatch.setattr(fmt, "_CHUNK_ELEMENTS", 7)  # 16-bit floats: many chunks, a partial one
    for dtype in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16):
        a = np.ones(50, dtype)
        assert fmt._all_finite(a), dtype
        for bad in (np.nan, np.inf, -np.inf):
            for where in (0, 6, 7, 49):
                b = a.copy()
                b[where] = bad
                assert not fmt._all_finite(b), (dtype, bad, where)
    # Finite float32 whose sum overflows: the sum says Inf, the exact check says finite.
    big = np.full(1000, 3e38, np.float32)
    with np.errstate(over="ignore"):
        assert np.isinf(big.sum())
    assert fmt._all_finite(big)
    # Infinities of both signs whose sum is NaN, and a float64 NaN.
    assert not fmt._all_finite(np.array([np.inf, -np.inf], np.float32))
    assert fmt.nonfinite_counts({"w": np.array([1.0, np.nan, np.inf, np.inf], np.float32)}) == {
        "w": {"nan": 1, "inf": 2}
    }


def test_the_digest_in_the_background_is_the_files_sha256(tmp_path):
    path = tmp_path / "file.bin"
    path.write_bytes(np.random.default_rng(2).bytes(3 << 20))  # three of its 1 MiB chunks
    with verify.BackgroundDigest(path) as digest:
        assert digest.result() == hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_digest_stops_when_asked(tmp_path):
    path = tmp_path / "file.bin"
    path.write_bytes(b"x" * 100)
    stop = threading.Event()
    stop.set()
    with pytest.raises(verify.DigestCancelled):
        verify.sha256_of(path, stop)
    digest = verify.BackgroundDigest(path)
    digest._stop.set()  # as leaving its block does, before the thread has read anything
    with digest:
        pass
    with pytest.raises(verify.DigestCancelled):
        digest.result()
