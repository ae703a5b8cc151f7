"""The Python API refuses a bad argument as the command line refuses a bad option: with the
project's own error (a RosettaError; a wrong Python type is an InputTypeError, an InputError that
is also a TypeError), in one line that names the argument, before any work and with nothing
written (issue 41, classes 3 and 4). Every public entry point of `transformer_rosetta` is tried
with None, a wrong type and a value out of range for each of its arguments.

Also here: beam 0 and negative beams refused in the API and on the command line alike, the
boundaries of the size that --max-shard-size and max_shard_size= take (read as huggingface_hub
reads it, which transformers' save_pretrained uses), and --config given as the JSON itself
(docs/PORTING.md's `--config '{"pad_id": N}'` lines)."""

from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import transformer_rosetta as tr
from parity_tests.cli.command_line import one_line_error, run
from parity_tests.conftest import import_or_skip
from parity_tests.paths import VECTORS
from transformer_rosetta.errors import InputTypeError
from transformer_rosetta.weights.format import load_weights, planned_files
from transformer_rosetta.weights.shards import parse_size

VECTOR = VECTORS / "pre_ln_untied.safetensors"  # a shared-format file that carries its config


@dataclass
class Models:
    """Small models of the three kinds in the numpy oracle, and their files."""

    dec: tr.RosettaModel  # decoder-only
    ed: tr.RosettaModel  # encoder-decoder
    enc: tr.RosettaModel  # encoder-only
    dec_path: Path
    config: tr.TransformerConfig  # the decoder-only one's

    def stepper(self, src: np.ndarray, beams: int, max_steps: int) -> Any:
        return self.dec.built.stepper(src, beams, max_steps)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    root = tmp_path_factory.mktemp("api_errors")
    loaded = {}
    for kind, name in (("dec", "tiny_decoder_only"), ("ed", "tiny"), ("enc", "tiny_encoder_only")):
        config = tr.preset(name)
        path = root / f"{kind}.safetensors"
        tr.save_weights(path, tr.init_weights(config, seed=1), config, "test")
        loaded[kind] = (tr.load(path, "numpy"), path)
    return Models(
        loaded["dec"][0],
        loaded["ed"][0],
        loaded["enc"][0],
        loaded["dec"][1],
        tr.preset("tiny_decoder_only"),
    )


IDS = [5, 7]
SRC = np.array([[5, 7]])
DEC = "tiny_decoder_only"

