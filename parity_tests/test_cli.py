"""`rosetta inspect`: the table, the JSON, and one line with exit 2 for every bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.app.cli.main import main

VECTOR = Path(__file__).parent / "vectors" / "pre_ln_untied.safetensors"


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
