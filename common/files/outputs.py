"""Every file the project writes goes through here: checks on the destination before any work
starts, and atomic writes that leave nothing behind on failure or on a catchable signal.

The promise (docs/RELIABILITY.md):
- a destination is checked before the work that produces it: it must be a regular file or not
  exist yet, in a folder that exists and that we can really write in (probed with a temp file,
  since `os.access` says yes to root on a read-only mount);
- an existing file is replaced only with `--force`, and never when it is also an input of the
  same command; a folder, a device node, a FIFO or a socket is never replaced, `--force` or not;
- a file is written under a temp folder beside it, fsynced, then renamed over the destination in
  one step, so a reader sees the old file or the new one, never half of one;
- a folder (a model's: Marian, Llama, shards) is staged whole and replaces the old folder as a
  whole in one exchange (publish), never merged into it; a file or folder that was absent when
  checked and appears meanwhile is left as it is;
- SIGTERM, SIGHUP and SIGINT during a write remove the temp folder before the process exits
  (SIGKILL cannot be caught: its `.NAME.*.partial` folder stays, and nothing ever reads it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from transformer_rosetta.errors import RosettaError
from transformer_rosetta.files.safe_read import shown

# Temp folders of the writes under way; a signal handler removes them before the process exits.
_PENDING: set[str] = set()
# Destinations that did not exist when checked: if one appears while the command works (another
# program, a second run), it is not replaced, --force or not, since nobody asked to replace it.
_NEW: set[str] = set()
# Signals that end the process through `Interrupted`, so that `finally` blocks run. SIGINT
# already raises KeyboardInterrupt; SIGKILL and SIGSTOP cannot be caught.
CAUGHT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)
# The signals held back (blocked) while a few steps must happen all or none (a temp folder made
# and registered; a staged result moved into place): every catchable one, Ctrl-C's included.
HELD_SIGNALS = (*CAUGHT_SIGNALS, signal.SIGINT)
# Existing folders checked by check_output_folder -> the names they held then: a name that the
# move into place would replace or drop, and that was not there when checked, appeared since.
_CHECKED: dict[str, frozenset[str]] = {}


class OutputError(RosettaError):
    """A destination that cannot or must not be written."""


class WriteFailed(OutputError, OSError):
    """A writer that failed midway (a full disk, a library's own error type): still an OSError,
    as what it wraps was, and a RosettaError with one line naming the file."""


class Interrupted(BaseException):  # noqa: N818 - like KeyboardInterrupt, not an error class
    """A catchable termination signal, raised in the main thread so that cleanup runs."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def _stat(path: Path, what: str) -> os.stat_result | None:
    """os.stat following links; None when nothing is there. A broken or looping link, or a parent
    that is not a folder, is an OutputError."""
    try:
        return path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            raise OutputError(f"{what}: {shown(path)} is a link to nothing") from None
        return None
    except OSError as exc:
        raise OutputError(f"{what}: {shown(path)}: {exc.strerror or exc}") from None
    except ValueError:  # a NUL byte in the name
        raise OutputError(f"{what}: {shown(path)}: not a valid file name") from None


def probe_folder(folder: Path, what: str, name: str = ".rosetta-probe") -> None:
    """Refuse a folder we cannot create `name` in, by creating (and removing) it inside a temp
    folder, exactly as atomic_write will: a read-only or full file system, a name too long for
    it, or one it cannot encode, shows here and not after the work."""
    st = _stat(folder, what)
    if st is None:
        raise OutputError(f"{what}: folder {shown(folder)}: the destination folder does not exist")
    if not stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{what}: {shown(folder)} is not a folder")
    try:
        tmpdir = _make_temp_folder(folder, name)
    except (OSError, UnicodeError) as exc:
        raise OutputError(f"{what}: cannot write in {shown(folder)}: {_reason(exc)}") from None
    try:
        Path(tmpdir, name).touch()
    except (OSError, UnicodeError) as exc:
        raise OutputError(
            f"{what}: cannot write {shown(name)} in {shown(folder)}: {_reason(exc)}"
        ) from None
    finally:
        _remove_temp_folder(tmpdir)


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _make_temp_folder(folder: Path, name: str) -> str:
    """A new `.NAME.XXXX.partial` folder in `folder`, registered for removal on a signal. The
    catchable signals are held back while it is made and registered, so that no signal can
    land between the two and leave it behind."""
    with signals_held():
        tmpdir = tempfile.mkdtemp(prefix=_temp_prefix(name), suffix=".partial", dir=folder)
        _PENDING.add(tmpdir)
    return tmpdir


def _remove_temp_folder(tmpdir: str) -> None:
    shutil.rmtree(tmpdir, ignore_errors=True)
    _PENDING.discard(tmpdir)


def _temp_prefix(name: str) -> str:
    """The temp folder's name stays short whatever the destination's (a name near the file
    system's limit still fits inside it)."""
    return f".{name[:40]}."


def check_output_file(
    path: str | os.PathLike,
    *,
    what: str = "--out",
    force: bool = False,
    suffix: str | None = None,
    inputs: Iterable[str | os.PathLike | None] = (),
    force_word: str = "--force",
) -> Path:
    """The checks made before any work whose result goes to `path`; returns the path to write
    (a link is followed, as `cp` follows one). `inputs` are the files the command reads: none of
    them may be the destination, even with --force. `what` and `force_word` are the caller's
    words for the destination and the overwrite ("path" and "force=True" in the Python API)."""
    if not os.fspath(path):
        raise OutputError(f"{what}: the file name is empty")
    # Read twice below; None and "" are no file.
    given: list[str | os.PathLike] = [source for source in inputs if source]
    path = Path(path)
    if suffix is not None and not path.name.endswith(suffix):
        raise OutputError(f"{what}: {shown(path)} should end in {suffix}")
    st = _stat(path, what)
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise OutputError(f"{what}: {shown(path)} is a folder; give a file name")
        if not stat.S_ISREG(st.st_mode):
            raise OutputError(
                f"{what}: {shown(path)} is not a regular file (a device, FIFO or socket); "
                "refusing to replace it"
            )
        if not force:
            raise OutputError(f"{what}: {shown(path)} exists; pass {force_word} to overwrite it")
        for source in given:
            if _same_file(path, Path(source)):
                raise OutputError(
                    f"{what}: {shown(path)} is also an input of this command; refusing to "
                    f"overwrite what it reads ({force_word} does not apply)"
                )
    refuse_inside_an_input(path, given, what)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    probe_folder(target.parent if str(target.parent) else Path("."), what, target.name)
    if st is None:
        _NEW.add(os.path.abspath(target))
    else:  # replacing it was asked for (--force)
        _NEW.discard(os.path.abspath(target))
    return target


def refuse_inside_an_input(
    path: str | os.PathLike, inputs: Iterable[str | os.PathLike | None], what: str
) -> None:
    """An input folder (a Marian or BERT model) is never written into: neither a file nor a
    folder at or under it, whether that exists yet or not (links followed)."""
    for source in inputs:
        if source and Path(source).is_dir() and _inside(Path(path), Path(source)):
            raise OutputError(
                f"{what}: {shown(path)} is inside the input folder {shown(source)}; refusing to "
                "write into what this command reads"
            )


def _inside(path: Path, folder: Path) -> bool:
    try:
        return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))
    except (OSError, ValueError):
        return False


