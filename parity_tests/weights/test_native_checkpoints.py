"""Each framework's own checkpoint behind the adapter (transformer_rosetta.adapter.backends.NativeCheckpoints): torch's
state_dict .pt, Keras's .weights.h5 and Flax's msgpack.

- Round trips through every ordered pair of native formats are bit-exact, in float32, bfloat16,
  float64 and float16, with shared, tied and untied embeddings and learned positions.
- Each file is the one its framework writes and reads itself (torch.save of model.state_dict(),
  model.save_weights / load_weights, the msgpack of the nnx.Param state).
- A .pt whose pickle would run code is refused, and the code does not run.
- A truncated, corrupt, foreign or wrong-config file gives one WeightFileError listing every
  problem, and a failed save leaves its destination as it was.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import zipfile

import numpy as np
import pytest

from parity_tests.conftest import backend_or_skip
from parity_tests.grid import variant
from transformer_rosetta.adapter.backends import FRAMEWORKS, NativeCheckpoints, unavailable_reason
from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.weights.init import init_weights

NATIVE = [name for name in FRAMEWORKS if name != "numpy"]
FILE_NAMES = {"torch": "model.pt", "tf": "model.weights.h5", "jax": "model.msgpack"}
SUFFIXES = {"torch": (".pt", ".bin"), "tf": (".weights.h5",), "jax": (".msgpack",)}
# Every ordered pair of the three formats once: t->k, k->f, f->t, t->f, f->k, k->t.
CHAIN = ("torch", "tf", "jax", "torch", "jax", "tf", "torch")

# Learned positions throughout (two more tables per file). Between them: one shared table that is
# also the output projection; separate tables with the output tied to the target one plus an
# output bias; separate untied tables with an output kernel.
CONFIGS = {
    "shared": variant("pre", "gelu", "learned", "shared", True),
    "tied": variant("post", "relu", "learned", "tied", False),
    "untied": variant("pre", "relu", "learned", "untied", False),
}
CHAIN_CASES = [(c, dt) for c in CONFIGS for dt in ("float32", "bfloat16")] + [
    ("tied", "float64"),
    ("shared", "float16"),
]


def available() -> list[str]:
    return [name for name in NATIVE if unavailable_reason(name) is None]


def assert_bit_exact(got: dict[str, np.ndarray], want: dict[str, np.ndarray], where: str) -> None:
    assert list(got) == list(want), f"{where}: names or order differ"
    for name, w in want.items():
        assert got[name].dtype == w.dtype, f"{where}: {name} is {got[name].dtype}, not {w.dtype}"
        assert got[name].shape == w.shape, f"{where}: {name} shape {got[name].shape}"
        assert got[name].tobytes() == w.tobytes(), f"{where}: {name} changed"


@pytest.mark.parametrize("name", NATIVE)
def test_backends_declare_native_checkpoints(name):
    backend = backend_or_skip(name)
    assert isinstance(backend, NativeCheckpoints)
    assert backend.native_suffixes == SUFFIXES[name]


@pytest.mark.parametrize(("config_id", "dtype"), CHAIN_CASES)
def test_round_trip_through_every_pair_of_native_formats_is_bit_exact(tmp_path, config_id, dtype):
    """canonical -> .pt -> canonical -> .weights.h5 -> canonical -> .msgpack -> canonical -> .pt
    -> ... : each file is written from what the previous one gave back, and every step returns
    the original bytes. A framework that is not installed drops out of the chain, which still
    passes through every pair of the others."""
    chain = [name for name in CHAIN if name in available()]
    if not chain:
        pytest.skip("no framework with a native checkpoint is installed")
    config = CONFIGS[config_id]
    original = init_weights(config, seed=11, scheme="perturbed", dtype=dtype)
    tensors = original
    for step, name in enumerate(chain):
        backend = backend_or_skip(name)
        path = tmp_path / f"{step}-{FILE_NAMES[name]}"
        backend.save_native(path, config, tensors)
        tensors = backend.load_native(path, config)
        assert_bit_exact(tensors, original, f"step {step}, {chain[max(step - 1, 0)]} -> {name}")


# -- each file is its framework's own ----------------------------------------------------------


@pytest.mark.parametrize("config_id", ["shared", "untied"])
def test_torch_file_is_the_models_state_dict(tmp_path, config_id):
    backend = backend_or_skip("torch")
    import torch

    from transformer_rosetta.torch_impl.model import Transformer

    config = CONFIGS[config_id]
    weights = init_weights(config, seed=3, scheme="perturbed", dtype="bfloat16")
    path = tmp_path / "model.pt"
    backend.save_native(path, config, weights)
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = Transformer(config)
    assert list(state) == list(model.state_dict())
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    # torch.save keeps one storage per tied Parameter, listed under each of its keys.
    model.load_state_dict(state)
    if config.share_embeddings:
        ptrs = {
            state[k].untyped_storage().data_ptr()
            for k in ("encoder.embedding.weight", "decoder.embedding.weight", "output.weight")
        }
        assert len(ptrs) == 1
    assert_bit_exact(backend.load_native(path, config), weights, "torch")
    # A {"state_dict": ...} wrapper (Lightning, many training scripts) is read the same.
    wrapped = tmp_path / "wrapped.bin"
    torch.save({"state_dict": state, "epoch": 3}, wrapped)
    assert_bit_exact(backend.load_native(wrapped, config), weights, "wrapped")
    raw = backend.read_tensors(wrapped)
    assert list(raw) == list(state)
    assert raw["encoder.embedding.weight"].dtype == np.dtype("bfloat16")


@pytest.mark.parametrize("config_id", ["shared", "untied"])
def test_keras_file_is_what_save_weights_writes_and_load_weights_reads(tmp_path, config_id):
    backend = backend_or_skip("tf")
    from transformer_rosetta.tf_impl import weights as tf_weights

    config = CONFIGS[config_id]
    weights = init_weights(config, seed=3, scheme="perturbed", dtype="bfloat16")
    ours = tmp_path / "ours.weights.h5"
    backend.save_native(ours, config, weights)
    # Keras's own reader takes our file...
    model = tf_weights.load_native(config, ours, "bfloat16")
    assert_bit_exact(tf_weights.export_canonical(model), weights, "keras load_weights")
    # ...and ours takes the file Keras's own writer makes.
    theirs = tmp_path / "theirs.weights.h5"
    model.save_weights(str(theirs))
    assert_bit_exact(backend.load_native(theirs, config), weights, "keras save_weights")


@pytest.mark.parametrize("config_id", ["shared", "untied"])
def test_flax_file_is_the_msgpack_of_the_param_state(tmp_path, config_id):
    backend = backend_or_skip("jax")
    from flax import nnx, serialization

    from transformer_rosetta.jax_impl import weights as jax_weights

    config = CONFIGS[config_id]
    weights = init_weights(config, seed=3, scheme="perturbed", dtype="bfloat16")
    ours = tmp_path / "ours.msgpack"
    backend.save_native(ours, config, weights)
    # Byte for byte the file of a built model's nnx.Param state.
    model = jax_weights.from_canonical(config, weights, "bfloat16")
    built = tmp_path / "built.msgpack"
    jax_weights.save_native(model, built)
    assert ours.read_bytes() == built.read_bytes()
    # And Flax's own restore puts it into a fresh model (msgpack gives list indices back as
    # strings; nnx.replace_by_pure_dict reads them as ints, as it does for orbax).
    fresh = jax_weights.from_canonical(
        config, init_weights(config, 0, dtype="bfloat16"), "bfloat16"
    )
    state = nnx.state(fresh, nnx.Param)
    nnx.replace_by_pure_dict(state, serialization.msgpack_restore(ours.read_bytes()))
    nnx.update(fresh, state)
    assert_bit_exact(jax_weights.export_canonical(fresh), weights, "flax msgpack_restore")


# -- a pickle that would run code ----------------------------------------------------------------


class Payload:
    """Unpickling this calls Path(marker).touch(): the shape of every pickle exploit (with
    os.system in place of touch), harmless here."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


