"""Reading what a user hands us: every bad file is one line on stderr and exit 2, never a traceback.

Four classes of input, each probed through `rosetta` itself (transformer_rosetta.app.cli.main.main) and fuzzed below
the CLI with hypothesis: weight files (safetensors headers of the wrong types, shapes or offsets,
nesting, links, FIFOs and devices), config JSON (ours and a Marian config.json), token ids
(.npy/.npz judged from their headers) and torch checkpoints (what the bytes are instead). A FIFO
is only ever read in a subprocess with a timeout, so a reader that opens one fails the test
instead of hanging the suite.
"""

from __future__ import annotations

import functools
import io
import json
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity_tests.paths import ROOT
from transformer_rosetta.app.cli.args import load_ids, load_inputs
from transformer_rosetta.cli import main
from transformer_rosetta.errors import RosettaError
from transformer_rosetta.files import safe_read
from transformer_rosetta.porting import marian
from transformer_rosetta.spec.config import TransformerConfig, preset
from transformer_rosetta.weights.format import load_weights, read_header, save_weights
from transformer_rosetta.weights.init import init_weights

CONFIG = preset("tiny")
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def one_line_error(code: int, err: str, *needles: str) -> None:
    """The promise: exit 2, exactly one stderr line 'rosetta: error: ...', no traceback, and the
    message names the problem (every needle in it)."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith("rosetta: error:"), err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    for unsafe in ("allow_pickle", "weights_only=False", "weights_only` set to `False"):
        assert unsafe not in err, err


def cli(capsys, *argv: str | Path) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    _, err = capsys.readouterr()
    return code, err


def cli_subprocess(*argv: str | Path) -> tuple[int, str]:
    """The CLI in its own process, killed after 60 s: for paths a blocking reader would hang on."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "transformer_rosetta", *map(str, argv)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"rosetta {' '.join(map(str, argv))} blocked on its input")
    return done.returncode, done.stderr


# -- weight files ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_weights(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("weights") / "tiny.safetensors"
    save_weights(path, init_weights(CONFIG, seed=0), CONFIG, producer="test")
    return path


