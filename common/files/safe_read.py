"""Reading the files a user hands us, safely: every check before any work, every failure one line.

Each reader here refuses what it cannot use with a RosettaError whose message is one line naming
the file and the problem, never an exception from deeper down: a path that is not a regular file
(a folder, a FIFO, a device, a symbolic-link loop) is refused from its stat, without opening it,
so a FIFO cannot block; JSON is size-limited, UTF-8-checked and depth-checked before it is
parsed; a .npy or .npz is judged from its header before any array is allocated. No reader here
ever unpickles, nor suggests doing so.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np

from transformer_rosetta.errors import InputError, RosettaError

# -- limits: every bound on what a user's file may make us do, in one place ----------------------

# A config is about 1 KB of JSON; a file 1000 times larger is the wrong file, not a config.
MAX_CONFIG_BYTES = 1 << 20
# Configs nest 1 level and safetensors headers 3; Python's JSON parser recurses per level, so a
# deeply nested file would otherwise end in RecursionError.
MAX_JSON_DEPTH = 64
# uint64 has 20 digits and no size, id or offset needs more; Python refuses to convert integers
# of more than 4300 digits (ValueError mid-parse) and converting long ones costs quadratic time.
MAX_INT_DIGITS = 20
# safetensors' own limit on the JSON header of a weight file.
MAX_HEADER_BYTES = 100_000_000
# Token-id arrays are megabytes; an .npy header claiming more than this is refused before any
# allocation (a header can claim 10^7 x 10^7 in 100 bytes).
MAX_NPY_BYTES = 2 << 30
# numpy's own default bound on a .npy header (its header parser is a literal_eval).
MAX_NPY_HEADER_BYTES = 10_000
# How many names one message lists before "and N more": keeps a message one readable line (a
# file for another model can lack hundreds of tensors), yet names a whole layer's worth.
MAX_LISTED = 10
# How many characters of a user's value a message quotes before "...": a 1 MB string in a
# config field must not become a 1 MB error line.
MAX_QUOTED_CHARS = 80


class FileProblem(RosettaError, ValueError):
    """One thing wrong with one user file: `path` (as shown, control characters escaped) and
    `problem`. The message is 'path: problem', or just the problem for text without a file."""

    def __init__(self, problem: str, path: str | os.PathLike | None = None) -> None:
        self.problem = problem
        self.path = None if path is None else shown(path)
        super().__init__(problem if self.path is None else f"{self.path}: {problem}")


class MissingFile(FileProblem):
    """The path does not exist (callers phrase 'no such file' their own way)."""


# -- showing user data in one-line messages ---------------------------------------------------------


def shown(text: str | os.PathLike) -> str:
    """`text` with each unprintable character escaped as repr() writes it (a newline as \\n), so
    that a name holding a newline or a terminal escape cannot break a one-line message."""
    text = os.fspath(text)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def brief(value: Any) -> str:
    """repr(value), cut to MAX_QUOTED_CHARS: a user's 1 MB string or list stays a short quote."""
    text = repr(value)
    if len(text) > MAX_QUOTED_CHARS:
        return text[: MAX_QUOTED_CHARS - 3] + "..."
    return text


