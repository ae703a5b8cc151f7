"""Issue 41, class 2, on our own files: the layer counts of a shared-format file's header config
(one file or a sharded folder), and of the `--config` given with a native checkpoint (torch,
Keras, Flax), are compared with the layers the file's keys hold before anything names every
layer the config claims (spec/names.py, layer_count_problems; weights/format.py,
check_layer_counts; docs/RELIABILITY.md, "Counts of an outside config").

Before the fix, a header config saying `num_decoder_layers: 1000000000` over a file of 2 layers
made `rosetta inspect`, `convert`, `parity`, `generate` and `tr.load` run for minutes with
growing memory: the validator listed the canonical names of 10^9 layers (canonical_specs) before
it compared one. A native checkpoint's `--config` did the same in each framework's reader, and
`rosetta inspect --config` listed every tensor of the config.

The files are the project's own, written by save_weights; the header config is then replaced
the way a hostile or mistaken writer would (safetensors' own writer for one file, add_metadata
for every shard of a folder). The messages' numbers are the files' (2 layers, indices 0 .. 1).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import safetensors.numpy

import transformer_rosetta as tr
from parity_tests.cli.command_line import one_line_error, run
from parity_tests.conftest import backend_or_skip
from parity_tests.reliability.test_outside_counts import API_SECONDS, B, fresh_process
from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.spec.config import preset
from transformer_rosetta.weights import format as fmt
from transformer_rosetta.weights.init import init_weights

TINY = preset("tiny")  # 2 encoder and 2 decoder layers
DECODER = preset("tiny_decoder_only")  # 2 decoder layers, for rosetta generate
HOLDS = "2 layers (decoder.layers.{i} for i = 0 .. 1)"
ENCODER_HOLDS = "2 layers (encoder.layers.{i} for i = 0 .. 1)"


def own_file(tmp_path: Path, config, changes: dict, sharded: bool = False) -> Path:
    """`config`'s weights in the shared format, their header config given `changes`."""
    weights = init_weights(config, seed=0)
    header_config = json.dumps({**config.to_dict(), **changes})
    if sharded:
        path = tmp_path / "model"
        fmt.save_weights(path, weights, config, producer="test", max_shard_size=4000)
        assert len(list(path.glob("model-*-of-*.safetensors"))) >= 2
        fmt.add_metadata(path, {"config": header_config})
        return path
    path = tmp_path / "model.safetensors"
    metadata = {"format": fmt.FORMAT_NAME, "format_version": "1", "config": header_config}
    safetensors.numpy.save_file(weights, str(path), metadata=metadata)
    return path


def api_refuses(path: Path, *needles: str) -> None:
    """tr.load refuses with a WeightFileError holding every needle, within API_SECONDS."""
    start = time.monotonic()
    with pytest.raises(WeightFileError) as err:
        tr.load(path)
    assert time.monotonic() - start < API_SECONDS, "work proportional to the count?"
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


# -- a huge count in a file's own header: every surface, in a fresh process under a timeout --------

# case -> (config, header changes, sharded, the words of the refusal)
HUGE = {
    "decoder layers": (TINY, {"num_decoder_layers": B}, False, ("num_decoder_layers", HOLDS)),
    "encoder layers": (
        TINY,
        {"num_encoder_layers": B},
        False,
        ("num_encoder_layers", ENCODER_HOLDS),
    ),
    "decoder-only": (DECODER, {"num_decoder_layers": B}, False, ("num_decoder_layers", HOLDS)),
    "sharded": (DECODER, {"num_decoder_layers": B}, True, ("num_decoder_layers", HOLDS)),
}


def surfaces(path: Path, out: Path, config) -> dict[str, list[object]]:
    """The commands that read a shared-format model (generate: decoder-only ones)."""
    commands = {
        "inspect": ["inspect", path],
        "convert": ["convert", path, out / "out.pt", "--no-verify"],
        "parity": ["parity", "--weights", path],
    }
    if not config.has_encoder:
        commands["generate"] = [
            "generate",
            "--weights",
            path,
            "--ids",
            "5,6",
            "--max-new-tokens",
            2,
        ]
    return commands


@pytest.mark.parametrize("case", list(HUGE))
def test_a_huge_layer_count_in_the_header_is_refused_within_the_timeout(tmp_path, case):
    config, changes, sharded, needles = HUGE[case]
    path = own_file(tmp_path, config, changes, sharded)
    value = str(next(iter(changes.values())))
    out = tmp_path / "out"
    out.mkdir()
    for command in surfaces(path, out, config).values():
        proc = fresh_process(*command)  # TimeoutExpired: it hangs
        one_line_error(proc.returncode, proc.stderr, f"{needles[0]}: {value}", *needles[1:])
        assert "Traceback" not in proc.stderr
    assert list(out.iterdir()) == []
    api_refuses(path, f"{needles[0]}: {value}", *needles[1:])


