"""`rosetta convert --max-shard-size`: a folder of shards in Hugging Face's layout that every
reader of the shared format takes (inspect, convert's source), and one line with exit 2 for a
size or a destination it cannot write."""

from __future__ import annotations

import json
import os

import pytest
from safetensors import safe_open

from parity_tests.cli.command_line import one_line_error, run
from parity_tests.paths import VECTORS
from transformer_rosetta.weights.format import load_weights, planned_files

VECTOR = VECTORS / "pre_ln_untied.safetensors"  # 94 float64 tensors, 62,088 bytes
INDEX = "model.safetensors.index.json"


@pytest.fixture
def sharded(capsys, tmp_path):
    folder = tmp_path / "shards"
    code, out, err = run(
        capsys, "convert", VECTOR, f"{folder}/", "--max-shard-size", "20KB", "--no-verify"
    )
    assert code == 0, err
    assert out.startswith(f"converted {VECTOR} (rosetta) -> ")
    return folder


def test_convert_writes_the_planned_shards_and_index(sharded):
    original = load_weights(VECTOR)
    files = planned_files(original.config, "float64", 20_000)
    assert len(files) > 2 and files[-1] == INDEX
    assert sorted(os.listdir(sharded)) == sorted(files)
    index = json.loads((sharded / INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in original.tensors.values())
    for file in files[:-1]:
        with safe_open(str(sharded / file), framework="np") as f:
            record = json.loads(f.metadata()["provenance"])  # in every shard
        assert record["verify"] == {"not_run": "--no-verify"}
    again = load_weights(sharded)
    assert again.config == original.config
    for name, t in original.tensors.items():
        assert again.tensors[name].tobytes() == t.tobytes(), name


@pytest.mark.parametrize("target", ["folder", "index"])
def test_inspect_reads_the_folder_and_its_index(capsys, sharded, target):
    path = sharded if target == "folder" else sharded / INDEX
    code, out, err = run(capsys, "inspect", path, "--json")
    assert code == 0, err
    report = json.loads(out)
    expected = json.loads(run(capsys, "inspect", VECTOR, "--json")[1])
    assert report["config"] == expected["config"]
    assert report["tensors"] == expected["tensors"]
    assert report["provenance"]["source"]["file"] == VECTOR.name


def test_a_sharded_model_converts_back_to_one_file(capsys, tmp_path, sharded):
    back = tmp_path / "back.safetensors"
    code, _, err = run(capsys, "convert", sharded / INDEX, back, "--no-verify")
    assert code == 0, err
    original, again = load_weights(VECTOR), load_weights(back)
    assert all(again.tensors[n].tobytes() == t.tobytes() for n, t in original.tensors.items())


def test_a_shard_that_is_missing_is_named(capsys, sharded):
    first = sorted(os.listdir(sharded))[0]
    (sharded / first).unlink()
    code, _, err = run(capsys, "inspect", sharded)
    one_line_error(code, err, f"missing shard {first} (named by {INDEX})")


@pytest.mark.parametrize(
    ("size", "needle"),
    [
        ("0", "'0': a shard holds at least 1 byte"),
        ("-5", "'-5' is not a size"),
        ("2XB", "'2XB': unknown unit 'XB'"),
    ],
)
def test_a_bad_size_is_one_line(capsys, tmp_path, size, needle):
    code, _, err = run(
        capsys, "convert", VECTOR, tmp_path / "shards", f"--max-shard-size={size}", "--no-verify"
    )
    one_line_error(code, err, needle)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "argv", [["model.pt"], ["model.weights.h5"], ["out", "--to", "torch"], ["o.onnx"]]
)
def test_shards_of_another_kind_are_refused(capsys, tmp_path, argv):
    dst, *rest = argv
    code, _, err = run(capsys, "convert", VECTOR, tmp_path / dst, *rest, "--max-shard-size", "20KB")
    one_line_error(code, err, "--max-shard-size writes the shared format")
    assert os.listdir(tmp_path) == []


def test_train_refuses_a_bad_size_before_training(capsys, tmp_path):
    code, _, err = run(
        capsys, "train", "--framework", "torch", "--task", "numbers", "--out", tmp_path / "m",
        "--max-shard-size", "2XB",
    )  # fmt: skip
    one_line_error(code, err, "'2XB': unknown unit 'XB'")
