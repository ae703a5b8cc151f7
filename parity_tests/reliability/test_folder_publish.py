"""Folder destinations (docs/RELIABILITY.md, "Nothing is lost"), and file names in any locale.

A folder (`--to marian`, `--to llama`, `--max-shard-size`) is staged whole and replaces the old
one as a whole, the same rule as for files:
- one that was absent when checked and appears while the command works (another program, a
  second run) is left as it is, exit 2, one line: nothing of the other program's is deleted
  or replaced (issue 41, class 1: its model.safetensors was deleted as a "stale layout file",
  its config.json replaced, and both racing runs exited 0);
- an existing one is replaced with --force in one exchange of the two folders, never merged:
  no file of the old layout is left, the folder's other files (a README) are kept, and a swap
  that fails leaves the old folder whole;
- Ctrl-C during the move is held until the move is done (issue 42: SIGINT was not held there,
  and the signal tests sent only SIGTERM and SIGHUP at that moment).

And a non-ASCII destination in the C locale (class 8: a name Python holds surrogate-escaped,
which torch's zip reader cannot encode) is written, verified and read in every kind.

The other program is a hook that runs between the check and the move (`convert._stamp`, called
on the staged result just before it is published), or a real second `rosetta convert` process
that a first one waits for at that moment. Every model is a stored vector (numpy-only runs).
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import transformer_rosetta
from parity_tests.cli.command_line import one_line_error, run
from parity_tests.conftest import backend_or_skip
from parity_tests.paths import ROOT, VECTORS
from transformer_rosetta.files import outputs
from transformer_rosetta.weights.format import load_weights, save_weights

SHARDED = VECTORS / "pre_ln_untied.safetensors"  # 62,088 bytes: 20 KB shards make 4 and an index
OTHER = VECTORS / "post_ln_shared.safetensors"  # another model, for the second run
LLAMA = VECTORS / "llama_decoder_only.safetensors"
THEIRS = {"model.safetensors": b"the other program's weights", "config.json": b'{"theirs": 1}'}
README = b"a note the user keeps beside the model\n"
# The package the subprocesses import: this test's own (a checkout, or a layout on PYTHONPATH).
PACKAGE_ROOT = Path(transformer_rosetta.__file__).parent.parent
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
ENV["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(PACKAGE_ROOT), str(ROOT)]))


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by relative path, with its bytes."""
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def leftovers(folder: Path) -> list[str]:
    """Staging folders (or kept old folders) beside the destination."""
    return sorted(
        p.name for p in folder.iterdir() if p.name.startswith(".") or "replaced" in p.name
    )


def same_tensors(path: Path, source: Path, config: bool = True) -> bool:
    """Whether the model at `path` holds `source`'s tensors bit for bit (and its config)."""
    a, b = load_weights(path), load_weights(source)
    return (a.config == b.config or not config) and all(
        a.tensors[n].tobytes() == t.tobytes() for n, t in b.tensors.items()
    )


def marian_source(tmp_path: Path) -> Path:
    """A model MarianMTModel can hold: a stored post-norm vector with torch's LayerNorm eps."""
    wf = load_weights(VECTORS / "post_ln_tied_concat.safetensors")
    path = tmp_path / "marian_source.safetensors"
    save_weights(path, wf.tensors, wf.config.replace(layer_norm_eps=1e-5), producer="test")
    return path


def someone_writes(monkeypatch, folder: Path, files: dict[str, bytes]) -> None:
    """Another program writes `files` into `folder` between the check and the move: while the
    staged result is stamped, the last step before it is published."""
    import transformer_rosetta.porting.convert as convert

    real = convert._stamp

    def stamp(*args: object, **kwargs: object) -> None:
        folder.mkdir(exist_ok=True)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        real(*args, **kwargs)

    monkeypatch.setattr(convert, "_stamp", stamp)


# -- a folder that appears between the check and the move -----------------------------------