def check_output_folder(
    folder: str | os.PathLike,
    names: Iterable[str],
    *,
    what: str,
    force: bool = False,
    inputs: Iterable[str | os.PathLike | None] = (),
    needed: int = 0,
    force_word: str = "--force",
) -> Path:
    """The checks for a command that writes `names` into `folder` (made if absent): the folder,
    or its nearest existing ancestor, must be a folder we can write in, and each file is checked
    as check_output_file checks one. Nothing is created here. Returns the folder to write (a link
    to a folder is followed, as `cp` follows one). What is found is recorded for the move into
    place (publish): a folder absent now that appears meanwhile is left alone, and so is a file
    of an existing folder that was not there now and that the move would replace."""
    if not os.fspath(folder):
        raise OutputError(f"{what}: the folder name is empty")
    folder = Path(folder)
    inputs = list(inputs)
    refuse_inside_an_input(folder, inputs, what)  # also for a folder that does not exist yet
    st = _stat(folder, what)
    if st is None:
        ancestor = folder.absolute().parent
        while _stat(ancestor, what) is None:
            ancestor = ancestor.parent
        for name in names:
            probe_folder(ancestor, what, name)
            _NEW.add(os.path.abspath(folder / name))
        check_free_space(ancestor, needed, what)
        _NEW.add(os.path.abspath(folder))
        _CHECKED.pop(os.path.abspath(folder), None)
        return folder
    if not stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{what}: {shown(folder)} exists and is not a folder")
    if folder.is_symlink():  # the folder replaced is the link's, and staged beside it
        folder = Path(os.path.realpath(folder))
    try:
        present = frozenset(os.listdir(folder))
    except OSError as exc:
        raise OutputError(f"{what}: {shown(folder)}: {_reason(exc)}") from None
    for name in names:
        check_output_file(
            folder / name, what=what, force=force, inputs=inputs, force_word=force_word
        )
    check_free_space(folder, needed, what)
    _NEW.discard(os.path.abspath(folder))
    _CHECKED[os.path.abspath(folder)] = present
    return folder


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def make_folder(folder: Path, what: str) -> None:
    """Create `folder` (and its parents) when the work is done and its files are about to be
    written, so that a failed run leaves no empty folder behind."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{what}: cannot create {shown(folder)}: {exc.strerror or exc}") from None


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """Refuse a write of `needed` bytes into a folder whose file system has less free: a full
    disk mid-write is an error some writers (HDF5) cannot even report cleanly."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if needed > free:
        raise OutputError(
            f"{what}: {shown(folder)} has {free / 2**20:,.1f} MiB free; the file needs about "
            f"{needed / 2**20:,.1f} MiB"
        )


