"""Canonical weights <-> the Keras model's variables, and the native `.weights.h5` checkpoint.

No second list of names: tf_impl/model.py names its layers so that a variable's `.path`, under
the model's own name and with "/" read as ".", is the canonical name (common/spec/names.py). Three
Keras leaf names differ from ours and are renamed by rule (LEAF_RENAMES). Keras's layout is the
canonical one (EinsumDense kernels [d, h, k] and [h, k, d], Dense kernels [in, out]), so no
tensor is transposed or packed, and every shape is still asserted.

Today's tensors too: a gated feed-forward's `gate` Dense gives `{prefix}.feed_forward.gate.kernel`
(and `.bias` with feed_forward_bias), an RMSNorm (Keras's RMSNormalization) keeps its gain as
`scale` (already the canonical leaf) and has no bias, key and value kernels have the config's
kv_heads heads, and a bias the config leaves out is never built.

The family's tensors follow the same rule: a stack's "token_type_embedding" and
"embedding_norm" layers give `{stack}.token_type_embedding` and `{stack}.embedding_norm.{scale,
bias}`, and what a half lacks (a decoder-only model's encoder and cross-attention, an
encoder-only one's decoder and output projection) is never built, so the variables are exactly
common/spec/names.py's canonical_specs.
"""

from __future__ import annotations

import functools
import math
import tempfile
from collections.abc import Mapping
from pathlib import Path

import keras
import numpy as np

from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.files.hdf5 import dataset_views, hdf5_datasets, stored_dtype
from transformer_rosetta.files.outputs import atomic_write
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.dtypes import dtype_name, numpy_dtype
from transformer_rosetta.spec.names import canonical_shapes
from transformer_rosetta.tf_impl.model import Transformer
from transformer_rosetta.weights.format import (
    check_layer_counts,
    tensor_problems,
    weight_file_path,
)

# idiom: Keras's name for a leaf -> ours; None drops the leaf (an Embedding layer's one variable
# is "embeddings", and the layer's own name is already the canonical tensor name).
LEAF_RENAMES: dict[str, str | None] = {"gamma": "scale", "beta": "bias", "embeddings": None}


# idiom: Keras creates variables in build(), so a usable model is made and built in one place
def new_model(config: TransformerConfig, dtype: str = "float32") -> Transformer:
    """A built Transformer with every variable created, computing in `dtype` (a Keras policy)."""
    model = Transformer(config, name="transformer", dtype=dtype)
    model.build()
    return model


# idiom: the rule from a Keras variable path to its canonical name
def canonical_name(path: str, model_name: str = "transformer") -> str:
    """The canonical name of the variable at `path` ("transformer/encoder/layers.0/...")."""
    parts = path.removeprefix(f"{model_name}/").split("/")
    leaf = LEAF_RENAMES.get(parts[-1], parts[-1])
    return ".".join(parts[:-1] if leaf is None else [*parts[:-1], leaf])


# idiom: Keras variables are addressed by path; this pairs them with the canonical names
def variables_by_name(model: Transformer) -> dict[str, keras.Variable]:
    """{canonical name: variable}, in canonical order; raises unless the two sets match exactly."""
    found = {canonical_name(v.path, model.name): v for v in model.weights}
    expected = canonical_shapes(model.config)
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected]
    if missing or unexpected:
        raise ValueError(
            f"Keras variables do not match the canonical names: missing {missing}, "
            f"unexpected {unexpected}"
        )
    return {name: found[name] for name in expected}


def native_name_map(config: TransformerConfig) -> dict[str, str]:
    """{canonical name: Keras variable path}, in canonical order (for the docs table)."""
    return {name: v.path for name, v in variables_by_name(new_model(config)).items()}


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"{name}: shape {list(got)} does not match {list(want)}")


def load_canonical(model: Transformer, weights: Mapping[str, np.ndarray]) -> None:
    """Copy canonical `weights` (any float dtype) into `model`, cast to its variables' dtype."""
    shapes = canonical_shapes(model.config)
    missing = [n for n in shapes if n not in weights]
    if missing:
        raise ValueError(f"missing tensors: {', '.join(missing)}")
    # rosetta: checkpoints
    for name, variable in variables_by_name(model).items():
        array = np.asarray(weights[name])
        _check_shape(name, array.shape, shapes[name])
        _check_shape(name, tuple(variable.shape), shapes[name])
        # Cast in numpy (round to nearest even, as ml_dtypes does), so that what the model holds
        # is bit for bit what `array.astype(dtype)` gives.
        variable.assign(array.astype(numpy_dtype(variable.dtype)))