@pytest.mark.parametrize("kind", ["shards", "llama", "marian"])
def test_a_folder_that_appears_meanwhile_is_left_as_it_is(capsys, tmp_path, monkeypatch, kind):
    dst = tmp_path / "dst"
    source, option = {
        "shards": (SHARDED, ["--max-shard-size", "20KB"]),
        "llama": (LLAMA, ["--to", "llama"]),
        "marian": (marian_source(tmp_path), ["--to", "marian"]),
    }[kind]
    someone_writes(monkeypatch, dst, THEIRS)
    code, _, err = run(capsys, "convert", source, dst, *option, "--no-verify")
    one_line_error(code, err, f"{dst} appeared while this command worked", "nothing was written")
    assert contents(dst) == THEIRS  # byte for byte, and nothing of ours beside them
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", ["shards", "llama"])
def test_a_model_file_that_appears_in_an_existing_folder_is_left_as_it_is(
    capsys, tmp_path, monkeypatch, kind
):
    """The folder existed (empty) when checked; the other program writes a file the move would
    replace (config.json) or, for shards, drop as the old layout's (model.safetensors)."""
    dst = tmp_path / "dst"
    dst.mkdir()
    source, option, name = {
        "shards": (SHARDED, ["--max-shard-size", "20KB"], "model.safetensors"),
        "llama": (LLAMA, ["--to", "llama"], "config.json"),
    }[kind]
    someone_writes(monkeypatch, dst, {name: THEIRS[name]})
    code, _, err = run(capsys, "convert", source, dst, *option, "--no-verify")
    one_line_error(code, err, f"{dst / name} appeared while this command worked", f"{dst} was left")
    assert contents(dst) == {name: THEIRS[name]}
    assert leftovers(tmp_path) == []


