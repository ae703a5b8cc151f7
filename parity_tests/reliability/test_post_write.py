"""Work after the write (docs/RELIABILITY.md, "Work after the write"): a file that a command
checks after writing it (`convert` and `export` verify it, then stamp its provenance) is staged
beside the destination and moved into place last. A signal at any moment of that work leaves
the destination as it was: no new file, no partial file, and an older file kept, --force or not.

The signals are real, sent to a real `rosetta` process while it verifies, the moment it says so
("verifying: ..." on stderr). Verification there lasts seconds (measured on 2 cores: a Flax
float64 model compiles its first forward, ~13 s; Keras ~3 s; onnxruntime is imported, ~2 s), so
a signal sent 0.2 s after the line lands inside it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity_tests.conftest import backend_or_skip
from parity_tests.paths import ROOT, VECTORS

VECTOR = VECTORS / "post_ln_shared.safetensors"
ROSETTA = [sys.executable, "-m", "transformer_rosetta"]
OLD = b"an older file, which must survive"


def stop_while_verifying(argv: list[str], sig: int, cwd: Path) -> subprocess.CompletedProcess:
    """Run `rosetta ARGV`, send `sig` 0.2 s after it reports that it is verifying, and return the
    finished process (its stderr after that line)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
    root = ROOT
    proc = subprocess.Popen(
        [*ROSETTA, *argv], cwd=cwd, env={**env, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "verifying:" in line:
            break
    else:
        proc.wait()
        pytest.fail(f"never verified: {''.join(seen)[-2000:]}")
    time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def ours(stderr: str) -> list[str]:
    """The lines rosetta wrote (TensorFlow's C++ logging may add its own before them)."""
    return [line for line in stderr.splitlines() if line.startswith("rosetta:")]


def assert_stopped(done: subprocess.CompletedProcess, sig: int) -> None:
    assert done.returncode == (130 if sig == signal.SIGINT else 128 + sig), done.stderr
    assert "Traceback" not in done.stderr
    (line,) = ours(done.stderr)
    assert done.stderr.rstrip().endswith(line)
    want = "rosetta: interrupted" if sig == signal.SIGINT else f"rosetta: stopped by {sig.name};"
    assert line.startswith(want), line


@pytest.mark.parametrize(
    ("sig", "name", "framework"),
    [(signal.SIGTERM, "old.msgpack", "jax"), (signal.SIGINT, "old.weights.h5", "tf")],
    ids=["SIGTERM-flax", "SIGINT-keras"],
)
def test_a_signal_during_verification_keeps_the_old_file(tmp_path, sig, name, framework):
    backend_or_skip(framework)
    old = tmp_path / name
    old.write_bytes(OLD)
    done = stop_while_verifying(["convert", str(VECTOR), str(old), "--force"], sig, tmp_path)
    assert_stopped(done, sig)
    assert old.read_bytes() == OLD  # untouched: the new file was never moved into place
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # and no staging folder left


# The export's verification imports onnxruntime, whose module initialisation catches the
# exception a signal handler raises inside it and raises `ImportError: initialization failed`
# instead (a fresh hostile run: a 30-line traceback, exit 1, the old file gone). Its window is
# too short to hit by timing, so this process's verification raises the signal itself and turns
# it into that ImportError, as onnxruntime's import did.
SIGNAL_INSIDE_AN_IMPORT = """
import os, signal, sys
import transformer_rosetta.porting.convert as convert
def verification(*args, **kwargs):
    try:
        os.kill(os.getpid(), signal.SIGHUP)
    except BaseException as exc:
        raise ImportError("initialization failed") from exc
    raise AssertionError("the signal handler did not run")
convert.run_verification = verification
from transformer_rosetta.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_signal_that_a_library_turns_into_its_own_error_still_ends_as_that_signal(tmp_path):
    backend_or_skip("torch")
    backend_or_skip("onnx")
    old = tmp_path / "old.onnx"
    old.write_bytes(OLD)
    root = ROOT
    done = subprocess.run(
        [sys.executable, "-c", SIGNAL_INSIDE_AN_IMPORT, "export", str(VECTOR), str(old), "--force"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert_stopped(done, signal.SIGHUP)
    assert old.read_bytes() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.onnx"]


def test_a_signal_during_verification_writes_no_new_file(tmp_path):
    backend_or_skip("jax")
    new = tmp_path / "new.msgpack"
    done = stop_while_verifying(["convert", str(VECTOR), str(new)], signal.SIGTERM, tmp_path)
    assert_stopped(done, signal.SIGTERM)
    assert list(tmp_path.iterdir()) == []