def text_writer(text: str) -> Callable[[str], object]:
    """atomic_write's writer of `text`: one function per text, so a loop over files can hand
    each its own (a lambda in the loop would see only the last text)."""
    return lambda tmp: Path(tmp).write_text(text)


def atomic_write(
    path: str | os.PathLike, write: Callable[[str], object], size: int | None = None
) -> None:
    """Call write(temp_path), fsync the result, then rename it over `path` in one step.

    temp_path has the same file name as `path` (so a library that insists on a suffix, like
    Keras's `.weights.h5`, is satisfied) inside a temp folder `.NAME.XXXX.partial` beside `path`;
    whatever `write` leaves in that folder is removed on every exit: success, error, Ctrl-C,
    SIGTERM or SIGHUP. `path` is as it was until the rename. `size`, the bytes about to be
    written, is checked against the free space first. A writer's failure (a full disk, a
    library's own error type) becomes an OutputError naming `path`.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise OutputError(f"{shown(path)}: folder {shown(folder)} does not exist")
    if size is not None:
        check_free_space(folder, size, shown(path))
    try:
        tmpdir = _make_temp_folder(folder, path.name)
    except OSError as exc:
        raise OutputError(f"cannot write in {shown(folder)}: {_reason(exc)}") from None
    received = len(_RECEIVED)
    try:
        tmp = os.path.join(tmpdir, path.name)
        try:
            write(tmp)
        except Exception as exc:  # noqa: BLE001 - every writer's own error type, named once
            if len(_RECEIVED) > received:  # the writer turned our signal into its own error
                raise Interrupted(_RECEIVED[-1]) from exc
            reason = (_reason(exc).strip().splitlines() or [type(exc).__name__])[-1]
            raise WriteFailed(f"cannot write {shown(path)}: {reason}") from exc
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for(path))
        _move_into_place(tmp, path)
        _fsync_folder(folder)
    finally:
        _remove_temp_folder(tmpdir)


@contextlib.contextmanager
def staged(path: str | os.PathLike) -> Iterator[Path]:
    """A place to write `path` and do its post-write work (verification, metadata) before it
    replaces anything: yields a path of the same name inside a temp folder `.NAME.XXXX.partial`
    beside `path` (registered, so a signal removes it), removed on every exit. The caller writes
    the staged file (or folder) there, checks it, and calls publish(stage, path) last. Until then
    `path` is as it was: a signal, an error or a failed check during the work costs nothing that
    was already there (docs/RELIABILITY.md, "Work after the write")."""
    path = Path(path)
    folder = path.absolute().parent
    while not folder.exists():  # a folder destination whose parents publish() will make
        folder = folder.parent
    try:
        tmpdir = _make_temp_folder(folder, path.name)
    except OSError as exc:
        raise OutputError(f"cannot write in {shown(folder)}: {_reason(exc)}") from None
    try:
        yield Path(tmpdir) / path.name
    finally:
        _remove_temp_folder(tmpdir)


def publish(
    stage: Path, path: Path, *, drops: Callable[[Path], Iterable[str]] | None = None
) -> None:
    """Move a staged file or folder into place, the last step of a write (staged). The catchable
    signals, Ctrl-C's included, are held while it runs, so that a signal lands before it
    (nothing replaced) or after it (all replaced), never between two of its steps.

    A file is renamed over `path` in one step (as atomic_write does). A folder is moved whole,
    never merged into the old one file by file:
    - absent when checked (check_output_folder) and present now: left as it is, OutputError;
      two runs racing to the same new folder end with the first one's folder whole;
    - absent now: the stage is renamed into place, failing rather than replace a folder that
      appeared in the meantime;
    - existing: the stage replaces it whole, in one exchange of the two folders (or, where the
      OS cannot exchange them, a rename aside and back on failure). The old folder's files that
      the new one lacks and that `drops(path)` does not name (a README, a tokenizer; not the
      stale shards of an earlier split) are linked into the stage first, so nothing that is not
      the model is lost, and never missing. A file the move would replace or drop that was not
      there when the folder was checked appeared meanwhile: OutputError, nothing changed.
    """
    with signals_held():
        if stage.is_dir():
            _publish_folder(stage, path, drops)
        else:
            os.chmod(stage, _mode_for(path))
            _move_into_place(str(stage), path)
        _fsync_folder(path.parent if str(path.parent) else Path("."))


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """The catchable signals (HELD_SIGNALS) wait while inside, and are handled as soon as it
    ends: steps that must happen all or not at all (a few renames) are never split by one.

    Blocking them in this thread (pthread_sigmask) is not enough: the kernel hands a signal
    sent to the process to any thread that does not block it (a writer thread, a BLAS worker),
    and Python then runs its handler in the main thread all the same. So the main thread's
    handlers are swapped for one that only notes the signal, and each noted signal is raised
    again, to the handler it was meant for, once the steps are done. Elsewhere than in the main
    thread (which alone runs handlers and may set them) the signals are blocked for this thread."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    noted: list[int] = []
    handlers: dict[int, Any] = {}  # signal.signal's handler types: a callable, SIG_DFL, SIG_IGN
    if threading.current_thread() is threading.main_thread():
        for sig in HELD_SIGNALS:
            if signal.getsignal(sig) is not None:  # None: a handler set outside Python, kept
                handlers[sig] = signal.signal(sig, lambda signum, _frame: noted.append(signum))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # one pending here is noted too
        for sig, handler in handlers.items():  # signal.signal runs any handler still due first
            signal.signal(sig, handler)
        for sig in dict.fromkeys(noted):
            signal.raise_signal(sig)