A_RUN_THAT_WAITS = """
import os, sys, time
from pathlib import Path
import transformer_rosetta.porting.convert as convert
ready, dst = Path(os.environ["READY"]), Path(os.environ["DST"])
real = convert._stamp
def stamp(*args, **kwargs):
    ready.touch()  # checked, written and verified: the next step is the move into place
    deadline = time.monotonic() + 120
    while not dst.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return real(*args, **kwargs)
convert._stamp = stamp
from transformer_rosetta.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_two_runs_racing_to_one_new_folder_keep_the_first_whole(tmp_path):
    """Two real `rosetta convert` processes, no --force, one absent folder: the first checks it,
    writes and verifies its shards, and waits; the second runs whole meanwhile. The first must
    then exit 2 and leave the second one's model as it wrote it."""
    dst, ready = tmp_path / "dst", tmp_path / "ready"
    first = subprocess.Popen(
        [sys.executable, "-c", A_RUN_THAT_WAITS, "convert", str(SHARDED), str(dst),
         "--max-shard-size", "20KB"],
        env={**ENV, "READY": str(ready), "DST": str(dst)}, cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline, "the first run never reached its move"
        time.sleep(0.01)
    second = subprocess.run(
        [sys.executable, "-m", "transformer_rosetta", "convert", str(OTHER), str(dst),
         "--max-shard-size", "20KB"],
        env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr
    written = contents(dst)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 2, err
    lines = [line for line in err.splitlines() if line.startswith("rosetta:")]
    assert lines == [
        f"rosetta: error: {dst} appeared while this command worked; it was left as it is, and "
        "nothing was written"
    ], err
    assert contents(dst) == written  # the second run's shards, byte for byte
    assert same_tensors(dst, OTHER)
    assert leftovers(tmp_path) == []


# -- --force: the old folder replaced as a whole -------------------------------------------------


@pytest.fixture
def old_split(capsys, tmp_path) -> Path:
    """A folder holding an earlier split (1 KB shards: one per tensor or so, and an index), a
    README and a subfolder of the user's."""
    dst = tmp_path / "dst"
    code, _, err = run(capsys, "convert", OTHER, dst, "--max-shard-size", "1KB", "--no-verify")
    assert code == 0, err
    (dst / "README.md").write_bytes(README)
    (dst / "notes").mkdir()
    (dst / "notes" / "run.txt").write_bytes(README)
    return dst


def test_force_replaces_the_old_layout_whole_and_keeps_the_users_files(capsys, old_split):
    dst = old_split
    readme = (dst / "README.md").stat().st_ino
    code, _, err = run(capsys, "convert", SHARDED, dst, "--max-shard-size", "1MB", "--no-verify")
    one_line_error(code, err, "exists; pass --force to overwrite it")  # the old shards are ours
    code, _, err = run(
        capsys, "convert", SHARDED, dst, "--max-shard-size", "1MB", "--no-verify", "--force"
    )
    assert code == 0, err
    # No shard nor index of the old split: one model.safetensors, as a 1 MB limit writes it.
    assert sorted(os.listdir(dst)) == ["README.md", "model.safetensors", "notes"]
    assert same_tensors(dst, SHARDED)
    assert (dst / "README.md").read_bytes() == README and (dst / "notes" / "run.txt").exists()
    assert (dst / "README.md").stat().st_ino == readme  # the user's own file, not a copy
    assert leftovers(dst.parent) == []


def test_a_folder_that_holds_only_other_files_takes_the_model_without_force(capsys, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "README.md").write_bytes(README)
    code, _, err = run(capsys, "convert", LLAMA, dst, "--to", "llama", "--no-verify")
    assert code == 0, err
    assert sorted(os.listdir(dst)) == [
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert (dst / "README.md").read_bytes() == README


@pytest.mark.parametrize("how", ["exchange", "renames"])
def test_a_swap_that_fails_leaves_the_old_folder_whole(capsys, old_split, monkeypatch, how):
    """The one-step exchange refused (EBUSY, as for a mount point), or, where the OS has none,
    the rename of the new folder into place refused after the old one went aside: the old
    folder is back, every file as it was, and the command says why in one line."""
    dst = old_split
    before = contents(dst)
    real_rename, real_renameat2 = os.rename, outputs._renameat2

    def renameat2(src: Path, target: Path, flags: int) -> bool:
        if how == "renames":
            return False  # an OS without renameat2
        if flags == outputs._RENAME_EXCHANGE:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(src), None, str(target))
        return real_renameat2(src, target, flags)

    def rename(src: object, target: object, *args: object, **kwargs: object) -> None:
        if Path(target) == dst and not str(src).endswith(".old"):  # the new folder, not the old
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(src), None, str(target))
        real_rename(src, target, *args, **kwargs)

    monkeypatch.setattr(outputs, "_renameat2", renameat2)
    monkeypatch.setattr(os, "rename", rename)
    code, _, err = run(
        capsys, "convert", SHARDED, dst, "--max-shard-size", "1MB", "--no-verify", "--force"
    )
    one_line_error(code, err, f"cannot write {dst}: Device or resource busy")
    assert contents(dst) == before
    assert leftovers(dst.parent) == []


def test_the_swap_by_two_renames_replaces_the_folder_whole(capsys, old_split, monkeypatch):
    """Where the OS cannot exchange two folders in one step: the same result."""
    dst = old_split
    monkeypatch.setattr(outputs, "_renameat2", lambda *args: False)
    code, _, err = run(
        capsys, "convert", SHARDED, dst, "--max-shard-size", "1MB", "--no-verify", "--force"
    )
    assert code == 0, err
    assert sorted(os.listdir(dst)) == ["README.md", "model.safetensors", "notes"]
    assert same_tensors(dst, SHARDED) and (dst / "README.md").read_bytes() == README
    assert leftovers(dst.parent) == []


# -- Ctrl-C at the move into place ----------------------------------------------------------------

CTRL_C_AT_THE_MOVE = """
import os, signal, sys, time
from transformer_rosetta.files import outputs
dst, where = os.path.abspath(os.environ["DST"]), os.environ["WHERE"]
def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
if where == "file":  # as the staged file is renamed over DST
    real = outputs._move_into_place
    def move(tmp, path):
        if os.path.abspath(path) == dst:
            ctrl_c()
        return real(tmp, path)
    outputs._move_into_place = move
elif where == "exchange":  # as the two folders are exchanged
    real = outputs._exchange
    def exchange(stage, path):
        ctrl_c()
        return real(stage, path)
    outputs._exchange = exchange
elif where == "another thread":  # the same, the kernel handing it to another thread (a writer's)
    import threading
    # started here, before any signal is held: a thread inherits its creator's blocked signals
    other = threading.Thread(target=threading.Event().wait, args=(60,), daemon=True)
    other.start()
    real = outputs._exchange
    def exchange(stage, path):
        signal.pthread_kill(other.ident, signal.SIGINT)
        time.sleep(0.2)  # its handler has run by now: Python would act on it in this thread
        return real(stage, path)
    outputs._exchange = exchange
else:  # an OS without renameat2: after the old folder went aside, before the new one comes
    outputs._renameat2 = lambda *args: False
    real = os.rename
    def rename(src, target, *args, **kwargs):
        real(src, target, *args, **kwargs)
        if os.path.abspath(src) == dst:
            ctrl_c()
    os.rename = rename
from transformer_rosetta.cli import main
sys.exit(main(sys.argv[1:]))
"""


def interrupted_at_the_move(where: str, dst: Path, *argv: object) -> None:
    """`rosetta convert ARGV` with Ctrl-C pressed inside the move into place: the move is
    finished first (the signal is held), then the command ends as Ctrl-C, in one line."""
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_AT_THE_MOVE, "convert", *map(str, argv), "--force"],
        env={**ENV, "DST": str(dst), "WHERE": where}, cwd=dst.parent,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("rosetta:")] == [
        "rosetta: interrupted"
    ]