# (id, call(models, out folder), the argument named, whether the value is of the wrong type)
CASES: list[tuple[str, Any, str, bool]] = [
    # transformer_rosetta.load
    ("load path None", lambda m, o: tr.load(None, "numpy"), "path", True),
    ("load path int", lambda m, o: tr.load(3, "numpy"), "path", True),
    ("load framework None", lambda m, o: tr.load(m.dec_path, None), "framework", True),
    ("load framework unknown", lambda m, o: tr.load(m.dec_path, "mxnet"), "framework", False),
    ("load device None", lambda m, o: tr.load(m.dec_path, "numpy", device=None), "device", True),
    ("load device unknown", lambda m, o: tr.load(m.dec_path, "numpy", device="tpu"), "device", 0),
    ("load dtype int", lambda m, o: tr.load(m.dec_path, "numpy", dtype=64), "dtype", True),
    ("load dtype unknown", lambda m, o: tr.load(m.dec_path, "numpy", dtype="int8"), "dtype", 0),
    ("load precision None", lambda m, o: tr.load(m.dec_path, "numpy", precision=None), "precision", 1),
    ("load precision unknown", lambda m, o: tr.load(m.dec_path, "numpy", precision="x"), "precision", 0),
    ("load allow_nonfinite str", lambda m, o: tr.load(m.dec_path, "numpy", allow_nonfinite="no"), "allow_nonfinite", 1),
    # RosettaModel.forward
    ("forward tgt text", lambda m, o: m.dec.forward(None, "abc"), "tgt", True),
    ("forward tgt floats", lambda m, o: m.dec.forward(None, [[1.5, 2.0]]), "tgt", False),
    ("forward tgt ragged", lambda m, o: m.dec.forward(None, [[1, 2], [3]]), "tgt", False),
    ("forward src ragged", lambda m, o: m.enc.forward([[1, 2], [3]]), "src", False),
    ("forward attention str", lambda m, o: m.dec.forward(None, [IDS], attention="yes"), "attention", 1),
    ("forward hidden_states int", lambda m, o: m.dec.forward(None, [IDS], hidden_states=2), "hidden_states", 1),
    # RosettaModel.generate, decoder-only
    ("generate inputs None", lambda m, o: m.dec.generate(None), "inputs", True),
    ("generate inputs int", lambda m, o: m.dec.generate(5), "inputs", True),
    ("generate beam 0", lambda m, o: m.dec.generate(IDS, beam=0), "beam", False),
    ("generate beam -1", lambda m, o: m.dec.generate(IDS, beam=-1), "beam", False),
    ("generate beam None", lambda m, o: m.dec.generate(IDS, beam=None), "beam", True),
    ("generate beam float", lambda m, o: m.dec.generate(IDS, beam=2.0), "beam", True),
    ("generate beam with sample", lambda m, o: m.dec.generate(IDS, beam=3, sample=True), "beam", 0),
    ("generate max_new_tokens 0", lambda m, o: m.dec.generate(IDS, max_new_tokens=0), "max_new_tokens", 0),
    ("generate max_new_tokens None", lambda m, o: m.dec.generate(IDS, max_new_tokens=None), "max_new_tokens", 1),
    ("generate sample str", lambda m, o: m.dec.generate(IDS, sample="yes"), "sample", True),
    ("generate seed str", lambda m, o: m.dec.generate(IDS, sample=True, seed="abc"), "seed", True),
    ("generate seed None", lambda m, o: m.dec.generate(IDS, sample=True, seed=None), "seed", True),
    ("generate seed float", lambda m, o: m.dec.generate(IDS, sample=True, seed=1.5), "seed", True),
    ("generate seed -1", lambda m, o: m.dec.generate(IDS, sample=True, seed=-1), "seed", False),
    ("generate seed 2**32", lambda m, o: m.dec.generate(IDS, sample=True, seed=2**32), "seed", 0),
    ("generate temperature 0", lambda m, o: m.dec.generate(IDS, sample=True, temperature=0), "temperature", 0),
    ("generate temperature str", lambda m, o: m.dec.generate(IDS, sample=True, temperature="1"), "temperature", 1),
    ("generate top_k 0", lambda m, o: m.dec.generate(IDS, sample=True, top_k=0), "top_k", 0),
    ("generate top_k float", lambda m, o: m.dec.generate(IDS, sample=True, top_k=2.5), "top_k", 1),
    ("generate top_p 0", lambda m, o: m.dec.generate(IDS, sample=True, top_p=0), "top_p", 0),
    ("generate top_p str", lambda m, o: m.dec.generate(IDS, sample=True, top_p="0.9"), "top_p", 1),
    ("generate temperature no sample", lambda m, o: m.dec.generate(IDS, temperature=0.5), "temperature", 0),
    ("generate top_k no sample", lambda m, o: m.dec.generate(IDS, top_k=3), "top_k", 0),
    ("generate cached str", lambda m, o: m.dec.generate(IDS, cached="no"), "cached", True),
    # RosettaModel.generate, encoder-decoder (its own search path)
    ("translate inputs None", lambda m, o: m.ed.generate(None), "inputs", True),
    ("translate beam 0", lambda m, o: m.ed.generate(IDS, beam=0), "beam", False),
    ("translate beam -2", lambda m, o: m.ed.generate(IDS, beam=-2), "beam", False),
    ("translate max_new_tokens 0", lambda m, o: m.ed.generate(IDS, max_new_tokens=0), "max_new_tokens", 0),
    ("translate seed str", lambda m, o: m.ed.generate(IDS, seed="abc"), "seed", True),
    ("translate cached str", lambda m, o: m.ed.generate(IDS, cached="x"), "cached", True),
    # RosettaModel.embed
    ("embed inputs None", lambda m, o: m.enc.embed(None), "inputs", True),
    ("embed inputs ints", lambda m, o: m.enc.embed([5, 6]), "inputs", False),
    ("embed batch_size 0", lambda m, o: m.enc.embed(SRC, batch_size=0), "batch_size", False),
    ("embed batch_size str", lambda m, o: m.enc.embed(SRC, batch_size="8"), "batch_size", True),
    # RosettaModel.save
    ("save path None", lambda m, o: m.dec.save(None), "path", True),
    ("save exists", lambda m, o: m.dec.save(m.dec_path), "path", False),
    ("save force str", lambda m, o: m.dec.save(o / "x.safetensors", force="no"), "force", True),
    ("save max_shard_size 0", lambda m, o: m.dec.save(o / "s", max_shard_size=0), "max_shard_size", 0),
    ("save max_shard_size -1", lambda m, o: m.dec.save(o / "s", max_shard_size=-1), "max_shard_size", 0),
    ("save max_shard_size 1.5", lambda m, o: m.dec.save(o / "s", max_shard_size=1.5), "max_shard_size", 1),
    ("save max_shard_size True", lambda m, o: m.dec.save(o / "s", max_shard_size=True), "max_shard_size", 1),
    ("save max_shard_size str", lambda m, o: m.dec.save(o / "s", max_shard_size="2GB"), "max_shard_size", 1),
    # transformer_rosetta.convert
    ("convert src None", lambda m, o: tr.convert(None, o / "c.pt"), "src", True),
    ("convert dst None", lambda m, o: tr.convert(m.dec_path, None), "dst", True),
    ("convert config list", lambda m, o: tr.convert(m.dec_path, o / "c.pt", config=[1, 2]), "config", 1),
    ("convert config bad JSON", lambda m, o: tr.convert(m.dec_path, o / "c.pt", config='{"pad_id": }'), "config", 0),
    ("convert from_kind int", lambda m, o: tr.convert(m.dec_path, o / "c.pt", from_kind=1), "from_kind", 1),
    ("convert from_kind unknown", lambda m, o: tr.convert(m.dec_path, o / "c.pt", from_kind="gguf"), "from_kind", 0),
    ("convert to_kind unknown", lambda m, o: tr.convert(m.dec_path, o / "c.pt", to_kind="gguf"), "to_kind", 0),
    ("convert force str", lambda m, o: tr.convert(m.dec_path, o / "c.pt", force="yes"), "force", True),
    ("convert allow_nonfinite int", lambda m, o: tr.convert(m.dec_path, o / "c.pt", allow_nonfinite=1), "allow_nonfinite", 1),
    ("convert learned_positions str", lambda m, o: tr.convert(m.dec_path, o / "c.pt", learned_positions="no"), "learned_positions", 1),
    ("convert verify str", lambda m, o: tr.convert(m.dec_path, o / "c.pt", verify="no"), "verify", True),
    ("convert also_read int", lambda m, o: tr.convert(m.dec_path, o / "c.pt", also_read=5), "also_read", 1),
    ("convert also_read str", lambda m, o: tr.convert(m.dec_path, o / "c.pt", also_read="c.json"), "also_read", 1),
    ("convert onnx list", lambda m, o: tr.convert(m.dec_path, o / "c.onnx", onnx=["forward"]), "onnx", 1),
    ("convert progress int", lambda m, o: tr.convert(m.dec_path, o / "c.pt", progress=5), "progress", 1),
    ("convert max_shard_size 0", lambda m, o: tr.convert(m.dec_path, o / "s", max_shard_size=0), "max_shard_size", 0),
    ("convert max_shard_size str", lambda m, o: tr.convert(m.dec_path, o / "s", max_shard_size="2GB"), "max_shard_size", 1),
    # transformer_rosetta.parity
    ("parity weights int", lambda m, o: tr.parity(5, frameworks=["numpy"]), "weights", True),
    ("parity preset list", lambda m, o: tr.parity(preset=["tiny"], frameworks=["numpy"]), "preset", 1),
    ("parity config list", lambda m, o: tr.parity(config=[1], frameworks=["numpy"]), "config", True),
    ("parity frameworks None", lambda m, o: tr.parity(frameworks=None), "frameworks", True),
    ("parity frameworks unknown", lambda m, o: tr.parity(frameworks=["mxnet"]), "frameworks", 0),
    ("parity dtype unknown", lambda m, o: tr.parity(dtype="int8", frameworks=["numpy"]), "dtype", 0),
    ("parity device unknown", lambda m, o: tr.parity(device="tpu", frameworks=["numpy"]), "device", 0),
    ("parity precision unknown", lambda m, o: tr.parity(precision="x", frameworks=["numpy"]), "precision", 0),
    ("parity seed str", lambda m, o: tr.parity(seed="abc", frameworks=["numpy"]), "seed", True),
    ("parity seed -1", lambda m, o: tr.parity(seed=-1, frameworks=["numpy"]), "seed", False),
    # the searches
    ("greedy start None", lambda m, o: tr.greedy_search(None, m.config, SRC), "start", True),
    ("greedy c None", lambda m, o: tr.greedy_search(m.stepper, None, SRC), "c", True),
    ("greedy src None", lambda m, o: tr.greedy_search(m.stepper, m.config, None), "src", False),
    ("greedy src ragged", lambda m, o: tr.greedy_search(m.stepper, m.config, [[1], [1, 2]]), "src", 0),
    ("greedy extra_len 0", lambda m, o: tr.greedy_search(m.stepper, m.config, SRC, extra_len=0), "extra_len", 0),
    ("greedy extra_len str", lambda m, o: tr.greedy_search(m.stepper, m.config, SRC, extra_len="5"), "extra_len", 1),
    ("greedy stop_at_eos str", lambda m, o: tr.greedy_search(m.stepper, m.config, SRC, stop_at_eos="no"), "stop_at_eos", 1),
    ("beam beam 0", lambda m, o: tr.beam_search(m.stepper, m.config, SRC, beam=0), "beam", False),
    ("beam beam str", lambda m, o: tr.beam_search(m.stepper, m.config, SRC, beam="4"), "beam", True),
    ("beam alpha str", lambda m, o: tr.beam_search(m.stepper, m.config, SRC, alpha="0.6"), "alpha", 1),
    ("beam alpha nan", lambda m, o: tr.beam_search(m.stepper, m.config, SRC, alpha=float("nan")), "alpha", 0),
    ("sample seed str", lambda m, o: tr.sample_search(m.stepper, m.config, SRC, seed="abc"), "seed", True),
    ("sample seed None", lambda m, o: tr.sample_search(m.stepper, m.config, SRC, seed=None), "seed", True),
    ("sample seed -1", lambda m, o: tr.sample_search(m.stepper, m.config, SRC, seed=-1), "seed", False),
    ("sample temperature -1", lambda m, o: tr.sample_search(m.stepper, m.config, SRC, temperature=-1.0), "temperature", 0),
    # the weight files
    ("load_weights path None", lambda m, o: tr.load_weights(None), "path", True),
    ("load_weights config list", lambda m, o: tr.load_weights(m.dec_path, config=[1]), "config", True),
    ("save_weights path None", lambda m, o: tr.save_weights(None, {}, m.config, "t"), "path", True),
    ("save_weights tensors None", lambda m, o: tr.save_weights(o / "w.safetensors", None, m.config, "t"), "tensors", 1),
    ("save_weights config None", lambda m, o: tr.save_weights(o / "w.safetensors", {}, None, "t"), "config", 1),
    ("save_weights producer None", lambda m, o: tr.save_weights(o / "w.safetensors", {}, m.config, None), "producer", 1),
    ("save_weights task int", lambda m, o: tr.save_weights(o / "w.safetensors", {}, m.config, "t", task=5), "task", 1),
    ("save_weights max_shard_size 0", lambda m, o: tr.save_weights(o / "w", {}, m.config, "t", max_shard_size=0), "max_shard_size", 0),
    ("save_weights max_shard_size str", lambda m, o: tr.save_weights(o / "w", {}, m.config, "t", max_shard_size="1GB"), "max_shard_size", 1),
    ("save_weights metadata list", lambda m, o: tr.save_weights(o / "w.safetensors", {}, m.config, "t", metadata=[("a", "b")]), "metadata", 1),
    ("init_weights c None", lambda m, o: tr.init_weights(None), "c", True),
    ("init_weights seed str", lambda m, o: tr.init_weights(m.config, seed="abc"), "seed", True),
    ("init_weights seed -1", lambda m, o: tr.init_weights(m.config, seed=-1), "seed", False),
    ("init_weights scheme unknown", lambda m, o: tr.init_weights(m.config, scheme="xavier"), "scheme", 0),
    ("init_weights dtype None", lambda m, o: tr.init_weights(m.config, dtype=None), "dtype", True),
    # the config
    ("preset None", lambda m, o: tr.preset(None), "preset", False),
    ("preset list", lambda m, o: tr.preset(["tiny"]), "preset", False),
    ("from_file None", lambda m, o: tr.TransformerConfig.from_file(None), "path", True),
    ("from_file bad JSON", lambda m, o: tr.TransformerConfig.from_file('{"d_model": }'), "config", 0),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "argument", "wrong_type"),
    [pytest.param(call, arg, bool(kind), id=name) for name, call, arg, kind in CASES],
)
def test_a_bad_argument_is_the_projects_error_naming_it(
    models, tmp_path, call, argument, wrong_type
):
    with pytest.raises(tr.RosettaError) as caught:
        call(models, tmp_path)
    error, message = caught.value, str(caught.value)
    assert "\n" not in message, message
    # "ARGUMENT: PROBLEM" (a ConfigError says "invalid config: " first, as it always does).
    assert re.match(rf"(invalid config: )?{re.escape(argument)}\b", message), message
    if wrong_type:  # still a TypeError, as Python's own, and an InputError
        assert isinstance(error, InputTypeError) and isinstance(error, TypeError), repr(error)
    assert os.listdir(tmp_path) == []  # refused before anything was written