def _appeared(path: Path, folder: Path | None = None) -> OutputError:
    kept = f"{shown(folder)} was left as it is" if folder is not None else "it was left as it is"
    return OutputError(
        f"{shown(path)} appeared while this command worked; {kept}, and nothing was written"
    )


def _publish_folder(stage: Path, path: Path, drops: Callable[[Path], Iterable[str]] | None) -> None:
    """publish for a staged folder (its docstring says the rule)."""
    if path.is_symlink():  # a link to a folder: the folder is replaced, the link kept
        path = Path(os.path.realpath(path))
    key = os.path.abspath(path)
    try:
        st: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and key in _NEW:
        raise _appeared(path)
    try:
        if st is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            _rename_new_folder(stage, path)
        elif not stat.S_ISDIR(st.st_mode):
            raise OutputError(
                f"{shown(path)} is no longer a folder; it was left as it is, and nothing was "
                "written"
            )
        else:
            _replace_folder(stage, path, drops, _CHECKED.get(key))
    except OSError as exc:
        raise WriteFailed(f"cannot write {shown(path)}: {_reason(exc)}") from exc
    for name in [n for n in _NEW if n == key or n.startswith(key + os.sep)]:
        _NEW.discard(name)  # placed: a later write there replaces what this one wrote
    _CHECKED.pop(key, None)
    _fsync_folder(path)