def split_file(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_safetensors(path: Path, header: dict | bytes | str, data: bytes) -> Path:
    raw = (
        header
        if isinstance(header, bytes)
        else (header if isinstance(header, str) else json.dumps(header)).encode()
    )
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


def mutate(header: dict, change: str) -> dict | str:
    """`header` with one broken field, by name (the ids of the test below)."""
    h = json.loads(json.dumps(header))
    name = first_tensor(h)
    meta = h["__metadata__"]
    if change == "version_arabic_digit":
        meta["format_version"] = "\u0661"  # '١'.isdigit() is true
    elif change == "version_superscript":
        meta["format_version"] = "\u00b2"  # '²'.isdigit() is true, int('²') fails
    elif change == "version_json_int":
        meta["format_version"] = 1
    elif change == "version_huge":
        meta["format_version"] = "9" * 5000
    elif change == "metadata_list":
        h["__metadata__"] = [1, 2]
    elif change == "metadata_string":
        h["__metadata__"] = "config"
    elif change == "config_object":
        meta["config"] = CONFIG.to_dict()
    elif change == "config_json_list":
        meta["config"] = "[1, 2]"
    elif change == "config_json_number":
        meta["config"] = "5"
    elif change == "config_deep":
        meta["config"] = "[" * 5000 + "]" * 5000
    elif change == "config_long_int":
        meta["config"] = json.dumps(CONFIG.to_dict()).replace(
            '"d_model": 16', '"d_model": ' + "1" * 5000
        )
    elif change == "shape_int":
        h[name]["shape"] = 5
    elif change == "shape_negative":
        h[name]["shape"] = [-1, 16]
    elif change == "shape_float":
        h[name]["shape"] = [1.5, 16]
    elif change == "dtype_list":
        h[name]["dtype"] = ["F32"]
    elif change == "offsets_infinite":
        return json.dumps(h).replace(json.dumps(h[name]["data_offsets"]), "[0, 1e999]", 1)
    elif change == "offsets_one":
        h[name]["data_offsets"] = [0]
    elif change == "offsets_size":
        begin, end = h[name]["data_offsets"]
        h[name]["data_offsets"] = [begin, end - 4]
    elif change == "offsets_overlap":
        other = [k for k in h if k not in ("__metadata__", name)][0]
        h[other]["data_offsets"] = list(h[name]["data_offsets"])
        h[other]["shape"], h[other]["dtype"] = h[name]["shape"], h[name]["dtype"]
    elif change == "entry_string":
        h[name] = "tensor"
    elif change == "entry_lacks_keys":
        h[name] = {"dtype": "F32"}
    elif change == "header_deep":
        return "[" * 5000 + "]" * 5000
    else:
        raise AssertionError(change)
    return h


HEADER_CASES = {
    "version_arabic_digit": "format_version must be an integer in decimal digits",
    "version_superscript": "format_version must be an integer in decimal digits",
    "version_json_int": "__metadata__ values must be strings (format_version is an integer)",
    "version_huge": "format_version must be an integer in decimal digits",
    "metadata_list": "__metadata__ must be an object of strings, got an array",
    "metadata_string": "__metadata__ must be an object of strings, got a string",
    "config_object": "__metadata__ values must be strings (config is an object)",
    "config_json_list": "config in metadata is invalid: a config must be a JSON object",
    "config_json_number": "config in metadata is invalid: a config must be a JSON object",
    "config_deep": "config in metadata is invalid: not usable JSON (nested deeper than 64",
    "config_long_int": "an integer of 5000 digits",
    "shape_int": "has shape 5, expected a list of integers >= 0",
    "shape_negative": "has shape [-1, 16], expected a list of integers >= 0",
    "shape_float": "has shape [1.5, 16], expected a list of integers >= 0",
    "dtype_list": "has dtype ['F32'], expected a string",
    "offsets_infinite": "has data_offsets [0, inf], expected [begin, end]",
    "offsets_one": "has data_offsets [0], expected [begin, end]",
    "offsets_size": "but shape",
    "offsets_overlap": "overlap",
    "entry_string": "is a string, not an object with dtype, shape, data_offsets",
    "entry_lacks_keys": "lacks shape, data_offsets",
    "header_deep": "not a safetensors file (header: not usable JSON (nested deeper than 64 levels))",
}


@pytest.mark.parametrize("change", list(HEADER_CASES))
def test_bad_safetensors_header_is_one_line(capsys, tmp_path, good_weights, change):
    header, data = split_file(good_weights)
    path = write_safetensors(tmp_path / "bad.safetensors", mutate(header, change), data)
    code, err = cli(capsys, "inspect", path)
    one_line_error(code, err, HEADER_CASES[change])
    if change.startswith(("shape", "dtype", "offsets", "entry")) and change != "offsets_overlap":
        assert first_tensor(header) in err  # the tensor at fault is named


def test_trailing_bytes_and_truncation_are_named(capsys, tmp_path, good_weights):
    header, data = split_file(good_weights)
    code, err = cli(
        capsys, "inspect", write_safetensors(tmp_path / "a.safetensors", header, data + b"x" * 7)
    )
    one_line_error(code, err, "7 bytes after the last tensor belong to no tensor")
    code, err = cli(
        capsys, "inspect", write_safetensors(tmp_path / "b.safetensors", header, data[:-7])
    )
    one_line_error(code, err, "truncated: the header describes")


@pytest.mark.parametrize("kind", ["loop", "broken_link", "folder", "dev_null", "dev_zero"])
def test_weight_path_that_is_no_regular_file(capsys, tmp_path, kind):
    path = tmp_path / "w.safetensors"
    if kind == "loop":
        path.symlink_to(path)
        needle = "a loop of symbolic links"
    elif kind == "broken_link":
        path.symlink_to(tmp_path / "gone")
        needle = "a symbolic link to nothing"
    elif kind == "folder":
        path.mkdir()
        needle = "is a folder, not a weight file"
    else:
        path = Path("/dev/null" if kind == "dev_null" else "/dev/zero")
        needle = "is a character device, not a weight file"
    code, err = cli(capsys, "inspect", path)
    one_line_error(code, err, needle)


def test_weight_file_name_with_a_newline_stays_one_line(capsys, tmp_path):
    path = tmp_path / "two\nlines.safetensors"
    path.write_bytes(b"junk")
    code, err = cli(capsys, "inspect", path)
    one_line_error(code, err, "two\\nlines.safetensors", "not a safetensors file")


# -- FIFOs, read only in a subprocess -----------------------------------------------------------


@pytest.fixture
def fifo(tmp_path):
    def make(name: str) -> Path:
        path = tmp_path / name
        os.mkfifo(path)
        return path

    return make


@pytest.mark.parametrize(
    "what", ["weights", "config", "src", "inputs", "torch", "marian_config", "marian_weights"]
)
def test_a_fifo_is_refused_without_blocking(tmp_path, fifo, good_weights, what):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([[1, 4, 5]]))
    if what == "weights":
        argv = ["inspect", fifo("w.safetensors")]
    elif what == "config":
        argv = ["inspect", "--config", fifo("c.json")]
    elif what == "src":
        argv = ["forward", "--framework", "numpy", "--weights", good_weights]
        argv += ["--src", fifo("src.npy"), "--tgt", ids, "--out", tmp_path / "o.npz"]
    elif what == "inputs":
        argv = ["parity", "--inputs", fifo("in.npz"), "--frameworks", "torch"]
    elif what == "torch":
        config = tmp_path / "c.json"
        config.write_text(CONFIG.to_json())
        argv = ["convert", fifo("w.pt"), tmp_path / "o.safetensors", "--config", config]
        argv += ["--from", "torch"]
    else:
        folder = tmp_path / "marian"
        folder.mkdir()
        if what == "marian_config":
            os.mkfifo(folder / "config.json")
            write_safetensors(folder / "model.safetensors", {"a": _f32_entry()}, bytes(4))
        else:
            (folder / "config.json").write_text(json.dumps(small_marian()))
            os.mkfifo(folder / "model.safetensors")
        argv = ["convert", folder, tmp_path / "o.safetensors"]
    code, err = cli_subprocess(*argv)
    one_line_error(code, err, "is a named pipe (FIFO)")