# The public functions, each with the prefix of its rows in CASES.
FUNCTIONS = {
    "load": "load ",
    "convert": "convert ",
    "parity": "parity ",
    "beam_search": "beam ",
    "greedy_search": "greedy ",
    "sample_search": "sample ",
    "load_weights": "load_weights ",
    "save_weights": "save_weights ",
    "init_weights": "init_weights ",
    "preset": "preset ",
}
METHODS = {"forward": "forward ", "generate": "generate ", "embed": "embed ", "save": "save "}


def test_every_public_function_and_method_has_rows():
    """A new entry point of the public API (or a new method of its model) gets rows here too."""
    functions = {n for n in tr.__all__ if inspect.isfunction(getattr(tr, n))}
    assert functions == set(FUNCTIONS)
    methods = {
        name
        for name, value in vars(tr.RosettaModel).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }
    assert methods == {*METHODS, "encode"}  # encode is embed (sentence-transformers' name)
    assert tr.RosettaModel.encode is tr.RosettaModel.embed
    names = [name for name, *_ in CASES]
    for prefix in (*FUNCTIONS.values(), *METHODS.values(), "from_file "):
        assert any(name.startswith(prefix) for name in names), prefix


def test_save_says_the_apis_words(models):
    """The API's word for overwriting is force=True, not the command line's --force."""
    with pytest.raises(tr.RosettaError) as caught:
        models.dec.save(models.dec_path)
    assert str(caught.value).endswith("exists; pass force=True to overwrite it")
    assert "--" not in str(caught.value)


