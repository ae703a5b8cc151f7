"""Native checkpoints in bounded memory: each writer streams from canonical arrays that may be
read-only mappings of a file, builds no model, and looks at each tensor a bounded number of
times; each reader hands out read-only views of the mapped file. And every file is still its
framework's own: torch.load + load_state_dict, Keras's load_weights and Flax's msgpack_restore
read what we write bit for bit (in float32, float64 and bfloat16, tied and untied), and the
files are laid out as the frameworks lay out theirs.

How much memory a conversion takes is measured in benchmarks/, not here.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest

from parity_tests.conftest import backend_or_skip
from parity_tests.grid import variant
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.dtypes import dtype_name
from transformer_rosetta.weights.init import init_weights

FILE_NAMES = {"torch": "model.pt", "tf": "model.weights.h5", "jax": "model.msgpack"}
# Tied: one table for the target embedding and the output (and learned positions); untied:
# separate tables and an output kernel of its own, sinusoidal positions.
CONFIGS = {
    "tied": variant("post", "relu", "learned", "tied", False),
    "untied": variant("pre", "relu", "sin-interleaved", "untied", True),
}
CASES = [(c, dt) for c in CONFIGS for dt in ("float32", "float64", "bfloat16")]
# Looks a writer may take at one tensor: the backend's check, the dtype of the first, the write.
MAX_LOOKS = 3


class Counting(Mapping[str, np.ndarray]):
    """Canonical tensors as read-only memory maps of a file on disk (what load_weights hands
    out), counting how often each is looked up."""

    def __init__(self, tensors: Mapping[str, np.ndarray], folder: Path) -> None:
        self.looks: Counter[str] = Counter()
        self.maps: dict[str, np.ndarray] = {}
        blob = folder / "tensors.bin"
        offsets, offset = {}, 0
        with blob.open("wb") as f:
            for name, t in tensors.items():
                a = np.ascontiguousarray(t)
                f.write(a.view(np.uint8).reshape(-1).data)
                offsets[name], offset = offset, offset + a.nbytes
        for name, t in tensors.items():
            self.maps[name] = np.memmap(blob, t.dtype, "r", offsets[name], t.shape)

    def __getitem__(self, name: str) -> np.ndarray:
        self.looks[name] += 1
        return self.maps[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.maps)

    def __len__(self) -> int:
        return len(self.maps)


def weights_for(config: TransformerConfig, dtype: str) -> dict[str, np.ndarray]:
    return init_weights(config, seed=5, scheme="perturbed", dtype=dtype)


def assert_bit_exact(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], where: str):
    assert list(got) == list(want), f"{where}: names or order differ"
    for name, w in want.items():
        g = np.asarray(got[name])
        assert g.dtype == w.dtype and g.shape == w.shape, f"{where}: {name} {g.dtype} {g.shape}"
        assert g.tobytes() == w.tobytes(), f"{where}: {name} changed"


def write_streamed(tmp_path: Path, framework: str, config, weights, monkeypatch) -> Path:
    """save_native from read-only memory maps, with the framework's model class unbuildable:
    every tensor looked at no more than MAX_LOOKS times."""
    backend = backend_or_skip(framework)
    if framework == "tf":
        from transformer_rosetta.tf_impl import weights as tf_weights

        # The one model write_native makes: the smallest of this structure, which tells Keras's
        # layout (and is cached); made here, before the model class is made unbuildable.
        tf_weights.native_layout(config)
    module = {"torch": "torch_impl", "tf": "tf_impl", "jax": "jax_impl"}[framework]
    model_class = __import__(
        f"transformer_rosetta.{module}.model", fromlist=["Transformer"]
    ).Transformer

    def refuse(*args, **kwargs):
        raise AssertionError("the writer built a model")

    source = Counting(weights, tmp_path)
    path = tmp_path / FILE_NAMES[framework]
    with monkeypatch.context() as patch:
        patch.setattr(model_class, "__init__", refuse)
        backend.save_native(path, config, source)
    assert set(source.looks) == set(weights)
    assert max(source.looks.values()) <= MAX_LOOKS, source.looks.most_common(3)
    return path


def assert_read_only_views(tensors: Mapping[str, np.ndarray]) -> None:
    """Our readers hand out the file's bytes, mapped: nothing is copied into memory."""
    for name, a in tensors.items():
        assert not a.flags.writeable and not a.flags.owndata, name