# -- config JSON -----------------------------------------------------------------------------------


def tiny_dict(**changes) -> dict:
    return {**CONFIG.to_dict(), **changes}


CONFIG_FILES = {
    "not_utf8": (b'{"d_model": "\xff\xfe"}', "not UTF-8 text"),
    "nested": (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 64 levels"),
    "long_int": (
        json.dumps(tiny_dict()).replace('"d_model": 16', '"d_model": ' + "7" * 5000).encode(),
        "an integer of 5000 digits (the limit is 20)",
    ),
    "huge": (b" " * (safe_read.MAX_CONFIG_BYTES + 1) + b"{}", "too large for"),
    "nan": (json.dumps(tiny_dict()).replace("0.1", "NaN").encode(), "NaN is not JSON"),
    "not_json": (b"{d_model: 3", "not valid JSON"),
    "array": (b"[1, 2]", "must be a JSON object"),
    "empty": (b"", "not valid JSON"),
}


@pytest.mark.parametrize("case", list(CONFIG_FILES))
def test_bad_config_file_is_one_line(capsys, tmp_path, case):
    content, needle = CONFIG_FILES[case]
    path = tmp_path / "c.json"
    path.write_bytes(content)
    code, err = cli(capsys, "inspect", "--config", path)
    one_line_error(code, err, "invalid config", needle)


@pytest.mark.parametrize("kind", ["folder", "dev_zero", "missing", "loop"])
def test_config_path_that_is_no_regular_file(capsys, tmp_path, kind):
    path = tmp_path / "c.json"
    needle = {
        "folder": "is a folder, not a config file",
        "dev_zero": "is a character device, not a config file",
        "missing": "no such config file",
        "loop": "a loop of symbolic links",
    }[kind]
    if kind == "folder":
        path.mkdir()
    elif kind == "dev_zero":
        path = Path("/dev/zero")
    elif kind == "loop":
        path.symlink_to(path)
    code, err = cli(capsys, "inspect", "--config", path)
    one_line_error(code, err, needle)


CONFIG_VALUES = {
    "d_model_string": ("d_model", "16", "d_model: must be an integer >= 1, got '16'"),
    "d_model_list": ("d_model", [16], "d_model: must be an integer >= 1, got [16]"),
    "d_model_bool": ("d_model", True, "d_model: must be an integer >= 1, got True"),
    "d_model_float": ("d_model", 64.5, "d_model: must be an integer >= 1, got 64.5"),
    "d_model_1e15": ("d_model", 1e15, "d_model: must be an integer >= 1, got 1000000000000000.0"),
    "num_heads_bool": ("num_heads", True, "num_heads: must be an integer >= 1, got True"),
    "pad_id_null": ("pad_id", None, "pad_id: must be an integer >= 0, got None"),
    "dropout_string": ("dropout", "0.1", "dropout: must be a number in [0, 1), got '0.1'"),
    "final_norm_int": ("final_norm", 1, "final_norm: must be true or false, got 1"),
    "activation_list": ("activation", ["gelu"], "activation: unknown value ['gelu']"),
    "activation_object": ("activation", {"a": 1}, "activation: unknown value {'a': 1}"),
    "long_string": ("norm_position", "x" * 10_000, "norm_position: unknown value 'xxxx"),
}


@pytest.mark.parametrize("case", list(CONFIG_VALUES))
def test_config_field_of_the_wrong_type_is_named(capsys, tmp_path, case):
    field, value, needle = CONFIG_VALUES[case]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(tiny_dict(**{field: value})))
    code, err = cli(capsys, "inspect", "--config", path)
    one_line_error(code, err, needle)
    assert len(err) < 400  # a 10,000-character value is quoted short


