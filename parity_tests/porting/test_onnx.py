"""ONNX: `rosetta export` (torch's exporter), onnxruntime as the fifth runtime of `rosetta parity`,
and decoding through the exported encoder and decoder-step graphs.

The float32 bound is parity's (common/spec/tolerances.py): the graph is the torch model's own
sequence of float32 operations (MatMul, Softmax, LayerNormalization with float32 statistics),
run by other kernels, so the same rounding analysis holds. The onnx tests skip, with the reason,
where the onnx extra is not installed; the last test checks that reason without it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from parity_tests.paths import VECTORS
from transformer_rosetta.adapter.backends import get_backend, unavailable_reason
from transformer_rosetta.app.parity import run_parity
from transformer_rosetta.cli import main
from transformer_rosetta.decoding.search import beam_search, greedy_search
from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.format import load_weights

# post-norm, tied output, concatenated sinusoids (Marian's kind)
POST_TIED = VECTORS / "post_ln_tied_concat.safetensors"
# pre-norm, the Annotated Transformer's std_plus_eps norm, wide heads (key_dim)
PRE_STD = VECTORS / "pre_std_plus_eps_key_dim.safetensors"
FLOAT32 = atol_for("float32")

needs_onnx = pytest.mark.skipif(
    unavailable_reason("onnx") is not None, reason=f"backend onnx: {unavailable_reason('onnx')}"
)


def run(capsys, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def float32_weights(path: Path) -> tuple:
    wf = load_weights(path)
    return wf.config, {k: np.asarray(v, np.float32) for k, v in wf.tensors.items()}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """POST_TIED exported with its attention maps by the CLI: (path, its onnxruntime session)."""
    from transformer_rosetta.adapter.onnx_backend import session

    path = tmp_path_factory.mktemp("onnx") / "model.onnx"
    assert main(["export", str(POST_TIED), str(path), "--attention"]) == 0
    return path, session(str(path))


def oracle(path: Path, src: np.ndarray, tgt_in: np.ndarray):
    """The float64 oracle on the float32-rounded weights the graph holds."""
    config, weights = float32_weights(path)
    return reference.forward(
        {k: v.astype(np.float64) for k, v in weights.items()}, config, src, tgt_in
    )


@needs_onnx
def test_the_graph_passes_the_checker_and_takes_any_batch_and_length(exported):
    import onnx

    path, sess = exported
    onnx.checker.check_model(str(path), full_check=True)
    config = load_weights(POST_TIED).config
    dims = {
        i.name: [d.dim_param for d in i.type.tensor_type.shape.dim]
        for i in onnx.load(str(path)).graph.input
    }
    assert dims == {"src": ["batch", "src_len"], "tgt_in": ["batch", "tgt_len"]}
    names = [o.name for o in sess.get_outputs()]
    for batch, src_len, tgt_len in ((1, 1, 1), (5, config.max_len, 3), (3, 7, config.max_len)):
        src, tgt_in = ragged_batch(config, batch, src_len, tgt_len, seed=batch)
        got = dict(zip(names, sess.run(None, {"src": src, "tgt_in": tgt_in}), strict=True))
        want = oracle(POST_TIED, src, tgt_in).named()
        for name in names:
            diff = float(np.abs(got[name] - want[name]).max())
            assert diff <= FLOAT32, (batch, src_len, tgt_len, name, diff)


@needs_onnx
def test_a_fully_padded_source_row_gives_zero_attention_not_nan(exported):
    path, sess = exported
    config = load_weights(POST_TIED).config
    src, tgt_in = ragged_batch(config, 3, 6, 4, seed=0)
    assert (src[-1] == config.pad_id).all()  # ragged_batch's last row at batch 3
    outputs = dict(
        zip(
            [o.name for o in sess.get_outputs()],
            sess.run(None, {"src": src, "tgt_in": tgt_in}),
            strict=True,
        )
    )
    assert all(np.isfinite(v).all() for v in outputs.values())
    for i in range(config.num_encoder_layers):
        assert (outputs[f"encoder.layers.{i}.self_attention"][-1] == 0).all()
    for i in range(config.num_decoder_layers):
        assert (outputs[f"decoder.layers.{i}.cross_attention"][-1] == 0).all()


@needs_onnx
def test_rosetta_parity_runs_onnx_torch_and_jax(capsys):
    code, out, err = run(capsys, "parity", "--frameworks", "onnx,torch,jax", "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"], err
    runs = {r["label"] for r in report["runs"]}
    assert {"onnx", "torch", "jax"} <= runs and "onnx" not in report["skipped"]
    onnx_vs_oracle = [
        c for c in report["comparisons"] if c["left"] == "onnx" and c["right"] == "numpy"
    ]
    # every quantity: the logits (both paths), the encoder output and the 6 attention maps
    assert len(onnx_vs_oracle) == len({c["quantity"] for c in report["comparisons"]}) == 9
    worst = max(c["max_abs"] for c in onnx_vs_oracle)
    assert 0 < worst <= FLOAT32  # float32 rounding really happened, within the bound


@needs_onnx
def test_onnx_parity_holds_on_a_pre_norm_std_plus_eps_model_with_wide_heads():
    config, weights = float32_weights(PRE_STD)
    assert config.norm_position == "pre" and config.norm_kind == "std_plus_eps" and config.key_dim
    src, tgt_in = ragged_batch(config, 4, 9, 7, seed=2)
    report = run_parity(config, weights, src, tgt_in, frameworks=("onnx",))
    assert [r.label for r in report.runs] == ["onnx"]
    assert report.passed, [c for c in report.comparisons if not c.passed]
    assert max(c.max_abs for c in report.comparisons) <= FLOAT32


@needs_onnx
def test_decoding_through_the_exported_encoder_and_step_gives_torchs_tokens():
    config, weights = float32_weights(POST_TIED)
    src, _ = ragged_batch(config, 3, 6, 2, seed=5)
    onnx_model = get_backend("onnx").build(config, weights)
    torch_model = get_backend("torch").build(config, weights)
    for search in (greedy_search, partial(beam_search, beam=2)):
        theirs = search(torch_model.stepper, config, src, extra_len=5)
        ours = search(onnx_model.stepper, config, src, extra_len=5)
        assert [t.tolist() for t in ours.tokens] == [t.tolist() for t in theirs.tokens]
        assert np.abs(np.asarray(ours.scores) - np.asarray(theirs.scores)).max() <= FLOAT32


@needs_onnx
def test_inspect_shows_the_graph_and_its_provenance(exported, capsys):
    path, _ = exported
    code, out, err = run(capsys, "inspect", path)
    assert code == 0, err
    sha = hashlib.sha256(POST_TIED.read_bytes()).hexdigest()
    assert f"converted from: {POST_TIED.name} (rosetta), sha256 {sha}" in out
    assert "onnx: graph forward, opset" in out and "attention true" in out
    assert "verified: passed" in out and "numpy float64 oracle vs onnxruntime" in out
    code, out, _ = run(capsys, "inspect", path, "--json")
    check = json.loads(out)["provenance"]["verify"]
    assert check["probe_seed"] == 0 and check["probe_shapes"] == [[3, 7, 5], [2, 4, 9]]
    assert 0 < check["max_abs_logit_diff"] <= check["bound"] == FLOAT32


@needs_onnx
@pytest.mark.parametrize(
    "extra, named",
    [
        (["--graph", "encoder", "--attention"], "--attention: only the forward graph"),
        (["--max-steps", "4"], "--max-steps: only the encoder and decoder_step graphs"),
    ],
)
def test_what_a_graph_cannot_have_is_refused_before_any_work(capsys, tmp_path, extra, named):
    code, _, err = run(capsys, "export", POST_TIED, tmp_path / "m.onnx", *extra)
    assert code == 2 and err.count("\n") == 1 and named in err, err
    assert list(tmp_path.iterdir()) == []


def test_an_onnx_file_is_not_a_source_and_an_export_ends_in_onnx(capsys, tmp_path):
    (tmp_path / "m.onnx").write_bytes(b"\x08\x07")
    code, _, err = run(capsys, "convert", tmp_path / "m.onnx", tmp_path / "m.safetensors")
    assert code == 2 and "onnx is written, not read" in err
    code, _, err = run(capsys, "export", POST_TIED, tmp_path / "m.safetensors")
    assert code == 2 and "m.safetensors should end in .onnx" in err
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


def test_without_the_onnx_extra_each_use_names_the_install(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "onnxruntime" else real(name, *a),
    )
    reason = "onnxruntime not installed (pip install 'transformer-rosetta[onnx]')"
    assert unavailable_reason("onnx") == reason
    config, weights = float32_weights(POST_TIED)
    src, tgt_in = ragged_batch(config, 2, 3, 3)
    report = run_parity(config, weights, src, tgt_in, frameworks=("onnx",))
    assert report.skipped == {"onnx": reason} and not report.runs
    code, _, err = run(capsys, "export", POST_TIED, tmp_path / "m.onnx")
    assert code == 2 and reason in err
    assert list(tmp_path.iterdir()) == []
