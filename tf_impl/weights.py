"""Canonical weights <-> the Keras model's variables, and the native `.weights.h5` checkpoint.

No second list of names: tf_impl/model.py names its layers so that a variable's `.path`, under
the model's own name and with "/" read as ".", is the canonical name (common/names.py). Three
Keras leaf names differ from ours and are renamed by rule (LEAF_RENAMES). Keras's layout is the
canonical one (EinsumDense kernels [d, h, k] and [h, k, d], Dense kernels [in, out]), so no
tensor is transposed or packed: TRANSPOSES is empty, and every shape is still asserted.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import keras
import numpy as np

from common.config import TransformerConfig
from common.dtypes import numpy_dtype
from common.names import canonical_shapes
from tf_impl.model import Transformer

# Keras's name for a leaf -> ours; None drops the leaf (an Embedding layer's one variable is
# "embeddings", and the layer's own name is already the canonical tensor name).
LEAF_RENAMES: dict[str, str | None] = {"gamma": "scale", "beta": "bias", "embeddings": None}
# Canonical name patterns that need a transpose between the two layouts: none in Keras.
TRANSPOSES: dict[str, tuple[int, ...]] = {}


def new_model(config: TransformerConfig, dtype: str = "float32") -> Transformer:
    """A built Transformer with every variable created, computing in `dtype` (a Keras policy)."""
    model = Transformer(config, name="transformer", dtype=dtype)
    model.build()
    return model


def canonical_name(path: str, model_name: str = "transformer") -> str:
    """The canonical name of the variable at `path` ("transformer/encoder/layers.0/...")."""
    parts = path.removeprefix(f"{model_name}/").split("/")
    leaf = LEAF_RENAMES.get(parts[-1], parts[-1])
    return ".".join(parts[:-1] if leaf is None else [*parts[:-1], leaf])


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


def save_native(model: Transformer, path: str | Path) -> None:
    """Write Keras's native checkpoint (`model.save_weights`); the path must end in .weights.h5."""
    model.save_weights(str(path))


def load_native(config: TransformerConfig, path: str | Path, dtype: str = "float32") -> Transformer:
    """A new model for `config` in `dtype` holding the weights of a `.weights.h5` checkpoint."""
    model = new_model(config, dtype)
    model.load_weights(str(path))
    return model