# -- torch ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("config_id", "dtype"), CASES)
def test_torch_writer_streams_and_torch_reads_it(tmp_path, monkeypatch, config_id, dtype):
    backend = backend_or_skip("torch")
    import torch

    from transformer_rosetta.torch_impl.backend import to_numpy
    from transformer_rosetta.torch_impl.model import Transformer
    from transformer_rosetta.torch_impl.weights import TORCH_DTYPES, export_canonical

    config = CONFIGS[config_id]
    weights = weights_for(config, dtype)
    path = write_streamed(tmp_path, "torch", config, weights, monkeypatch)

    # torch's own reader and load_state_dict (strict), in the order the module lists its keys.
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = Transformer(config).to(TORCH_DTYPES[dtype])
    assert list(state) == list(model.state_dict())
    # Contiguous, as model.state_dict() gives them (a kernel was staged transposed, not viewed).
    assert all(t.is_contiguous() for t in state.values())
    model.load_state_dict(state)
    exported = {n: to_numpy(t, exact=True) for n, t in export_canonical(model).items()}
    assert_bit_exact(exported, weights, "torch load_state_dict")
    # A tied tensor is one storage under each of its keys.
    if config.tie_output:
        keys = ("decoder.embedding.weight", "output.weight")
        assert len({state[k].untyped_storage().data_ptr() for k in keys}) == 1

    # Ours: mapped, the kernels transposed views of it.
    got = backend.load_native(path, config)
    assert_bit_exact(got, weights, "load_native")
    assert_read_only_views(got)
    kernel = "encoder.layers.0.feed_forward.intermediate.kernel"
    assert not got[kernel].flags.c_contiguous  # (in, out) of the stored (out, in): a view


@pytest.mark.parametrize(("config_id", "dtype"), CASES)
@pytest.mark.parametrize("how", ["laid out, then filled", "staged", "a layout it does not know"])
def test_torch_writer_writes_torch_saves_own_bytes(tmp_path, monkeypatch, config_id, dtype, how):
    """The file is byte for byte what torch.save writes for the model's state_dict tensors (in
    a file of the same name: the archive's folder is the file's stem), and every zip member's
    CRC-32 checks: whether torch lays the archive out and the writer fills each storage in place
    (torch.serialization.skip_data), or a torch without skip_data gets the staged copies, or the
    archive is laid out in a way the writer does not know (it falls back to the staged copies)."""
    backend_or_skip("torch")
    import zipfile

    import torch

    from transformer_rosetta.torch_impl import weights as torch_weights
    from transformer_rosetta.torch_impl.model import Transformer
    from transformer_rosetta.torch_impl.weights import TORCH_DTYPES, load_canonical

    config = CONFIGS[config_id]
    weights = weights_for(config, dtype)
    # The reference: torch.save of a model's own state_dict, the weights loaded into it by
    # load_canonical (not the writer's code), as a plain dict (state_dict's _metadata aside).
    model = Transformer(config).to(TORCH_DTYPES[dtype])
    load_canonical(model, weights)
    (tmp_path / "reference").mkdir()
    torch.save(dict(model.state_dict()), tmp_path / "reference" / FILE_NAMES["torch"])
    want = (tmp_path / "reference" / FILE_NAMES["torch"]).read_bytes()

    filled = []
    real_fill = torch_weights._fill_storages
    monkeypatch.setattr(
        torch_weights, "_fill_storages", lambda *a: (filled.append(1), real_fill(*a))
    )
    if how == "staged":
        monkeypatch.delattr(torch.serialization, "skip_data")
    elif how == "a layout it does not know":
        real_members = torch_weights.stored_members

        def one_room_too_small(path):
            members = real_members(path)
            name = next(n for n in members if "/data/" in n)
            members[name] = dataclasses.replace(members[name], size=members[name].size - 1)
            return members

        monkeypatch.setattr(torch_weights, "stored_members", one_room_too_small)
    path = write_streamed(tmp_path, "torch", config, weights, monkeypatch)
    assert bool(filled) == (how != "staged")
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None  # every member's bytes match its CRC-32
    assert path.read_bytes() == want


# -- Keras ---------------------------------------------------------------------------------------


def _structure(path: Path) -> dict[str, tuple]:
    """Every group and dataset of an HDF5 file: its kind and attributes (a name Keras numbers
    itself, "dropout_5", without its number), a dataset's stored dtype and shape."""
    import h5py

    found: dict[str, tuple] = {}

    def visit(name: str, item) -> None:
        attrs = {k: re.sub(r"_\d+$", "", str(v)) for k, v in item.attrs.items()}
        if isinstance(item, h5py.Dataset):
            found[name] = ("dataset", attrs, item.dtype.str, item.shape, item.chunks)
        else:
            found[name] = ("group", attrs)

    with h5py.File(path, "r") as f:
        f.visititems(visit)
        found["/"] = ("root", dict(f.attrs))
    return found


