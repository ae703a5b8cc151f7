"""`rosetta parity` and `rosetta forward`: tables, JSON, exit codes, plots and user inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity_tests.paths import VECTORS
from transformer_rosetta.adapter.backends import unavailable_reason
from transformer_rosetta.app import parity
from transformer_rosetta.cli import main
from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.config import preset
from transformer_rosetta.weights.format import load_weights, save_weights
from transformer_rosetta.weights.init import init_weights

needs_torch = pytest.mark.skipif(
    unavailable_reason("torch") is not None, reason=f"torch: {unavailable_reason('torch')}"
)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@needs_torch
def test_parity_json_compares_every_quantity_against_the_oracle_and_pairs(capsys):
    code, out, _ = run(
        capsys, "parity", "--frameworks", "numpy,torch", "--dtype", "float64", "--json"
    )
    report = json.loads(out)
    assert code == 0 and report["passed"] is True
    quantities = {c["quantity"] for c in report["comparisons"]}
    tiny = preset("tiny")
    assert len(quantities) == 2 + tiny.num_encoder_layers + 2 * tiny.num_decoder_layers + 1
    assert {
        "logits",
        "encoder_output",
        "logits (fused)",
        "decoder.layers.1.cross_attention",
    } <= quantities
    assert all(c["tolerance"] == 1e-10 and c["max_abs"] < 1e-12 for c in report["comparisons"])
    assert {(c["left"], c["right"]) for c in report["comparisons"]} == {("torch", "numpy")}


@needs_torch
def test_parity_table_and_plots(capsys, tmp_path):
    code, out, err = run(capsys, "parity", "--frameworks", "torch", "--plot", str(tmp_path))
    assert code == 0
    assert (
        "torch vs oracle" in out
        and "logits (fused)" in out
        and out.rstrip().splitlines()[-1].startswith("PASS")
    )
    assert "torch: building and running" in err  # progress goes to stderr
    pngs = sorted(p.name for p in tmp_path.iterdir())
    assert pngs == [
        "decoder_layers_1_cross_attention_head0.png",
        "decoder_layers_1_self_attention_head0.png",
        "encoder_layers_1_self_attention_head0.png",
    ]
    assert all((tmp_path / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


@needs_torch
def test_parity_exits_1_when_a_framework_disagrees(capsys, monkeypatch):
    real = parity.run_framework

    def off_by_a_little(*args, **kwargs):
        outputs = real(*args, **kwargs)
        outputs["logits"] = outputs["logits"] + 2e-5  # just over the float32 bound
        return outputs

    monkeypatch.setattr(parity, "run_framework", off_by_a_little)
    code, out, _ = run(capsys, "parity", "--frameworks", "torch")
    assert code == 1
    assert "FAIL" in out and out.rstrip().splitlines()[-1].startswith("FAIL: 1 of")


@needs_torch
def test_parity_on_user_weights_and_inputs(capsys, tmp_path):
    inputs = tmp_path / "batch.npz"
    src = np.array([[5, 6, 7, 0], [8, 0, 0, 0]])
    tgt = np.array([[1, 9, 3], [1, 4, 0]])
    np.savez(inputs, src=src, tgt=tgt)
    weights = str(VECTORS / "pre_ln_untied.safetensors")
    code, out, _ = run(
        capsys,
        "parity",
        "--weights",
        weights,
        "--inputs",
        str(inputs),
        "--frameworks",
        "torch",
        "--dtype",
        "float64",
        "--json",
    )
    report = json.loads(out)
    assert code == 0 and report["batch"] == 2 and report["src_len"] == 4
    assert report["config"]["norm_position"] == "pre"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["parity", "--frameworks", "torch,mxnet"], "unknown framework 'mxnet'"),
        (["parity", "--frameworks", "numpy"], "names only the oracle, which always runs"),
        (["parity", "--weights", "nope.safetensors"], "nope.safetensors: no such file"),
        (
            ["parity", "--weights", str(VECTORS / "pre_ln_untied.safetensors"), "--preset", "tiny"],
            "config differs from the expected one in",
        ),
        (["parity", "--batch", "0"], "argument --batch: must be >= 1"),
        (["parity", "--inputs", "missing.npz"], "--inputs: no such file missing.npz"),
        (["parity", "--preset", "tiny", "--config", "c.json"], "not both"),
        (
            ["forward", "--framework", "numpy", "--weights", "w.safetensors"],
            "the following arguments are required",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err


def test_parity_inputs_missing_keys_and_bad_ids(capsys, tmp_path):
    path = tmp_path / "x.npz"
    np.savez(path, source=np.zeros((1, 2), np.int64))
    code, _, err = run(capsys, "parity", "--inputs", str(path))
    assert code == 2 and "lacks src, tgt (has source)" in err
    np.savez(path, src=np.array([[3, 99]]), tgt=np.array([[1, 2]]))
    code, _, err = run(capsys, "parity", "--inputs", str(path), "--frameworks", "numpy,torch")
    assert code == 2 and "src: token id 99 at [0, 1] is outside the vocabulary [0, 48)" in err


@pytest.fixture
def forward_files(tmp_path):
    config = preset("tiny")
    weights = init_weights(config, seed=4, scheme="perturbed", dtype="float64")
    save_weights(tmp_path / "w.safetensors", weights, config, producer="test")
    np.save(tmp_path / "src.npy", np.array([[5, 6, 7, 0], [8, 9, 0, 0]]))
    np.save(tmp_path / "tgt.npy", np.array([[1, 4, 5], [1, 6, 0]]))
    return tmp_path


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_forward_writes_canonical_names_matching_the_oracle(capsys, forward_files, framework):
    if unavailable_reason(framework):
        pytest.skip(unavailable_reason(framework))
    d = forward_files
    code, out, _ = run(
        capsys,
        "forward",
        "--framework",
        framework,
        "--weights",
        str(d / "w.safetensors"),
        "--src",
        str(d / "src.npy"),
        "--tgt",
        str(d / "tgt.npy"),
        "--dtype",
        "float64",
        "--out",
        str(d / "out.npz"),
    )
    assert code == 0 and out.startswith(f"wrote {d / 'out.npz'}: 8 arrays")
    wf = load_weights(d / "w.safetensors")
    want = reference.forward(
        wf.tensors, wf.config, np.load(d / "src.npy"), np.load(d / "tgt.npy")
    ).named()
    with np.load(d / "out.npz", allow_pickle=False) as got:
        assert set(got.files) == set(want)
        for key in want:
            assert np.max(np.abs(got[key] - want[key])) <= 1e-10, key


def test_forward_bad_inputs_exit_2_and_write_nothing(capsys, forward_files):
    d = forward_files
    np.save(d / "bad.npy", np.array([[5, 600]]))
    np.save(d / "rank1.npy", np.array([5, 6]))
    np.save(d / "float.npy", np.array([[5.0, 6.0]]))
    (d / "junk.npy").write_bytes(b"junk")
    np.save(d / "one_row.npy", np.array([[1, 4]]))
    base = [
        "forward",
        "--framework",
        "numpy",
        "--weights",
        str(d / "w.safetensors"),
        "--out",
        str(d / "o.npz"),
    ]
    cases = [
        (["--src", str(d / "bad.npy"), "--tgt", str(d / "tgt.npy")], "token id 600"),
        (["--src", str(d / "rank1.npy"), "--tgt", str(d / "tgt.npy")], "rank 2"),
        (["--src", str(d / "float.npy"), "--tgt", str(d / "tgt.npy")], "must be integers"),
        (["--src", str(d / "junk.npy"), "--tgt", str(d / "tgt.npy")], "not a readable .npy array"),
        (["--src", str(d / "src.npy"), "--tgt", str(d / "one_row.npy")], "batch sizes differ"),
    ]
    for extra, message in cases:
        code, _, err = run(capsys, *base, *extra)
        assert code == 2 and message in err and err.count("\n") == 1, err
    (d / "short.safetensors").write_bytes((d / "w.safetensors").read_bytes()[:-40])
    code, _, err = run(
        capsys,
        "forward",
        "--framework",
        "numpy",
        "--weights",
        str(d / "short.safetensors"),
        "--src",
        str(d / "src.npy"),
        "--tgt",
        str(d / "tgt.npy"),
        "--out",
        str(d / "o.npz"),
    )
    assert code == 2 and "truncated" in err
    assert not (d / "o.npz").exists()


# -- the halves of the family: decoder-only and encoder-only ------------------------------

HALVES = {
    "tiny_decoder_only": {
        "quantities": [
            "logits",
            "decoder.layers.0.self_attention",
            "decoder.layers.1.self_attention",
            "logits (fused)",
        ],
        "lengths": (None, 7),
        "inputs": "inputs: batch 4, target length 7 (a decoder-only model: no source), ragged padding",
        "plots": ["decoder_layers_1_self_attention_head0.png"],
    },
    "tiny_encoder_only": {
        "quantities": [
            "encoder_output",
            "pooled_output",
            "encoder.layers.0.self_attention",
            "encoder.layers.1.self_attention",
            "encoder_output (fused)",
        ],
        "lengths": (9, None),
        "inputs": "inputs: batch 4, source length 9 (an encoder-only model: no target), "
        "ragged padding",
        "plots": ["encoder_layers_1_self_attention_head0.png"],
    },
}


@needs_torch
@pytest.mark.parametrize("name", list(HALVES))
def test_parity_json_of_a_half_compares_its_own_outputs(capsys, name):
    code, out, _ = run(
        capsys, "parity", "--preset", name, "--frameworks", "numpy,torch", "--dtype", "float64",
        "--json",
    )  # fmt: skip
    report = json.loads(out)
    want = HALVES[name]
    assert code == 0 and report["passed"] is True
    assert [c["quantity"] for c in report["comparisons"]] == want["quantities"]
    assert (report["src_len"], report["tgt_len"]) == want["lengths"] and report["batch"] == 4
    assert report["kind"] == preset(name).kind
    assert all(c["max_abs"] < 1e-12 for c in report["comparisons"])


@needs_torch
@pytest.mark.parametrize("name", list(HALVES))
def test_parity_table_and_plots_of_a_half(capsys, tmp_path, name):
    code, out, _ = run(
        capsys, "parity", "--preset", name, "--frameworks", "torch", "--plot", str(tmp_path)
    )
    want = HALVES[name]
    assert code == 0
    lines = out.splitlines()
    assert lines[1] == want["inputs"]
    rows = [line.split("  ")[0] for line in lines[5 : 5 + len(want["quantities"])]]
    assert rows == want["quantities"]
    assert lines[-1].startswith(f"PASS: {len(want['quantities'])} comparisons of torch")
    assert sorted(p.name for p in tmp_path.iterdir()) == want["plots"]


@pytest.mark.parametrize("name", list(HALVES))
def test_parity_of_a_half_passes_in_every_framework(capsys, name):
    """`rosetta parity --preset NAME`, float32, defaults."""
    ran = [f for f in ("torch", "tf", "jax") if unavailable_reason(f) is None]
    if not ran:
        pytest.skip("no framework installed")
    code, out, err = run(capsys, "parity", "--preset", name)
    comparisons = len(HALVES[name]["quantities"]) * (len(ran) + len(ran) * (len(ran) - 1) // 2)
    assert code == 0, out + err
    assert out.splitlines()[-1].startswith(f"PASS: {comparisons} comparisons of {', '.join(ran)}")


@needs_torch
def test_parity_of_a_half_on_user_inputs_and_the_onnx_runtime_skipped(capsys, tmp_path):
    path = tmp_path / "tgt.npz"
    np.savez(path, tgt=np.array([[1, 9, 3, 5], [1, 4, 0, 0]]))
    frameworks = "torch,onnx" if unavailable_reason("onnx") is None else "torch"
    code, out, _ = run(
        capsys, "parity", "--preset", "tiny_decoder_only", "--inputs", str(path),
        "--frameworks", frameworks, "--json",
    )  # fmt: skip
    report = json.loads(out)
    assert code == 0 and (report["batch"], report["src_len"], report["tgt_len"]) == (2, None, 4)
    assert [r["label"] for r in report["runs"]] == ["torch"]
    if frameworks == "torch,onnx":
        assert report["skipped"] == {
            "onnx": "the exported graphs are the encoder-decoder's; this model is decoder-only"
        }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--preset", "tiny_decoder_only", "--src-len", "5"],
            "--src-len: a decoder-only model has no encoder and takes no src; give --tgt-len only",
        ),
        (
            ["--preset", "tiny_encoder_only", "--tgt-len", "5"],
            "--tgt-len: an encoder-only model has no decoder and takes no tgt; give --src-len only",
        ),
        (
            ["--preset", "tiny_decoder_only", "--inputs", "{both}"],
            "--inputs: a decoder-only model has no encoder and takes no src; {both} holds one: "
            "save only tgt",
        ),
        (
            ["--preset", "tiny_encoder_only", "--inputs", "{tgt}"],
            "--inputs: {tgt} lacks src (has tgt)",
        ),
        (
            ["--preset", "tiny_encoder_only", "--plot", "{plots}", "--plot-layer", "2"],
            "--plot-layer 2 is outside the model's layers 0..1",
        ),
    ],
)
def test_a_half_refuses_the_inputs_of_the_other_in_one_line(capsys, tmp_path, argv, message):
    files = {"both": tmp_path / "both.npz", "tgt": tmp_path / "tgt.npz", "plots": tmp_path / "p"}
    np.savez(files["both"], src=np.array([[5, 6]]), tgt=np.array([[1, 4]]))
    np.savez(files["tgt"], tgt=np.array([[1, 4]]))
    code, out, err = run(capsys, "parity", *(a.format(**files) for a in argv))
    assert code == 2 and out == ""
    assert err == f"rosetta: error: {message.format(**files)}\n"
    assert not files["plots"].exists()


@pytest.fixture
def half_files(tmp_path):
    for name in HALVES:
        config = preset(name)
        weights = init_weights(config, seed=4, scheme="perturbed", dtype="float64")
        save_weights(tmp_path / f"{name}.safetensors", weights, config, producer="test")
    np.save(tmp_path / "src.npy", np.array([[5, 6, 7, 0], [8, 9, 0, 0]]))
    np.save(tmp_path / "tgt.npy", np.array([[1, 4, 5], [1, 6, 0]]))
    return tmp_path


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize(
    ("name", "given", "arrays"),
    [
        ("tiny_decoder_only", "tgt", ["logits", "decoder.layers.0.self_attention"]),
        ("tiny_encoder_only", "src", ["encoder_output", "pooled_output"]),
    ],
)
def test_forward_of_a_half_takes_its_one_input(capsys, half_files, framework, name, given, arrays):
    if unavailable_reason(framework):
        pytest.skip(unavailable_reason(framework))
    d = half_files
    code, out, _ = run(
        capsys, "forward", "--framework", framework, "--weights", str(d / f"{name}.safetensors"),
        f"--{given}", str(d / f"{given}.npy"), "--dtype", "float64", "--out", str(d / "out.npz"),
        "--json",
    )  # fmt: skip
    summary = json.loads(out)
    assert code == 0 and summary["kind"] == preset(name).kind
    wf = load_weights(d / f"{name}.safetensors")
    ids = np.load(d / f"{given}.npy")
    want = reference.forward(
        wf.tensors, wf.config, *((None, ids) if given == "tgt" else (ids, None))
    ).named()
    with np.load(d / "out.npz", allow_pickle=False) as got:
        assert set(got.files) == set(want) and set(arrays) <= set(want)
        for key in want:
            assert np.max(np.abs(got[key] - want[key])) <= 1e-10, key
    assert summary["arrays"]["logits" if given == "tgt" else "pooled_output"] == (
        [2, 3, 48] if given == "tgt" else [2, 16]
    )


def test_forward_of_a_half_refuses_the_other_input_and_writes_nothing(capsys, half_files):
    d = half_files
    cases = [
        (
            "tiny_decoder_only",
            ["--src", str(d / "src.npy"), "--tgt", str(d / "tgt.npy")],
            "--src: a decoder-only model has no encoder and takes no src; give --tgt only",
        ),
        (
            "tiny_decoder_only",
            [],
            "--tgt: a decoder-only model reads decoder input ids; give --tgt TGT.npy",
        ),
        (
            "tiny_encoder_only",
            ["--tgt", str(d / "tgt.npy")],
            "--tgt: an encoder-only model has no decoder and takes no tgt; give --src only",
        ),
        (
            "tiny_encoder_only",
            [],
            "--src: an encoder-only model reads source ids; give --src SRC.npy",
        ),
    ]
    for name, extra, message in cases:
        code, out, err = run(
            capsys, "forward", "--framework", "numpy", "--weights",
            str(d / f"{name}.safetensors"), "--out", str(d / "o.npz"), *extra,
        )  # fmt: skip
        assert code == 2 and out == "" and err == f"rosetta: error: {message}\n"
    assert not (d / "o.npz").exists()
