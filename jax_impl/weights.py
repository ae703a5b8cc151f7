"""Canonical weights <-> the Flax NNX model, and the native checkpoint.

The rule, and the only mapping there is: model.py names its attributes after the canonical names,
so the path of every nnx.Param in `nnx.state(model, nnx.Param)` joined with "." *is* its canonical
name (("encoder", "layers", 0, "self_attention", "query", "kernel") is
"encoder.layers.0.self_attention.query.kernel"). Nothing here lists a name: transformer_rosetta.spec.names derives
them, and each load asserts that the model's paths and the canonical names are the same set.

Layouts are canonical already: nnx.LinearGeneral keeps attention kernels as [d, heads, k] and
[h, k, d] with biases [heads, k] and [d] (the key and value projections have num_kv_heads heads),
nnx.Linear kernels are [in, out] (the gated feed-forward's `gate` too), nnx.LayerNorm has
`scale` and `bias` and model.RMSNorm `scale` alone, embeddings are [vocab, d]; a bias the config
leaves out (attention_bias, attention_output_bias, feed_forward_bias) is no nnx.Param at all. So,
unlike torch, nothing is transposed or packed.

float64 needs JAX's x64 mode. `x64_scope(dtype)` switches it on for a float64 model only, as a
context manager (jax.enable_x64), so float32 users in the same process are not affected.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

import jax
import msgpack
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
from transformer_rosetta.spec.dtypes import numpy_dtype
from transformer_rosetta.spec.names import canonical_shapes
from transformer_rosetta.weights.format import (
    check_layer_counts,
    check_tensors,
    weight_file_path,
)

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
    config is not in the file: load_native takes it, as nnx.merge takes a graphdef. A live
    module's state is in memory already, so Flax's own msgpack_serialize writes it (one bytes
    object of the whole file); write_native streams the same bytes from canonical tensors.
    """
    data = serialization.msgpack_serialize(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    atomic_write(Path(path), lambda tmp: Path(tmp).write_bytes(data))


def write_native(
    path: str | Path, config: TransformerConfig, weights: Mapping[str, np.ndarray]
) -> None:
    """save_native's file for canonical `weights`, in their dtype (bit-exact), written atomically.
    The caller has validated them.

    Streamed, byte for byte what msgpack_serialize writes for a model holding `weights`: the
    tree's map headers and keys, then each array as Flax's msgpack extension (type 1: the shape,
    the dtype's name and the C-order bytes), written straight from the caller's array (which may
    be mapped from a file), one at a time, so the file is never built in memory. An array over
    Flax's MAX_CHUNK_SIZE is split into chunks as Flax splits it. No model is built: the tree is
    the canonical names (_param_tree).
    """
    tree = _param_tree(config)
    itemsize = np.asarray(next(iter(weights.values()))).dtype.itemsize
    size = itemsize * sum(math.prod(shape) for shape in canonical_shapes(config).values())

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            _pack_tree(f, tree, weights)

    atomic_write(Path(path), write, size + 256 * len(canonical_shapes(config)))


_Tree = dict[str | int, "_Tree | str"]  # a nested dict whose leaves are canonical names


def _param_tree(config: TransformerConfig) -> _Tree:
    """The nested dict nnx.to_pure_dict(nnx.state(model, nnx.Param)) gives for `config`, with
    each leaf's canonical name in place of its array: a name's parts are the path (a list item's
    index an int), and each level is in the order NNX gives it, sorted (indices by number)."""
    tree: dict = {}
    for name in canonical_shapes(config):
        *parents, leaf = (int(p) if p.isdecimal() else p for p in name.split("."))
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = name

    def ordered(node: dict) -> _Tree:
        keys = sorted(node, key=lambda k: (isinstance(k, str), k))
        return {k: ordered(node[k]) if isinstance(node[k], dict) else node[k] for k in keys}

    return ordered(tree)


# flax.serialization's msgpack extension type of an ndarray (_MsgpackExtType.ndarray)
_NDARRAY_EXT = 1
_CHUNKED = "__msgpack_chunked_array__"  # flax.serialization's key of an array split in chunks


def _pack_tree(f: IO[bytes], tree: _Tree, weights: Mapping[str, np.ndarray]) -> None:
    """Write `tree` as msgpack_serialize does, each leaf name's array from `weights`."""
    packer = msgpack.Packer(use_bin_type=True)
    f.write(packer.pack_map_header(len(tree)))
    for key, value in tree.items():
        f.write(packer.pack(key))
        if isinstance(value, dict):
            _pack_tree(f, value, weights)
        else:
            _pack_array(f, packer, np.asarray(weights[value]))


def _pack_array(f: IO[bytes], packer: msgpack.Packer, array: np.ndarray) -> None:
    """One array as msgpack_serialize writes it: one extension, or Flax's map of chunks when it
    is over MAX_CHUNK_SIZE bytes (msgpack holds at most 2**32 - 1 bytes in one object)."""
    # Contiguous in native byte order, as tobytes("C") would give: a copy of this one array only
    # when it is not already (a transposed view).
    array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))
    if array.nbytes <= serialization.MAX_CHUNK_SIZE:
        _pack_ndarray(f, array)
        return
    chunk = max(1, int(serialization.MAX_CHUNK_SIZE / array.dtype.itemsize))
    flat = array.reshape(-1)
    starts = range(0, flat.size, chunk)
    f.write(packer.pack_map_header(3))
    f.write(packer.pack(_CHUNKED) + packer.pack(True))
    f.write(packer.pack("shape") + packer.pack({str(i): n for i, n in enumerate(array.shape)}))
    f.write(packer.pack("chunks") + packer.pack_map_header(len(starts)))
    for i, start in enumerate(starts):
        f.write(packer.pack(str(i)))
        _pack_ndarray(f, flat[start : start + chunk])