@pytest.mark.parametrize(("config_id", "dtype"), CASES)
def test_keras_writer_streams_and_keras_reads_it(tmp_path, monkeypatch, config_id, dtype):
    backend = backend_or_skip("tf")
    from transformer_rosetta.files.hdf5 import read_hdf5
    from transformer_rosetta.tf_impl import weights as tf_weights

    config = CONFIGS[config_id]
    weights = weights_for(config, dtype)
    path = write_streamed(tmp_path, "tf", config, weights, monkeypatch)

    # Keras's own reader, into a model of this config.
    model = tf_weights.load_native(config, path, dtype)
    assert_bit_exact(tf_weights.export_canonical(model), weights, "keras load_weights")
    # The file Keras writes for that model has the same groups, attributes and datasets.
    theirs = tmp_path / "theirs.weights.h5"
    model.save_weights(str(theirs))
    assert _structure(path) == _structure(theirs)
    assert_bit_exact(read_hdf5(path), read_hdf5(theirs), "datasets")

    got = backend.load_native(path, config)
    assert_bit_exact(got, weights, "load_native")
    assert_read_only_views(got)


def test_keras_reader_reads_a_dataset_stored_in_chunks(tmp_path):
    """HDF5 may keep a dataset chunked and compressed (not Keras's way, but h5py's option): that
    one is read, not mapped, and comes out the same."""
    backend = backend_or_skip("tf")
    import h5py

    from transformer_rosetta.tf_impl.weights import native_layout

    config = CONFIGS["untied"]
    weights = weights_for(config, "float32")
    path = tmp_path / FILE_NAMES["tf"]
    backend.save_native(path, config, weights)
    name = "encoder.layers.0.self_attention.query.kernel"
    where = {n: ds for ds, n in native_layout(config).items()}[name]
    with h5py.File(path, "r+") as f:
        data = f[where][()]
        del f[where]
        f.create_dataset(where, data=data, chunks=True, compression="gzip")
    got = backend.load_native(path, config)
    assert_bit_exact(got, weights, "chunked")
    assert got[name].flags.owndata  # read (one copy of this tensor); the others mapped
    assert not got["output.kernel"].flags.owndata


def keras_groups(path: Path) -> set[tuple[str, tuple]]:
    """Every group of a Keras file with its attributes, less the names Keras numbers itself
    ("dropout_17": how many layers the process made before; Keras reads none back)."""
    import h5py

    out = set()
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda p, item: (
                out.add((p, tuple(item.attrs.items())))
                if isinstance(item, h5py.Group)
                and not re.fullmatch(r"dropout(_\d+)?", str(item.attrs.get("name")))
                else None
            )
        )
    return out


@pytest.mark.parametrize(
    "depths",
    [None, (3, 5), (0, 4), (12, 1)],
    ids=["as-is", "3-5-layers", "decoder-only-4", "encoder-12"],
)
def test_keras_layout_of_the_smallest_model_is_the_full_models(tmp_path, depths):
    """native_layout asks Keras about a model of the same structure at the smallest sizes and at
    most two layers a stack, and renumbers layer 1 for the deeper ones. The file Keras writes for
    the model itself, its k-th variable filled with k + 1, holds each number in the dataset that
    the layout names for that variable, and has the same groups with the same attributes as the
    file write_native lays out."""
    backend_or_skip("tf")
    from transformer_rosetta.files.hdf5 import hdf5_datasets
    from transformer_rosetta.tf_impl import weights as tf_weights

    configs = [*CONFIGS.values(), variant("pre", "gelu", "learned", "shared", True)]
    if depths is not None:
        encoder, decoder = depths
        configs = [
            c.replace(
                num_encoder_layers=encoder,
                num_decoder_layers=decoder,
                share_embeddings=c.share_embeddings and encoder > 0,
            )
            for c in configs
        ]
    for config in configs:
        model = tf_weights.new_model(config)
        names = list(tf_weights.variables_by_name(model))
        for k, variable in enumerate(tf_weights.variables_by_name(model).values()):
            variable.assign(np.full(variable.shape, k + 1, np.float32))
        path = tmp_path / "full.weights.h5"
        model.save_weights(str(path))
        with hdf5_datasets(path) as datasets:
            held = {p: names[int(ds[(0,) * ds.ndim]) - 1] for p, ds in datasets.items()}
        assert held == tf_weights.native_layout(config)
        ours = tmp_path / "ours.weights.h5"
        tf_weights.write_native(ours, config, weights_for(config, "float32"))
        assert keras_groups(ours) == keras_groups(path)