def test_ctrl_c_during_the_move_of_a_file_is_held_until_it_is_in_place(tmp_path):
    dst = tmp_path / "model.safetensors"
    dst.write_bytes(b"the previous file")
    interrupted_at_the_move("file", dst, SHARDED, dst)
    assert same_tensors(dst, SHARDED)  # the new file, whole: the move ran to its end
    assert "provenance" in load_weights(dst).metadata  # stamped, as a finished run leaves it
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


@pytest.mark.parametrize("where", ["exchange", "another thread", "renames"])
def test_ctrl_c_during_the_swap_of_a_folder_is_held_until_it_is_in_place(old_split, where):
    dst = old_split
    interrupted_at_the_move(where, dst, SHARDED, dst, "--max-shard-size", "1MB", "--no-verify")
    assert sorted(os.listdir(dst)) == ["README.md", "model.safetensors", "notes"]
    assert same_tensors(dst, SHARDED) and (dst / "README.md").read_bytes() == README
    assert leftovers(dst.parent) == []


# -- class 8: a non-ASCII destination in the C locale ---------------------------------------------


# Write (verified: the written file read back by its own runtime) and read again as a source,
# in one process, so that each framework is imported once.
WRITE_THEN_READ = """
import sys
from transformer_rosetta.cli import main
source, name, config, *option = sys.argv[1:]
code = main(["convert", source, name, *option])
given = ["--config", config] if name.endswith((".pt", ".weights.h5", ".msgpack")) else []
sys.exit(code or main(["convert", name, "back.safetensors", *given, "--no-verify"]))
"""


