"""The shared weight file: safetensors with canonical names, the config in the header metadata.

docs/FORMAT.md is the normative description; this module implements it. Loading checks
everything it can and reports every problem in one WeightFileError. Saving validates first and
writes atomically (a temp file in the same folder, fsync, rename), so a crash or a bad tensor
never leaves a partial or clobbered file.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.numpy
from safetensors import safe_open

from common.config import TransformerConfig
from common.dtypes import DTYPES, dtype_name
from common.errors import ConfigError, WeightFileError
from common.names import canonical_shapes

FORMAT_NAME = "transformer-rosetta"
FORMAT_VERSION = 1
# Metadata keys in the safetensors header (all values are strings, as safetensors requires).
META_FORMAT = "format"
META_VERSION = "format_version"
META_CONFIG = "config"
META_PRODUCER = "producer"
META_TASK = "task"  # optional: the generated task (common/tasks.py) whose tokenizer the model reads
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
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


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
    """
    problems: list[str] = []
    expected = canonical_shapes(config)
    missing = [n for n in expected if n not in entries]
    unexpected = sorted(n for n in entries if n not in expected)
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected)}")
    for name, shape in expected.items():
        if name in entries and tuple(entries[name][1]) != shape:
            problems.append(
                f"wrong shape for {name}: file has {list(entries[name][1])}, "
                f"config needs {list(shape)}"
            )
    problems += dtype_problems(entries)
    return problems


def dtype_problems(entries: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    problems = []
    allowed = ", ".join(DTYPES)
    for name, (dtype, _) in entries.items():
        if dtype not in DTYPES:
            problems.append(f"wrong dtype for {name}: {dtype}; the format stores {allowed}")
    floats = {dt for dt, _ in entries.values() if dt in DTYPES}
    if len(floats) > 1:
        counts = {dt: sum(1 for d, _ in entries.values() if d == dt) for dt in sorted(floats)}
        summary = ", ".join(f"{n} {dt}" for dt, n in counts.items())
        problems.append(f"mixed dtypes ({summary}); a weight file holds one dtype")
    return problems


def read_header(path: str | Path) -> tuple[dict[str, dict], dict[str, str] | None]:
    """Parse a safetensors header: ({name: {dtype, shape, data_offsets}}, metadata or None).

    Checks the framing by hand, so that a file that is not safetensors at all and one that was
    cut short get messages saying which.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightFileError(str(path), [f"not a safetensors file ({size} bytes)"])
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER_BYTES:
                raise WeightFileError(
                    str(path), ["not a safetensors file (no valid header length at its start)"]
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise WeightFileError(str(path), ["no such file"]) from None
    except IsADirectoryError:
        raise WeightFileError(str(path), ["is a folder, not a weight file"]) from None
    except PermissionError:
        raise WeightFileError(str(path), ["permission denied"]) from None
    if len(raw) < n:
        if raw[:1] == b"{":
            raise WeightFileError(
                str(path), [f"truncated: the header needs {n} bytes, the file has {size - 8}"]
            )
        raise WeightFileError(str(path), ["not a safetensors file (no valid header at its start)"])
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise WeightFileError(str(path), ["not a safetensors file (header is not JSON)"]) from None
    metadata = header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    try:
        needed = max((int(e["data_offsets"][1]) for e in header.values()), default=0)
    except (TypeError, KeyError, ValueError, IndexError):
        raise WeightFileError(
            str(path), ["corrupt safetensors header (bad data_offsets)"]
        ) from None
    if needed > data_bytes:
        raise WeightFileError(
            str(path),
            [
                f"truncated: the header describes {needed} bytes of tensor data, the file has "
                f"{data_bytes}"
            ],
        )
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
    problems = []
    missing = [k for k in REQUIRED_METADATA if k not in metadata]
    if missing:
        problems.append(f"metadata lacks {', '.join(missing)}")
    fmt = metadata.get(META_FORMAT)
    if fmt is not None and fmt != FORMAT_NAME:
        problems.append(f"not a {FORMAT_NAME} file (metadata format is {fmt!r})")
    version = metadata.get(META_VERSION)
    if version is not None:
        if not version.isdigit():
            problems.append(f"format_version must be an integer, got {version!r}")
        elif int(version) > FORMAT_VERSION:
            problems.append(
                f"written in format version {version}, newer than this reader's "
                f"{FORMAT_VERSION}: upgrade transformer-rosetta to read it"
            )
    config = None
    if META_CONFIG in metadata:
        try:
            config = TransformerConfig.from_json(metadata[META_CONFIG])
        except ConfigError as exc:
            problems.append(f"config in metadata is invalid: {'; '.join(exc.problems)}")
    return problems, config


def load_weights(path: str | Path, config: TransformerConfig | None = None) -> WeightFile:
    """Read and validate a weight file; raise one WeightFileError listing every problem.

    `config`, when given, is what the caller expects: a file whose config differs is refused,
    and a file without metadata is checked against it.
    """
    header, metadata = read_header(path)
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
        name: (
            _DTYPE_NAMES.get(e.get("dtype"), str(e.get("dtype"))),
            tuple(e.get("shape", ())),
        )
        for name, e in header.items()
    }
    if check_config is not None:
        problems += tensor_problems(check_config, entries)
    else:
        problems += dtype_problems(entries)
    if problems or check_config is None:
        raise WeightFileError(str(path), problems)

    try:
        with safe_open(str(path), framework="np") as f:
            tensors = {name: f.get_tensor(name) for name in canonical_shapes(check_config)}
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise WeightFileError(str(path), [f"corrupt tensor data ({exc})"]) from None
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
    """Validate `tensors` against `config`, then write them atomically in canonical order.
    `task` names the common.tasks task a trained model belongs to (metadata key "task")."""
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
    atomic_write(path, lambda tmp: safetensors.numpy.save_file(ordered, tmp, metadata=metadata))


def atomic_write(path: Path, write: callable) -> None:
    """Call write(temp_path) for a temp file beside `path`, fsync it, then rename it over `path`.

    A failure at any point removes the temp file and leaves `path` as it was.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise WeightFileError(str(path), [f"folder {folder} does not exist"])
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=folder)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