def listing(names: Iterable[Any], limit: int = MAX_LISTED) -> str:
    """'a, b, c', or the first `limit` names and 'and N more'."""
    names = [shown(str(n)) for n in names]
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} and {len(names) - limit} more"


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for 'expected X, got Y' messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def is_int(value: Any) -> bool:
    """A JSON integer: an int that is not a bool (True is an int in Python, not in JSON)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# The JSON types a field may have, by the word that names them in messages.
_TYPE_CHECKS = {
    "an integer": is_int,
    "a number": is_number,
    "a string": lambda v: isinstance(v, str),
    "true or false": lambda v: isinstance(v, bool),
    "an object": lambda v: isinstance(v, dict),
    "an array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def type_problem(field: str, value: Any, *expected: str) -> str | None:
    """None when `value` has one of the `expected` JSON types (keys of _TYPE_CHECKS), else
    'field: must be X, got a string '512'' (the style of config validation)."""
    if any(_TYPE_CHECKS[kind](value) for kind in expected):
        return None
    if value is None or isinstance(value, bool):
        return f"{field}: must be {' or '.join(expected)}, got {json.dumps(value)}"
    return f"{field}: must be {' or '.join(expected)}, got {json_type(value)} {brief(value)}"


# -- files ----------------------------------------------------------------------------------------

_NOT_REGULAR = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def regular_file(path: str | os.PathLike, what: str) -> Path:
    """`path`, once stat (following symbolic links) shows a regular file; never opens it.

    `what` names the file expected, with its article ("a weight file"), for messages such as
    "is a folder, not a weight file". Raises MissingFile or FileProblem.
    """
    if not os.fspath(path):  # Path("") would be the current folder
        raise FileProblem("the file name is empty", '""')
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise FileProblem("a symbolic link to nothing (broken link)", path) from None
        raise MissingFile("no such file", path) from None
    except OSError as exc:
        raise FileProblem(os_problem(exc), path) from None
    except ValueError:  # a NUL byte in the name
        raise FileProblem("not a valid file name (it holds a NUL character)", path) from None
    if stat.S_ISDIR(st.st_mode):
        raise FileProblem(f"is a folder, not {what}", path)
    for test, kind in _NOT_REGULAR:
        if test(st.st_mode):
            raise FileProblem(f"is {kind}, not {what}", path)
    if not stat.S_ISREG(st.st_mode):
        raise FileProblem(f"is not a regular file, not {what}", path)
    return path


def os_problem(exc: OSError) -> str:
    """One short phrase for an OSError from stat or open: what happened, not errno's jargon."""
    # errno is None for an OSError raised without one: that gets the generic phrase.
    phrases: dict[int | None, str] = {
        errno.ELOOP: "a loop of symbolic links",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.ENOTDIR: "no such file (a part of the path is not a folder)",
        errno.ENAMETOOLONG: "the file name is too long",
        errno.EISDIR: "is a folder",
    }
    return phrases.get(exc.errno, f"cannot be read ({exc.strerror or type(exc).__name__})")


def read_bytes(path: str | os.PathLike, what: str, max_bytes: int) -> bytes:
    """The whole of a regular file of at most `max_bytes` bytes (checked before reading)."""
    path = regular_file(path, what)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise FileProblem(
                    f"too large for {what}: {size:,} bytes, over the limit of {max_bytes:,}", path
                )
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise FileProblem(os_problem(exc), path) from None
    if len(data) > max_bytes:  # it grew after the stat
        raise FileProblem(f"too large for {what}: over the limit of {max_bytes:,} bytes", path)
    return data


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


# -- JSON -----------------------------------------------------------------------------------------

# Strings (whose brackets do not count) and the brackets themselves, for the depth scan.
_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)


class _JsonRefused(Exception):
    """Raised from json.loads' hooks; carries the problem."""


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _JsonRefused(
            f"an integer of {len(text.lstrip('-'))} digits (the limit is {MAX_INT_DIGITS})"
        )
    return int(text)


def _json_constant(name: str) -> float:
    raise _JsonRefused(f"{name} is not JSON")