def export_canonical(model: Transformer) -> dict[str, np.ndarray]:
    """Every canonical tensor of `model`, in canonical order and in its dtype (bfloat16 as
    ml_dtypes.bfloat16), bit for bit what the variables hold."""
    shapes = canonical_shapes(model.config)
    out = {}
    for name, variable in variables_by_name(model).items():
        array = keras.ops.convert_to_numpy(variable)
        _check_shape(name, array.shape, shapes[name])
        out[name] = array.astype(numpy_dtype(variable.dtype), copy=True)
    return out


KERAS_SUFFIX = ".weights.h5"  # idiom: Keras's save_weights requires this suffix


# idiom: Keras's own save_weights of a live model (torch's torch.save is all of write_native)
def save_native(model: Transformer, path: str | Path) -> None:
    """Write Keras's native checkpoint (`model.save_weights`) atomically; the path must end in
    .weights.h5, as Keras requires (atomic_write's temp file keeps the destination's name)."""
    path = Path(path)
    if not path.name.endswith(KERAS_SUFFIX):
        raise WeightFileError(
            str(path), [f"a Keras weights file's name must end in {KERAS_SUFFIX}"]
        )
    atomic_write(path, lambda tmp: model.save_weights(tmp))


def write_native(
    path: str | Path, config: TransformerConfig, weights: Mapping[str, np.ndarray]
) -> None:
    """The .weights.h5 that model.save_weights writes for a model for `config` holding canonical
    `weights`, in their dtype (one dtype; the caller has validated them), bit for bit.

    No model is built: Keras's file is its layout (groups, their attributes, one dataset per
    variable, _keras_skeleton) and each variable's values, so the datasets are written with h5py
    one at a time, each straight from the caller's array (which may be mapped from a file), as
    Keras's H5IOStore writes them: a plain dataset, a bfloat16 one as 2-byte opaque values with a
    "dtype" attribute. model.load_weights reads the file as it reads its own.
    """
    path = Path(path)
    if not path.name.endswith(KERAS_SUFFIX):
        raise WeightFileError(
            str(path), [f"a Keras weights file's name must end in {KERAS_SUFFIX}"]
        )
    groups, datasets = _keras_skeleton(config)
    itemsize = np.asarray(next(iter(weights.values()))).dtype.itemsize
    size = itemsize * sum(math.prod(shape) for shape in canonical_shapes(config).values())

    def write(tmp: str) -> None:
        import h5py

        with h5py.File(tmp, "w") as f:
            for group_path, attrs in groups:
                group = f.require_group(group_path)
                for key, value in attrs:
                    group.attrs[key] = value
            for ds_path, name in datasets.items():
                array = np.asarray(weights[name])
                ds = f.create_dataset(ds_path, data=array)
                if dtype_name(array.dtype) == "bfloat16":
                    ds.attrs["dtype"] = "bfloat16"

    atomic_write(path, write, size)


def _layout_config(config: TransformerConfig) -> TransformerConfig:
    """`config`'s structure (its layers, which tensors it has, so every name) with every size as
    small as the spec allows: Keras lays a file out by the model's structure alone, so the file of
    this model shows where each of `config`'s variables goes without a model of `config`'s size."""
    ids = max(config.pad_id, config.bos_id, config.eos_id) + 1  # the special ids must fit
    return config.replace(
        src_vocab_size=ids,
        tgt_vocab_size=ids,
        d_model=2 if config.key_dim is not None else 2 * config.num_heads,  # even, h divides it
        key_dim=None if config.key_dim is None else 2,  # even: rotary positions rotate pairs
        d_ff=1,
        max_len=1,
        type_vocab_size=min(config.type_vocab_size, 1),
    )


_Attrs = tuple[tuple[str, object], ...]


# Layers per stack in the model Keras is asked about: layer 0 and layer 1 show every naming rule
# (the first list item has the class's name, the k-th the name with "_k"), and a model's depth
# would otherwise cost Keras about 0.07 s a layer to build and save.
_ASKED_DEPTH = 2


