"""Canonical weights <-> the Keras model's variables, and the native `.weights.h5` checkpoint.

No second list of names: tf_impl/model.py names its layers so that a variable's `.path`, under
the model's own name and with "/" read as ".", is the canonical name (common/spec/names.py). Three
Keras leaf names differ from ours and are renamed by rule (LEAF_RENAMES). Keras's layout is the
canonical one (EinsumDense kernels [d, h, k] and [h, k, d], Dense kernels [in, out]), so no
tensor is transposed or packed, and every shape is still asserted.

The family's tensors follow the same rule: a stack's "token_type_embedding" and
"embedding_norm" layers give `{stack}.token_type_embedding` and `{stack}.embedding_norm.{scale,
bias}`, and what a half lacks (a decoder-only model's encoder and cross-attention, an
encoder-only one's decoder and output projection) is never built, so the variables are exactly
common/spec/names.py's canonical_specs.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Mapping
from pathlib import Path

import keras
import numpy as np

from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.files.hdf5 import dataset_array, hdf5_datasets, stored_dtype
from transformer_rosetta.files.outputs import atomic_write
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.dtypes import dtype_name, numpy_dtype
from transformer_rosetta.spec.names import canonical_shapes
from transformer_rosetta.tf_impl.model import Transformer
from transformer_rosetta.weights.format import tensor_problems, weight_file_path

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
    """The .weights.h5 of a model for `config` holding canonical `weights`, in their dtype (one
    dtype; the caller has validated them), so that every tensor is stored bit for bit."""
    model = new_model(config, dtype_name(next(iter(weights.values())).dtype))
    load_canonical(model, weights)
    save_native(model, path)


# idiom: Keras's .weights.h5 addresses datasets by attribute path, which Keras alone knows
@functools.lru_cache(maxsize=8)
def native_layout(config: TransformerConfig) -> dict[str, str]:
    """{HDF5 dataset path: canonical name}, in canonical order, as model.save_weights lays them
    out for `config` (e.g. "decoder/layers/decoder_layer/cross_attention/key/vars/0").

    Keras addresses a variable by attribute path and index within its layer, with list items
    named after their class ("encoder_layer", "encoder_layer_1"), not by the variable's name.
    Rather than restate those rules, ask Keras: save a model whose k-th canonical variable is
    filled with the number k + 1 and read which dataset holds which number. float16 stores every
    integer up to 2048 exactly and halves the bytes written.
    """
    model = new_model(config, "float16")
    variables = variables_by_name(model)
    assert len(variables) < 2048, "float16 markers are exact only below 2048"
    for k, variable in enumerate(variables.values()):
        variable.assign(np.full(variable.shape, k + 1, np.float16))
    names = list(variables)
    found: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as folder:
        file = Path(folder) / f"layout{KERAS_SUFFIX}"
        model.save_weights(str(file))
        with hdf5_datasets(file) as datasets:
            for ds_path, ds in datasets.items():
                found[names[int(ds[(0,) * ds.ndim]) - 1]] = ds_path
    assert set(found) == set(names), f"not saved by Keras: {set(names) - set(found)}"
    return {found[name]: name for name in names}


def read_native(path: str | Path, config: TransformerConfig) -> dict[str, np.ndarray]:
    """Canonical tensors, in canonical order and the stored dtype (bit-exact), from the
    .weights.h5 of a model for `config`; one WeightFileError lists every problem.

    Read with h5py against native_layout, not through model.load_weights: Keras stops at the
    first variable that does not fit and skips layers it cannot find, while this reports every
    missing, unexpected and wrong-shaped tensor at once, and builds no model.
    """
    # a folder, FIFO or device is refused from its stat, unopened (h5py would block)
    path = weight_file_path(path, "a Keras weights file")
    layout = native_layout(config)
    # idiom: Keras saves HDF5; read through the project's one HDF5 reader (common/files/hdf5.py),
    # which refuses a dataset stored outside the file before any is read.
    with hdf5_datasets(path, "Keras .weights.h5") as datasets:
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
        tensors = {name: dataset_array(datasets[ds_path]) for ds_path, name in layout.items()}
    return {name: tensors[name] for name in canonical_shapes(config)}


# idiom: Keras's own load_weights, into a model made for the config
def load_native(config: TransformerConfig, path: str | Path, dtype: str = "float32") -> Transformer:
    """A new model for `config` in `dtype` holding the weights of a `.weights.h5` checkpoint."""
    model = new_model(config, dtype)
    model.load_weights(str(path))
    return model