def _pack_ndarray(f: IO[bytes], array: np.ndarray) -> None:
    """flax.serialization._ndarray_to_bytes's extension, its header packed here and its bytes
    written from the array's memory: msgpack.packb((shape, dtype name, bytes)) as extension
    type 1. `array` is C-contiguous."""
    head = b"\x93" + msgpack.packb(list(array.shape)) + msgpack.packb(array.dtype.name)
    head += _msgpack_length(array.nbytes, b"\xc4", b"\xc5", b"\xc6")  # bin 8/16/32
    f.write(_ext_header(_NDARRAY_EXT, len(head) + array.nbytes) + head)
    f.write(array.reshape(-1).view(np.uint8).data)


def _msgpack_length(n: int, one: bytes, two: bytes, four: bytes) -> bytes:
    """A msgpack length: the smallest of the 1-, 2- and 4-byte big-endian forms."""
    if n < 1 << 8:
        return one + n.to_bytes(1, "big")
    if n < 1 << 16:
        return two + n.to_bytes(2, "big")
    return four + n.to_bytes(4, "big")


_FIXEXT = {1: b"\xd4", 2: b"\xd5", 4: b"\xd6", 8: b"\xd7", 16: b"\xd8"}


def _ext_header(code: int, n: int) -> bytes:
    """The header msgpack writes before `n` bytes of extension type `code`: fixext 1/2/4/8/16 for
    those sizes, else ext 8/16/32."""
    if n in _FIXEXT:
        return _FIXEXT[n] + code.to_bytes(1, "big", signed=True)
    return _msgpack_length(n, b"\xc7", b"\xc8", b"\xc9") + code.to_bytes(1, "big", signed=True)


def read_native(path: str | Path, config: TransformerConfig) -> dict[str, np.ndarray]:
    """Canonical tensors, in canonical order and the stored dtype (bit-exact), from save_native's
    file for `config`; one WeightFileError lists every problem (a file that is not msgpack, is
    cut short, or holds other tensors, names or shapes).

    The file is mapped and read as msgpack_restore reads it, except that each array is a
    read-only view of its bytes in the mapped file (_MappedMsgpack), so nothing is copied into
    memory; only an array Flax split into chunks (over 1 GiB) is joined into one copy.
    """
    # a folder, FIFO or device is refused from its stat, unopened (a FIFO would block)
    path = weight_file_path(path, "a Flax checkpoint")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except OSError as exc:
        raise WeightFileError(shown(path), [os_problem(exc)]) from None
    try:
        restored = _MappedMsgpack(data).restore()
    except _Truncated as exc:
        raise WeightFileError(shown(path), [f"truncated ({exc})"]) from None
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        reason = shown(str(exc))[:200] or type(exc).__name__
        raise WeightFileError(shown(path), [f"not a Flax msgpack checkpoint ({reason})"]) from None
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
    # A --config of 10^9 layers over a file of 2: refused before its names are built.
    check_layer_counts(path, config, flat)
    check_tensors(path, config, flat)
    return {name: flat[name] for name in canonical_shapes(config)}


class _Truncated(Exception):
    """The msgpack ends before the object it started."""


