"""Canonical weights <-> the Flax NNX model, and the native checkpoint.

The rule, and the only mapping there is: model.py names its attributes after the canonical names,
so the path of every nnx.Param in `nnx.state(model, nnx.Param)` joined with "." *is* its canonical
name (("encoder", "layers", 0, "self_attention", "query", "kernel") is
"encoder.layers.0.self_attention.query.kernel"). Nothing here lists a name: transformer_rosetta.spec.names derives
them, and each load asserts that the model's paths and the canonical names are the same set.

Layouts are canonical already: nnx.LinearGeneral keeps attention kernels as [d, h, k] and
[h, k, d] with biases [h, k] and [d], nnx.Linear kernels are [in, out], nnx.LayerNorm has
`scale` and `bias`, embeddings are [vocab, d]. So, unlike torch, nothing is transposed or packed.

float64 needs JAX's x64 mode. `x64_scope(dtype)` switches it on for a float64 model only, as a
context manager (jax.enable_x64), so float32 users in the same process are not affected.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from pathlib import Path

import jax
import numpy as np
from flax import nnx, serialization

from transformer_rosetta.errors import WeightFileError
from transformer_rosetta.files.outputs import atomic_write
from transformer_rosetta.files.safe_read import (
    MAX_JSON_DEPTH,
    listing,
    os_problem,
    shown,
)
from transformer_rosetta.jax_impl.model import Transformer
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.dtypes import dtype_name, numpy_dtype
from transformer_rosetta.spec.names import canonical_shapes
from transformer_rosetta.weights.format import check_tensors, weight_file_path

_StatePath = tuple[str | int, ...]


# idiom: JAX's x64 mode is a global switch; float64 models need it on, scoped
def x64_scope(dtype: str) -> contextlib.AbstractContextManager:
    """JAX's 64-bit mode on exactly while building and running a float64 model, off otherwise.

    jax.enable_x64 is a context manager over a thread-local config value, and jit keys its cache
    on it, so a float64 model and a float32 one in one process each compile in their own mode.
    """
    return jax.enable_x64(dtype == "float64")


def _canonical_name(path: _StatePath) -> str:
    """The canonical name of an nnx.state path: its parts joined with "."."""
    return ".".join(str(part) for part in path)


def _attribute_path(path: _StatePath) -> str:
    """How Python code reaches the tensor: model.encoder.layers[0].self_attention.query.kernel."""
    return "model" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


# idiom: an nnx.Param's state path is its canonical name; train.canonical_grads reads by it too
def param_paths(model: Transformer) -> dict[str, _StatePath]:
    """{canonical name: nnx.state path} for every nnx.Param, checked against transformer_rosetta.spec.names."""
    paths = {_canonical_name(p): p for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    expected = canonical_shapes(model.config)
    if set(paths) != set(expected):
        raise AssertionError(
            f"model params and canonical names differ: only in the model "
            f"{sorted(set(paths) - set(expected))}, only canonical "
            f"{sorted(set(expected) - set(paths))}"
        )
    return {name: paths[name] for name in expected}


def native_name_map(config: TransformerConfig) -> dict[str, str]:
    """{canonical name: how to reach it on a Transformer}, in canonical order (for the docs)."""
    with x64_scope("float32"):
        model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return {name: _attribute_path(path) for name, path in param_paths(model).items()}


def _params_pure_dict(
    model: Transformer, weights: Mapping[str, np.ndarray], dtype: str
) -> dict[str, np.ndarray]:
    """The model's nnx.Param state as a pure nested dict holding `weights`, shapes asserted."""
    target = numpy_dtype(dtype)
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    for name, path in param_paths(model).items():
        node = pure
        for part in path[:-1]:
            node = node[part]
        have = tuple(node[path[-1]].shape)
        given = np.asarray(weights[name])
        assert given.shape == have, f"{name}: weights have {given.shape}, model needs {have}"
        # Cast on the host with numpy (ml_dtypes for bfloat16): one correctly rounded step even
        # from float64, where a jnp cast without x64 would go through float32 first.
        node[path[-1]] = given.astype(target, copy=False)
    return pure


def load_canonical(
    model: Transformer,
    weights: Mapping[str, np.ndarray],
    dtype: str,  # idiom: the cast is on the host (numpy), to the dtype the module was built in
) -> None:
    """Copy canonical `weights` (any float dtype, cast to `dtype`) into `model` in place."""
    missing = [n for n in canonical_shapes(model.config) if n not in weights]
    if missing:
        raise ValueError(f"missing tensors: {', '.join(missing)}")
    # rosetta: checkpoints
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, _params_pure_dict(model, weights, dtype))
    nnx.update(model, state)


# idiom: NNX builds a module with its dtype and rngs, then loads: one call for both
def from_canonical(
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    dtype: str = "float32",
    *,
    seed: int = 0,
) -> Transformer:
    """A Transformer in `dtype` holding canonical `weights`; `seed` only seeds dropout."""
    with x64_scope(dtype):
        model = Transformer(config, dtype=numpy_dtype(dtype), rngs=nnx.Rngs(seed))
        load_canonical(model, weights, dtype)
    return model


