"""The fast paths of a conversion give the same bytes as the slow ones: a tensor mapped from a
weight file is copied by the kernel (files/mapped.py) from the right offset, or from memory
where the kernel cannot; a strided tensor is written a tiled block at a time; the finite check
reads a sum first and decides exactly; the source's digest is read in a thread and stops when
asked."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import threading

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from transformer_rosetta.files import mapped
from transformer_rosetta.porting import verify
from transformer_rosetta.weights import format as fmt


@pytest.fixture
def source(tmp_path):
    """A safetensors file written by safetensors itself, its tensors and each one's offset in
    the file, computed from the header as its spec says (8 + header length + data_offsets)."""
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((37, 5)).astype(np.float32),
        "b": rng.standard_normal((300,)).astype(np.float32),
        "c": rng.standard_normal((6, 7, 9)).astype(np.float32),
    }
    path = tmp_path / "source.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    offsets = {name: 8 + n + header[name]["data_offsets"][0] for name in tensors}
    return path, tensors, offsets


def mapped_views(path):
    """Each tensor of `path` as load_weights's reader gives it: a view of the mapped file."""
    part = fmt._read_part(path)
    data = fmt._map_data(part, str(path))
    return {name: fmt._tensor_view(data, entry) for name, entry in part.header.items()}


def test_a_mapped_view_is_traced_to_its_bytes_in_the_file(source):
    path, tensors, offsets = source
    views = mapped_views(path)
    for name, view in views.items():
        region = mapped.file_region(view)
        assert region is not None, name
        assert region[0].path == path and region[1] == offsets[name]
    # A copy, a transposed view or a slice that is not contiguous is not the file's bytes.
    assert mapped.file_region(views["a"].copy()) is None
    assert mapped.file_region(views["a"].T) is None
    assert mapped.file_region(views["c"][:, 1]) is None
    assert mapped.file_region(tensors["a"]) is None


def write_each(views, path):
    """copy_view of every view into one file, back to back; the file's bytes."""
    with open(path, "wb", buffering=0) as f:
        offset = 0
        for view in views:
            mapped.copy_view(view, f.fileno(), offset)
            offset += view.nbytes
    return path.read_bytes()


def test_the_kernel_copies_from_the_tensors_offset(source, tmp_path, monkeypatch):
    path, tensors, offsets = source
    views = mapped_views(path)
    calls = []
    real = os.copy_file_range

    def spy(src, dst, count, offset_src, offset_dst):
        calls.append((count, offset_src, offset_dst))
        return real(src, dst, count, offset_src, offset_dst)

    monkeypatch.setattr(os, "copy_file_range", spy)
    out = write_each(views.values(), tmp_path / "out.bin")
    assert out == b"".join(t.tobytes() for t in tensors.values())
    sizes = [t.nbytes for t in tensors.values()]
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    assert calls == [
        (size, offsets[name], start)
        for name, size, start in zip(tensors, sizes, starts, strict=True)
    ]


@pytest.mark.parametrize("refusal", [errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP])
def test_a_refused_kernel_copy_writes_from_memory(source, tmp_path, monkeypatch, refusal):
    path, tensors, _ = source

    def refuse(*args):
        raise OSError(refusal, os.strerror(refusal))

    monkeypatch.setattr(os, "copy_file_range", refuse)
    out = write_each(mapped_views(path).values(), tmp_path / "out.bin")
    assert out == b"".join(t.tobytes() for t in tensors.values())


def test_a_real_write_error_is_raised(source, tmp_path, monkeypatch):
    path, _, _ = source

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "copy_file_range", full)
    with pytest.raises(OSError, match="No space"):
        write_each(mapped_views(path).values(), tmp_path / "out.bin")


def test_a_file_replaced_after_mapping_is_not_read(source, tmp_path):
    """The mapping still holds the old file's pages; the file now at the path holds others, so
    the kernel copy (by path) is skipped and the tensor's own bytes are written."""
    path, tensors, _ = source
    views = mapped_views(path)
    other = {k: np.full_like(v, 7.0) for k, v in tensors.items()}
    replacement = tmp_path / "other.safetensors"
    safetensors.numpy.save_file(other, str(replacement))
    os.replace(replacement, path)
    out = write_each(views.values(), tmp_path / "out.bin")
    assert out == b"".join(t.tobytes() for t in tensors.values())


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float64])
def test_a_strided_tensor_is_written_in_tiled_blocks(tmp_path, monkeypatch, dtype):
    """A torch kernel's canonical view: (d, h, d_k) over (h * d_k, d) storage. Small blocks
    and tiles, so that rows and columns both end in partial tiles."""
    monkeypatch.setattr(mapped, "_BLOCK_BYTES", 200)
    monkeypatch.setattr(mapped, "_TILE", 3)
    rng = np.random.default_rng(1)
    storage = rng.standard_normal((4 * 5, 11)).astype(dtype)  # (out, in), as nn.Linear keeps it
    canonical = storage.T.reshape(11, 4, 5)
    assert not canonical.flags.c_contiguous and np.shares_memory(canonical, storage)
    out = write_each([canonical, storage.T], tmp_path / "out.bin")
    assert (
        out == np.ascontiguousarray(canonical).tobytes() + np.ascontiguousarray(storage.T).tobytes()
    )


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


def test_the_digest_in_the_background_is_the_files_sha256(source):
    path, _, _ = source
    with verify.BackgroundDigest(path) as digest:
        assert digest.result() == hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_digest_stops_when_asked(source):
    path, _, _ = source
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