@functools.lru_cache(maxsize=8)
def _keras_skeleton(
    config: TransformerConfig,
) -> tuple[tuple[tuple[str, _Attrs], ...], dict[str, str]]:
    """(every group of the file model.save_weights writes for `config`, with its attributes;
    {dataset path: canonical name}, in canonical order).

    Keras addresses a variable by attribute path and index within its layer, with list items
    named after their class ("encoder_layer", "encoder_layer_1"), not by the variable's name, and
    gives each layer's "vars" group the layer's name as an attribute. Rather than restate those
    rules, ask Keras (_saved_layout) about a model of `config`'s structure at the smallest sizes
    and at most _ASKED_DEPTH layers a stack; a deeper stack's layer k is its layer 1 renamed by
    Keras's list rule ("_1" -> "_k"), its name attribute "1" -> "k" (_deeper_layers).
    """
    asked = config.replace(
        num_encoder_layers=min(config.num_encoder_layers, _ASKED_DEPTH),
        num_decoder_layers=min(config.num_decoder_layers, _ASKED_DEPTH),
    )
    groups, found = _saved_layout(_layout_config(asked))
    all_groups = list(groups)
    for stack in ("encoder", "decoder"):
        depth = getattr(config, f"num_{stack}_layers")
        if depth > _ASKED_DEPTH:
            all_groups += _deeper_layers(stack, depth, groups, found)
    paths = {}
    for name in canonical_shapes(config):
        stack, _, rest = name.partition(".layers.")
        index, _, leaf = rest.partition(".")
        if stack in ("encoder", "decoder") and index.isdigit() and int(index) >= _ASKED_DEPTH:
            one = _layer_group(stack, found)
            paths[name] = _renumbered(one, found[f"{stack}.layers.1.{leaf}"], int(index))
        else:
            paths[name] = found[name]
    return tuple(all_groups), {path: name for name, path in paths.items()}


def _layer_group(stack: str, found: Mapping[str, str]) -> str:
    """The group of `stack`'s layer 1 ("encoder/layers/encoder_layer_1"), read off where Keras
    put a tensor of layer 0 and the same tensor of layer 1."""
    leaf = next(n for n in found if n.startswith(f"{stack}.layers.1.")).split(".", 3)[3]
    zero = found[f"{stack}.layers.0.{leaf}"].split("/")
    one = found[f"{stack}.layers.1.{leaf}"].split("/")
    at = next(i for i, (a, b) in enumerate(zip(zero, one, strict=True)) if a != b)
    if one[at] != f"{zero[at]}_1":  # Keras's list rule, which the deeper layers rely on
        raise AssertionError(f"Keras named layer 1 {one[at]!r} beside {zero[at]!r}")
    return "/".join(one[: at + 1])


def _renumbered(one: str, path: str, k: int) -> str:
    """`path` under layer 1's group `one`, moved under layer k's."""
    return one.removesuffix("_1") + f"_{k}" + path[len(one) :]


def _deeper_layers(
    stack: str, depth: int, groups: tuple[tuple[str, _Attrs], ...], found: Mapping[str, str]
) -> list[tuple[str, _Attrs]]:
    """The groups of `stack`'s layers _ASKED_DEPTH .. depth - 1: layer 1's, renumbered."""
    one = _layer_group(stack, found)
    layer_one = [(p, a) for p, a in groups if p == one or p.startswith(f"{one}/")]
    out = []
    for k in range(_ASKED_DEPTH, depth):
        for path, attrs in layer_one:
            if path == f"{one}/vars":  # the layer's own name, its index in the stack
                attrs = tuple((key, str(k) if value == "1" else value) for key, value in attrs)
            out.append((_renumbered(one, path, k), attrs))
    return out


