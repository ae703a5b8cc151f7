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
- SIGTERM, SIGHUP and SIGINT during a write remove the temp folder before the process exits
  (SIGKILL cannot be caught: its `.NAME.*.partial` folder stays, and nothing ever reads it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

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
    held = set(CAUGHT_SIGNALS) | {signal.SIGINT}
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        tmpdir = tempfile.mkdtemp(prefix=_temp_prefix(name), suffix=".partial", dir=folder)
        _PENDING.add(tmpdir)
    finally:
        if in_main:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
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
) -> Path:
    """The checks made before any work whose result goes to `path`; returns the path to write
    (a link is followed, as `cp` follows one). `inputs` are the files the command reads: none of
    them may be the destination, even with --force."""
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
            raise OutputError(f"{what}: {shown(path)} exists; pass --force to overwrite it")
        for source in given:
            if _same_file(path, Path(source)):
                raise OutputError(
                    f"{what}: {shown(path)} is also an input of this command; refusing to "
                    "overwrite what it reads (--force does not apply)"
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
) -> Path:
    """The checks for a command that writes `names` into `folder` (made if absent): the folder,
    or its nearest existing ancestor, must be a folder we can write in, and each file is checked
    as check_output_file checks one. Nothing is created here."""
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
        return folder
    if not stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{what}: {shown(folder)} exists and is not a folder")
    for name in names:
        check_output_file(folder / name, what=what, force=force, inputs=inputs)
    check_free_space(folder, needed, what)
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


def publish(stage: Path, path: Path) -> None:
    """Move a staged file into place in one step (as atomic_write does), or a staged folder's
    files: the folder itself when `path` does not exist yet, else file by file over the ones of
    the same name (each rename whole). The catchable signals are held while it runs, so that a
    signal lands before it (nothing replaced) or after it (all replaced)."""
    held = set(CAUGHT_SIGNALS) | {signal.SIGINT}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        if stage.is_dir():
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                os.rename(stage, path)
                _NEW.discard(os.path.abspath(path))
            else:
                for item in sorted(stage.iterdir()):
                    os.chmod(item, _mode_for(path / item.name))
                    os.replace(item, path / item.name)
                _fsync_folder(path)
        else:
            os.chmod(stage, _mode_for(path))
            _move_into_place(str(stage), path)
        _fsync_folder(path.parent if str(path.parent) else Path("."))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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