class _MappedMsgpack:
    """msgpack_restore over a mapped file, without the copies: Flax's arrays (extension type 1)
    become read-only views of their bytes in the mapping; maps are walked here, with their
    depth bounded; any other object (a key, a number, a list) is decoded by msgpack itself.

    msgpack_restore needs the whole file as one bytes object, unpacks each extension's bytes
    into another, and its arrays view those: three copies of the model. Here there is none.
    """

    def __init__(self, data: mmap.mmap | bytes) -> None:
        # `end`: where the object being read must end (the file's end, or an extension's)
        self.data, self.pos, self.end = data, 0, len(data)

    def restore(self) -> object:
        tree = self._object(0)
        if self.pos != len(self.data):
            raise ValueError(f"{len(self.data) - self.pos} bytes of extra data after the tree")
        return tree

    def _take(self, n: int) -> int:
        """Move past `n` bytes; where they start."""
        start = self.pos
        if start + n > self.end:
            raise _Truncated(f"the file ends inside an object that starts at byte {start}")
        self.pos += n
        return start

    def _uint(self, n: int) -> int:
        start = self._take(n)
        return int.from_bytes(self.data[start : start + n], "big")

    def _object(self, depth: int) -> object:
        if self.pos >= self.end:
            raise _Truncated("the file ends where an object should start")
        code = self.data[self.pos]
        if 0x80 <= code <= 0x8F or code in (0xDE, 0xDF):
            return self._map(depth)
        if 0xD4 <= code <= 0xD8 or 0xC7 <= code <= 0xC9:
            array = self._ndarray()
            if array is not None:
                return array
        return self._decoded()

    def _map(self, depth: int) -> object:
        if depth >= MAX_JSON_DEPTH:
            raise ValueError(f"its tree is nested deeper than {MAX_JSON_DEPTH} levels")
        code = self.data[self._take(1)]
        n = code & 0x0F if code <= 0x8F else self._uint(2 if code == 0xDE else 4)
        out: dict = {}
        for _ in range(n):
            key = self._decoded()
            if isinstance(key, (list, dict)):  # msgpack_restore cannot hash it either
                raise ValueError(f"a map key that is a {type(key).__name__}")
            out[key] = self._object(depth + 1)
        return _unchunked(out) if _CHUNKED in out else out

    def _ndarray(self) -> np.ndarray | None:
        """The array at pos when it is Flax's extension (type 1), as a view; else None, pos
        unmoved (another extension is msgpack's to decode)."""
        start = self.pos
        code = self.data[self._take(1)]
        fixed = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
        n = fixed[code] if code in fixed else self._uint(1 << (code - 0xC7))
        if self.data[self._take(1)] != _NDARRAY_EXT:
            self.pos = start
            return None
        end = self.pos + n
        if end > len(self.data):
            raise _Truncated(f"the file ends inside the array that starts at byte {start}")
        not_flax = f"the array at byte {start} is not Flax's (shape, dtype, bytes)"
        # Inside: [shape, dtype name, bytes], as msgpack.packb((shape, name, bytes)) writes it,
        # all within the extension's n bytes.
        self.end = end
        try:
            if self.data[self._take(1)] != 0x93:
                raise ValueError(not_flax)
            shape, name = self._decoded(), self._decoded()
            code = self.data[self._take(1)]
            if code not in (0xC4, 0xC5, 0xC6):
                raise ValueError(f"the array at byte {start} holds no bytes")
            nbytes = self._uint(1 << (code - 0xC4))
            offset = self._take(nbytes)
        except _Truncated:
            raise ValueError(not_flax) from None
        finally:
            self.end = len(self.data)
        if self.pos != end or not isinstance(shape, list) or not isinstance(name, str):
            raise ValueError(not_flax)
        dtype = _flax_dtype(name)
        if dtype.itemsize == 0 or nbytes % dtype.itemsize:
            raise ValueError(f"the array at byte {start} holds {nbytes} bytes of {name}")
        count = nbytes // dtype.itemsize
        # np.frombuffer(...).reshape(shape), as Flax reads it: a view, read-only as the map is.
        array = np.frombuffer(self.data, dtype, count, offset) if count else np.empty(0, dtype)
        return array.reshape(shape)

    def _decoded(self) -> object:
        """The object at pos decoded by msgpack (as msgpack_restore would), pos moved past it."""
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=2**31 - 1)
        fed, step = self.pos, 256  # keys and numbers are short: feed a little, then more
        while True:
            unpacker.feed(self.data[fed : min(fed + step, self.end)])
            fed, step = min(fed + step, self.end), step * 2
            try:
                value = unpacker.unpack()
            except msgpack.OutOfData:
                if fed >= self.end:
                    raise _Truncated(
                        f"the file ends inside the object at byte {self.pos}"
                    ) from None
                continue
            self.pos += unpacker.tell()
            return value


def _flax_dtype(name: str) -> np.dtype:
    """flax.serialization._dtype_from_name: numpy's dtype of that name, bfloat16 ml_dtypes'."""
    dtype = np.dtype(numpy_dtype("bfloat16")) if name == "bfloat16" else np.dtype(name)
    if dtype.hasobject:
        raise ValueError(f"an array of dtype {name}, which no checkpoint holds")
    return dtype


def _unchunked(node: dict) -> np.ndarray:
    """An array Flax split into chunks, joined (one copy): flax.serialization._unchunk."""
    try:
        shape = tuple(node["shape"][str(i)] for i in range(len(node["shape"])))
        chunks = [node["chunks"][str(i)] for i in range(len(node["chunks"]))]
        return np.concatenate(chunks).reshape(shape)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a chunked array that does not join ({exc})") from None


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