# -- beams: 0 and negative refused in the API and the CLI ------------------------------------------


@pytest.mark.parametrize("beam", [0, -1])
def test_a_beam_below_one_is_refused_in_the_api_and_the_cli(models, capsys, beam):
    for model in (models.dec, models.ed):  # greedy by default: the beam was ignored before
        with pytest.raises(tr.InputError, match=rf"^beam: must be an integer >= 1, got {beam}$"):
            model.generate(IDS, beam=beam, max_new_tokens=2)
    code, _, err = run(
        capsys, "generate", "--weights", models.dec_path, "--framework", "numpy", "--ids", "5,7",
        "--max-new-tokens", "2", "--beam", str(beam),
    )  # fmt: skip
    one_line_error(code, err, "--beam", f"must be >= 1, got {beam}")


def test_beam_one_is_greedy_and_more_is_beam_search(models):
    """The strategy follows from beam (generate's docstring): 1 is greedy search's tokens, 2
    beam search's with two beams (EOS, when it ended a row, returned as transformers does)."""
    c = models.config
    greedy = tr.greedy_search(models.stepper, c, SRC, extra_len=4)
    beams = tr.beam_search(models.stepper, c, SRC, beam=2, extra_len=4)
    for decoded, beam in ((greedy, 1), (beams, 2)):
        want = [int(t) for t in decoded.tokens[0]] + ([c.eos_id] if decoded.finished[0] else [])
        assert models.dec.generate(IDS, beam=beam, max_new_tokens=4) == want


