"""`rosetta`'s entry: the parser of every command, and `main`, where every error a user can cause
becomes one line on stderr and an exit code (0 ok, 1 a parity or threshold failure, 2 bad
input), and where a closed standard output or error does not stop the work."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from transformer_rosetta.app.cli.args import EXIT_BAD_INPUT, Parser, UsageError
from transformer_rosetta.app.cli.convert import add_convert, add_export
from transformer_rosetta.app.cli.demo import add_demo
from transformer_rosetta.app.cli.embed import add_embed
from transformer_rosetta.app.cli.forward import add_forward
from transformer_rosetta.app.cli.generate import add_generate
from transformer_rosetta.app.cli.inspect import add_inspect
from transformer_rosetta.app.cli.parity import add_parity
from transformer_rosetta.app.cli.train import add_train
from transformer_rosetta.app.cli.translate import add_translate
from transformer_rosetta.errors import RosettaError
from transformer_rosetta.files.outputs import (
    Interrupted,
    shown,
    signal_received,
    signals_end_cleanly,
)

# Registers one command on the subparsers: its arguments and its run function.
AddCommand = Callable[[argparse._SubParsersAction], None]


def build_parser(extra: Sequence[AddCommand] = ()) -> argparse.ArgumentParser:
    """`rosetta` and its commands, in the order `rosetta --help` lists them. `extra` are the
    commands of the layers above the application (`bench`, from the benchmarks), which this
    package cannot import without a cycle; transformer_rosetta.cli passes them."""
    parser = Parser(
        prog="rosetta",
        description=(
            "Transformer Rosetta: one Transformer spec (the paper's encoder-decoder, and its "
            "decoder-only and encoder-only halves) in PyTorch, Keras 3/TensorFlow and Flax "
            "NNX/JAX, with a NumPy float64 oracle and one weight format."
        ),
        epilog="Exit codes: 0 ok, 1 a parity or threshold failure, 2 bad input.",
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=Parser)
    for add in (
        add_demo,
        add_train,
        add_translate,
        add_generate,
        add_parity,
        add_forward,
        add_embed,
        add_convert,
        add_export,
        add_inspect,
        *extra,
    ):
        add(sub)
    return parser


def command_names(parser: argparse.ArgumentParser) -> list[str]:
    """The commands of a parser build_parser made, in its order."""
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def main(argv: Sequence[str] | None = None, extra: Sequence[AddCommand] = ()) -> int:
    """Run one command. Every error a user can cause ends here as one line on stderr and exit
    2; a termination signal as one line and 128 + its number, after removing partial files."""
    _replace_closed_streams()
    for stream in (sys.stdout, sys.stderr):  # a name the terminal cannot encode is escaped
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    sys.stdout = _StdoutThatMayClose(sys.stdout)
    try:
        with signals_end_cleanly():
            parser = build_parser(extra)
            args = parser.parse_args(argv)
            if not hasattr(args, "run"):
                raise UsageError(
                    f"no command given; choose one of {', '.join(command_names(parser))} "
                    "(see 'rosetta --help')"
                )
            # Non-finite values are reported once, by name (see config_and_weights); numpy's
            # own RuntimeWarnings about NaN arithmetic would only add lines after that.
            with np.errstate(all="ignore"):
                code = args.run(args)
            sys.stdout.flush()  # a full disk or a closed pipe shows here, not after exit
            return code
    except RosettaError as exc:
        signum = signal_received()
        if signum is not None:  # the signal stopped the work first; this error is its aftermath
            return _stopped(signum)
        return _fail(str(exc))
    except MemoryError:
        return _fail("out of memory; try a smaller batch, length or model")
    except KeyboardInterrupt:
        return _stopped(signal.SIGINT)
    except Interrupted as exc:
        return _stopped(exc.signum)
    except Exception as exc:
        signum = signal_received()
        if signum is not None:  # a library turned our signal into its own error (an ImportError)
            return _stopped(signum)
        if not isinstance(exc, OSError):
            raise
        # e.g. stdout on a full disk, or a write that the system refused
        _silence_stdout()
        where = shown(exc.filename) if exc.filename else "to standard output"
        return _fail(f"cannot write {where}: {exc.strerror or exc}")
    finally:
        if isinstance(sys.stdout, _StdoutThatMayClose):
            sys.stdout = sys.stdout.stream


def _stopped(signum: int) -> int:
    """One line for a command a signal stopped, and the shell's exit code for it (128 + N)."""
    if signum == signal.SIGINT:
        print("rosetta: interrupted", file=sys.stderr)
        return 130
    print(
        f"rosetta: stopped by {signal.Signals(signum).name}; no partial file was left",
        file=sys.stderr,
    )
    return 128 + signum


MAX_MESSAGE_CHARS = 1000  # an error is one readable line, whatever the input it quotes


def _fail(message: str) -> int:
    text = shown(message or "failed")
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 40] + f"... ({len(text):,} characters in all)"
    with contextlib.suppress(OSError):  # stderr itself may be a full disk: the exit code stays
        print(f"rosetta: error: {text}", file=sys.stderr)
    return EXIT_BAD_INPUT


class _StdoutThatMayClose:
    """stdout, except that a reader who goes away (`rosetta train ... | head -1`) does not stop
    the work: the rest of the output goes to the null device, and the files are still written."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        _silence_stdout()
        self.stream = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _replace_closed_streams() -> None:
    """Python sets sys.stdout/sys.stderr to None when fd 1 or 2 was closed at start
    (`rosetta ... 2>&-`); write to the null device instead of failing on the first print."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the process


def _silence_stdout() -> None:
    """After stdout failed, point it at the null device so the interpreter's own flush at exit
    does not print a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
