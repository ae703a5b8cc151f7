"""The shared weight file: safetensors with canonical names, the config in the header metadata.

docs/FORMAT.md is the normative description; this module implements it. Loading checks
everything it can and reports every problem in one WeightFileError, then maps the file: each
tensor is a read-only view of the file's pages, so a model of any size costs no memory of its
own until it is used. Saving validates first, then streams the tensors one by one into a temp
file in the same folder (fsync, rename), so a crash or a bad tensor never leaves a partial or
clobbered file, and no second copy of the weights is ever built. A model may also be a folder of
shards in Hugging Face's layout (weights/shards.py), read and written by the same functions.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import stat
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.errors import ConfigError, WeightFileError
from transformer_rosetta.files.array_writes import CopyBlock, write_arrays, write_at
from transformer_rosetta.files.outputs import (
    WriteFailed,
    atomic_write,
    check_free_space,
    publish,
    staged,
)
from transformer_rosetta.files.safe_read import (
    MAX_HEADER_BYTES,
    MAX_INT_DIGITS,
    MAX_LISTED,
    FileProblem,
    brief,
    is_int,
    json_type,
    listing,
    os_problem,
    parse_json,
    regular_file,
    shown,
)
from transformer_rosetta.spec.arguments import (
    check_instance,
    check_mapping,
    check_path,
    check_text,
)
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.dtypes import DTYPES, dtype_name
from transformer_rosetta.spec.names import canonical_shapes, layer_count_problems
from transformer_rosetta.weights import shards

FORMAT_NAME = "transformer-rosetta"
FORMAT_VERSION = 1
# Metadata keys in the safetensors header (all values are strings, as safetensors requires).
META_FORMAT = "format"
META_VERSION = "format_version"
META_CONFIG = "config"
META_PRODUCER = "producer"
META_TASK = (
    "task"  # optional: the generated task (common/app/tasks.py) whose tokenizer the model reads
)
# optional: where a converted file came from and how it was checked (common/porting/verify.py)
META_PROVENANCE = "provenance"
# optional: the tokenizer of an imported model, as the `tokenizers` library's JSON
META_TOKENIZER = "tokenizer"
REQUIRED_METADATA = (META_FORMAT, META_VERSION, META_CONFIG)

# safetensors' dtype codes for the dtypes the format stores.
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# The other codes safetensors knows, named as numpy names them, for error messages.
_OTHER_DTYPES = {
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3",
    "F8_E5M2": "float8_e5m2",
}
_DTYPE_NAMES = {**SAFETENSORS_DTYPES, **_OTHER_DTYPES}


@dataclass(frozen=True)
class WeightFile:
    """A loaded, validated weight file (or sharded model)."""

    config: TransformerConfig
    # Canonical order. Read-only views of the mapped file: copy one (np.array) to change it.
    tensors: dict[str, np.ndarray]
    dtype: str
    metadata: dict[str, str]

    @property
    def producer(self) -> str:
        return self.metadata.get(META_PRODUCER, "unknown")


def tensor_problems(
    config: TransformerConfig, entries: Mapping[str, tuple[str, tuple[int, ...]]]
) -> list[str]:
    """Compare {name: (dtype name, shape)} against the spec of `config`.

    Lists every missing, unexpected and wrong-shaped tensor, every unsupported dtype, and a mix
    of dtypes (a file has one dtype, so that a reader never has to guess what to compute in).
    Long lists name the first MAX_LISTED tensors and count the rest, to keep one line readable.
    """
    problems: list[str] = []
    expected = canonical_shapes(config)
    missing = [n for n in expected if n not in entries]
    unexpected = sorted(n for n in entries if n not in expected)
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {listing(unexpected)}")
    wrong = [
        f"wrong shape for {name}: file has {list(entries[name][1])}, config needs {list(shape)}"
        for name, shape in expected.items()
        if name in entries and tuple(entries[name][1]) != shape
    ]
    problems += _capped(wrong, "tensors of the wrong shape")
    problems += dtype_problems(entries)
    return problems


def check_layer_counts(
    path: str | Path,
    config: TransformerConfig,
    keys: Iterable[str],
    stems: Mapping[str, str] | None = None,
) -> None:
    """WeightFileError naming the layer counts of `config` that no file of these `keys` can
    hold, before a reader names every layer `config` claims: a file of K tensors holds at most K
    layers (each holds at least one), so a count above K is refused from the count alone
    (spec/names.py, layer_count_problems; `stems`, how the file names its layers). A count within
    K is left to the tensor-by-tensor comparison, which names each missing and unexpected tensor
    and costs what the file does. The one guard of every native checkpoint reader (torch, Keras,
    Flax), whose config the caller gives (`--config`)."""
    keys = list(keys)
    if max(config.num_encoder_layers, config.num_decoder_layers) > len(keys):
        raise WeightFileError(shown(path), layer_count_problems(config, keys, stems))


def dtype_problems(entries: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """One problem per dtype the format does not store (naming its tensors), and one for a mix."""
    problems = []
    allowed = ", ".join(DTYPES)
    unsupported: dict[str, list[str]] = {}
    for name, (dtype, _) in entries.items():
        if dtype not in DTYPES:
            unsupported.setdefault(str(dtype), []).append(name)
    for dtype, names in unsupported.items():
        which = names[0] if len(names) == 1 else f"{len(names)} tensors ({listing(names)})"
        problems.append(f"wrong dtype for {which}: {shown(dtype)}; the format stores {allowed}")
    floats = {dt for dt, _ in entries.values() if dt in DTYPES}
    if len(floats) > 1:
        counts = {dt: sum(1 for d, _ in entries.values() if d == dt) for dt in sorted(floats)}
        summary = ", ".join(f"{n} {dt}" for dt, n in counts.items())
        problems.append(f"mixed dtypes ({summary}); a weight file holds one dtype")
    return problems


def _capped(problems: list[str], what: str) -> list[str]:
    """The first MAX_LISTED problems, then one that counts the rest."""
    if len(problems) <= MAX_LISTED:
        return problems
    return [*problems[:MAX_LISTED], f"and {len(problems) - MAX_LISTED} more {what}"]


# Bytes per element of each safetensors dtype code; the sub-byte codes (F4, F6_*) are absent,
# and a tensor of a code not listed here is not size-checked (safetensors itself refuses it).
_ITEMSIZES = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0"), 1),
    **dict.fromkeys(("F8_E4M3FNUZ", "F8_E5M2FNUZ"), 1),
    **dict.fromkeys(("I16", "U16", "F16", "BF16"), 2),
    **dict.fromkeys(("I32", "U32", "F32"), 4),
    **dict.fromkeys(("I64", "U64", "F64", "C64"), 8),
}
_ENTRY_KEYS = ("dtype", "shape", "data_offsets")


def _entry_problem(entry: object) -> str | None:
    """What is wrong with one tensor's header entry, as '<name> ...' continues it."""
    if not isinstance(entry, dict):
        return f"is {json_type(entry)}, not an object with {', '.join(_ENTRY_KEYS)}"
    missing = [k for k in _ENTRY_KEYS if k not in entry]
    if missing:
        return f"lacks {', '.join(missing)}"
    dtype, shape, offsets = (entry[k] for k in _ENTRY_KEYS)
    if not isinstance(dtype, str):
        return f'has dtype {brief(dtype)}, expected a string such as "F32"'
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        return f"has shape {brief(shape)}, expected a list of integers >= 0"
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        return f"has data_offsets {brief(offsets)}, expected [begin, end] with 0 <= begin <= end"
    if dtype in _ITEMSIZES:
        nbytes = math.prod(shape) * _ITEMSIZES[dtype]
        if offsets[1] - offsets[0] != nbytes:
            return (
                f"has data_offsets {offsets} ({offsets[1] - offsets[0]} bytes), but shape "
                f"{shape} of {dtype} takes {nbytes}"
            )
    return None


