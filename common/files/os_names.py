"""File names for libraries that re-encode them as UTF-8, whatever the locale.

The OS gives a file name as bytes. Python holds bytes that are not UTF-8 (any non-ASCII name in
the C locale, with `PYTHONUTF8=0`; a Latin-1 name anywhere) as a str with surrogate escapes,
and its own `open` gives the same bytes back. A library whose native code takes the name as
UTF-8 text (torch's zip reader, onnxruntime, the tokenizers' Rust) cannot encode those
surrogates and fails on a file that is there (docs/RELIABILITY.md, issue 41's class 8).
`library_path` hands such a library a name it can take for the same file: the name itself when
it is UTF-8, else the file opened by Python and named by its descriptor (`/proc/self/fd/N`, an
ASCII name that the kernel resolves to the open file or folder). safetensors and h5py encode
names as the OS does (os.fsencode) and need none of this.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

# Where the kernel names a process's open files (Linux); elsewhere a name that is not UTF-8 is
# rare (macOS and Windows keep names as Unicode), and it goes to the library as it is.
_FD_FOLDER = "/proc/self/fd"


def is_utf8(path: str | os.PathLike) -> bool:
    """Whether `path` is text that a library taking UTF-8 names can encode."""
    try:
        os.fspath(path).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@contextlib.contextmanager
def library_path(path: str | os.PathLike) -> Iterator[str]:
    """A name of the file or folder at `path` that a UTF-8-only library can open, valid inside
    the block: `path` itself when it encodes, else its open descriptor's `/proc/self/fd/N` (a
    folder's too: the library finds the folder's files under it). A name that cannot be opened
    goes as it is, so that the library reports it as it would any missing file."""
    text = os.fspath(path)
    if is_utf8(text) or not os.path.isdir(_FD_FOLDER):
        yield text
        return
    try:
        fd = os.open(text, os.O_RDONLY)
    except OSError:
        yield text
        return
    try:
        yield f"{_FD_FOLDER}/{fd}"
    finally:
        os.close(fd)