def _saved_layout(
    config: TransformerConfig,
) -> tuple[tuple[tuple[str, _Attrs], ...], dict[str, str]]:
    """(the groups of the file model.save_weights writes for a model of `config`, with their
    attributes; {canonical name: dataset path}): the model's k-th canonical variable is filled
    with the number k + 1, and the file read for which dataset holds which number. A layer's
    name that Keras numbers itself ("dropout_5") depends on how many layers the process made
    before; Keras reads none of them back."""
    model = new_model(config)
    variables = variables_by_name(model)
    for k, variable in enumerate(variables.values()):
        variable.assign(np.full(variable.shape, k + 1, np.float32))  # exact up to 2**24
    names = list(variables)
    found: dict[str, str] = {}
    groups: list[tuple[str, _Attrs]] = []
    with tempfile.TemporaryDirectory() as folder:
        file = Path(folder) / f"layout{KERAS_SUFFIX}"
        model.save_weights(str(file))
        import h5py

        with h5py.File(file, "r") as f:
            f.visititems(
                lambda p, item: (
                    groups.append((p, tuple(item.attrs.items())))
                    if isinstance(item, h5py.Group)
                    else None
                )
            )
        with hdf5_datasets(file) as datasets:
            for ds_path, ds in datasets.items():
                found[names[int(ds[(0,) * ds.ndim]) - 1]] = ds_path
    assert set(found) == set(names), f"not saved by Keras: {set(names) - set(found)}"
    return tuple(groups), found


# idiom: Keras's .weights.h5 addresses datasets by attribute path, which Keras alone knows
def native_layout(config: TransformerConfig) -> dict[str, str]:
    """{HDF5 dataset path: canonical name}, in canonical order, as model.save_weights lays them
    out for `config` (e.g. "decoder/layers/decoder_layer/cross_attention/key/vars/0"), found
    from a model of `config`'s structure at the smallest sizes (_keras_skeleton)."""
    return dict(_keras_skeleton(config)[1])


def _layer_stems(config: TransformerConfig) -> dict[str, str]:
    """{stack: how model.save_weights names its layers ("encoder/layers/encoder_layer{_i}")},
    for layer_count_problems: read off the skeleton of `config` at two layers a stack, which
    costs the same whatever the config's layer counts."""
    stacks = [s for s in ("encoder", "decoder") if getattr(config, f"num_{s}_layers")]
    two = config.replace(**{f"num_{s}_layers": _ASKED_DEPTH for s in stacks})
    found = {name: path for path, name in _keras_skeleton(two)[1].items()}
    return {s: _layer_group(s, found).removesuffix("_1") + "{_i}" for s in stacks}


def read_native(path: str | Path, config: TransformerConfig) -> dict[str, np.ndarray]:
    """Canonical tensors, in canonical order and the stored dtype (bit-exact), from the
    .weights.h5 of a model for `config`; one WeightFileError lists every problem.

    Read with h5py against native_layout, not through model.load_weights: Keras stops at the
    first variable that does not fit and skips layers it cannot find, while this reports every
    missing, unexpected and wrong-shaped tensor at once, and builds no model. The arrays are
    read-only views of the file's mapped bytes (files.hdf5.dataset_views), so nothing is copied
    into memory.
    """
    # a folder, FIFO or device is refused from its stat, unopened (h5py would block)
    path = weight_file_path(path, "a Keras weights file")
    # idiom: Keras saves HDF5; read through the project's one HDF5 reader (common/files/hdf5.py),
    # which refuses a dataset stored outside the file before any is read.
    with hdf5_datasets(path, "Keras .weights.h5") as datasets:
        # A --config of 10^9 layers over a file of 2: refused before its layout is built.
        # idiom: Keras names each layer itself (encoder_layer, encoder_layer_1, ...), so the
        # stems are read off a two-layer skeleton; torch and Flax use the canonical stems.
        check_layer_counts(path, config, datasets, _layer_stems(config))
        layout = native_layout(config)
        stored = {p: (stored_dtype(ds), tuple(ds.shape)) for p, ds in datasets.items()}
        unexpected = sorted(p for p in stored if p not in layout)
        entries = {layout[p]: e for p, e in stored.items() if p in layout}
        problems = tensor_problems(config, entries)
        if unexpected:
            problems.append(
                f"datasets this model does not have ({len(unexpected)}): {', '.join(unexpected)}"
            )
        if problems:
            raise WeightFileError(str(path), problems)
        tensors = dataset_views(
            path, {name: datasets[ds_path] for ds_path, name in layout.items()}, "Keras .weights.h5"
        )
    return {name: tensors[name] for name in canonical_shapes(config)}


# idiom: Keras's own load_weights, into a model made for the config
def load_native(config: TransformerConfig, path: str | Path, dtype: str = "float32") -> Transformer:
    """A new model for `config` in `dtype` holding the weights of a `.weights.h5` checkpoint."""
    model = new_model(config, dtype)
    model.load_weights(str(path))
    return model