def test_sampling_options_need_sample_in_the_api_as_on_the_command_line(models, capsys):
    with pytest.raises(tr.InputError, match="^temperature: applies to sample=True"):
        models.dec.generate(IDS, temperature=0.5, max_new_tokens=2)
    code, _, err = run(
        capsys, "generate", "--weights", models.dec_path, "--framework", "numpy", "--ids", "5,7",
        "--max-new-tokens", "2", "--temperature", "0.5",
    )  # fmt: skip
    one_line_error(code, err, "--temperature applies to --sample")


# -- sizes: --max-shard-size and max_shard_size= --------------------------------------------------


@pytest.mark.parametrize(
    "text", ["2GB", "200MB", "500KB", "1.5GB", "0.5MB", "1.25KB", "2 GB", "7TB"]
)
def test_a_size_with_a_decimal_unit_is_read_as_huggingface_hub_reads_it(text):
    """transformers' save_pretrained reads max_shard_size with huggingface_hub's
    parse_size_to_int: decimal units, a decimal number allowed ("1.5GB" is 1.5e9 bytes)."""
    hub = import_or_skip("huggingface_hub.serialization._base", "huggingface_hub reads sizes")
    assert parse_size(text) == hub.parse_size_to_int(text)


@pytest.mark.parametrize(
    ("text", "size"), [("1KiB", 2**10), ("3MiB", 3 * 2**20), ("2GiB", 2 * 2**30)]
)
def test_a_binary_unit_is_a_power_of_two_as_transformers_reads_it(text, size):
    hub = import_or_skip("transformers.utils.hub", "transformers reads binary sizes")
    assert parse_size(text) == hub.convert_file_size_to_int(text) == size