def test_many_unknown_fields_are_counted_not_all_listed(capsys, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({f"field_{i}": i for i in range(500)}))
    code, err = cli(capsys, "inspect", "--config", path)
    one_line_error(code, err, "field_0: unknown config field", "and 490 more unknown config fields")


# -- a Marian config.json ------------------------------------------------------------------------


def small_marian(**changes) -> dict:
    hf = {
        "model_type": "marian",
        "vocab_size": 40,
        "decoder_vocab_size": 40,
        "d_model": 16,
        "encoder_layers": 1,
        "decoder_layers": 1,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
        "encoder_ffn_dim": 32,
        "decoder_ffn_dim": 32,
        "max_position_embeddings": 64,
        "activation_function": "relu",
        "pad_token_id": 39,
        "eos_token_id": 0,
        "decoder_start_token_id": 39,
        "scale_embedding": True,
    }
    hf.update(changes)
    return hf


def _f32_entry() -> dict:
    return {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}


MARIAN_CASES = {
    "activation_list": (
        {"activation_function": ["gelu"]},
        "activation_function: must be a string, got an array ['gelu']",
    ),
    "heads_list": (
        {"encoder_attention_heads": [2], "decoder_attention_heads": [2]},
        "encoder_attention_heads: must be an integer, got an array [2]",
    ),
    "d_model_string": ({"d_model": "16"}, "d_model: must be an integer, got a string '16'"),
    "d_model_bool": ({"d_model": True}, "d_model: must be an integer, got true"),
    "vocab_float": ({"vocab_size": 40.0}, "vocab_size: must be an integer, got a number 40.0"),
    "decoder_vocab_list": (
        {"decoder_vocab_size": [40]},
        "decoder_vocab_size: must be an integer or null, got an array [40]",
    ),
    "scale_string": (
        {"scale_embedding": "false"},
        "scale_embedding: must be true or false, got a string 'false'",
    ),
    "dropout_null": ({"dropout": None}, "dropout: must be a number, got null"),
    "eos_nested": ({"eos_token_id": [[0]]}, "eos_token_id: must be one token id"),
}


@pytest.mark.parametrize("case", list(MARIAN_CASES))
def test_marian_field_of_the_wrong_type_is_named(capsys, tmp_path, case):
    changes, needle = MARIAN_CASES[case]
    folder = tmp_path / "opus"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(small_marian(**changes)))
    write_safetensors(folder / "model.safetensors", {"a": _f32_entry()}, bytes(4))
    code, err = cli(capsys, "convert", folder, tmp_path / "out.safetensors")
    one_line_error(code, err, needle)


@pytest.mark.parametrize("case", ["not_utf8", "nested", "long_int", "huge"])
def test_bad_marian_config_json_is_one_line(capsys, tmp_path, case):
    content, needle = CONFIG_FILES[case]
    folder = tmp_path / "opus"
    folder.mkdir()
    (folder / "config.json").write_bytes(content)
    write_safetensors(folder / "model.safetensors", {"a": _f32_entry()}, bytes(4))
    code, err = cli(capsys, "convert", folder, tmp_path / "out.safetensors")
    one_line_error(code, err, "config.json", needle)


# -- token ids: .npy and .npz --------------------------------------------------------------------


def npy_bytes(header: str, data: bytes = b"", version: tuple[int, int] = (1, 0)) -> bytes:
    """A .npy with a hand-written header dict (numpy would refuse to write a lying one)."""
    text = header.encode("latin1")
    size_format = "<H" if version == (1, 0) else "<I"
    pad = 64 - (10 + len(text) + 1) % 64
    text += b" " * pad + b"\n"
    return b"\x93NUMPY" + bytes(version) + struct.pack(size_format, len(text)) + text + data


def saved_npy(array: np.ndarray) -> bytes:
    f = io.BytesIO()
    np.save(f, array, allow_pickle=True)
    return f.getvalue()