# -- a count slightly off: named as well, in this process ----------------------------------------

NEAR = {
    "3 decoder layers for 2": (
        TINY,
        {"num_decoder_layers": 3},
        False,
        ("num_decoder_layers: 3", HOLDS),
    ),
    "1 encoder layer for 2": (
        TINY,
        {"num_encoder_layers": 1},
        False,
        ("num_encoder_layers: 1", ENCODER_HOLDS),
    ),
    "sharded, 3 for 2": (
        DECODER,
        {"num_decoder_layers": 3},
        True,
        ("num_decoder_layers: 3", HOLDS),
    ),
}


@pytest.mark.parametrize("case", list(NEAR))
def test_a_layer_count_off_by_one_is_refused_naming_the_field(tmp_path, capsys, case):
    config, changes, sharded, needles = NEAR[case]
    path = own_file(tmp_path, config, changes, sharded)
    code, _, err = run(capsys, "inspect", path)
    one_line_error(code, err, *needles)
    api_refuses(path, *needles)


def gapped_file(tmp_path: Path, header_layers: int) -> Path:
    """A decoder-only file of layers 0 and 2 (layer 1's tensors left out of a 3-layer model's),
    its header config saying `header_layers`."""
    config = DECODER.replace(num_decoder_layers=3)
    weights = {
        k: v
        for k, v in init_weights(config, seed=0).items()
        if not k.startswith("decoder.layers.1.")
    }
    header = json.dumps({**config.to_dict(), "num_decoder_layers": header_layers})
    path = tmp_path / "gapped.safetensors"
    metadata = {"format": fmt.FORMAT_NAME, "format_version": "1", "config": header}
    safetensors.numpy.save_file(weights, str(path), metadata=metadata)
    return path


# Two indices are held, 0 and 2: neither 2 layers (its last index is not 1) nor 3 (only two are
# held). Each is refused by the count, naming the indices the file holds.
GAPPED_HOLDS = "2 layers (decoder.layers.{i} for i = 0, 2)"


@pytest.mark.parametrize("header_layers", [2, 3])
def test_a_file_whose_layers_have_a_gap_is_refused_by_the_count(tmp_path, capsys, header_layers):
    path = gapped_file(tmp_path, header_layers)
    needles = (f"num_decoder_layers: {header_layers}, but the file holds {GAPPED_HOLDS}",)
    code, _, err = run(capsys, "inspect", path)
    one_line_error(code, err, *needles)
    api_refuses(path, *needles)


def test_the_unchanged_files_still_load(tmp_path):
    """The check refuses what a file cannot hold, not the model it holds."""
    for config, sharded in ((TINY, False), (DECODER, True)):
        folder = tmp_path / f"{config.kind}-{sharded}"
        folder.mkdir()
        model = tr.load(own_file(folder, config, {}, sharded))
        assert model.config == config


# -- a native checkpoint read with a --config of 10^9 layers --------------------------------------

# framework -> (--from, the file name model.save_weights and friends give)
NATIVE = {
    "torch": ("torch", "model.pt"),
    "tf": ("keras", "model.weights.h5"),
    "jax": ("flax", "model.msgpack"),
}
# How each reader names the file's decoder layers.
NATIVE_HOLDS = {
    "torch": HOLDS,
    "tf": "2 layers (decoder/layers/decoder_layer{_i} for i = 0 .. 1)",
    "jax": HOLDS,
}


def native_file(tmp_path: Path, name: str, layers: int) -> tuple[Path, Path, str]:
    """(TINY's checkpoint in framework `name`, a --config of `layers` decoder layers, --from)."""
    backend = backend_or_skip(name)
    from_kind, file_name = NATIVE[name]
    path = tmp_path / file_name
    backend.save_native(path, TINY, init_weights(TINY, seed=0))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY.to_dict(), "num_decoder_layers": layers}))
    return path, config, from_kind


@pytest.mark.parametrize("name", list(NATIVE))
def test_a_native_checkpoint_with_a_huge_config_is_refused_within_the_timeout(tmp_path, name):
    path, config, from_kind = native_file(tmp_path, name, B)
    dst = tmp_path / "out.safetensors"
    proc = fresh_process("convert", path, dst, "--from", from_kind, "--config", config)
    one_line_error(proc.returncode, proc.stderr, f"num_decoder_layers: {B}", NATIVE_HOLDS[name])
    assert not dst.exists()