def _rename_new_folder(stage: Path, path: Path) -> None:
    """Rename `stage` to `path`, which must not exist: where the OS can (renameat2's
    RENAME_NOREPLACE) in one step that fails if it does; else after a look, and rename(2) itself
    fails over a folder that holds anything (only an empty one that appeared in between could
    be replaced, and it holds nothing to lose)."""
    try:
        if _renameat2(stage, path, _RENAME_NOREPLACE):
            return
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
        os.rename(stage, path)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise _appeared(path) from None
        raise


def _replace_folder(
    stage: Path,
    path: Path,
    drops: Callable[[Path], Iterable[str]] | None,
    checked: frozenset[str] | None,
) -> None:
    """Replace the existing folder `path` by `stage` whole (publish's rule). `checked`: the
    names `path` held when check_output_folder saw it (None: never checked, a library call)."""
    names = set(os.listdir(path))
    ours = set(os.listdir(stage))
    replaced = (ours | set(drops(path) if drops else ())) & names
    for name in sorted(replaced):
        if os.path.abspath(path / name) in _NEW or (checked is not None and name not in checked):
            raise _appeared(path / name, path)
    kept = sorted(names - replaced)
    for name in kept:
        try:
            _link_tree(path / name, stage / name)
        except OSError as exc:
            raise OutputError(
                f"cannot replace {shown(path)}: {shown(name)} in it cannot be kept in the new "
                f"folder ({_reason(exc)}); it was left as it is, and nothing was written"
            ) from None
    os.chmod(stage, stat.S_IMODE(os.stat(path).st_mode))  # the folder keeps its permissions
    _exchange(stage, path)  # one step: `path` is the new folder, `stage` the old one
    try:
        clashes = _carry_back(stage, path, set(kept), names)
    except OSError as exc:
        clashes, why = [], _reason(exc)
    else:
        why = ""
    if clashes or why:  # the old folder is not removed (with the temp folder) but kept beside
        aside = Path(tempfile.mkdtemp(prefix=f"{path.name[:40]}.replaced-", dir=path.parent))
        os.rename(stage, aside / path.name)
        what = (
            f"{shown(path / clashes[0])} appeared while this command replaced {shown(path)}"
            if clashes
            else f"{shown(path)} was replaced, but its old files could not all be kept ({why})"
        )
        raise OutputError(f"{what}; the replaced folder is kept as {shown(aside / path.name)}")


def _link_tree(src: Path, dst: Path) -> None:
    """`src` again at `dst` without a copy where the file system allows: each file hard-linked
    (a link is linked itself, not followed), each folder made anew with the same permissions. A
    file that cannot be linked (another file system, a file system without links) is copied;
    the original replaces the copy after the swap (_carry_back)."""
    st = os.lstat(src)
    if stat.S_ISDIR(st.st_mode):
        os.mkdir(dst)
        for name in os.listdir(src):
            _link_tree(src / name, dst / name)
        os.chmod(dst, stat.S_IMODE(st.st_mode))
        return
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(src), dst)
        elif stat.S_ISREG(st.st_mode):
            shutil.copy2(src, dst)
        else:
            raise


def _carry_back(old: Path, new: Path, kept: set[str], before: set[str]) -> list[str]:
    """After the swap, what the old folder holds that the new one does not have as it is: what
    another program changed or added there between the listing and the swap. Each such file is
    moved into the new folder (the newer version wins over the link made before). Returns the
    names that clash with the new model's own files, which are not moved."""
    clashes = []
    for name in sorted(os.listdir(old)):
        if name in kept:
            _merge_back(old / name, new / name)
        elif name not in before:  # appeared during the swap
            if os.path.lexists(new / name):
                clashes.append(name)
            else:
                os.rename(old / name, new / name)
    return clashes