def header_problems(header: dict, data_bytes: int) -> list[str]:
    """Everything wrong with a parsed safetensors header for a file with `data_bytes` bytes of
    tensor data: field types, byte counts, overlaps and gaps, and a data size that differs."""
    problems = []
    metadata = header.get("__metadata__")
    if metadata is not None:
        if not isinstance(metadata, dict):
            problems.append(
                "corrupt safetensors header: __metadata__ must be an object of strings, got "
                f"{json_type(metadata)}"
            )
        else:
            bad = [f"{k} is {json_type(v)}" for k, v in metadata.items() if not isinstance(v, str)]
            if bad:
                problems.append(
                    f"corrupt safetensors header: __metadata__ values must be strings ({listing(bad)})"
                )
    bad_entries, spans = [], []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        problem = _entry_problem(entry)
        if problem:
            bad_entries.append(f"corrupt safetensors header: tensor {shown(name)} {problem}")
        else:
            spans.append((*entry["data_offsets"], name))
    problems += _capped(bad_entries, "tensors with corrupt entries")
    if problems:
        return problems
    # safetensors requires the tensors to tile the data: no overlap, no gap, nothing after.
    tiling: list[str] = []
    end, last = 0, None  # the furthest end so far, and the tensor that reaches it
    for begin, stop, name in sorted(spans):
        if begin > end:
            where = f"after tensor {shown(last)}" if last is not None else "at the start"
            tiling.append(
                f"corrupt safetensors header: {begin - end} bytes {where} belong to no tensor"
            )
        elif begin < end:
            # end > 0 here, and end only grows past 0 together with `last` being set.
            assert last is not None
            tiling.append(
                f"corrupt safetensors header: tensors {shown(last)} and {shown(name)} overlap"
            )
        if stop >= end:
            end, last = stop, name
    problems += _capped(tiling, "gaps or overlaps")
    if end > data_bytes:
        problems.append(
            f"truncated: the header describes {end} bytes of tensor data, the file has {data_bytes}"
        )
    elif end < data_bytes and not problems:
        problems.append(
            f"corrupt: {data_bytes - end} bytes after the last tensor belong to no tensor"
        )
    return problems