@pytest.mark.parametrize(
    ("text", "size"),
    [("1", 1), ("1.", 1), (" 7 ", 7), (".5KB", 500), ("1.5KiB", 1536),
     ("99999999999999999999TB", 99999999999999999999 * 10**12)],
)  # fmt: skip
def test_the_exact_sizes_at_the_boundaries(text, size):
    """Exact, not through a float: 20 nines of terabytes is no float's value."""
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("0", "a shard holds at least 1 byte"),
        ("0.4", "a shard holds at least 1 byte"),
        ("1.5", "not a whole number of bytes"),  # was 1 byte: a shard per tensor
        ("1.5B", "not a whole number of bytes"),
        ("1.0000001KB", "not a whole number of bytes"),  # 1000.0001 bytes
        ("1.1KiB", "not a whole number of bytes"),  # 1126.4 bytes
        ("0.0001KB", "a shard holds at least 1 byte"),
        ("-5", "is not a size"),
        ("-1.5GB", "is not a size"),
        ("abc", "is not a size"),
        ("", "is not a size"),
        ("1e9", "is not a size"),
        ("2XB", "unknown unit 'XB'"),
        ("9" * 21, "more than 20 digits"),
        ("9" * 100_000 + "GB", "more than 20 digits"),  # refused at once, never computed
    ],
)
def test_a_size_that_is_no_whole_count_of_bytes_is_refused(text, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        parse_size(text)


def test_a_fraction_on_the_command_line_is_one_line_and_writes_nothing(capsys, tmp_path):
    code, _, err = run(
        capsys, "convert", VECTOR, tmp_path / "shards", "--max-shard-size", "1.5", "--no-verify"
    )
    one_line_error(code, err, "--max-shard-size", "'1.5' is not a whole number of bytes")
    assert os.listdir(tmp_path) == []


def test_a_decimal_size_with_a_unit_shards_as_its_bytes(capsys, tmp_path):
    """--max-shard-size 1.5KB is 1500 bytes, the split the API's max_shard_size=1500 makes."""
    folder = tmp_path / "shards"
    code, _, err = run(
        capsys, "convert", VECTOR, folder, "--max-shard-size", "1.5KB", "--no-verify"
    )
    assert code == 0, err
    files = planned_files(load_weights(VECTOR).config, "float64", 1500)
    assert len(files) > 3 and sorted(os.listdir(folder)) == sorted(files)


# -- --config as the JSON itself ---------------------------------------------------------------

TINY = {"d_model": 32, "num_heads": 2, "d_ff": 64, "num_encoder_layers": 1,
        "num_decoder_layers": 1, "src_vocab_size": 50, "tgt_vocab_size": 50}  # fmt: skip


def test_inline_config_json_reads_as_its_file_does(capsys, tmp_path):
    text = json.dumps(TINY)
    file = tmp_path / "c.json"
    file.write_text(text)
    code, from_file, err = run(capsys, "inspect", "--config", file)
    assert code == 0, err
    code, inline, err = run(capsys, "inspect", "--config", text)
    assert code == 0, err
    # Everything but the first line, which names the source.
    assert inline.split("\n", 1)[1] == from_file.split("\n", 1)[1]
    assert tr.TransformerConfig.from_file(text) == tr.TransformerConfig.from_file(file)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"pad_id": }', "config JSON '{\"pad_id\": }': not valid JSON"),
        ('{"pad_id": 0, "pad_id": 1}', "the key 'pad_id' appears more than once"),
        ('{"a":' * 65 + "1" + "}" * 65, "nested deeper than 64"),
        ('{"d_model": 1' + "0" * 30 + "}", "digits"),
        ("[1, 2]", "no such config file"),  # no `{`: a file's name, as before
        ('  {"d_modle": 32}', "d_modle: unknown config field (did you mean 'd_model'?)"),
    ],
)
def test_malformed_inline_config_is_one_line(capsys, tmp_path, text, needle):
    code, _, err = run(capsys, "convert", VECTOR, tmp_path / "x.pt", "--config", text)
    one_line_error(code, err, needle)
    assert os.listdir(tmp_path) == []


