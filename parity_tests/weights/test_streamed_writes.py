"""save_weights streams: the file is safetensors' own (save_file's bytes, with room left in the
header), each tensor is read at most twice and never kept, a failure leaves nothing behind, and
add_metadata rewrites the header in place when it fits."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping

import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open

from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.files.outputs import WriteFailed
from transformer_rosetta.spec.config import preset
from transformer_rosetta.weights import format as fmt
from transformer_rosetta.weights.init import init_weights

CONFIG = preset("tiny").replace(share_embeddings=False, tgt_vocab_size=40, output_bias=True)


def split(data: bytes) -> tuple[bytes, bytes]:
    """(the header's JSON text, the data) of a safetensors file's bytes."""
    (n,) = struct.unpack("<Q", data[:8])
    return data[8 : 8 + n], data[8 + n :]


def metadata_span(text: bytes) -> tuple[int, int]:
    """Where the __metadata__ object's text starts and ends inside a header's JSON."""
    start = text.index(b'"__metadata__":') + len(b'"__metadata__":')
    _, length = json.JSONDecoder().raw_decode(text[start:].decode())
    return start, start + len(text[start:].decode()[:length].encode())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_the_bytes_are_safetensors_own(tmp_path, dtype):
    """Against safetensors.numpy.save_file of the same tensors and metadata: the same data, and
    the same header text but for two things safetensors does not fix or we add on purpose:
    the order of the metadata keys (a Rust HashMap's, random per process) and HEADER_ROOM
    spaces after the JSON."""
    weights = init_weights(CONFIG, seed=11, scheme="perturbed", dtype=dtype)
    ours = tmp_path / "ours.safetensors"
    fmt.save_weights(ours, weights, CONFIG, producer="test", task="numbers")
    _, metadata = fmt.read_header(ours)
    theirs = tmp_path / "theirs.safetensors"
    safetensors.numpy.save_file(weights, str(theirs), metadata=metadata)

    our_text, our_data = split(ours.read_bytes())
    their_text, their_data = split(theirs.read_bytes())
    assert our_data == their_data
    assert len(our_text) == len(their_text) + fmt.HEADER_ROOM
    assert our_text[len(their_text) :] == b" " * fmt.HEADER_ROOM
    our_text = our_text[: len(their_text)]
    (a, b), (c, d) = metadata_span(our_text), metadata_span(their_text)
    assert (a, b) == (c, d)  # the metadata objects are the same length, at the same place
    assert our_text[:a] + our_text[b:] == their_text[:c] + their_text[d:]
    assert json.loads(our_text[a:b]) == json.loads(their_text[c:d])
    # Our order is fixed: the format's keys first.
    assert list(json.loads(our_text[a:b])) == [
        "format",
        "format_version",
        "config",
        "producer",
        "task",
    ]


def test_safetensors_readers_skip_the_room(tmp_path):
    weights = init_weights(CONFIG, seed=2, dtype="bfloat16")
    path = tmp_path / "w.safetensors"
    fmt.save_weights(path, weights, CONFIG, producer="test", metadata={"note": "é ✓"})
    with safe_open(str(path), framework="np") as f:
        assert f.metadata()["note"] == "é ✓"
        assert set(f.keys()) == set(weights)
        for name, want in weights.items():
            assert f.get_tensor(name).tobytes() == want.tobytes(), name
    loaded = safetensors.numpy.load_file(str(path))
    assert all(loaded[n].tobytes() == w.tobytes() for n, w in weights.items())


class Counting(Mapping):
    """Weights computed on access (as a transpose of a mapped file would be), counting each."""

    def __init__(self, weights, fail_on=None):
        self.weights, self.fail_on = weights, fail_on
        self.reads: list[str] = []

    def __getitem__(self, name):
        self.reads.append(name)
        if self.fail_on == (name, self.reads.count(name)):
            raise RuntimeError(f"cannot compute {name}")
        return np.array(self.weights[name])  # a new array each time, as a computation gives

    def __iter__(self):
        return iter(self.weights)

    def __len__(self):
        return len(self.weights)


@pytest.mark.parametrize("max_shard_size", [None, 3000])
def test_each_tensor_is_read_at_most_twice_and_written_in_file_order(tmp_path, max_shard_size):
    weights = init_weights(CONFIG, seed=4)
    lazy = Counting(weights)
    path = tmp_path / ("w.safetensors" if max_shard_size is None else "shards")
    fmt.save_weights(path, lazy, CONFIG, producer="test", max_shard_size=max_shard_size)
    counts = {name: lazy.reads.count(name) for name in weights}
    assert set(counts.values()) == {2}
    # The check reads each once, then the write once each, shard by shard in name order.
    check, write = lazy.reads[: len(weights)], lazy.reads[len(weights) :]
    assert sorted(check) == sorted(weights)
    if max_shard_size is None:
        assert write == sorted(weights)
    loaded = fmt.load_weights(path).tensors
    assert all(loaded[n].tobytes() == w.tobytes() for n, w in weights.items())


@pytest.mark.parametrize("max_shard_size", [None, 3000])
def test_a_failure_mid_write_leaves_no_file_and_no_temp(tmp_path, max_shard_size):
    weights = init_weights(CONFIG, seed=4)
    lazy = Counting(weights, fail_on=("output.bias", 2))
    (tmp_path / "out").mkdir()
    path = tmp_path / "out" / ("w.safetensors" if max_shard_size is None else "shards")
    with pytest.raises((RuntimeError, WriteFailed), match="cannot compute output.bias"):
        fmt.save_weights(path, lazy, CONFIG, producer="test", max_shard_size=max_shard_size)
    # output.bias is the last tensor in both orders: every other one was written first.
    assert len(lazy.reads) == 2 * len(weights)
    assert os.listdir(tmp_path / "out") == []


def test_a_tensor_that_changes_between_check_and_write_is_refused(tmp_path):
    weights = init_weights(CONFIG, seed=4)

    class Shifty(Counting):
        def __getitem__(self, name):
            value = super().__getitem__(name)
            return value[:-1] if name == "output.bias" and self.reads.count(name) == 2 else value

    path = tmp_path / "w.safetensors"
    with pytest.raises(WriteFailed, match=r"tensor output.bias changed between its check and its"):
        fmt.save_weights(path, Shifty(weights), CONFIG, producer="test")
    assert os.listdir(tmp_path) == []


def test_metadata_adds_entries_and_refuses_the_writers_own(tmp_path):
    weights = init_weights(CONFIG, seed=4)
    path = tmp_path / "w.safetensors"
    fmt.save_weights(path, weights, CONFIG, "test", metadata={"provenance": '{"a": 1}'})
    assert fmt.load_weights(path).metadata["provenance"] == '{"a": 1}'
    with pytest.raises(WeightFileError) as info:
        fmt.save_weights(
            tmp_path / "x.safetensors", weights, CONFIG, "t", metadata={"config": "{}"}
        )
    assert info.value.problems == [
        "metadata config is set by the writer (format, format_version, config, producer, task)"
    ]
    with pytest.raises(WeightFileError, match="metadata n must be a string, got an integer"):
        fmt.save_weights(tmp_path / "x.safetensors", weights, CONFIG, "t", metadata={"n": 1})
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors"]


def test_add_metadata_rewrites_a_header_that_fits_in_place(tmp_path):
    weights = init_weights(CONFIG, seed=4)
    path = tmp_path / "w.safetensors"
    fmt.save_weights(path, weights, CONFIG, "test")
    before, inode = path.read_bytes(), path.stat().st_ino
    fmt.add_metadata(path, {"provenance": "x" * 4000})
    after = path.read_bytes()
    assert path.stat().st_ino == inode and len(after) == len(before)  # in place
    assert split(after)[1] == split(before)[1]
    assert fmt.load_weights(path).metadata["provenance"] == "x" * 4000
    with safe_open(str(path), framework="np") as f:
        assert f.metadata()["provenance"] == "x" * 4000


def test_add_metadata_that_does_not_fit_rewrites_the_file(tmp_path):
    weights = init_weights(CONFIG, seed=4)
    path = tmp_path / "w.safetensors"
    fmt.save_weights(path, weights, CONFIG, "test")
    before, inode = path.read_bytes(), path.stat().st_ino
    big = "y" * (2 * fmt.HEADER_ROOM)
    fmt.add_metadata(path, {"tokenizer": big})
    after = path.read_bytes()
    assert path.stat().st_ino != inode  # a new file, renamed over the old
    assert split(after)[1] == split(before)[1]
    assert len(split(after)[0]) % 8 == 0
    assert split(after)[0].endswith(b" " * fmt.HEADER_ROOM)  # fresh room for the next update
    assert fmt.load_weights(path).metadata["tokenizer"] == big
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors"]


def test_add_metadata_never_writes_through_a_second_link(tmp_path):
    """A file with two names (a hub cache's blob) is replaced, not changed in place: the other
    name keeps its bytes."""
    weights = init_weights(CONFIG, seed=4)
    path = tmp_path / "w.safetensors"
    fmt.save_weights(path, weights, CONFIG, "test")
    other = tmp_path / "blob"
    os.link(path, other)
    before = other.read_bytes()
    fmt.add_metadata(path, {"provenance": "p"})
    assert other.read_bytes() == before
    assert fmt.load_weights(path).metadata["provenance"] == "p"


def test_add_metadata_on_a_file_safetensors_wrote(tmp_path):
    """No room there: the whole rewrite, as before."""
    weights = init_weights(CONFIG, seed=4)
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(weights, str(path), metadata={"format": "pt"})
    fmt.add_metadata(path, {"provenance": "p"})
    with safe_open(str(path), framework="np") as f:
        assert f.metadata() == {"format": "pt", "provenance": "p"}
        assert all(f.get_tensor(n).tobytes() == w.tobytes() for n, w in weights.items())