def weight_file_path(path: str | Path, what: str) -> Path:
    """`path` once it is a regular file (safe_read.regular_file), else a WeightFileError naming
    the problem: the one check every weight-file reader makes before opening anything."""
    try:
        return regular_file(path, what)
    except FileProblem as exc:
        # regular_file names the path in every FileProblem it raises; shown(path) is a fallback.
        raise WeightFileError(
            exc.path if exc.path is not None else shown(path), [exc.problem]
        ) from None


@dataclass(frozen=True)
class _Part:
    """One safetensors file of a model, its header checked: where its tensor data starts, and
    its size, which mapping it later checks again (a file replaced meanwhile is not misread)."""

    path: Path
    header: dict[str, dict]
    metadata: dict[str, str] | None
    data_start: int
    size: int


def _read_part(path: str | Path) -> _Part:
    """Parse and check one file's safetensors header (read_header's single-file case)."""
    path = weight_file_path(path, "a weight file")
    name = shown(path)
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise WeightFileError(name, [f"not a safetensors file ({size} bytes)"])
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise WeightFileError(
                    name, ["not a safetensors file (no valid header length at its start)"]
                )
            raw = f.read(n)
    except OSError as exc:
        raise WeightFileError(name, [os_problem(exc)]) from None
    if len(raw) < n:
        if raw[:1] == b"{":
            raise WeightFileError(
                name, [f"truncated: the header needs {n} bytes, the file has {size - 8}"]
            )
        raise WeightFileError(name, ["not a safetensors file (no valid header at its start)"])
    try:
        header = parse_json(raw)
    except FileProblem as exc:
        raise WeightFileError(name, [f"not a safetensors file (header: {exc.problem})"]) from None
    if not isinstance(header, dict):
        raise WeightFileError(
            name, [f"not a safetensors file (header is {json_type(header)}, not an object)"]
        )
    problems = header_problems(header, size - 8 - n)
    if problems:
        raise WeightFileError(name, problems)
    metadata = header.pop("__metadata__", None)
    return _Part(path, header, metadata, 8 + n, size)


def _read_parts(path: str | Path) -> list[_Part]:
    """Every file of the model at `path` (shards.locate), each header checked, and for a sharded
    model every shard checked against the index and the others (shards.shard_problems) before
    any tensor is read: all the problems of all the shards in one WeightFileError."""
    layout = shards.locate(path)
    if not layout.sharded:
        return [_read_part(layout.files[0])]
    label = shown(path)
    parts, problems = [], []
    for file in layout.files:
        try:
            parts.append(_read_part(file))
        except WeightFileError as exc:
            problems += [f"{shown(file.name)}: {problem}" for problem in exc.problems]
    if problems:
        raise WeightFileError(label, problems)
    problems = shards.shard_problems(
        layout,
        {part.path.name: list(part.header) for part in parts},
        sum(_data_bytes(part.header) for part in parts),
        {part.path.name: part.metadata for part in parts},
    )
    if problems:
        raise WeightFileError(label, problems)
    return parts


def _data_bytes(header: Mapping[str, dict]) -> int:
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())


def read_header(path: str | Path) -> tuple[dict[str, dict], dict[str, str] | None]:
    """Parse and check a safetensors header: ({name: {dtype, shape, data_offsets}}, metadata or
    None).

    The path must be a regular file (a FIFO or device is refused unopened). The framing is
    checked by hand, so that a file that is not safetensors at all and one that was cut short
    get messages saying which; the JSON is parsed depth- and size-safely; then every field's
    type is checked (header_problems), naming the tensor at fault.

    `path` may also be a sharded model (a folder, or its index: weights/shards.py): every shard
    is checked, and against the index, and the result is their union, with each entry's
    data_offsets counting in its own shard, and the metadata they all carry.
    """
    parts = _read_parts(path)
    header = {name: entry for part in parts for name, entry in part.header.items()}
    return header, parts[0].metadata