REFUSED = "refused: the file's pickle holds objects other than tensors (weights_only loading)"


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_a_pickle_that_would_run_code_is_refused_and_never_runs(tmp_path, writer):
    backend = backend_or_skip("torch")
    import torch

    marker = tmp_path / "payload_ran"
    path = tmp_path / "evil.pt"
    payload = {"encoder.embedding.weight": Payload(marker)}
    if writer == "torch.save":  # the zip format torch writes, data.pkl inside
        torch.save(payload, path)
    else:  # a bare pickle stream, which torch.load also accepts (the legacy format)
        path.write_bytes(pickle.dumps(payload))

    config = CONFIGS["tied"]
    for load in (backend.read_tensors, lambda p: backend.load_native(p, config)):
        with pytest.raises(WeightFileError) as info:
            load(path)
        assert REFUSED in str(info.value)
        assert len(info.value.problems) == 1
        assert not marker.exists(), "the payload ran"

    # The control: the payload is live, and plain unpickling does run it.
    if writer == "torch.save":
        with zipfile.ZipFile(path) as archive:
            data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    else:
        data = path.read_bytes()
    pickle.loads(data)
    assert marker.exists()


# -- files that cannot be used -------------------------------------------------------------------


def write_valid(tmp_path: pathlib.Path, name: str, config_id: str = "tied") -> pathlib.Path:
    backend = backend_or_skip(name)
    config = CONFIGS[config_id]
    path = tmp_path / FILE_NAMES[name]
    backend.save_native(path, config, init_weights(config, seed=2, dtype="float32"))
    return path