@pytest.mark.parametrize(
    "field", ["num_encoder_layers", "num_decoder_layers"], ids=["encoder", "decoder"]
)
def test_check_layer_counts_refuses_a_count_of_either_stack_above_the_keys(field):
    """weights/format.py, check_layer_counts, on TINY's canonical keys (2 layers a stack): 10^9
    layers in either stack is more than the file's keys can hold, refused naming that stack's
    count and the layers held; 2 layers is left to the tensor-by-tensor comparison."""
    keys = list(init_weights(TINY, seed=0))
    holds = HOLDS if field == "num_decoder_layers" else ENCODER_HOLDS
    with pytest.raises(WeightFileError) as err:
        fmt.check_layer_counts("model.pt", TINY.replace(**{field: B}), keys)
    assert f"{field}: {B}, but the file holds {holds}" in str(err.value)
    fmt.check_layer_counts("model.pt", TINY, keys)  # no error


def test_a_native_checkpoint_with_a_huge_encoder_count_is_refused_within_the_timeout(tmp_path):
    """The encoder's count too, through torch's reader, in a fresh process under a timeout."""
    path, config, from_kind = native_file(tmp_path, "torch", 2)
    config.write_text(json.dumps({**TINY.to_dict(), "num_encoder_layers": B}))
    dst = tmp_path / "out.safetensors"
    proc = fresh_process("convert", path, dst, "--from", from_kind, "--config", config)
    one_line_error(proc.returncode, proc.stderr, f"num_encoder_layers: {B}", ENCODER_HOLDS)
    assert not dst.exists()


@pytest.mark.parametrize("name", list(NATIVE))
def test_a_native_checkpoint_with_one_layer_too_many_lists_what_is_missing(tmp_path, capsys, name):
    """A count within what the file could hold is compared tensor by tensor, as before: each
    missing tensor of layer 2 (26 of a decoder layer with cross-attention) is named."""
    path, config, from_kind = native_file(tmp_path, name, 3)
    dst = tmp_path / "out.safetensors"
    code, _, err = run(capsys, "convert", path, dst, "--from", from_kind, "--config", config)
    one_line_error(code, err, "missing tensors (26): decoder.layers.2.self_attention.query.")
    assert not dst.exists()


# -- rosetta inspect --config: what it lists is capped, what it counts is not ----------------------


def test_inspect_of_a_config_with_a_huge_count_lists_the_first_tensors_and_counts_the_rest(
    tmp_path,
):
    """TINY's tensors by hand: one shared embedding; an encoder layer 16 (q, k, v, output, each
    a kernel and a bias: 8; feed-forward 4; two LayerNorms 4), a decoder layer 26 (16 and the
    cross-attention's 8 and its LayerNorm's 2). With 10^9 decoder layers:
    1 + 2 * 16 + 26 * 10^9 tensors, of which the first 10,000 are listed."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY.to_dict(), "num_decoder_layers": B}))
    count = 1 + 2 * 16 + 26 * B
    proc = fresh_process("inspect", "--config", path, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["tensor_count"] == count
    assert len(report["tensors"]) == 10_000
    proc = fresh_process("inspect", "--config", path)
    assert proc.returncode == 0, proc.stderr
    assert f"... and {count - 10_000:,} more tensors, not listed" in proc.stdout
    assert f"in {count} tensors" in proc.stdout


def test_a_huge_max_len_without_a_position_tensor_is_refused_by_the_memory_it_needs(
    tmp_path, capsys
):
    """Rotary positions store no tensor, so no shape bounds the header's max_len; each model
    built from it computes a table of max_len rows (spec/names.py, position_buffer_count). 10^12
    rows is refused by the memory estimate, in one line, before a model is built: `convert` (its
    verification builds the models), `generate` and `tr.load`. It used to end in the allocator's
    RuntimeError and a traceback."""
    from transformer_rosetta.files.memory import ResourceError

    path = own_file(tmp_path, preset("tiny_llama"), {"max_len": 10**12})
    out = tmp_path / "out.pt"
    code, _, err = run(capsys, "convert", path, out)
    one_line_error(code, err, "--verify's float64 model of this config needs about", "GiB")
    assert not out.exists()
    code, _, err = run(
        capsys,
        "generate",
        "--weights",
        path,
        "--framework",
        "numpy",
        "--max-new-tokens",
        2,
        "--ids",
        "1,2",
    )
    one_line_error(code, err, "a numpy model of this config needs about")
    with pytest.raises(ResourceError, match="a numpy model of this config needs about"):
        tr.load(path, framework="numpy")