def weight_paths(path: str | Path) -> list[Path]:
    """The safetensors files that make up the model at `path`: the one weight file, or a
    sharded model's shards in order, every one checked (and against its index) first. The index
    is not among them: what it says, each shard's header says too."""
    return [part.path for part in _read_parts(path)]


def weights_size(path: str | Path) -> int:
    """The bytes of tensor data of the model at `path` (all shards), from the headers alone."""
    return sum(_data_bytes(part.header) for part in _read_parts(path))


def metadata_problems(
    metadata: dict[str, str] | None,
) -> tuple[list[str], TransformerConfig | None]:
    """Check the format name, version and config; returns (problems, config or None)."""
    if metadata is None:
        return [
            "metadata absent: a Transformer Rosetta file carries format, format_version and "
            "config in its safetensors header"
        ], None
    if not isinstance(metadata, dict):
        return [f"metadata must be an object of strings, got {json_type(metadata)}"], None
    problems = []
    missing = [k for k in REQUIRED_METADATA if k not in metadata]
    if missing:
        problems.append(f"metadata lacks {', '.join(missing)}")
    fmt = metadata.get(META_FORMAT)
    if fmt is not None and fmt != FORMAT_NAME:
        problems.append(f"not a {FORMAT_NAME} file (metadata format is {brief(fmt)})")
    version = metadata.get(META_VERSION)
    if version is not None:
        # ASCII digits only: str.isdigit() also accepts '١' and '²', which int() reads or refuses.
        if not (
            isinstance(version, str)
            and version.isascii()
            and version.isdecimal()
            and len(version) <= MAX_INT_DIGITS
        ):
            problems.append(
                f'format_version must be an integer in decimal digits, such as "1", got '
                f"{json_type(version)} {brief(version)}"
            )
        elif int(version) > FORMAT_VERSION:
            problems.append(
                f"written in format version {version}, newer than this reader's "
                f"{FORMAT_VERSION}: upgrade transformer-rosetta to read it"
            )
    config = None
    if META_CONFIG in metadata:
        text = metadata[META_CONFIG]
        if not isinstance(text, str):
            problems.append(f"config in metadata must be JSON text, got {json_type(text)}")
        else:
            try:
                config = TransformerConfig.from_json(text)
            except ConfigError as exc:
                problems.append(f"config in metadata is invalid: {'; '.join(exc.problems)}")
    return problems, config


def load_weights(path: str | Path, config: TransformerConfig | None = None) -> WeightFile:
    """Read and validate a weight file; raise one WeightFileError listing every problem.

    `config`, when given, is what the caller expects: a file whose config differs is refused,
    and a file without metadata is checked against it.
    """
    check_path(path, "path")
    if config is not None:
        check_instance(config, "config", TransformerConfig, "a TransformerConfig or None")
    parts = _read_parts(path)  # every field's type is checked there, and every shard
    header = {name: entry for part in parts for name, entry in part.header.items()}
    metadata = parts[0].metadata  # every shard carries the same (checked by _read_parts)
    label = shown(path)
    problems, file_config = metadata_problems(metadata)
    if metadata is None and config is not None:
        problems = []  # a plain safetensors file, read against the caller's config
    if config is not None and file_config is not None and file_config != config:
        diffs = [
            f"{k} (file {v!r}, expected {getattr(config, k)!r})"
            for k, v in file_config.to_dict().items()
            if getattr(config, k) != v
        ]
        problems.append(f"config differs from the expected one in {', '.join(diffs)}")
    check_config = file_config if file_config is not None else config
    entries = {
        name: (_DTYPE_NAMES.get(e["dtype"], e["dtype"]), tuple(e["shape"]))
        for name, e in header.items()
    }
    # The layer counts first, from the keys alone: tensor_problems names every tensor the config
    # claims, and a header config of 10^9 layers over a file of 2 must not cost 10^9 layers of
    # names. A count that contradicts the file is the one thing to say about its layers.
    counted = [] if check_config is None else layer_count_problems(check_config, header)
    if check_config is not None and not counted:
        problems += tensor_problems(check_config, entries)
    else:
        problems += counted + dtype_problems(entries)
    if problems or check_config is None:
        raise WeightFileError(label, problems)

    mapped = {}
    for part in parts:
        data = _map_data(part, label)
        mapped.update({name: _tensor_view(data, entry) for name, entry in part.header.items()})
    tensors = {name: mapped[name] for name in canonical_shapes(check_config)}
    dtype = next(iter(entries.values()))[0] if entries else "float32"
    return WeightFile(check_config, tensors, dtype, dict(metadata or {}))