# What each reader says, in part, about a file cut in half and about bytes of no known format.
TRUNCATED = {"torch": "truncated or corrupt", "tf": "truncated file", "jax": "truncated"}
NOT_THIS_FORMAT = {
    "torch": "not a torch checkpoint",
    "tf": "not a readable Keras .weights.h5",
    "jax": "not a Flax msgpack checkpoint",
}


@pytest.mark.parametrize("name", NATIVE)
def test_truncated_corrupt_and_foreign_files_give_one_clear_problem(tmp_path, name):
    backend = backend_or_skip(name)
    config = CONFIGS["tied"]
    good = write_valid(tmp_path, name)
    data = good.read_bytes()

    def refused(path: pathlib.Path) -> str:
        with pytest.raises(WeightFileError) as info:
            backend.load_native(path, config)
        assert info.value.path == str(path)
        assert len(info.value.problems) == 1, info.value.problems
        return info.value.problems[0]

    cut = tmp_path / f"cut-{good.name}"
    cut.write_bytes(data[: len(data) // 2])
    assert TRUNCATED[name] in refused(cut)

    junk = tmp_path / f"junk-{good.name}"
    junk.write_bytes(b"these bytes are not a checkpoint\n" * 8)
    assert NOT_THIS_FORMAT[name] in refused(junk)

    empty = tmp_path / f"empty-{good.name}"
    empty.write_bytes(b"")
    refused(empty)

    assert refused(tmp_path / f"absent-{good.name}") == "no such file"

    # Another framework's checkpoint under this one's name.
    for other in available():
        if other != name:
            foreign = tmp_path / f"from-{other}-{good.name}"
            foreign.write_bytes(write_valid(tmp_path, other).read_bytes())
            refused(foreign)


# A file for config A read as config B: B drops an encoder layer (unexpected tensors), adds a
# decoder layer (missing ones) and widens d_ff (wrong shapes), all to be reported at once.
WRONG = dict(num_encoder_layers=1, num_decoder_layers=2, d_ff=21)
# How each framework names one tensor of each problem in its message.
NAMES_IN_MESSAGES = {
    "torch": (
        "encoder.layers.1.self_attention.query.weight",
        "decoder.layers.1.cross_attention.key.weight",
        "wrong shape for encoder.layers.0.feed_forward.intermediate.weight",
    ),
    "tf": (
        "encoder/layers/encoder_layer_1/self_attention/query/vars/0",
        "decoder.layers.1.cross_attention.key.kernel",
        "wrong shape for encoder.layers.0.feed_forward.intermediate.kernel",
    ),
    "jax": (
        "encoder.layers.1.self_attention.query.kernel",
        "decoder.layers.1.cross_attention.key.kernel",
        "wrong shape for encoder.layers.0.feed_forward.intermediate.kernel",
    ),
}


@pytest.mark.parametrize("name", NATIVE)
def test_a_file_for_another_config_lists_every_problem(tmp_path, name):
    backend = backend_or_skip(name)
    path = write_valid(tmp_path, name)
    other = CONFIGS["tied"].replace(**WRONG)
    with pytest.raises(WeightFileError) as info:
        backend.load_native(path, other)
    message = str(info.value)
    unexpected, missing, wrong_shape = NAMES_IN_MESSAGES[name]
    assert unexpected in message and missing in message and wrong_shape in message
    assert "config needs [12, 21]" in message or "config needs [21, 12]" in message
    # One problem per missing/unexpected group, one per wrong shape (3 FFN tensors x 2 layers:
    # the encoder's remaining layer and the decoder's first).
    assert len(info.value.problems) == 2 + 6, info.value.problems


def test_torch_file_with_untied_aliases_mixed_dtypes_or_non_tensors_is_refused(tmp_path):
    backend = backend_or_skip("torch")
    import torch

    config = CONFIGS["shared"]
    path = write_valid(tmp_path, "torch", "shared")
    state = torch.load(path, map_location="cpu", weights_only=True)

    untied = dict(state)
    untied["output.weight"] = state["output.weight"].clone()
    untied["output.weight"][0, 0] += 1
    untied["decoder.layers.0.feed_forward_norm.bias"] = state[
        "decoder.layers.0.feed_forward_norm.bias"
    ].double()
    bad = tmp_path / "untied.pt"
    torch.save(untied, bad)
    with pytest.raises(WeightFileError) as info:
        backend.load_native(bad, config)
    assert info.value.problems == [
        "mixed dtypes (66 float32, 1 float64); a weight file holds one dtype"
    ]
    untied["decoder.layers.0.feed_forward_norm.bias"] = state[
        "decoder.layers.0.feed_forward_norm.bias"
    ]
    torch.save(untied, bad)
    with pytest.raises(WeightFileError, match="output.weight differs from encoder.embedding"):
        backend.load_native(bad, config)

    torch.save({**state, "step": 7}, bad)
    with pytest.raises(WeightFileError, match=r"entries that are not tensors: step \(int\)"):
        backend.read_tensors(bad)
    torch.save([state["output.weight"]], bad)
    with pytest.raises(WeightFileError, match="holds a list, not a dict"):
        backend.read_tensors(bad)


# -- a failed save leaves the destination as it was ----------------------------------------------


def test_keras_refuses_a_name_keras_cannot_load(tmp_path):
    backend = backend_or_skip("tf")
    config = CONFIGS["tied"]
    with pytest.raises(WeightFileError, match=r"must end in \.weights\.h5"):
        backend.save_native(tmp_path / "model.h5", config, init_weights(config))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", NATIVE)
def test_invalid_weights_are_refused_before_anything_is_written(tmp_path, name):
    backend = backend_or_skip(name)
    config = CONFIGS["untied"]
    weights = init_weights(config, seed=1)
    del weights["decoder.layers.0.cross_attention.value.kernel"]
    weights["output.kernel"] = weights["output.kernel"][:, :-1]
    weights["encoder.position_embedding"] = weights["encoder.position_embedding"].astype(np.int32)
    dest = tmp_path / FILE_NAMES[name]
    dest.write_bytes(b"the previous checkpoint")
    with pytest.raises(WeightFileError) as info:
        backend.save_native(dest, config, weights)
    message = str(info.value)
    assert "missing tensors (1): decoder.layers.0.cross_attention.value.kernel" in message
    assert "wrong shape for output.kernel: file has [12, 28], config needs [12, 29]" in message
    assert "wrong dtype for encoder.position_embedding: int32" in message
    assert dest.read_bytes() == b"the previous checkpoint"
    assert os.listdir(tmp_path) == [dest.name]


def _fail_midway(path: str | os.PathLike, *args, **kwargs) -> None:
    """A writer that dies after writing part of its file, as on a full disk."""
    pathlib.Path(path).write_bytes(b"half a checkpoint")
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("name", NATIVE)
def test_a_writer_that_fails_midway_leaves_no_partial_file(tmp_path, name, monkeypatch):
    backend = backend_or_skip(name)
    config = CONFIGS["tied"]
    weights = init_weights(config)
    dest = tmp_path / FILE_NAMES[name]
    dest.write_bytes(b"the previous checkpoint")
    if name == "torch":
        import torch

        monkeypatch.setattr(torch, "save", lambda obj, path, *a, **k: _fail_midway(path))
    elif name == "tf":
        import h5py

        # The file is open and its groups are written when the first dataset fails.
        def create_dataset(self, *args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(h5py.Group, "create_dataset", create_dataset)
    else:
        from transformer_rosetta.jax_impl import weights as jax_weights

        # The tree's headers are written, then the first array dies half way.
        def pack_ndarray(f, array):
            f.write(array.tobytes()[: array.nbytes // 2])
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(jax_weights, "_pack_ndarray", pack_ndarray)
    with pytest.raises(OSError, match="No space left"):
        backend.save_native(dest, config, weights)
    monkeypatch.undo()
    assert dest.read_bytes() == b"the previous checkpoint"
    assert os.listdir(tmp_path) == [dest.name]
