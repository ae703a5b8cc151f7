"""`rosetta inspect`: the table, the JSON, and one line with exit 2 for every bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parity_tests.paths import VECTORS
from transformer_rosetta.cli import main

VECTOR = VECTORS / "pre_ln_untied.safetensors"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_preset_base_prints_config_table_and_count(capsys):
    code, out, err = run(capsys, "inspect", "--preset", "base")
    assert code == 0 and err == ""
    assert "  d_model              512" in out
    assert "shared_embedding                                   [37000, 512]       float32" in out
    assert "decoder.layers.5.cross_attention.output.kernel     [8, 64, 512]" in out
    assert "parameters: 63,082,496 (63.1M) in 253 tensors" in out
    assert "output -> shared_embedding" in out


def test_inspect_vocab_options(capsys):
    code, out, _ = run(capsys, "inspect", "--preset", "big", "--vocab", "32000", "--json")
    report = json.loads(out)
    assert code == 0 and report["config"]["d_model"] == 1024
    assert report["tensors"][0] == {
        "name": "shared_embedding",
        "shape": [32000, 1024],
        "dtype": "float32",
    }


def test_inspect_file_json_reads_back_the_config(capsys):
    code, out, _ = run(capsys, "inspect", str(VECTOR), "--json")
    report = json.loads(out)
    assert code == 0
    assert report["config"]["norm_position"] == "pre" and report["config"]["tgt_vocab_size"] == 37
    assert report["producer"] == "common.reference"
    assert {"name": "output.bias", "shape": [37], "dtype": "float64"} in report["tensors"]
    assert report["tied"] == {}


def test_inspect_config_file(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(
        json.dumps(
            {"d_model": 64, "num_heads": 4, "d_ff": 128, "src_vocab_size": 99, "tgt_vocab_size": 99}
        )
    )
    code, out, _ = run(capsys, "inspect", "--config", str(path), "--json")
    assert code == 0 and json.loads(out)["config"]["d_model"] == 64


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "missing.safetensors"], "missing.safetensors: no such file"),
        (["inspect", "--preset", "huge"], "invalid choice: 'huge'"),
        (
            ["inspect", "--preset", "base", "--src-vocab", "100"],
            "share_embeddings: one shared embedding",
        ),
        (["inspect", "--preset", "base", "--vocab", "0"], "src_vocab_size: must be >= 1, got 0"),
        (["inspect", str(VECTOR), "--preset", "tiny"], "not both"),
        (["inspect", "--bogus"], "unrecognized arguments: --bogus"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("rosetta: error: ")
    assert message in err


def test_corrupt_and_truncated_files(tmp_path, capsys):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not weights at all")
    code, _, err = run(capsys, "inspect", str(junk))
    assert code == 2 and "not a safetensors file" in err
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(VECTOR.read_bytes()[:-10])
    code, _, err = run(capsys, "inspect", str(cut))
    assert code == 2 and "truncated" in err and err.count("\n") == 1
    bad_config = tmp_path / "c.json"
    bad_config.write_text('{"d_model": 512, "layers": 6}')
    code, _, err = run(capsys, "inspect", "--config", str(bad_config))
    assert code == 2 and "layers: unknown config field" in err


def test_console_script_has_help_and_no_traceback(tmp_path):
    exe = shutil.which("rosetta") or str(Path(sys.executable).parent / "rosetta")
    if not Path(exe).exists():
        pytest.skip("the rosetta console script is not installed (pip install -e .)")
    help_text = subprocess.run([exe, "inspect", "--help"], capture_output=True, text=True)
    assert help_text.returncode == 0 and "--preset" in help_text.stdout
    bad = subprocess.run(
        [exe, "inspect", str(tmp_path / "x.safetensors")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


# -- the three kinds -----------------------------------------------------------------------

# all-MiniLM-L6-v2 as common/porting/bert.py converts it, written out by hand: a BERT encoder.
MINILM = {
    "src_vocab_size": 30522,
    "tgt_vocab_size": 30522,
    "d_model": 384,
    "num_heads": 12,
    "d_ff": 1536,
    "num_encoder_layers": 6,
    "num_decoder_layers": 0,
    "max_len": 512,
    "layer_norm_eps": 1e-12,
    "activation": "gelu",
    "position_kind": "learned",
    "type_vocab_size": 2,
    "embedding_norm": True,
    "scale_embeddings": False,
    "share_embeddings": False,
    "tie_output": False,
    "pooling": "mean",
    "pooled_l2_norm": True,
    "bos_id": 101,
    "eos_id": 102,
}


def test_inspect_names_the_kind_of_the_encoder_decoder(capsys):
    code, out, _ = run(capsys, "inspect", "--preset", "base")
    assert code == 0
    assert out.splitlines()[1:5] == [
        "kind: encoder-decoder",
        "  encoder: 6 layers, bidirectional self-attention",
        "  decoder: 6 layers, causal self-attention, cross-attention to the encoder",
        "  d_model 512, 8 heads (d_k 64), d_ff 2048, relu, post-norm, sinusoidal positions "
        "(interleaved)",
    ]
    assert "absent:" not in out and "(unused" not in out


def test_inspect_decoder_only_shows_what_drops_out(capsys):
    code, out, _ = run(capsys, "inspect", "--preset", "tiny_decoder_only")
    assert code == 0
    assert out.splitlines()[1:6] == [
        "kind: decoder-only (GPT-style)",
        "  decoder: 2 layers, causal self-attention, no cross-attention",
        "  d_model 16, 2 heads (d_k 8), d_ff 32, gelu_tanh, pre-norm, learned positions "
        "(max_len 32)",
        "  outputs: logits [batch, T, 48]",
        "  absent: encoder, cross-attention, encoder output",
    ]
    assert "  src_vocab_size       48  (unused: no encoder)" in out
    assert "  tgt_vocab_size       48\n" in out
    assert "encoder." not in out and "cross_attention" not in out
    assert "parameters: 5,760 (0.0M) in 36 tensors" in out
    assert "stored once and shared: target -> decoder.embedding, output -> decoder.embedding" in out


def test_inspect_a_converted_minilm_config_reads_as_a_bert_encoder(tmp_path, capsys):
    path = tmp_path / "minilm.json"
    path.write_text(json.dumps(MINILM))
    code, out, _ = run(capsys, "inspect", "--config", str(path))
    assert code == 0
    assert out.splitlines()[1:10] == [
        "kind: encoder-only (BERT-style)",
        "  encoder: 6 layers, bidirectional self-attention",
        "  d_model 384, 12 heads (d_k 32), d_ff 1536, gelu, post-norm, learned positions "
        "(max_len 512)",
        "  token type embeddings (2 types; row 0 is added to every token)",
        "  embedding LayerNorm (eps 1e-12)",
        "  pooling: mean over non-pad positions, then L2-normalised",
        "  outputs: encoder_output [batch, S, 384], pooled_output [batch, 384]",
        "  absent: decoder, cross-attention, output projection (no logits), decoding",
        "config:",
    ]
    for line in (
        "  tgt_vocab_size       30522  (unused: no decoder)",
        "  bos_id               101  (unused: does not decode)",
        "  tie_output           false  (unused: no output projection)",
        "encoder.token_type_embedding                       [2, 384]",
        "encoder.embedding_norm.scale                       [384]",
    ):
        assert line in out
    # BertModel's count less its pooler (a dense layer sentence-transformers does not use).
    assert "parameters: 22,565,376 (22.6M) in 101 tensors" in out
    assert "stored once" not in out and "\ndecoder." not in out and "\noutput." not in out


def test_inspect_file_json_of_an_encoder_only_model(tmp_path, capsys):
    from transformer_rosetta.spec.config import preset
    from transformer_rosetta.weights.format import save_weights
    from transformer_rosetta.weights.init import init_weights

    config = preset("tiny_encoder_only")
    path = tmp_path / "enc.safetensors"
    save_weights(path, init_weights(config, seed=1), config, producer="test")
    code, out, _ = run(capsys, "inspect", str(path), "--json")
    report = json.loads(out)
    assert code == 0 and report["tied"] == {} and report["parameters"] == 5792
    assert report["model"]["kind"] == "encoder_only"
    assert report["model"]["label"] == "encoder-only (BERT-style)"
    assert report["model"]["stacks"] == {"encoder": "2 layers, bidirectional self-attention"}
    assert report["model"]["outputs"] == [
        "encoder_output [batch, S, 16]",
        "pooled_output [batch, 16]",
    ]
    assert report["model"]["unused_fields"] == [
        "tgt_vocab_size", "share_embeddings", "tie_output", "output_bias", "bos_id", "eos_id",
        "label_smoothing",
    ]  # fmt: skip
    assert {t["name"] for t in report["tensors"]} >= {"encoder.embedding_norm.bias"}
