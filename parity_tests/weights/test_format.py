"""The weight file: bit-exact round trips, one message per kind of problem, atomic saves."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import safetensors.numpy

from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.spec.config import preset
from transformer_rosetta.spec.names import canonical_shapes
from transformer_rosetta.weights import format as fmt
from transformer_rosetta.weights.init import init_weights

CONFIG = preset("tiny").replace(share_embeddings=False, tgt_vocab_size=40, output_bias=True)


def saved(tmp_path, dtype="float32", name="w.safetensors"):
    path = tmp_path / name
    weights = init_weights(CONFIG, seed=7, scheme="perturbed", dtype=dtype)
    fmt.save_weights(path, weights, CONFIG, producer="test")
    return path, weights


def problems_loading(path, **kwargs) -> list[str]:
    with pytest.raises(WeightFileError) as info:
        fmt.load_weights(path, **kwargs)
    return info.value.problems


def write_raw(path, tensors, metadata):
    safetensors.numpy.save_file(tensors, str(path), metadata=metadata)


def good_metadata(**changes):
    meta = {"format": fmt.FORMAT_NAME, "format_version": "1", "config": CONFIG.to_json()}
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not None}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    path, weights = saved(tmp_path, dtype)
    loaded = fmt.load_weights(path)
    assert loaded.config == CONFIG
    assert loaded.dtype == dtype
    assert loaded.producer == "test"
    assert list(loaded.tensors) == list(canonical_shapes(CONFIG))
    for name, want in weights.items():
        got = loaded.tensors[name]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes(), name


def test_metadata_holds_format_version_config_and_producer(tmp_path):
    path, _ = saved(tmp_path)
    _, metadata = fmt.read_header(path)
    assert metadata["format"] == "transformer-rosetta"
    assert metadata["format_version"] == "1"
    assert json.loads(metadata["config"]) == CONFIG.to_dict()
    assert metadata["producer"] == "test"


def test_missing_unexpected_wrong_shape_and_dtype_all_at_once(tmp_path):
    weights = init_weights(CONFIG, 0)
    del weights["encoder.layers.0.self_attention.query.kernel"]
    weights["encoder.layers.0.extra"] = np.zeros(3, np.float32)
    weights["decoder.final_norm_typo.scale"] = np.zeros(3, np.float32)
    weights["output.bias"] = np.zeros(41, np.float32)
    weights["decoder.embedding"] = weights["decoder.embedding"].astype(np.int32)
    path = tmp_path / "bad.safetensors"
    write_raw(path, weights, good_metadata())
    problems = problems_loading(path)
    assert problems[0] == "missing tensors (1): encoder.layers.0.self_attention.query.kernel"
    assert problems[1] == (
        "unexpected tensors (2): decoder.final_norm_typo.scale, encoder.layers.0.extra"
    )
    assert "wrong shape for output.bias: file has [41], config needs [40]" in problems
    assert any(p.startswith("wrong dtype for decoder.embedding: int32") for p in problems)
    assert len(problems) == 4


def test_mixed_dtypes(tmp_path):
    weights = init_weights(CONFIG, 0)
    weights["output.bias"] = weights["output.bias"].astype(np.float16)
    path = tmp_path / "mixed.safetensors"
    write_raw(path, weights, good_metadata())
    (problem,) = problems_loading(path)
    assert (
        problem.startswith("mixed dtypes (1 float16, ")
        and "a weight file holds one dtype" in problem
    )


def test_metadata_absent(tmp_path):
    path = tmp_path / "plain.safetensors"
    write_raw(path, init_weights(CONFIG, 0), None)
    (problem,) = problems_loading(path)
    assert problem.startswith("metadata absent")
    # With the config given by the caller, the same file loads.
    assert fmt.load_weights(path, config=CONFIG).config == CONFIG


def test_config_invalid(tmp_path):
    bad = {**CONFIG.to_dict(), "num_heads": 5}
    path = tmp_path / "badconfig.safetensors"
    write_raw(path, init_weights(CONFIG, 0), good_metadata(config=json.dumps(bad)))
    (problem,) = problems_loading(path)
    assert problem.startswith("config in metadata is invalid: d_model: 16 is not divisible")


def test_config_not_the_expected_one(tmp_path):
    path, _ = saved(tmp_path)
    problems = problems_loading(path, config=CONFIG.replace(activation="gelu"))
    assert problems == [
        "config differs from the expected one in activation (file 'relu', expected 'gelu')"
    ]


def test_future_version_is_refused(tmp_path):
    path = tmp_path / "future.safetensors"
    write_raw(path, init_weights(CONFIG, 0), good_metadata(format_version="2"))
    (problem,) = problems_loading(path)
    assert problem == (
        "written in format version 2, newer than this reader's 1: upgrade transformer-rosetta "
        "to read it"
    )


def test_other_format_name(tmp_path):
    path = tmp_path / "other.safetensors"
    write_raw(path, init_weights(CONFIG, 0), good_metadata(format="some-other-format"))
    assert "not a transformer-rosetta file (metadata format is 'some-other-format')" in (
        problems_loading(path)
    )


def test_truncated_file(tmp_path):
    path, _ = saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    (problem,) = problems_loading(path)
    assert problem.startswith("truncated: the header describes")
    (header_len,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[: 8 + header_len // 2])
    (problem,) = problems_loading(path)
    assert problem.startswith(f"truncated: the header needs {header_len} bytes")


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"hello",
        b"PK\x03\x04" + bytes(200),
        b"\x10\x00\x00\x00\x00\x00\x00\x00[1, 2, 3, 4, 5, 6]",
    ],
)
def test_not_a_safetensors_file(tmp_path, content):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(content)
    (problem,) = problems_loading(path)
    assert problem.startswith("not a safetensors file")


def test_missing_file_and_folder(tmp_path):
    assert problems_loading(tmp_path / "nope.safetensors") == ["no such file"]
    assert problems_loading(tmp_path) == ["is a folder, not a weight file"]


def test_save_validates_before_writing(tmp_path):
    weights = init_weights(CONFIG, 0)
    weights.pop("output.bias")
    path = tmp_path / "w.safetensors"
    with pytest.raises(WeightFileError, match=r"missing tensors \(1\): output.bias"):
        fmt.save_weights(path, weights, CONFIG, producer="test")
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_interrupted_save_keeps_the_old_file_and_leaves_no_partial(tmp_path):
    path, _ = saved(tmp_path)
    before = path.read_bytes()

    class DiesMidWrite(dict):
        """The weights, until the write (after the check, the header and most tensors were
        written: the file is in name order) asks for output.bias: then Ctrl-C, as if the user
        pressed it mid-write."""

        def __getitem__(self, name):
            if name == "output.bias" and self.checked:
                raise KeyboardInterrupt
            self.checked = self.checked or name == "output.bias"
            return super().__getitem__(name)

        def items(self):
            return ((name, self[name]) for name in self)

    weights = DiesMidWrite(init_weights(CONFIG, seed=99))
    weights.checked = False
    with pytest.raises(KeyboardInterrupt):
        fmt.save_weights(path, weights, CONFIG, producer="test")
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors"]


def test_save_into_missing_folder(tmp_path):
    with pytest.raises(WeightFileError, match="does not exist"):
        fmt.save_weights(tmp_path / "no" / "w.safetensors", init_weights(CONFIG, 0), CONFIG, "t")