NPY_CASES = {
    "text": (b"hello, these are ids\n1 2 3\n", "it is not a .npy file"),
    "empty": (b"", "it is not a .npy file"),
    "npz": (None, "it is an .npz archive (a zip of arrays), not a .npy file"),
    "huge_claim": (
        npy_bytes("{'descr': '<i8', 'fortran_order': False, 'shape': (10000000, 10000000), }"),
        "the limit is 2 GiB",
    ),
    "truncated": (saved_npy(np.arange(60).reshape(6, 10))[:-40], "it is truncated"),
    "bool": (saved_npy(np.ones((2, 3), bool)), "dtype bool; token ids must be integers"),
    "float": (saved_npy(np.ones((2, 3))), "dtype float64; token ids must be integers"),
    "object": (
        saved_npy(np.array([[1, "a"]], dtype=object)),
        "Python objects (dtype object), which are never loaded",
    ),
    "structured": (
        saved_npy(np.zeros((2, 2), dtype=[("a", "<i4"), ("b", "<i4")])),
        "structured dtype",
    ),
    "rank1": (saved_npy(np.arange(3)), "token ids must be rank 2"),
    "bad_header": (npy_bytes("{'descr': '<i8', oops"), "its .npy header is damaged"),
    "long_header": (
        npy_bytes(
            "{'descr': '<i8', 'fortran_order': False, 'shape': (1, 1), 'x': '"
            + "y" * 70_000
            + "'}",
            version=(2, 0),
        ),
        "its .npy header is damaged or longer than 10000 bytes",
    ),
    "version_9": (b"\x93NUMPY\x09\x00" + bytes(100), "format 9.0"),
    "magic_only": (b"\x93NUMPY", "its .npy header is cut short"),
}


@pytest.mark.parametrize("case", list(NPY_CASES))
def test_bad_src_npy_is_one_line(capsys, tmp_path, good_weights, case):
    content, needle = NPY_CASES[case]
    src = tmp_path / "src.npy"
    if content is None:
        np.savez(src.with_suffix(".npz"), src=np.ones((1, 2), np.int64))
        src = src.with_suffix(".npz")
    else:
        src.write_bytes(content)
    tgt = tmp_path / "tgt.npy"
    np.save(tgt, np.array([[1, 4]]))
    code, err = cli(
        capsys, "forward", "--framework", "numpy", "--weights", good_weights,
        "--src", src, "--tgt", tgt, "--out", tmp_path / "out.npz",
    )  # fmt: skip
    one_line_error(code, err, "--src", needle)
    assert "pickle" not in err.replace("never loaded", "")  # no advice about pickles at all
    assert not (tmp_path / "out.npz").exists()


@pytest.mark.parametrize("kind", ["folder", "dev_zero", "missing", "newline"])
def test_src_path_that_is_no_regular_file(capsys, tmp_path, kind):
    path = {"newline": tmp_path / "a\nb.npy", "dev_zero": Path("/dev/zero")}.get(
        kind, tmp_path / "src.npy"
    )
    if kind == "folder":
        path.mkdir()
    elif kind == "newline":
        path.write_bytes(b"junk")
    with pytest.raises(RosettaError) as info:
        load_ids(str(path), "--src")
    message = str(info.value)
    assert "\n" not in message
    assert {
        "folder": "is a folder, not a .npy file",
        "dev_zero": "is a character device, not a .npy file",
        "missing": "--src: no such file",
        "newline": "a\\nb.npy is not a readable .npy array",
    }[kind] in message


def npz_with(tmp_path: Path, members: dict[str, bytes]) -> Path:
    path = tmp_path / "in.npz"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


GOOD_IDS = saved_npy(np.array([[1, 4, 5]]))
NPZ_CASES = {
    "npy": (lambda p: _write(p / "in.npz", GOOD_IDS), "a single .npy array, not an .npz"),
    "text": (lambda p: _write(p / "in.npz", b"src tgt"), "not an .npz archive (not a zip file)"),
    "cut_zip": (
        lambda p: _write(p / "in.npz", npz_with(p, {"src.npy": GOOD_IDS}).read_bytes()[:40]),
        "a damaged or cut-short zip archive",
    ),
    "huge_member": (
        lambda p: npz_with(p, {"src.npy": NPY_CASES["huge_claim"][0], "tgt.npy": GOOD_IDS}),
        "src: its header claims shape [10000000, 10000000]",
    ),
    "object_member": (
        lambda p: npz_with(p, {"src.npy": NPY_CASES["object"][0], "tgt.npy": GOOD_IDS}),
        "src: it holds Python objects",
    ),
    "text_member": (
        lambda p: npz_with(p, {"src.npy": b"1 2 3", "tgt.npy": GOOD_IDS}),
        "src: it is not a .npy file",
    ),
    "truncated_member": (
        lambda p: npz_with(p, {"src.npy": GOOD_IDS, "tgt.npy": GOOD_IDS[:-8]}),
        "tgt: it is truncated",
    ),
    "missing_key": (lambda p: npz_with(p, {"source.npy": GOOD_IDS}), "lacks src, tgt (has source)"),
}


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case", list(NPZ_CASES))
def test_bad_inputs_npz_is_one_line(capsys, tmp_path, case):
    make, needle = NPZ_CASES[case]
    path = make(tmp_path)
    code, err = cli(capsys, "parity", "--inputs", path, "--frameworks", "torch")
    one_line_error(code, err, "--inputs", needle)


