"""load_weights maps the file: every tensor is a read-only view of the file's pages, equal bit
for bit to what safetensors itself reads, in every dtype the format stores."""

from __future__ import annotations

import json
import mmap
import struct

import numpy as np
import pytest
import safetensors.numpy

from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.spec.config import preset
from transformer_rosetta.weights import format as fmt
from transformer_rosetta.weights.init import init_weights

CONFIG = preset("tiny").replace(share_embeddings=False, tgt_vocab_size=40, output_bias=True)
DTYPES = ["float32", "float16", "bfloat16", "float64"]


def saved(tmp_path, dtype="float32"):
    path = tmp_path / "w.safetensors"
    weights = init_weights(CONFIG, seed=3, scheme="perturbed", dtype=dtype)
    fmt.save_weights(path, weights, CONFIG, producer="test")
    return path, weights


def mapping_behind(array: np.ndarray) -> object:
    """The object at the end of an array's chain of bases: what owns its memory."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_are_what_safetensors_reads(tmp_path, dtype):
    path, weights = saved(tmp_path, dtype)
    loaded = fmt.load_weights(path)
    reference = safetensors.numpy.load_file(str(path))
    assert set(loaded.tensors) == set(reference) == set(weights)
    for name, got in loaded.tensors.items():
        assert got.dtype == reference[name].dtype == weights[name].dtype, name
        assert got.shape == reference[name].shape, name
        assert got.tobytes() == reference[name].tobytes() == weights[name].tobytes(), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensors_are_read_only_views_of_the_mapped_file(tmp_path, dtype):
    path, _ = saved(tmp_path, dtype)
    tensors = fmt.load_weights(path).tensors
    owners = {id(mapping_behind(t)) for t in tensors.values()}
    assert len(owners) == 1  # one mapping of the file holds them all
    owner = mapping_behind(next(iter(tensors.values())))
    assert isinstance(owner, mmap.mmap)
    assert len(owner) == path.stat().st_size  # the whole file, not a copy of its data
    for name, t in tensors.items():
        assert not t.flags.writeable, name
        assert not t.flags.owndata, name
    t = tensors["output.bias"]
    with pytest.raises(ValueError, match="read-only"):
        t[0] = 1


def test_the_views_sit_at_the_header_offsets(tmp_path):
    """Each tensor starts where its header entry says, counted from the end of the header."""
    path, _ = saved(tmp_path)
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8 : 8 + n])
    tensors = fmt.load_weights(path).tensors
    whole = np.frombuffer(mapping_behind(tensors["output.bias"]), dtype=np.uint8)
    for name, t in tensors.items():
        begin, end = header[name]["data_offsets"]
        assert np.shares_memory(t, whole[8 + n + begin : 8 + n + end]), name
        assert t.__array_interface__["data"][0] == whole.ctypes.data + 8 + n + begin, name


def test_an_unaligned_data_region_reads_the_same_values(tmp_path):
    """A hand-written header whose length is not a multiple of 8 (safetensors pads it, but a
    reader must not rely on that): the views are unaligned, and their values still exact."""
    path, weights = saved(tmp_path)
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    raw = path.read_bytes()
    text = raw[8 : 8 + n].rstrip(b" ")
    # Pad to a data region that starts 3 bytes past a multiple of 8, odd for every dtype wider
    # than a byte: whatever the config's JSON length, no float32 view can be aligned there.
    text += b" " * ((3 - 8 - len(text)) % 8)
    assert (8 + len(text)) % 8 == 3
    odd = tmp_path / "odd.safetensors"
    odd.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    loaded = fmt.load_weights(odd)
    assert not all(t.flags.aligned for t in loaded.tensors.values())
    for name, want in weights.items():
        assert loaded.tensors[name].tobytes() == want.tobytes(), name


def test_a_file_that_changes_after_its_check_is_refused(tmp_path):
    path, _ = saved(tmp_path)
    (part,) = fmt._read_parts(path)
    with path.open("ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(WeightFileError, match="changed while it was being read"):
        fmt._map_data(part, str(path))


def test_the_big_endian_path_keeps_every_value(tmp_path, monkeypatch):
    """On a big-endian machine reads swap each tensor into native order and writes swap it
    back. Here (little-endian) the same code runs with the swap a no-op, so it must keep every
    bit and still hand out read-only arrays."""
    monkeypatch.setattr(fmt, "_LITTLE_ENDIAN", False)
    for dtype in DTYPES:
        path = tmp_path / f"{dtype}.safetensors"
        weights = init_weights(CONFIG, seed=5, dtype=dtype)
        fmt.save_weights(path, weights, CONFIG, producer="test")
        reference = safetensors.numpy.load_file(str(path))
        loaded = fmt.load_weights(path).tensors
        for name, want in weights.items():
            assert reference[name].tobytes() == want.tobytes(), name
            assert loaded[name].tobytes() == want.tobytes(), name
            assert loaded[name].dtype == want.dtype and not loaded[name].flags.writeable