# -- Flax ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("config_id", "dtype"), CASES)
def test_flax_writer_streams_msgpack_serialize_s_bytes(tmp_path, monkeypatch, config_id, dtype):
    backend = backend_or_skip("jax")
    from flax import nnx, serialization

    from transformer_rosetta.jax_impl import weights as jax_weights

    config = CONFIGS[config_id]
    weights = weights_for(config, dtype)
    path = write_streamed(tmp_path, "jax", config, weights, monkeypatch)

    # Byte for byte what Flax's msgpack_serialize writes for a model holding these weights.
    model = jax_weights.from_canonical(config, weights, dtype)
    data = path.read_bytes()
    assert data == serialization.msgpack_serialize(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    # Flax's own msgpack_restore reads it into a fresh model, bit for bit.
    fresh = jax_weights.from_canonical(config, init_weights(config, seed=0, dtype=dtype), dtype)
    state = nnx.state(fresh, nnx.Param)
    nnx.replace_by_pure_dict(state, serialization.msgpack_restore(data))
    nnx.update(fresh, state)
    assert_bit_exact(jax_weights.export_canonical(fresh), weights, "flax msgpack_restore")

    got = backend.load_native(path, config)
    assert_bit_exact(got, weights, "load_native")
    assert_read_only_views(got)


def test_flax_arrays_over_the_chunk_size_are_chunked_as_flax_chunks_them(tmp_path, monkeypatch):
    """msgpack holds at most 2**32 - 1 bytes in one object, so Flax splits an array over
    MAX_CHUNK_SIZE (1 GiB) into chunks. With the size made small, the streamed file is still
    msgpack_serialize's, and both readers join the chunks back."""
    backend = backend_or_skip("jax")
    from flax import nnx, serialization

    from transformer_rosetta.jax_impl import weights as jax_weights

    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 100)  # bytes: 25 float32 values
    config = CONFIGS["tied"]
    weights = weights_for(config, "float32")
    path = tmp_path / FILE_NAMES["jax"]
    backend.save_native(path, config, weights)
    model = jax_weights.from_canonical(config, weights, "float32")
    want = serialization.msgpack_serialize(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    assert b"__msgpack_chunked_array__" in want
    assert path.read_bytes() == want
    assert_bit_exact(backend.load_native(path, config), weights, "chunked")


def test_msgpack_extension_headers_are_msgpack_s_own():
    """Every form of the extension header (fixext 1..16, ext 8/16/32) and of the bin header
    inside, at each boundary, is what msgpack itself packs."""
    backend_or_skip("jax")
    import msgpack

    from transformer_rosetta.jax_impl.weights import _ext_header, _msgpack_length

    for n in (1, 2, 3, 4, 8, 15, 16, 17, 255, 256, 65535, 65536, 70000):
        packed = msgpack.packb(msgpack.ExtType(1, b"\0" * n))
        assert _ext_header(1, n) == packed[:-n], n
        packed = msgpack.packb(b"\0" * n, use_bin_type=True)
        assert _msgpack_length(n, b"\xc4", b"\xc5", b"\xc6") == packed[:-n], n


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"\x81\xa1a\x01\x00", "not a Flax msgpack checkpoint (1 bytes of extra data"),
        (b"\x81\xa1a\xc7\x10\x01\x93\x91\x02", "truncated (the file ends inside the array"),
        (b"\x81\xa1a\xc7\x03\x01\x93\x91\x02", "not a Flax msgpack checkpoint"),
        (b"\x81\xa1a\xa3abc", "leaves that are not arrays: a (str)"),
        (b"\x81\x91\x01\x01", "not a Flax msgpack checkpoint (a map key that is a list)"),
        (b"\x93\x01\x02\x03", "not a Flax checkpoint: the msgpack holds a list, not a tree"),
    ],
)
def test_flax_reader_names_what_is_wrong_with_a_file(tmp_path, data, problem):
    """The mapped reader's own parsing refuses what msgpack_restore would, in one line: bytes
    after the tree, an array cut short or not Flax's encoding, a leaf that is no array, a key
    that cannot be one, a file that holds no tree."""
    backend = backend_or_skip("jax")
    from transformer_rosetta.errors import WeightFileError

    path = tmp_path / FILE_NAMES["jax"]
    path.write_bytes(data)
    with pytest.raises(WeightFileError) as info:
        backend.load_native(path, CONFIGS["tied"])
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith(problem), info.value.problems


# -- across the formats --------------------------------------------------------------------------


@pytest.mark.parametrize("framework", list(FILE_NAMES))
def test_a_file_read_back_writes_the_same_file(tmp_path, framework):
    """A reader's views (mapped, read-only; torch's kernels transposed views) are what a writer
    takes: written again, the file is the same tensors."""
    backend = backend_or_skip(framework)
    config = CONFIGS["untied"]
    weights = weights_for(config, "float32")
    first, second = tmp_path / f"a-{FILE_NAMES[framework]}", tmp_path / FILE_NAMES[framework]
    backend.save_native(first, config, weights)
    backend.save_native(second, config, backend.load_native(first, config))
    assert_bit_exact(backend.load_native(second, config), weights, "again")
    if framework == "jax":  # msgpack has one encoding of a tree: the very same bytes
        assert first.read_bytes() == second.read_bytes()
    assert dtype_name(next(iter(backend.load_native(second, config).values())).dtype) == "float32"