@pytest.mark.parametrize(
    ("name", "needs", "option"),
    [
        ("é.pt", "torch", []),
        ("é.safetensors", None, []),
        ("é.weights.h5", "tf", []),
        # Flax's verification reads the file with read_native, as the read back does; its
        # 20 s of compiling would add nothing here.
        ("é.msgpack", "jax", ["--no-verify"]),
        ("é_shards", None, ["--max-shard-size", "20KB"]),
        ("é_llama", "torch", ["--to", "llama"]),
    ],
)
def test_a_non_ascii_destination_in_the_c_locale_is_written_and_verified(
    tmp_path, name, needs, option
):
    """In the C locale (and no UTF-8 mode) Python holds the name's bytes surrogate-escaped; the
    written file is verified (read back by its framework, or by transformers), then read again
    as a source: both exit 0, and the tensors come back bit for bit."""
    if needs:
        backend_or_skip(needs)
    source = LLAMA if "llama" in name else OTHER
    env = {**ENV, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"}
    env.pop("PYTHONIOENCODING", None)
    config = tmp_path / "config.json"
    config.write_text(load_weights(source).config.to_json())
    done = subprocess.run(  # a relative name: its bytes go to the process as given
        [sys.executable, "-c", WRITE_THEN_READ, str(source), name, str(config), *option],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert ("not verified" if "--no-verify" in option else "verified: ") in done.stdout
    assert os.fsencode(name) in os.listdir(os.fsencode(tmp_path))
    # A Llama folder's import reads its own config (its pad token, say): the tensors are compared.
    assert same_tensors(tmp_path / "back.safetensors", source, config="llama" not in name)


# -- the steps themselves (files/outputs.py, files/os_names.py), in this process ------------------


def test_signals_are_held_inside_and_handled_after(tmp_path):
    """signals_held: SIGTERM, then Ctrl-C, sent inside the block run nothing there; once it
    ends, each goes to the handler it was meant for (SIGTERM's own, Python's KeyboardInterrupt
    for Ctrl-C). One at a time: of two held together, the first one handled ends the block."""
    seen: list[object] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: seen.append(signum))
    try:
        with outputs.signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # a signal not held has run its handler by now
            seen.append("the block ran to its end")
        assert seen == ["the block ran to its end", signal.SIGTERM]
        with pytest.raises(KeyboardInterrupt):
            with outputs.signals_held():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                seen.append("and again")
        assert seen[2:] == ["and again"]
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()  # nothing left blocked


def test_a_new_folder_is_never_renamed_over_one_that_appeared(tmp_path, monkeypatch):
    """_rename_new_folder onto a folder that appeared meanwhile, empty (the one a plain rename
    would replace without a word): OutputError, the folder there kept, the stage where it was;
    by renameat2's RENAME_NOREPLACE, and where the OS lacks it (the look first)."""
    for lacking in (False, True):
        stage, dst = tmp_path / f"stage{lacking}", tmp_path / f"dst{lacking}"
        stage.mkdir()
        (stage / "model.safetensors").write_bytes(b"ours")
        dst.mkdir()
        if lacking:
            monkeypatch.setattr(outputs, "_renameat2", lambda *args: False)
        with pytest.raises(outputs.OutputError, match="appeared while this command worked"):
            outputs._rename_new_folder(stage, dst)
        assert os.listdir(dst) == [] and os.listdir(stage) == ["model.safetensors"]
        other = tmp_path / f"new{lacking}"
        outputs._rename_new_folder(stage, other)  # nothing there: renamed
        assert not stage.exists() and os.listdir(other) == ["model.safetensors"]


@pytest.mark.parametrize("lacking", [False, True], ids=["renameat2", "two renames"])
def test_the_exchange_swaps_the_two_folders(tmp_path, monkeypatch, lacking):
    if lacking:
        monkeypatch.setattr(outputs, "_renameat2", lambda *args: False)
    stage, dst = tmp_path / "stage", tmp_path / "dst"
    stage.mkdir()
    dst.mkdir()
    (stage / "new").write_bytes(b"new")
    (dst / "old").write_bytes(b"old")
    outputs._exchange(stage, dst)
    assert contents(dst) == {"new": b"new"} and contents(stage) == {"old": b"old"}
    assert sorted(os.listdir(tmp_path)) == ["dst", "stage"]


def test_a_replaced_folder_keeps_its_permissions_and_its_other_files(tmp_path):
    """publish over an existing folder (mode 0o750, a README and a stale shard that `drops`
    names): the new folder has the old one's mode and README (the same file, linked), and
    neither the stale shard nor the old model."""
    dst = tmp_path / "dst"
    dst.mkdir()
    for name, data in {"README.md": README, "model.safetensors": b"old", "stale": b"x"}.items():
        (dst / name).write_bytes(data)
    readme = (dst / "README.md").stat().st_ino
    os.chmod(dst, 0o750)
    with outputs.staged(dst) as stage:
        stage.mkdir()
        (stage / "model.safetensors").write_bytes(b"new")
        outputs.publish(stage, dst, drops=lambda _path: ["stale"])
    assert contents(dst) == {"README.md": README, "model.safetensors": b"new"}
    assert (dst / "README.md").stat().st_ino == readme
    assert stat.S_IMODE(dst.stat().st_mode) == 0o750
    assert leftovers(tmp_path) == []


def test_a_library_gets_a_name_it_can_encode_for_the_same_file(tmp_path):
    """library_path: a UTF-8 name goes as it is; a name of bytes that are not UTF-8 (held
    surrogate-escaped) goes as /proc/self/fd/N, an open descriptor of the same file (or folder:
    its files are found under it), closed when the block ends; a name that cannot be opened goes
    as it is, for the library to report as missing."""
    from transformer_rosetta.files.os_names import is_utf8, library_path

    plain = tmp_path / "é.bin"
    plain.write_bytes(b"plain")
    raw = os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9")  # Latin-1's e-acute: not UTF-8
    assert is_utf8(plain) and not is_utf8(raw)
    with library_path(plain) as name:
        assert name == str(plain)
    Path(raw).write_bytes(b"latin-1")
    with library_path(raw) as name:
        assert name.startswith("/proc/self/fd/") and is_utf8(name)
        assert Path(name).read_bytes() == b"latin-1"
        fd = int(name.rsplit("/", 1)[1])
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
    folder = os.fsdecode(os.fsencode(tmp_path) + b"/dossier\xe9")
    os.mkdir(folder)
    Path(folder, "config.json").write_text("{}")
    with library_path(Path(folder)) as name:
        assert Path(name, "config.json").read_text() == "{}"
    missing = os.fsdecode(os.fsencode(tmp_path) + b"/absent\xe9")
    with library_path(missing) as name:
        assert name == missing