def test_good_ids_still_load(tmp_path):
    np.save(tmp_path / "a.npy", np.asfortranarray(np.arange(6, dtype=">i4").reshape(2, 3)))
    assert load_ids(str(tmp_path / "a.npy"), "--src").tolist() == [[0, 1, 2], [3, 4, 5]]
    np.savez_compressed(tmp_path / "b.npz", src=np.ones((2, 3), np.int64), tgt=np.zeros((2, 1)))
    with pytest.raises(RosettaError, match="tgt: it holds dtype float64"):
        load_inputs(str(tmp_path / "b.npz"))
    np.savez_compressed(tmp_path / "c.npz", src=np.ones((2, 3), np.uint8), tgt=np.ones((2, 1), int))
    src, tgt = load_inputs(str(tmp_path / "c.npz"))
    assert src.shape == (2, 3) and tgt.shape == (2, 1)


# -- torch checkpoints ------------------------------------------------------------------------


@pytest.fixture
def torch_convert(capsys, tmp_path):
    pytest.importorskip("torch")
    config = tmp_path / "c.json"
    config.write_text(CONFIG.to_json())

    def run(path: Path) -> tuple[int, str]:
        return cli(capsys, "convert", path, tmp_path / "out.safetensors", "--from", "torch",
                   "--config", config)  # fmt: skip

    return run


def _torch_files(tmp_path: Path, case: str) -> Path:
    import pickle

    import torch

    path = tmp_path / "w.pt"
    rng = np.random.default_rng(0)
    if case == "random_bytes":
        path.write_bytes(rng.bytes(4096))
    elif case == "random_after_proto":
        path.write_bytes(b"\x80" + rng.bytes(4096))
    elif case == "zip_not_torch":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("hello.txt", "hi")
    elif case == "zip_bad_data_pkl":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("archive/data.pkl", rng.bytes(100))
    elif case == "cut_zip":
        torch.save({"a": torch.zeros(3)}, path)
        path.write_bytes(path.read_bytes()[:200])
    elif case == "cut_legacy":
        torch.save({"a": torch.zeros(300)}, path, _use_new_zipfile_serialization=False)
        path.write_bytes(path.read_bytes()[:300])
    elif case == "plain_pickle":
        path.write_bytes(pickle.dumps({"a": [1, 2]}))
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "text":
        path.write_text("encoder.embedding.weight = [1, 2, 3]\n")
    return path


TORCH_CASES = {
    "random_bytes": "not a torch checkpoint (neither a zip archive nor a binary pickle",
    "random_after_proto": "not a torch checkpoint (not a pickle:",
    "zip_not_torch": "a zip archive, but not torch.save's: it has no data.pkl",
    "zip_bad_data_pkl": "its data.pkl is not a pickle",
    "cut_zip": "truncated or corrupt torch checkpoint",
    "cut_legacy": "truncated or corrupt torch checkpoint",
    "plain_pickle": "a plain pickle (protocol 4), which torch's weights_only loader does not read",
    "empty": "the file is empty",
    "text": "neither a zip archive nor a binary pickle",
}


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_torch_file_says_what_it_is_instead(torch_convert, tmp_path, case):
    code, err = torch_convert(_torch_files(tmp_path, case))
    one_line_error(code, err, TORCH_CASES[case])
    assert "enforce fail" not in err and "objects other than tensors" not in err


def test_int_tensors_are_listed_short(torch_convert, tmp_path):
    import torch

    from transformer_rosetta.torch_impl.weights import state_dict_from_canonical

    weights = {k: torch.from_numpy(v) for k, v in init_weights(CONFIG, seed=0).items()}
    state = {k: v.to(torch.int32) for k, v in state_dict_from_canonical(CONFIG, weights).items()}
    path = tmp_path / "ints.pt"
    torch.save(state, path)
    code, err = torch_convert(path)
    one_line_error(code, err, "wrong dtype for", "int32", "more")
    assert len(err) < 1500, len(err)


