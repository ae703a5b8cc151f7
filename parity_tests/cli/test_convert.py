"""`rosetta convert`: kinds, refusals, --force, atomic writes, the summary line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from parity_tests.paths import VECTORS
from transformer_rosetta.adapter.backends import unavailable_reason
from transformer_rosetta.cli import main
from transformer_rosetta.spec.config import preset
from transformer_rosetta.weights.format import load_weights, save_weights
from transformer_rosetta.weights.init import init_weights

VECTOR = VECTORS / "pre_ln_untied.safetensors"
NATIVE = {
    "torch": ("torch", "model.pt"),
    "keras": ("tf", "model.weights.h5"),
    "flax": ("jax", "model.msgpack"),
}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(load_weights(VECTOR).config.to_json())
    return path


def test_rosetta_to_rosetta_prints_the_summary_and_the_verification(capsys, tmp_path):
    code, out, _ = run(capsys, "convert", VECTOR, tmp_path / "copy.safetensors")
    assert code == 0
    # The oracle runs both sides on the same float64 tensors: the difference is exactly 0.
    assert out == (
        f"converted {VECTOR} (rosetta) -> {tmp_path / 'copy.safetensors'} (rosetta): "
        "94 tensors, 7,761 parameters, float64\n"
        "verified: max |logit difference| 0 <= 1e-10, numpy float64 oracle vs numpy float64 "
        "oracle, 2 seeded ragged probes\n"
    )
    again = load_weights(tmp_path / "copy.safetensors")
    original = load_weights(VECTOR)
    assert all(
        again.tensors[k].tobytes() == original.tensors[k].tobytes() for k in original.tensors
    )


@pytest.mark.parametrize("kind", list(NATIVE))
def test_every_native_kind_round_trips_bit_exactly(capsys, tmp_path, config_file, kind):
    backend, name = NATIVE[kind]
    if unavailable_reason(backend):
        pytest.skip(unavailable_reason(backend))
    native, back = tmp_path / name, tmp_path / "back.safetensors"
    code, out, err = run(capsys, "convert", VECTOR, native, "--config", config_file)
    assert code == 0, err
    assert f"({kind}): 94 tensors" in out
    code, out, err = run(capsys, "convert", native, back, "--config", config_file)
    assert code == 0, err
    original, again = load_weights(VECTOR), load_weights(back)
    assert again.config == original.config
    assert all(
        again.tensors[k].tobytes() == original.tensors[k].tobytes() for k in original.tensors
    )


def test_chain_through_every_native_format_is_bit_exact(capsys, tmp_path, config_file):
    missing = {b: r for b in ("torch", "tf", "jax") if (r := unavailable_reason(b))}
    if missing:
        pytest.skip(f"needs every framework: {missing}")
    config = preset("tiny").replace(share_embeddings=False, tie_output=True, tgt_vocab_size=40)
    weights = init_weights(config, seed=3, scheme="perturbed", dtype="bfloat16")
    start = tmp_path / "start.safetensors"
    save_weights(start, weights, config, producer="test")
    cfg = tmp_path / "tiny.json"
    cfg.write_text(config.to_json())
    chain = [
        "a.pt",
        "b.safetensors",
        "c.weights.h5",
        "d.safetensors",
        "e.msgpack",
        "f.safetensors",
        "g.pt",
        "h.safetensors",
    ]
    previous = start
    for name in chain:
        code, _, err = run(capsys, "convert", previous, tmp_path / name, "--config", cfg)
        assert code == 0, err
        previous = tmp_path / name
    end = load_weights(previous)
    assert end.dtype == "bfloat16"
    assert all(end.tensors[k].tobytes() == weights[k].tobytes() for k in weights)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.safetensors", "out.safetensors"], "missing.safetensors: no such file or folder"),
        ([VECTOR, "out.xyz"], "cannot tell the kind to write from the name"),
        (["in.pt", "out.safetensors", "--from", "torch"], "--config FILE.json is required"),
        ([VECTOR, VECTOR], "exists; pass --force to overwrite it"),
        ([VECTOR, "nofolder/out.safetensors"], "the destination folder does not exist"),
        (
            [VECTOR, "out.bin", "--from", "rosetta", "--to", "annotated"],
            "invalid choice: 'annotated'",
        ),
    ],
)
def test_refusals_are_one_line_exit_2(capsys, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    shutil.copy(VECTOR, tmp_path / "in.pt")  # any file: a torch source is refused before reading
    code, out, err = run(capsys, "convert", *args)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert message in err


def test_existing_destination_is_left_untouched_without_force(capsys, tmp_path):
    dst = tmp_path / "dst.safetensors"
    dst.write_bytes(b"precious")
    code, _, err = run(capsys, "convert", VECTOR, dst)
    assert code == 2 and dst.read_bytes() == b"precious"
    code, out, _ = run(capsys, "convert", VECTOR, dst, "--force", "--json")
    assert code == 0 and json.loads(out)["tensors"] == 94
    assert load_weights(dst).config == load_weights(VECTOR).config


def test_corrupt_source_leaves_destination_untouched(capsys, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(VECTOR.read_bytes()[:-64])
    dst = tmp_path / "dst.safetensors"
    dst.write_bytes(b"precious")
    code, _, err = run(capsys, "convert", bad, dst, "--force")
    assert code == 2 and "truncated" in err
    assert dst.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors", "dst.safetensors"]


def test_mismatched_config_is_refused(capsys, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(preset("tiny").to_json())
    code, _, err = run(capsys, "convert", VECTOR, tmp_path / "x.safetensors", "--config", other)
    assert code == 2 and "config differs from the expected one in" in err
    assert not (tmp_path / "x.safetensors").exists()
    np.testing.assert_equal(len(list(tmp_path.iterdir())), 1)


def test_a_pickle_payload_is_refused_and_never_runs(capsys, tmp_path, config_file):
    if unavailable_reason("torch"):
        pytest.skip(unavailable_reason("torch"))
    import pathlib
    import pickle

    marker = tmp_path / "payload_ran"

    class Payload:
        def __reduce__(self):
            return (pathlib.Path.touch, (marker,))

    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps({"encoder.layers.0.self_attention.query.weight": Payload()}))
    dst = tmp_path / "out.safetensors"
    code, out, err = run(capsys, "convert", evil, dst, "--from", "torch", "--config", config_file)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "refused: the file's pickle holds objects other than tensors" in err
    assert not marker.exists() and not dst.exists()