def json_depth_problem(text: str, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """A problem when `text` nests arrays/objects deeper than `max_depth`, found by scanning
    brackets outside strings, so that the parser never recurses that deep."""
    depth = 0
    for match in _JSON_TOKENS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > max_depth:
                return f"nested deeper than {max_depth} levels"
        elif token in "]}":
            depth -= 1
    return None


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are unique: with a repeated key, json.loads keeps the last value
    silently, and two readers of the same file could disagree on what it says."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        raise _JsonRefused(f"the key {brief(_first_repeated(pairs))} appears more than once")
    return obj


def _first_repeated(pairs: list[tuple[str, Any]]) -> str:
    """The first key of `pairs` met a second time (the caller knows some key repeats)."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    raise ValueError("no key repeats")


def parse_json(data: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads, refusing with FileProblem (no path) text that is not UTF-8, nests deeper
    than `max_depth`, holds an integer longer than MAX_INT_DIGITS, NaN or Infinity, or is not
    valid JSON. Never raises RecursionError or ValueError of its own."""
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FileProblem(f"not UTF-8 text (byte {exc.start} is invalid)") from None
    if not isinstance(data, str):
        raise FileProblem(f"JSON text must be a string, got {json_type(data)}")
    depth = json_depth_problem(data, max_depth)
    if depth:
        raise FileProblem(f"not usable JSON ({depth})")
    try:
        return json.loads(
            data,
            parse_int=_json_int,
            parse_constant=_json_constant,
            object_pairs_hook=_json_object,
        )
    except _JsonRefused as exc:
        raise FileProblem(f"not usable JSON ({exc})") from None
    except json.JSONDecodeError as exc:
        raise FileProblem(f"not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except (RecursionError, ValueError) as exc:  # a backstop: the checks above should prevent it
        raise FileProblem(f"not usable JSON ({type(exc).__name__})") from None


def read_json(
    path: str | os.PathLike,
    what: str = "a JSON file",
    max_bytes: int = MAX_CONFIG_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """The parsed JSON of a regular file of at most `max_bytes`; FileProblem naming the file."""
    data = read_bytes(path, what, max_bytes)
    try:
        return parse_json(data, max_depth)
    except FileProblem as exc:
        raise FileProblem(exc.problem, path) from None


# -- .npy and .npz: token ids -------------------------------------------------------------------

_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK\x03\x04"


def npy_header(f: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) from the .npy header at `f`'s position, read with numpy's
    own header readers (a literal_eval, never a pickle); FileProblem (no path) when it is not a
    .npy header. `f` is left at the start of the data."""
    head = f.read(len(_NPY_MAGIC))
    if head != _NPY_MAGIC:
        if head.startswith(_ZIP_MAGIC):
            raise FileProblem("it is an .npz archive (a zip of arrays), not a .npy file")
        raise FileProblem("it is not a .npy file (no numpy header at its start)")
    try:
        major, minor = (b for b in f.read(2))
    except ValueError:
        raise FileProblem("its .npy header is cut short") from None
    try:
        if (major, minor) == (1, 0):
            return np.lib.format.read_array_header_1_0(f, max_header_size=MAX_NPY_HEADER_BYTES)
        if (major, minor) == (2, 0):
            return np.lib.format.read_array_header_2_0(f, max_header_size=MAX_NPY_HEADER_BYTES)
    except Exception:  # numpy's literal_eval and its tokenize fallback raise many kinds
        # numpy's text for a long header advises allow_pickle; ours never does.
        raise FileProblem(
            f"its .npy header is damaged or longer than {MAX_NPY_HEADER_BYTES} bytes"
        ) from None
    if (major, minor) == (3, 0):  # numpy writes 3.0 only for structured dtypes' unicode names
        raise FileProblem("it is a .npy of format 3.0 (a structured array)")
    raise FileProblem(f"it is a .npy of format {major}.{minor}, which numpy does not define")


def ids_header_problem(shape: tuple[int, ...], dtype: np.dtype) -> str | None:
    """What makes a .npy header unfit for token ids [batch, length], before any data is read."""
    if dtype.hasobject:
        return "it holds Python objects (dtype object), which are never loaded; token ids must be integers"
    if dtype.fields is not None or dtype.subdtype is not None:
        return f"it holds a structured dtype {brief(str(dtype))}; token ids must be integers"
    if dtype.kind not in "iu":
        return f"it holds dtype {dtype}; token ids must be integers"
    if len(shape) != 2:
        return (
            f"it holds an array of shape {list(shape)}; token ids must be rank 2, [batch, length]"
        )
    if any(not isinstance(n, int) or n < 0 for n in shape):
        return f"its header claims shape {brief(list(shape))}; sizes must be whole numbers >= 0"
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_NPY_BYTES:
        return (
            f"its header claims shape {list(shape)} of {dtype}, {_size(nbytes)}; the limit is "
            f"{_size(MAX_NPY_BYTES)}"
        )
    return None


def _read_ids(f: IO[bytes], available: int | None) -> np.ndarray:
    """The array of the .npy at `f`, or FileProblem (no path) saying what is wrong with it;
    `available` is the byte count of the whole .npy when known, to refuse a cut-short file
    before reading it."""
    shape, fortran, dtype = npy_header(f)
    problem = ids_header_problem(shape, dtype)
    if problem:
        raise FileProblem(problem)
    nbytes = math.prod(shape) * dtype.itemsize
    if available is not None:
        data_bytes = available - _position(f)
        if data_bytes < nbytes:
            raise FileProblem(
                f"it is truncated: its header describes {nbytes} bytes of data, it has "
                f"{max(data_bytes, 0)}"
            )
    data = f.read(nbytes)
    if len(data) < nbytes:
        raise FileProblem(f"it is truncated: its header describes {nbytes} bytes of data")
    array = np.frombuffer(data, dtype=dtype, count=math.prod(shape))
    order: Literal["C", "F"] = "F" if fortran else "C"
    return array.reshape(shape, order=order).copy(order="C")


def _position(f: IO[bytes]) -> int:
    try:
        return f.tell()
    except (OSError, AttributeError):  # a stream that cannot tell: its length is not checked
        return 0


def read_ids(path: str | os.PathLike, name: str) -> np.ndarray:
    """An integer array [batch, length] from a .npy file, for the option `name` (e.g. '--src').

    The file must be regular (a FIFO is refused without opening it); its header is checked
    (integer dtype, rank 2, at most MAX_NPY_BYTES, data present) before the data is read.
    """
    _ids_file(path, name, "a .npy file")
    try:
        with open(path, "rb") as f:
            return _read_ids(f, os.fstat(f.fileno()).st_size)
    except FileProblem as exc:
        problem = exc.problem
    except OSError as exc:
        problem = os_problem(exc)
    raise InputError(f"{name}: {shown(path)} is not a readable .npy array ({problem})")


def _ids_file(path: str | os.PathLike, name: str, what: str) -> None:
    """regular_file for the option `name`, as an InputError."""
    try:
        regular_file(path, what)
    except MissingFile:
        raise InputError(f"{name}: no such file {shown(path)}") from None
    except FileProblem as exc:
        raise InputError(f"{name}: {exc}") from None


def read_ids_npz(
    path: str | os.PathLike, name: str, keys: tuple[str, ...] = ("src", "tgt")
) -> tuple[np.ndarray, ...]:
    """The arrays `keys` (each integer [batch, length]) of an .npz made by np.savez, for the
    option `name`. Each member's .npy header is checked before it is decompressed, so neither a
    huge claimed shape nor a zip bomb is expanded."""
    _ids_file(path, name, "an .npz file")

    def refuse(problem: str) -> InputError:
        return InputError(f"{name}: {shown(path)} is not a readable .npz file ({problem})")

    try:
        with open(path, "rb") as f:
            head = f.read(len(_NPY_MAGIC))
    except OSError as exc:
        raise refuse(os_problem(exc)) from None
    if head == _NPY_MAGIC:
        raise refuse("it is a single .npy array, not an .npz archive of src and tgt")
    try:
        with zipfile.ZipFile(path) as archive:
            members = {info.filename: info for info in archive.infolist()}
            files = [n[:-4] if n.endswith(".npy") else n for n in members]
            missing = [k for k in keys if f"{k}.npy" not in members and k not in members]
            if missing:
                raise InputError(
                    f"{name}: {shown(path)} lacks {', '.join(missing)} (has "
                    f"{listing(files) or 'nothing'})"
                )
            arrays = []
            for key in keys:
                info = members.get(f"{key}.npy") or members[key]
                with archive.open(info) as member:
                    try:
                        arrays.append(_read_ids(member, info.file_size))
                    except FileProblem as exc:
                        raise refuse(f"{key}: {exc.problem}") from None
            return tuple(arrays)
    except InputError:
        raise
    except zipfile.BadZipFile:
        if head.startswith(_ZIP_MAGIC):
            raise refuse("a damaged or cut-short zip archive") from None
        raise refuse("it is not an .npz archive (not a zip file)") from None
    except (zlib.error, EOFError, NotImplementedError, RuntimeError, OSError, ValueError):
        # RuntimeError: an encrypted member; NotImplementedError: an unknown compression.
        raise refuse("a damaged zip archive, or one np.savez does not write") from None