def export_canonical(model: Transformer) -> dict[str, np.ndarray]:
    """Every canonical tensor, in canonical order and in the model's dtype, bit-exact (bfloat16
    as ml_dtypes.bfloat16 numpy arrays)."""
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    return {name: np.asarray(flat[path][...]) for name, path in param_paths(model).items()}


# idiom: Flax's own checkpoint of a live module (the backend writes it from canonical tensors)
def save_native(model: Transformer, path: str | Path) -> None:
    """Flax's native checkpoint: the nnx.Param state as msgpack (flax.serialization).

    msgpack rather than orbax: one small file written atomically, no background threads and no
    folder layout, and restoring it into a freshly built model checks the tree structure. The
    config is not in the file: load_native takes it, as nnx.merge takes a graphdef.
    """
    _write_msgpack(path, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _write_msgpack(path: str | Path, pure: Mapping) -> None:
    data = serialization.msgpack_serialize(pure)
    atomic_write(Path(path), lambda tmp: Path(tmp).write_bytes(data))


def write_native(
    path: str | Path, config: TransformerConfig, weights: Mapping[str, np.ndarray]
) -> None:
    """save_native's file for canonical `weights`, in their dtype (bit-exact), written atomically.
    The caller has validated them.

    The tree comes from nnx.eval_shape, which builds the model abstractly (shapes, no arrays), so
    no parameter is initialised only to be overwritten; the file is the one save_native writes
    for a model holding `weights`.
    """
    dtype = dtype_name(next(iter(weights.values())).dtype)
    _write_msgpack(path, _params_pure_dict(_abstract_model(config), weights, dtype))


@functools.lru_cache(maxsize=8)
def _abstract_model(config: TransformerConfig) -> Transformer:
    """The model for `config` built by nnx.eval_shape: its tree, with shapes and no arrays."""
    with x64_scope("float32"):
        return nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))


def read_native(path: str | Path, config: TransformerConfig) -> dict[str, np.ndarray]:
    """Canonical tensors, in canonical order and the stored dtype (bit-exact), from save_native's
    file for `config`; one WeightFileError lists every problem (a file that is not msgpack, is
    cut short, or holds other tensors, names or shapes)."""
    # a folder, FIFO or device is refused from its stat, unopened (a FIFO would block)
    path = weight_file_path(path, "a Flax checkpoint")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise WeightFileError(shown(path), [os_problem(exc)]) from None
    try:
        restored = serialization.msgpack_restore(data)
    except Exception as exc:  # msgpack's ExtraData / ValueError("incomplete input"), numpy's
        kind = "truncated" if "incomplete" in str(exc) else "not a Flax msgpack checkpoint"
        raise WeightFileError(shown(path), [f"{kind} ({shown(str(exc))[:200]})"]) from None
    if not isinstance(restored, Mapping):
        raise WeightFileError(
            str(path),
            [f"not a Flax checkpoint: the msgpack holds a {type(restored).__name__}, not a tree"],
        )
    try:
        flat = {_canonical_name(p): v for p, v in _leaves(restored)}
    except ValueError as exc:  # nested deeper than any model
        raise WeightFileError(shown(path), [f"not a Flax checkpoint ({exc})"]) from None
    others = [f"{n} ({type(v).__name__})" for n, v in flat.items() if not isinstance(v, np.ndarray)]
    if others:
        raise WeightFileError(shown(path), [f"leaves that are not arrays: {listing(others)}"])
    check_tensors(path, config, flat)
    # msgpack_restore's arrays are read-only views of the file's bytes; hand out our own copies.
    return {name: np.array(flat[name]) for name in canonical_shapes(config)}


# idiom: a module restored from save_native's file (the backend reads canonical tensors)
def load_native(config: TransformerConfig, path: str | Path, dtype: str = "float32") -> Transformer:
    """A Transformer for `config` in `dtype` restored from save_native's file, every problem of
    the file reported at once, and a file in another dtype refused (not silently cast)."""
    tensors = read_native(path, config)
    stored = next(iter(tensors.values())).dtype
    if stored != numpy_dtype(dtype):
        raise WeightFileError(
            str(path), [f"wrong dtype: the file holds {stored}, asked for {dtype}"]
        )
    return from_canonical(config, tensors, dtype)


def _leaves(tree: Mapping, prefix: _StatePath = ()) -> Iterator[tuple[_StatePath, np.ndarray]]:
    """(path, array) for every leaf of a nested dict; msgpack gives list indices back as str.

    Iterative, with a depth bound: a file nested a thousand deep is refused with ValueError,
    not a RecursionError. Only ASCII digits are indices ('²'.isdigit() is true, int() fails).
    """
    stack = [(prefix, iter(tree.items()))]
    while stack:
        path, items = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            continue
        key, value = item
        part = int(key) if isinstance(key, str) and key.isascii() and key.isdecimal() else key
        if isinstance(value, Mapping):
            if len(stack) >= MAX_JSON_DEPTH:
                raise ValueError(f"its tree is nested deeper than {MAX_JSON_DEPTH} levels")
            stack.append(((*path, part), iter(value.items())))
        else:
            yield (*path, part), value