# The numpy dtype of each stored code, in the file's byte order (safetensors is little-endian).
_FILE_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": DTYPES["bfloat16"],  # ml_dtypes' bfloat16 has no byte-order variant: see _tensor_view
}
_LITTLE_ENDIAN = sys.byteorder == "little"


def _map_data(part: _Part, label: str) -> np.ndarray:
    """The tensor data of `part` as read-only bytes mapped from the file (no copy: the kernel
    reads a page when a tensor first touches it, and may drop it again, so the weights cost no
    anonymous memory). A file that changed since its header was checked is refused."""
    try:
        with part.path.open("rb") as f:
            if os.fstat(f.fileno()).st_size != part.size or f.read(8) != struct.pack(
                "<Q", part.data_start - 8
            ):
                raise WeightFileError(
                    label, [f"{shown(part.path.name)} changed while it was being read"]
                )
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:  # ValueError: a file that cannot be mapped
        reason = os_problem(exc) if isinstance(exc, OSError) else str(exc)
        raise WeightFileError(label, [f"cannot map {shown(part.path.name)} ({reason})"]) from None
    # ACCESS_READ: the buffer, and every array viewing it, is read-only.
    return np.frombuffer(mapped, dtype=np.uint8, offset=part.data_start)


def _tensor_view(data: np.ndarray, entry: Mapping[str, Any]) -> np.ndarray:
    """One tensor of the data at its header's offsets, in the native byte order: a view of the
    mapped file on a little-endian machine, a swapped copy (read-only too) on a big-endian one."""
    begin, end = entry["data_offsets"]
    raw = data[begin:end]
    dtype = _FILE_DTYPES[entry["dtype"]]
    if _LITTLE_ENDIAN:
        return raw.view(dtype).reshape(entry["shape"])
    swapped = (
        raw.view(f"<u{dtype.itemsize}").astype(f"=u{dtype.itemsize}").view(dtype.newbyteorder("="))
    )
    swapped.flags.writeable = False
    return swapped.reshape(entry["shape"])


def check_tensors(
    path: str | Path, config: TransformerConfig, tensors: Mapping[str, np.ndarray]
) -> None:
    """Refuse canonical `tensors` that do not fit `config`: every problem in one WeightFileError
    naming `path`, raised before anything is written there (every writer calls this first)."""
    _checked_entries(path, config, tensors)


def _checked_entries(
    path: str | Path, config: TransformerConfig, tensors: Mapping[str, Any]
) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """check_tensors, returning {name: (dtype, shape)} in canonical order. Each value is looked
    at once, for its dtype and shape only, and not kept: `tensors` may compute each on access
    (a transpose of a mapped file) and a model's worth of them is never held."""
    entries, found = {}, {}
    for name, t in tensors.items():
        dtype = t.dtype if isinstance(t, np.ndarray) else np.asarray(t).dtype
        shape = tuple(np.shape(t))
        found[name] = (dtype, shape)
        try:
            entries[name] = (dtype_name(dtype), shape)
        except ValueError:
            entries[name] = (str(dtype), shape)
    problems = tensor_problems(config, entries)
    if problems:
        raise WeightFileError(str(path), problems)
    return {name: found[name] for name in canonical_shapes(config)}


# Spaces left in every header this writer writes, beyond safetensors' padding to 8 bytes: room
# for add_metadata to rewrite the header in place (a provenance record is about 1 KB), instead
# of copying the whole file. JSON allows whitespace after the value; every reader skips it.
HEADER_ROOM = 16 * 1024
_WRITER_KEYS = (META_FORMAT, META_VERSION, META_CONFIG, META_PRODUCER, META_TASK)