@pytest.mark.parametrize("kind", ["folder", "dev_null"])
def test_torch_path_that_is_no_regular_file(torch_convert, tmp_path, kind):
    path = tmp_path / "w.pt"
    if kind == "folder":
        path.mkdir()
    else:
        path = Path("/dev/null")
    code, err = torch_convert(path)
    one_line_error(code, err, {"folder": "is a folder", "dev_null": "character device"}[kind])


def test_torch_reader_names_a_link_loop(tmp_path):
    pytest.importorskip("torch")
    from transformer_rosetta.torch_impl.weights import read_state_dict

    path = tmp_path / "w.pt"
    path.symlink_to(path)
    with pytest.raises(RosettaError, match="a loop of symbolic links"):
        read_state_dict(path)


# -- fuzzing below the CLI: every case loads or is a RosettaError --------------------------------

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False),
    st.text(max_size=12),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def nest(value: object, depth: int) -> str:
    """`value` as JSON, wrapped in `depth` arrays (written by hand: json.dumps recurses)."""
    return "[" * depth + json.dumps(value) + "]" * depth


def either(good: st.SearchStrategy, noise: st.SearchStrategy = JSON_VALUES) -> st.SearchStrategy:
    """Mostly a valid value, sometimes any JSON value."""
    return st.one_of(good, good, noise)


@st.composite
def safetensors_files(draw: st.DrawFn) -> bytes:
    good_meta = {"format": "transformer-rosetta", "format_version": "1",
                 "config": CONFIG.to_json()}  # fmt: skip
    meta_value = either(st.sampled_from(["transformer-rosetta", "1", "\u0661", CONFIG.to_json(),
                                         "[]", "{}", nest(0, 200)]))  # fmt: skip
    metadata = draw(
        either(
            st.fixed_dictionaries({k: either(st.just(v), meta_value) for k, v in good_meta.items()})
        )
    )
    entries = {}
    for i in range(draw(st.integers(0, 3))):
        entries[f"t{i}"] = draw(
            either(
                st.fixed_dictionaries(
                    {
                        "dtype": either(st.sampled_from(["F32", "F64", "I32", "F4", "X"])),
                        "shape": either(st.lists(st.integers(-2, 4), max_size=3)),
                        "data_offsets": either(
                            st.lists(st.integers(-2, 64), min_size=2, max_size=2)
                        ),
                    }
                )
            )
        )
    header = {"__metadata__": metadata, **entries} if draw(st.booleans()) else entries
    text = json.dumps(header)
    depth = draw(st.sampled_from([0, 0, 0, 1, 63, 64, 65, 3000]))
    if depth:
        text = nest(header, depth)
    data = draw(st.binary(max_size=80))
    raw = text.encode()
    if draw(st.integers(0, 9)) == 0:  # a lying header length
        return struct.pack("<Q", draw(st.integers(0, 2**64 - 1))) + raw + data
    return struct.pack("<Q", len(raw)) + raw + data


@FUZZ
@given(content=safetensors_files())
def test_fuzzed_safetensors_headers_load_or_refuse(tmp_path, content):
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(content)
    for read in (read_header, load_weights, lambda p: load_weights(p, config=CONFIG)):
        try:
            read(path)
        except RosettaError as exc:
            assert "\n" not in str(exc)


@functools.cache
def good_file() -> tuple[dict, bytes]:
    """The header and data of a valid tiny weight file, in memory."""
    metadata = {"format": "transformer-rosetta", "format_version": "1", "config": CONFIG.to_json()}
    data = safetensors.numpy.save(init_weights(CONFIG, seed=0), metadata=metadata)
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


@st.composite
def mutated_good_files(draw: st.DrawFn) -> bytes:
    """A valid file with up to three fields of its header replaced by any JSON value."""
    header, data = good_file()
    header = json.loads(json.dumps(header))
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(sorted(header)))
        keys = sorted(header[name])
        key = draw(st.sampled_from(keys))
        value = header[name][key]
        if isinstance(value, list) and value and key != "config" and draw(st.booleans()):
            value[draw(st.integers(0, len(value) - 1))] = draw(st.integers(-(2**64), 2**64))
        else:
            header[name][key] = draw(JSON_VALUES)
    raw = json.dumps(header).encode()
    cut = draw(st.sampled_from([0, 0, 0, 1, 64]))
    return struct.pack("<Q", len(raw)) + raw + data[: len(data) - cut]