def _merge_back(src: Path, dst: Path) -> None:
    """Make `dst` (its linked tree, _link_tree) hold what `src` holds now, moving from `src`
    whatever is not already the same file at `dst`."""
    s = os.lstat(src)
    try:
        d: os.stat_result | None = os.lstat(dst)
    except FileNotFoundError:
        d = None
    if d is not None and stat.S_ISDIR(s.st_mode) and stat.S_ISDIR(d.st_mode):
        for name in os.listdir(src):
            _merge_back(src / name, dst / name)
        return
    if d is not None and os.path.samestat(s, d):
        return
    if d is not None:  # the link or copy made before the swap: the original replaces it
        if stat.S_ISDIR(d.st_mode):
            shutil.rmtree(dst)
        else:
            os.unlink(dst)
    os.rename(src, dst)


def _exchange(stage: Path, path: Path) -> None:
    """Swap the folders `stage` and `path`: in one step where the OS can (renameat2's
    RENAME_EXCHANGE, Linux); else `path` is renamed aside, `stage` into its place, and `path`
    back if that fails. Afterwards `path` holds what `stage` held, and `stage` the old folder."""
    if _renameat2(stage, path, _RENAME_EXCHANGE):
        return
    aside = stage.with_name(stage.name + ".old")
    os.rename(path, aside)
    try:
        os.rename(stage, path)
    except BaseException:
        os.rename(aside, path)
        raise
    os.rename(aside, stage)


# renameat2(2)'s flags (linux/fs.h) and AT_FDCWD (fcntl.h).
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


@functools.cache
def _libc_renameat2() -> Callable[..., int] | None:
    """The C library's renameat2 (glibc 2.28+), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    function.argtypes += [ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2(src, dst, flags): True when it was done, False where the OS or the file system
    lacks it (the caller then does it another way); any other failure is its OSError. The names
    go to the OS as its bytes (os.fsencode), whatever the locale."""
    function = _libc_renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), os.fspath(src), None, os.fspath(dst))


def _move_into_place(tmp: str, path: Path) -> None:
    """Rename `tmp` over `path` in one step; for a destination that was new when checked, link
    instead, which fails rather than replace a file that appeared meanwhile."""
    if os.path.abspath(path) not in _NEW:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
        _NEW.discard(os.path.abspath(path))
    except FileExistsError:
        raise OutputError(
            f"{shown(path)} appeared while this command worked; it was left as it is, and "
            "nothing was written"
        ) from None
    except OSError:  # a file system without hard links: the plain rename
        os.replace(tmp, path)


def _mode_for(path: Path) -> int:
    """The permissions of the file being replaced, or what a plain `open(path, "w")` would give
    (some writers create their files 0600, and a temp folder is private)."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable; not every file system lets a folder be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove_pending() -> None:
    """Remove the temp folders of every write under way (called by the signal handler)."""
    for tmpdir in list(_PENDING):
        shutil.rmtree(tmpdir, ignore_errors=True)
        _PENDING.discard(tmpdir)


# Every signal _on_signal took, in order: a writer library that catches the Interrupted raised
# inside its own code (h5py, in an HDF5 callback) and raises its own error instead still ends as
# that signal (atomic_write).
_RECEIVED: list[int] = []


def _on_signal(signum: int, _frame: object) -> None:
    _RECEIVED.append(signum)
    remove_pending()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Interrupted(signum)


def signal_received() -> int | None:
    """The last signal _on_signal took, if any: a library that caught the exception it raised
    (an import that fails with its own ImportError, an HDF5 callback) and raised its own error
    instead still ends the command as that signal (the CLI's main)."""
    return _RECEIVED[-1] if _RECEIVED else None


@contextlib.contextmanager
def signals_end_cleanly() -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise Interrupted (after removing pending temp folders)
    instead of killing the process on the spot, so that every `finally` runs; SIGINT raises
    KeyboardInterrupt as Python's own handler does, and is recorded like them. Only the main
    thread may set handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _RECEIVED.clear()  # one command's signals: signal_received() says nothing of an earlier one
    previous = {sig: signal.signal(sig, _on_signal) for sig in (*CAUGHT_SIGNALS, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