def test_inline_config_is_held_to_a_files_size_limit():
    from transformer_rosetta.files.safe_read import MAX_CONFIG_BYTES

    text = '{"d_model": 32, "x": "' + "y" * MAX_CONFIG_BYTES + '"}'
    with pytest.raises(tr.ConfigError, match=f"over the limit of {MAX_CONFIG_BYTES:,}"):
        tr.TransformerConfig.from_file(text)


def test_a_config_file_given_to_the_api_is_never_its_destination(tmp_path):
    """convert(config=FILE) reads FILE as --config does, so FILE is an input: not writable."""
    file = tmp_path / "c.json"
    file.write_text(json.dumps(load_weights(VECTOR).config.to_dict()))
    with pytest.raises(tr.RosettaError, match="is also an input"):
        tr.convert(VECTOR, file, to_kind="torch", config=file, force=True)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """Tiny save_pretrained folders: a GPT-2 without a pad token, a 4-head Llama."""
    torch = import_or_skip("torch", "torch builds the transformers models")
    transformers = import_or_skip("transformers", "transformers builds the folders")
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16,
            bos_token_id=39, eos_token_id=39,
        )
    )  # fmt: skip
    gpt2.save_pretrained(root / "gpt2")
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
            bos_token_id=1, eos_token_id=2,
        )
    )  # fmt: skip
    llama.save_pretrained(root / "llama")
    return root / "gpt2", root / "llama"


def test_the_documented_inline_configs_work(capsys, tmp_path, hf_folders):
    """docs/PORTING.md: `--config '{"pad_id": N}'` picks GPT-2's pad id; `--config
    '{"num_heads": 2}'` on a 4-head folder is refused with the documented line, as is a field
    the code fixes (rotary_layout); and through the API's config= alike."""
    gpt2, llama = hf_folders
    out = tmp_path / "gpt2.safetensors"
    code, _, err = run(
        capsys, "convert", gpt2, out, "--from", "gpt2", "--config", '{"pad_id": 5}', "--no-verify"
    )
    assert code == 0, err
    assert load_weights(out).config.pad_id == 5
    api = tr.convert(gpt2, tmp_path / "api.safetensors", from_kind="gpt2",
                     config='{"pad_id": 6}', verify=False)  # fmt: skip
    assert api.config.pad_id == 6
    code, _, err = run(
        capsys, "convert", llama, tmp_path / "x.safetensors", "--config",
        '{"rotary_layout": "interleaved"}',
    )  # fmt: skip
    one_line_error(code, err, "rotary_layout: --config says 'interleaved', but transformers' "
                   "rotate_half pairs dimension i with i + d_k/2")  # fmt: skip
    # The documented line as a shell runs it: the quotes are the shell's, the JSON is ours.
    line = (
        f"{shlex.quote(sys.executable)} -m transformer_rosetta convert {shlex.quote(str(llama))} "
        f"""{shlex.quote(str(tmp_path / "y.safetensors"))} --config '{{"num_heads": 2}}'"""
    )
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=300)
    one_line_error(
        done.returncode,
        done.stderr,
        "num_heads: --config says 2, but config.json's num_attention_heads says 4",
    )
    assert sorted(os.listdir(tmp_path)) == ["api.safetensors", "gpt2.safetensors"]