@FUZZ
@given(content=mutated_good_files())
def test_fuzzed_fields_of_a_good_file_load_or_refuse(tmp_path, content):
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(content)
    try:
        wf = load_weights(path)
    except RosettaError as exc:
        assert "\n" not in str(exc)
    else:
        assert wf.config == CONFIG and len(wf.tensors) == len(good_file()[0]) - 1


CONFIG_FIELDS = list(CONFIG.to_dict())


@st.composite
def config_texts(draw: st.DrawFn) -> str:
    base = CONFIG.to_dict()
    fields = draw(st.lists(st.sampled_from(CONFIG_FIELDS), max_size=4, unique=True))
    for field in fields:
        base[field] = draw(JSON_VALUES)
    if draw(st.integers(0, 4)) == 0:
        base[draw(st.text(max_size=10))] = draw(JSON_VALUES)
    text = json.dumps(base)
    kind = draw(st.sampled_from(["plain", "plain", "nested", "long_int", "cut", "huge"]))
    if kind == "nested":
        return nest(base, draw(st.sampled_from([1, 64, 65, 100_000])))
    if kind == "long_int":
        return text.replace('"d_model": 16', '"d_model": ' + "9" * draw(st.integers(15, 6000)))
    if kind == "cut":
        return text[: draw(st.integers(0, len(text)))]
    if kind == "huge":
        return text + " " * safe_read.MAX_CONFIG_BYTES
    return text


@FUZZ
@given(text=config_texts(), encoding=st.sampled_from(["utf-8", "utf-8", "utf-16", "latin-1"]))
def test_fuzzed_config_json_loads_or_refuses(tmp_path, text, encoding):
    try:
        TransformerConfig.from_json(text)
    except RosettaError as exc:
        assert "\n" not in str(exc)
    path = tmp_path / "c.json"
    path.write_bytes(text.encode(encoding, errors="replace"))
    try:
        TransformerConfig.from_file(path)
    except RosettaError as exc:
        assert "\n" not in str(exc)


MARIAN_KEYS = list(small_marian()) + list(marian.HF_TYPES) + list(marian.LEGACY_KEYS)


@FUZZ
@given(
    changes=st.dictionaries(st.sampled_from(MARIAN_KEYS), JSON_VALUES, max_size=5),
    drop=st.lists(st.sampled_from(list(small_marian())), max_size=3),
)
def test_fuzzed_marian_config_maps_or_refuses(changes, drop):
    hf = small_marian(**changes)
    for key in drop:
        hf.pop(key, None)
    try:
        marian.marian_config(hf)
    except RosettaError as exc:
        assert "\n" not in str(exc)


DESCRS = st.sampled_from(["<i8", "<i4", "|u1", ">i2", "<f8", "|b1", "|O", "<U3", "[('a', '<i4')]",
                          "'<i8'", "<i16", "garbage"])  # fmt: skip


@st.composite
def npy_files(draw: st.DrawFn) -> bytes:
    shape = draw(st.lists(st.integers(0, 10**8), max_size=3).map(tuple) | st.just((2, 3)))
    descr = draw(DESCRS)
    descr_text = descr if descr.startswith(("[", "'")) else repr(descr)
    fortran = draw(st.sampled_from(["False", "True", "1", "'x'"]))
    header = f"{{'descr': {descr_text}, 'fortran_order': {fortran}, 'shape': {shape}, }}"
    if draw(st.integers(0, 5)) == 0:
        header = draw(st.text(st.characters(max_codepoint=255), max_size=40))
    data = draw(st.binary(max_size=64))
    return npy_bytes(header, data, draw(st.sampled_from([(1, 0), (2, 0), (3, 0)])))


@FUZZ
@given(content=npy_files())
def test_fuzzed_npy_headers_load_or_refuse(tmp_path, content):
    path = tmp_path / "ids.npy"
    path.write_bytes(content)
    try:
        ids = load_ids(str(path), "--src")
    except RosettaError as exc:
        assert "\n" not in str(exc) and "allow_pickle" not in str(exc)
    else:
        assert ids.ndim == 2 and ids.dtype.kind in "iu"
    npz = tmp_path / "in.npz"
    with zipfile.ZipFile(npz, "w") as archive:
        archive.writestr("src.npy", content)
        archive.writestr("tgt.npy", GOOD_IDS)
    try:
        load_inputs(str(npz))
    except RosettaError as exc:
        assert "\n" not in str(exc) and "allow_pickle" not in str(exc)