def save_weights(
    path: str | Path,
    tensors: Mapping[str, np.ndarray],
    config: TransformerConfig,
    producer: str,
    *,
    task: str | None = None,
    max_shard_size: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Validate `tensors` against `config`, then stream them into `path` atomically, one by
    one: each value is read twice (once for its dtype and shape, once to write its bytes) and
    never kept, so a Mapping that computes its values on access costs one tensor of memory at a
    time. The file is what safetensors.numpy.save_file writes for the same tensors (tensors in
    name order, docs/FORMAT.md "Order inside the file"), with HEADER_ROOM more spaces after the
    header's JSON and the metadata keys in a fixed order.

    `task` names the transformer_rosetta.app.tasks task a trained model belongs to (metadata key
    "task"); `metadata` adds other string entries (the provenance record, the tokenizer).
    `max_shard_size` (bytes) writes a folder at `path` in Hugging Face's sharded layout instead
    (weights/shards.py): staged beside it and moved into place whole, every shard carrying the
    same metadata. A caller that writes into an existing folder checks shards.replaced_files
    first: the layout's files already there are replaced or removed."""
    # The API's arguments, each by its name, before anything is looked at (spec/arguments.py).
    check_path(path, "path")
    check_mapping(tensors, "tensors", "a mapping of canonical tensor name -> array")
    check_instance(config, "config", TransformerConfig, "a TransformerConfig")
    check_text(producer, "producer")
    if task is not None:
        check_text(task, "task")
    if max_shard_size is not None:
        shards.check_shard_size(max_shard_size)
    if metadata is not None:
        check_mapping(metadata, "metadata", "a mapping of string -> string, or None")
    write_weights(
        path, tensors, config, producer, task=task, max_shard_size=max_shard_size, metadata=metadata
    )


def write_weights(
    path: str | Path,
    tensors: Mapping[str, np.ndarray],
    config: TransformerConfig,
    producer: str,
    *,
    task: str | None = None,
    max_shard_size: int | None = None,
    metadata: Mapping[str, str] | None = None,
    copy_block: CopyBlock | None = None,
) -> None:
    """save_weights, with `copy_block` putting each strided tensor (a transposed view) into C
    order a block at a time (files/array_writes.py): a conversion passes its source framework's
    own copy, faster than numpy's tiles (a .pt's kernels: torch's copy_)."""
    path = Path(path)
    entries = _checked_entries(path, config, tensors)
    header_metadata = _metadata(path, config, producer, task, metadata)
    if max_shard_size is not None:
        _save_sharded(path, tensors, entries, header_metadata, max_shard_size, copy_block)
        return
    if not (path.parent if str(path.parent) else Path(".")).is_dir():
        raise WeightFileError(str(path), [f"folder {path.parent} does not exist"])
    names = sorted(entries)  # safetensors' order: a file holds one dtype, so by name
    head = _header_bytes(names, entries, header_metadata, HEADER_ROOM)
    size = len(head) + sum(_nbytes(*entries[name]) for name in names)
    atomic_write(
        path, lambda tmp: _write_file(Path(tmp), head, names, entries, tensors, copy_block), size
    )


def _metadata(
    path: Path,
    config: TransformerConfig,
    producer: str,
    task: str | None,
    extra: Mapping[str, str] | None,
) -> dict[str, str]:
    """The header's metadata: the format's keys first, then the caller's others."""
    metadata = {
        META_FORMAT: FORMAT_NAME,
        META_VERSION: str(FORMAT_VERSION),
        META_CONFIG: config.to_json(),
        META_PRODUCER: producer,
    }
    if task is not None:
        metadata[META_TASK] = task
    extra = dict(extra or {})
    problems = [
        f"metadata {shown(k)} is set by the writer (format, format_version, config, producer, task)"
        for k in extra
        if k in _WRITER_KEYS
    ]
    problems += [
        f"metadata {shown(str(k))} must be a string, got {json_type(v)}"
        for k, v in extra.items()
        if not isinstance(k, str) or not isinstance(v, str)
    ]
    if problems:
        raise WeightFileError(str(path), problems)
    return {**metadata, **extra}


def _nbytes(dtype: np.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def _json_bytes(header: Mapping[str, Any]) -> bytes:
    """A header as safetensors' serde_json writes it: no spaces, text as UTF-8 (not escaped)."""
    return json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _header_bytes(
    names: Sequence[str],
    entries: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
    metadata: Mapping[str, str],
    room: int,
) -> bytes:
    """The 8-byte little-endian length and the JSON header of a file holding `names` back to
    back in this order: __metadata__ first, then each tensor's dtype, shape and data_offsets,
    padded with spaces to a multiple of 8 (as safetensors pads it) and `room` more."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in names:
        dtype, shape = entries[name]
        end = offset + _nbytes(dtype, shape)
        code = _SAFETENSORS_CODES[dtype_name(dtype)]
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = _json_bytes(header)
    text += b" " * (-len(text) % 8 + room)
    return struct.pack("<Q", len(text)) + text


_SAFETENSORS_CODES = {name: code for code, name in SAFETENSORS_DTYPES.items()}


def _write_file(
    path: Path,
    head: bytes,
    names: Sequence[str],
    entries: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
    tensors: Mapping[str, Any],
    copy_block: CopyBlock | None = None,
) -> None:
    """Write the header, then each tensor's bytes in `names` order, reading `tensors[name]` once
    each and keeping none: a contiguous little-endian tensor (a view of a mapped file's pages)
    goes to the file as it is, a strided one a block at a time (files/array_writes.py)."""

    def placed() -> Iterator[tuple[np.ndarray, int]]:
        offset = len(head)
        for name in names:
            a = _file_array(path, name, tensors[name], entries[name])
            yield a, offset
            offset += a.nbytes

    with path.open("wb", buffering=0) as f:  # raw writes at known offsets, no buffer between
        write_at(f.fileno(), head, 0)
        write_arrays(f.fileno(), placed(), copy_block=copy_block)


def _file_array(
    path: Path, name: str, value: Any, entry: tuple[np.dtype, tuple[int, ...]]
) -> np.ndarray:
    """`value` as an array whose bytes in C order are the file's (little-endian), once it is
    what the check saw: a Mapping that computes its values must compute the same one twice."""
    a = value if isinstance(value, np.ndarray) else np.asarray(value)
    if (a.dtype, a.shape) != entry:
        raise WeightFileError(
            str(path),
            [
                f"tensor {name} changed between its check and its write: "
                f"{a.dtype} {list(a.shape)}, was {entry[0]} {list(entry[1])}"
            ],
        )
    if not _LITTLE_ENDIAN:  # safetensors is little-endian: swap a big-endian machine's bytes
        a = np.ascontiguousarray(a).view(f"=u{a.dtype.itemsize}").astype(f"<u{a.dtype.itemsize}")
    return a


def _save_sharded(
    folder: Path,
    tensors: Mapping[str, Any],
    entries: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
    metadata: Mapping[str, str],
    max_shard_size: int,
    copy_block: CopyBlock | None = None,
) -> None:
    """save_weights into a folder of shards (weights/shards.py), staged beside `folder` and
    published whole: a failure or a signal leaves `folder` as it was."""
    sizes = {name: _nbytes(*entry) for name, entry in entries.items()}
    groups = shards.split_into_shards(sizes, max_shard_size)
    files = shards.shard_file_names(len(groups))
    heads = [_header_bytes(sorted(g), entries, metadata, HEADER_ROOM) for g in groups]
    with staged(folder) as stage:
        check_free_space(stage.parent, sum(sizes.values()) + sum(map(len, heads)), shown(folder))
        try:
            stage.mkdir()
            for file, group, head in zip(files, groups, heads, strict=True):
                _write_file(stage / file, head, sorted(group), entries, tensors, copy_block)
            if len(groups) > 1:
                weight_map = {
                    name: file for file, group in zip(files, groups, strict=True) for name in group
                }
                parameters = sum(math.prod(shape) for _, shape in entries.values())
                text = shards.index_text(weight_map, sum(sizes.values()), parameters)
                (stage / shards.INDEX_FILE).write_text(text, encoding="utf-8")
            for file in os.listdir(stage):
                with open(stage / file, "rb+") as f:
                    os.fsync(f.fileno())
        except OSError as exc:  # a full disk: one line naming the destination
            reason = exc.strerror or type(exc).__name__
            raise WriteFailed(f"cannot write {shown(folder)}: {reason}") from exc
        publish_weights(stage, folder)


def publish_weights(stage: Path, path: Path) -> None:
    """outputs.publish for a staged model: a file, or a folder of the sharded layout. A folder
    replaces the one at `path` whole (docs/RELIABILITY.md, "Nothing is lost"), so the folder
    holds one model: the layout's files there that the new model lacks (the stale shards of an
    earlier, larger split; a model.safetensors, which readers prefer to an index, first of all)
    are not carried into it, the folder's other files (a README) are. The caller has checked
    them (shards.replaced_files); one that appeared since, or a folder that was absent when
    checked and appeared since, is left as it is (OutputError)."""
    publish(stage, path, drops=shards.layout_files)


def planned_files(config: TransformerConfig, dtype: str, max_shard_size: int) -> list[str]:
    """What save_weights(max_shard_size=...) writes for a model of `config` in `dtype`: the
    file names to check before the work (check_output_folder, with shards.replaced_files)."""
    itemsize = DTYPES[dtype].itemsize
    sizes = {name: math.prod(shape) * itemsize for name, shape in canonical_shapes(config).items()}
    return shards.planned_files(sizes, max_shard_size)


def nonfinite_counts(tensors: Mapping[str, np.ndarray]) -> dict[str, dict[str, int]]:
    """{name: {"nan": n, "inf": m}} for every tensor that holds NaN or +-Inf, in file order."""
    found = {}
    for name, t in tensors.items():
        a = np.asarray(t)
        if _all_finite(a):
            continue
        found[name] = {"nan": int(np.isnan(a).sum()), "inf": int(np.isinf(a).sum())}
    return found


# Bits of a 16-bit float's exponent: all set, and the value is an Inf or a NaN.
_EXPONENT_BITS = {np.dtype(np.float16): 0x7C00, DTYPES["bfloat16"]: 0x7F80}
# Elements a 16-bit tensor is checked in at once: the temporaries stay a few MB.
_CHUNK_ELEMENTS = 1 << 22


def _all_finite(a: np.ndarray) -> bool:
    """Whether `a` holds no NaN and no Inf, in one read that allocates nothing per element
    where it can, since the check reads every weight of a model of any size. float32 and
    float64: the sum of finite values is finite unless it overflows, and a NaN or an Inf
    anywhere makes it NaN or Inf; a sum that is not finite is decided by the exact check. 16-bit
    floats: their exponent bits, a chunk at a time."""
    if a.dtype in (np.float32, np.float64):
        with np.errstate(over="ignore", invalid="ignore"):
            if np.isfinite(np.add.reduce(a, axis=None)):
                return True
        return bool(np.isfinite(a).all())
    mask = _EXPONENT_BITS.get(a.dtype)
    if mask is None:
        return bool(np.isfinite(a).all())
    bits = np.ascontiguousarray(a).reshape(-1).view(np.uint16)
    for begin in range(0, bits.size, _CHUNK_ELEMENTS):
        chunk = bits[begin : begin + _CHUNK_ELEMENTS]
        if ((chunk & mask) == mask).any():
            return False
    return True


def describe_nonfinite(found: Mapping[str, Mapping[str, int]], limit: int = 3) -> str:
    """'2 tensors hold non-finite values (a: 3 NaN; b: 1 Inf)', naming at most `limit` tensors."""
    parts = []
    for name, counts in list(found.items())[:limit]:
        kinds = [
            f"{n} {label}" for label, n in (("NaN", counts["nan"]), ("Inf", counts["inf"])) if n
        ]
        parts.append(f"{name}: {', '.join(kinds)}")
    more = f"; and {len(found) - limit} more" if len(found) > limit else ""
    noun = "tensor holds" if len(found) == 1 else "tensors hold"
    return f"{len(found)} {noun} non-finite values ({'; '.join(parts)}{more})"


def check_finite(path: str | Path, tensors: Mapping[str, np.ndarray], allow: bool) -> None:
    """Refuse weights with NaN or Inf unless `allow` (the CLI's --allow-nonfinite): a model with
    them computes NaN everywhere, and a decoder then emits nothing but pad."""
    if allow:
        return
    found = nonfinite_counts(tensors)
    if found:
        raise WeightFileError(
            str(path), [f"{describe_nonfinite(found)}; pass --allow-nonfinite to use them anyway"]
        )


def add_metadata(path: str | Path, updates: Mapping[str, str]) -> None:
    """Add string entries to a safetensors file's header metadata, keeping every tensor's bytes.
    Works on any safetensors file (ours, a Marian folder's model.safetensors), and on a sharded
    model (a folder or its index), whose every shard gets them.

    When the new header fits the old one's length (this writer leaves HEADER_ROOM spaces for
    it), it is written over the old in place, padded with spaces: the data does not move, so
    nothing else is copied. The callers do this on files not yet published (a staged convert or
    save), since one interrupted write of a few kilobytes could leave the header half old. A
    header that does not fit, or a file that is linked (a hub cache's blob) or not writable, is
    rewritten whole instead: a new header with fresh room and the data copied, atomically."""
    for part in _read_parts(path):  # every shard checked first, and against its index
        _add_part_metadata(part, updates)


def _add_part_metadata(part: _Part, updates: Mapping[str, str]) -> None:
    with part.path.open("rb") as f:
        f.seek(8)
        old = json.loads(f.read(part.data_start - 8))  # checked by _read_part
    metadata = {**(old.pop("__metadata__", None) or {}), **updates}
    text = _json_bytes({"__metadata__": metadata, **old})
    room = part.data_start - 8 - len(text)
    if room >= 0 and _writable_in_place(part.path):
        try:
            with part.path.open("r+b") as out:
                out.seek(8)
                out.write(text + b" " * room)
                out.flush()
                os.fsync(out.fileno())
            return
        except OSError:  # refused after all (a read-only mount): the whole rewrite below
            pass
    text += b" " * (-len(text) % 8 + HEADER_ROOM)

    def write(tmp: str) -> None:
        with part.path.open("rb") as src, open(tmp, "wb") as dst:
            dst.write(struct.pack("<Q", len(text)) + text)
            src.seek(part.data_start)
            shutil.copyfileobj(src, dst)

    atomic_write(part.path, write, part.size + len(text))


def _writable_in_place(path: Path) -> bool:
    """A regular file with one name: writing into it changes no other file's content."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and os.access(path, os.W_OK)