# -- build_model's memory check counts the dtype asked for --------------------------------------


@pytest.mark.parametrize(("dtype", "itemsize"), [("float32", 4), ("float64", 8), ("bfloat16", 2)])
def test_the_memory_check_counts_the_dtype_it_builds_in(dtype, itemsize):
    """A rotary model's max_len of 10^12 that no tensor bounds: the cosine and sine tables a
    framework builds hold max_len x d_k numbers (d_k / 2 each), 10^12 x 8 here, at the itemsize
    of the requested dtype: about 29,802.3 GiB in float32, twice that in float64, half in
    bfloat16 (the weights, ~10^4 numbers, do not move the first decimal). Refused in one line
    before a model is built, by the figure of the dtype it would have built in."""
    from parity_tests.conftest import backend_or_skip
    from transformer_rosetta.app.model import build_model
    from transformer_rosetta.files.memory import ResourceError

    backend_or_skip("torch")
    small = tr.preset("tiny_llama")
    config = small.replace(max_len=10**12)
    d_k = small.d_model // small.num_heads
    gib = 10**12 * d_k * itemsize / 2**30
    with pytest.raises(ResourceError) as refused:
        build_model("torch", config, tr.init_weights(small, seed=0), dtype=dtype, device="cpu")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"a torch model of this config needs about {gib:,.1f} GiB"), message


# -- the one check of how to decode, below the model's own checks ---------------------------------

# (id, generate_ids' options, the argument named). RosettaModel.generate and the command line
# check beam, sample and the sampling options themselves first; generate_ids reaches
# check_decoding_options alone, so every refusal here is that check's.
DECODING = [
    ("greedy beam 0", {"strategy": "greedy", "beam": 0}, "beam"),
    ("beam beam 0", {"strategy": "beam", "beam": 0}, "beam"),
    ("beam stop_at_eos False", {"strategy": "beam", "beam": 2, "stop_at_eos": False}, "stop_at_eos"),
    ("greedy stop_at_eos str", {"stop_at_eos": "no"}, "stop_at_eos"),
    ("greedy cached int", {"cached": 1}, "cached"),
    ("sample seed -1", {"strategy": "sample", "seed": -1}, "seed"),
    ("strategy unknown", {"strategy": "topk"}, "strategy"),
    ("max_new_tokens 0", {"max_new_tokens": 0}, "max_new_tokens"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("options", "argument"), [pytest.param(o, a, id=name) for name, o, a in DECODING]
)
def test_generate_ids_refuses_what_check_decoding_options_refuses(models, options, argument):
    """common/app/generation.py, check_decoding_options: every argument is checked whatever the
    strategy (a beam of 0 under greedy too), in one line naming it."""
    from transformer_rosetta.app.generation import generate_ids

    with pytest.raises(tr.InputError) as caught:
        generate_ids(models.dec.built, [IDS], **{"max_new_tokens": 2, **options})
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{argument}:"), message
    if argument == "beam":
        assert message == "beam: must be an integer >= 1, got 0"


def test_greedy_and_sampling_may_run_past_eos(models):
    """stop_at_eos=False is refused for beam search only: greedy and sampling decode exactly
    max_new_tokens (3) new tokens with it."""
    from transformer_rosetta.app.generation import generate_ids

    for strategy in ("greedy", "sample"):
        (new,) = generate_ids(
            models.dec.built, [IDS], max_new_tokens=3, strategy=strategy, stop_at_eos=False
        )
        assert len(new) == 3, strategy


def test_inline_json_is_told_by_its_first_character(tmp_path, monkeypatch):
    """config.py, is_inline_json: a value is the JSON itself when it starts with `{` (after
    blanks), and a file's name otherwise, whatever it ends with: the JSON with a trailing
    newline is still JSON; files named `c}` and `./{c}.json` (the docstring's way to name a
    file that starts with a brace) are read as files."""
    want = tr.TransformerConfig.from_file(json.dumps(TINY))
    assert want.d_model == TINY["d_model"]
    assert tr.TransformerConfig.from_file(json.dumps(TINY) + "\n") == want
    monkeypatch.chdir(tmp_path)
    for name in ("c}", "{c}.json"):
        (tmp_path / name).write_text(json.dumps(TINY))
    assert tr.TransformerConfig.from_file("c}") == want
    assert tr.TransformerConfig.from_file("./{c}.json") == want
