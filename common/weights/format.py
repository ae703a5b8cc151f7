"""The shared weight file: safetensors with canonical names, the config in the header metadata.

docs/FORMAT.md is the normative description; this module implements it. Loading checks
everything it can and reports every problem in one WeightFileError. Saving validates first and
writes atomically (a temp file in the same folder, fsync, rename), so a crash or a bad tensor
never leaves a partial or clobbered file.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.numpy
from safetensors import safe_open

from transformer_rosetta.errors import ConfigError, WeightFileError
from transformer_rosetta.files.outputs import atomic_write
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
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.dtypes import DTYPES, dtype_name
from transformer_rosetta.spec.names import canonical_shapes

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
    """A loaded, validated weight file."""

    config: TransformerConfig
    tensors: dict[str, np.ndarray]  # canonical order
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


def read_header(path: str | Path) -> tuple[dict[str, dict], dict[str, str] | None]:
    """Parse and check a safetensors header: ({name: {dtype, shape, data_offsets}}, metadata or
    None).

    The path must be a regular file (a FIFO or device is refused unopened). The framing is
    checked by hand, so that a file that is not safetensors at all and one that was cut short
    get messages saying which; the JSON is parsed depth- and size-safely; then every field's
    type is checked (header_problems), naming the tensor at fault.
    """
    path = weight_file_path(path, "a weight file")
    name = shown(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
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
    return header, metadata


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
    header, metadata = read_header(path)  # every field's type is checked there
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
    if check_config is not None:
        problems += tensor_problems(check_config, entries)
    else:
        problems += dtype_problems(entries)
    if problems or check_config is None:
        raise WeightFileError(label, problems)

    try:
        with safe_open(str(path), framework="np") as f:
            tensors = {name: f.get_tensor(name) for name in canonical_shapes(check_config)}
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise WeightFileError(label, [f"corrupt tensor data ({shown(str(exc))[:200]})"]) from None
    dtype = next(iter(entries.values()))[0] if entries else "float32"
    return WeightFile(check_config, tensors, dtype, dict(metadata or {}))


def check_tensors(
    path: str | Path, config: TransformerConfig, tensors: Mapping[str, np.ndarray]
) -> None:
    """Refuse canonical `tensors` that do not fit `config`: every problem in one WeightFileError
    naming `path`, raised before anything is written there (every writer calls this first)."""
    entries = {}
    for name, t in tensors.items():
        a = np.asarray(t)
        try:
            entries[name] = (dtype_name(a.dtype), a.shape)
        except ValueError:
            entries[name] = (str(a.dtype), a.shape)
    problems = tensor_problems(config, entries)
    if problems:
        raise WeightFileError(str(path), problems)


def save_weights(
    path: str | Path,
    tensors: Mapping[str, np.ndarray],
    config: TransformerConfig,
    producer: str,
    *,
    task: str | None = None,
) -> None:
    """Validate `tensors` against `config`, then write them atomically (safetensors orders them
    by name; readers rely on names only).
    `task` names the transformer_rosetta.app.tasks task a trained model belongs to (metadata key "task")."""
    path = Path(path)
    arrays = {name: np.ascontiguousarray(np.asarray(t)) for name, t in tensors.items()}
    check_tensors(path, config, arrays)
    ordered = {name: arrays[name] for name in canonical_shapes(config)}
    metadata = {
        META_FORMAT: FORMAT_NAME,
        META_VERSION: str(FORMAT_VERSION),
        META_CONFIG: config.to_json(),
        META_PRODUCER: producer,
    }
    if task is not None:
        metadata[META_TASK] = task
    if not (path.parent if str(path.parent) else Path(".")).is_dir():
        raise WeightFileError(str(path), [f"folder {path.parent} does not exist"])
    size = (
        sum(a.nbytes for a in ordered.values())
        + sum(len(v) for v in metadata.values())
        + 64 * len(ordered)
    )
    atomic_write(
        path, lambda tmp: safetensors.numpy.save_file(ordered, tmp, metadata=metadata), size
    )


def nonfinite_counts(tensors: Mapping[str, np.ndarray]) -> dict[str, dict[str, int]]:
    """{name: {"nan": n, "inf": m}} for every tensor that holds NaN or +-Inf, in file order."""
    found = {}
    for name, t in tensors.items():
        a = np.asarray(t)
        if np.isfinite(a).all():
            continue
        found[name] = {"nan": int(np.isnan(a).sum()), "inf": int(np.isinf(a).sum())}
    return found


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
    """Add string entries to a safetensors file's header metadata, keeping every tensor's bytes:
    the header is rewritten and the data copied as it is (offsets count from the data's start),
    atomically. Works on any safetensors file (ours, a Marian folder's model.safetensors)."""
    path = Path(path)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data_start = 8 + length
    header["__metadata__"] = {**(header.get("__metadata__") or {}), **updates}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes with spaces

    def write(tmp: str) -> None:
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            dst.write(struct.pack("<Q", len(text)) + text)
            src.seek(data_start)
            shutil.copyfileobj(src, dst)

    atomic_write(path, write, os.path.getsize(path) + len(text))
