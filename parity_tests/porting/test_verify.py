"""`convert --verify`: the source and the written file run on seeded ragged probes; the record
(largest logit difference, bound, probes, the source's sha256, versions) goes into the file's
metadata, `inspect` shows it, and a file that misses the bound is removed with exit 1."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

import numpy as np
import pytest

from parity_tests.conftest import backend_or_skip
from parity_tests.paths import VECTORS
from transformer_rosetta.cli import main
from transformer_rosetta.porting import convert as convert_module
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.format import META_PROVENANCE, load_weights

VECTOR = VECTORS / "pre_ln_untied.safetensors"  # float64


def run(capsys, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def provenance(path: Path) -> dict:
    return json.loads(load_weights(path).metadata[META_PROVENANCE])


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(load_weights(VECTOR).config.to_json())
    return path


def test_a_conversion_records_its_source_and_its_check(capsys, tmp_path, config_file):
    backend_or_skip("torch")
    native, back = tmp_path / "model.pt", tmp_path / "back.safetensors"
    code, out, err = run(capsys, "convert", VECTOR, native, "--config", config_file)
    assert code == 0, err
    # torch's float64 model against the float64 oracle: float64's bound.
    assert "verified: max |logit difference|" in out and "<= 1e-10" in out
    assert "(torch files have no metadata: the record is not stored)" in out
    code, out, err = run(capsys, "convert", native, back, "--config", config_file)
    assert code == 0, err
    record = provenance(back)
    assert record["source"] == {
        "file": "model.pt",
        "kind": "torch",
        "sha256": hashlib.sha256(native.read_bytes()).hexdigest(),
    }
    installed = importlib.metadata.version("transformer-rosetta")  # the distribution's, not ours
    assert record["converter"].startswith(f"transformer-rosetta {installed} ")
    check = record["verify"]
    assert check["passed"] and check["bound"] == atol_for("float64") == 1e-10
    assert check["max_abs_logit_diff"] <= 1e-12  # measured 1.3e-15: summation order only
    assert check["sides"][0].startswith("torch ") and check["sides"][1] == "numpy float64 oracle"
    assert check["probe_seed"] == 0 and check["probe_shapes"] == [[3, 7, 5], [2, 4, 9]]
    assert {"torch", "numpy"} <= set(check["versions"])
    code, out, err = run(capsys, "inspect", back)
    assert code == 0, err
    assert f"converted from: model.pt (torch), sha256 {record['source']['sha256']}" in out
    assert "verified: passed" in out and "probes: seed 0, batch x src x tgt 3x7x5, 2x4x9" in out


def _off_by_a_bias(real):
    """A converter bug of the realistic kind: one bias entry written 1e-3 off. (Not every entry:
    a shift of all of them by the same amount is one the next LayerNorm takes out exactly.)"""

    def write(path, kind, config, tensors, producer, onnx=None, **options):
        tensors = dict(tensors)
        name = next(n for n in tensors if n.endswith("feed_forward.output.bias"))
        tensors[name] = tensors[name].copy()
        tensors[name][0] += 1e-3
        return real(path, kind, config, tensors, producer, onnx, **options)

    return write


@pytest.mark.parametrize("force", [False, True])
def test_a_destination_that_misses_its_bound_is_not_written_with_exit_1(
    capsys, tmp_path, monkeypatch, force
):
    """The file is verified where it was staged, beside DST: a miss writes nothing, and an older
    file at DST (--force) is left as it was."""
    dst = tmp_path / "copy.safetensors"
    if force:
        dst.write_bytes(b"an older file")
    monkeypatch.setattr(
        convert_module, "write_destination", _off_by_a_bias(convert_module.write_destination)
    )
    code, out, err = run(capsys, "convert", VECTOR, dst, *(["--force"] if force else []))
    assert code == 1 and out == "" and "Traceback" not in err
    # progress first ("  verifying: ..."), then the one line that says what went wrong
    last = err.splitlines()[-1]
    assert last.startswith("rosetta: error: verification failed: max |logit difference| ")
    assert "exceeds the bound 1e-10 (numpy float64 oracle vs numpy float64 oracle)" in last
    assert last.endswith(f"{dst} was {'left as it was' if force else 'not written'}")
    if force:
        assert dst.read_bytes() == b"an older file"
        assert [p.name for p in tmp_path.iterdir()] == ["copy.safetensors"]
    else:
        assert not dst.exists() and [p.name for p in tmp_path.iterdir()] == []
        assert [p.name for p in tmp_path.iterdir()] == []
    # --no-verify writes the same bug and says it did not look.
    code, out, err = run(capsys, "convert", VECTOR, dst, "--no-verify", "--force")
    assert code == 0 and "not verified: --no-verify" in out
    assert provenance(dst)["verify"] == {"not_run": "--no-verify"}


def test_an_outside_models_code_is_not_run_and_the_record_says_so(capsys, tmp_path):
    backend_or_skip("torch")
    from parity_tests.fixtures import SIZES, annotated_transformer

    model = annotated_transformer.make_model(SIZES, seed=7)
    annotated_transformer.save(model, tmp_path / "annotated.pt")
    (tmp_path / "heads.json").write_text(json.dumps({"num_heads": SIZES["num_heads"]}))
    args = ("convert", tmp_path / "annotated.pt", tmp_path / "m.safetensors")
    code, _, err = run(capsys, *args, "--config", tmp_path / "heads.json", "--verify")
    assert code == 2 and err.count("\n") == 1
    assert "--verify: annotated is the user's own code, which rosetta does not run" in err
    assert not (tmp_path / "m.safetensors").exists()
    code, out, err = run(capsys, *args, "--config", tmp_path / "heads.json")
    assert code == 0, err
    assert "not verified: annotated is the user's own code" in out
    record = provenance(tmp_path / "m.safetensors")
    assert record["source"]["kind"] == "annotated"
    assert (
        record["source"]["sha256"]
        == hashlib.sha256((tmp_path / "annotated.pt").read_bytes()).hexdigest()
    )
    assert record["verify"] == {
        "not_run": "annotated is the user's own code, which rosetta does not run"
    }


def test_the_record_keeps_every_tensor_byte(tmp_path):
    """Stamping the record rewrites the header only: the tensors are the bytes first written."""
    out = tmp_path / "copy.safetensors"
    assert main(["convert", str(VECTOR), str(out)]) == 0
    before, after = load_weights(VECTOR), load_weights(out)
    assert META_PROVENANCE in after.metadata and after.config == before.config
    for name, value in before.tensors.items():
        assert np.asarray(after.tensors[name]).tobytes() == np.asarray(value).tobytes(), name


@pytest.mark.parametrize(
    ("vector", "gap", "compared", "shapes"),
    [
        ("gpt_decoder_only", "max_abs_logit_diff", None, [[3, None, 5], [2, None, 9]]),
        (
            "bert_encoder_only",
            "max_abs_output_diff",
            "encoder_output, pooled_output",
            [[3, 7, None], [2, 4, None]],
        ),
    ],
)
def test_a_half_is_verified_on_what_it_outputs(capsys, tmp_path, vector, gap, compared, shapes):
    """A decoder-only model's logits; an encoder-only model's encoder output and pooled vector
    (it has no logits). Both sides float64 (torch and the oracle): float64's bound."""
    backend_or_skip("torch")
    source = VECTOR.parent / f"{vector}.safetensors"
    native, back = tmp_path / "model.pt", tmp_path / "back.safetensors"
    config = tmp_path / "config.json"
    config.write_text(load_weights(source).config.to_json())
    assert run(capsys, "convert", source, native, "--config", config)[0] == 0
    code, out, err = run(capsys, "convert", native, back, "--config", config)
    assert code == 0, err
    check = provenance(back)["verify"]
    assert check["passed"] and check[gap] <= 1e-12 and check["bound"] == 1e-10
    assert check.get("compared") == compared and check["probe_shapes"] == shapes
    code, out, err = run(capsys, "inspect", back)
    assert code == 0, err
    what = "logit" if compared is None else compared
    assert f"verified: passed, max |{what} difference|" in out
    assert (
        "batch x src x tgt " + ", ".join("x".join(str(n or "-") for n in s) for s in shapes) in out
    )
