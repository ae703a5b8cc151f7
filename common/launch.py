"""The `rosetta` console script. Importing the CLI takes a second or more (numpy, matplotlib, a
framework's registry); a Ctrl-C, SIGTERM or SIGHUP in that second arrives before
transformer_rosetta.cli can catch it. This entry point catches it, imports nothing heavy itself, and
then hands over."""

from __future__ import annotations

import contextlib
import os
import signal
import sys


def _stopped_while_starting(signum: int, _frame: object) -> None:
    name = signal.Signals(signum).name
    sys.stderr.write(f"rosetta: stopped by {name} while starting; nothing was written\n")
    raise SystemExit(128 + signum)


_interrupts: list[int] = []


def _interrupted_while_starting(signum: int, _frame: object) -> None:
    _interrupts.append(signum)
    raise KeyboardInterrupt


def main() -> int:
    """Install the start-up signal handlers, import the CLI, run it."""
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), _stopped_while_starting)
    signal.signal(signal.SIGINT, _interrupted_while_starting)
    try:
        from transformer_rosetta.cli import main as run
    except (KeyboardInterrupt, ImportError):
        # A Ctrl-C inside a C extension's import (numpy's) surfaces as its ImportError.
        if not _interrupts:
            raise
        sys.stderr.write("rosetta: interrupted while starting; nothing was written\n")
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    code = run()
    if code > 128:
        # A signal stopped the command, which has removed its partial files and said so. Leave
        # without the interpreter's teardown: a framework whose worker threads the signal left
        # mid-computation can crash in it (SIGSEGV), which would turn 128 + N into -11.
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
