"""The checks of the values the public API takes, written once for the API and the command line.

The CLI's option types (app/cli/args.py: --seed, --max-shard-size) and every entry point of
`transformer_rosetta` (load, RosettaModel's methods, convert, parity, the searches, the weight
files' readers and writers) call the same functions, so that a value one refuses the other
refuses too, and refuses before any work. Each refusal names the argument as its caller spells
it ("seed" in the API, "--seed" on the command line) and is the project's own error: InputError
for a value outside its range, InputTypeError (an InputError that is also a TypeError, as
Python's own type errors are) for a value of the wrong type.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from transformer_rosetta.errors import InputError, InputTypeError
from transformer_rosetta.files.safe_read import brief

SEED_MAX = 2**32 - 1  # the widest seed every framework's generator takes (JAX keys are uint32)


def is_integer(value: Any) -> bool:
    """A Python or numpy integer that is not a bool (True is an int to Python, not a count)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(
    value: Any, name: str, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """`value` as an int once it is an integer within [minimum, maximum] (either end open when
    None); InputTypeError for a non-integer (a float, a string, None), InputError out of range."""
    if minimum is not None and maximum is not None:
        wanted = f"an integer from {minimum} to {maximum}"
    elif minimum is not None:
        wanted = f"an integer >= {minimum}"
    elif maximum is not None:
        wanted = f"an integer <= {maximum}"
    else:
        wanted = "an integer"
    if not is_integer(value):
        raise InputTypeError(f"{name}: must be {wanted}, got {brief(value)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise InputError(f"{name}: must be {wanted}, got {int(value)}")
    return int(value)


def check_seed(value: Any, name: str = "seed") -> int:
    """A seed, 0 to SEED_MAX: what --seed takes, and what every API function with a seed takes.
    numpy alone would take any non-negative integer, JAX's keys only 32 bits: one range for all."""
    return check_int(value, name, minimum=0, maximum=SEED_MAX)


def check_flag(value: Any, name: str) -> bool:
    """A bool (Python's or numpy's). "no" or 0 is refused: a truthy string would otherwise turn
    an option on silently."""
    if not isinstance(value, (bool, np.bool_)):
        raise InputTypeError(f"{name}: must be True or False, got {brief(value)}")
    return bool(value)


def check_choice(value: Any, name: str, allowed: Sequence[str]) -> str:
    """One of `allowed` (strings); InputTypeError for a non-string, InputError for another one."""
    if not isinstance(value, str):
        raise InputTypeError(f"{name}: must be one of {', '.join(allowed)}, got {brief(value)}")
    if value not in allowed:
        raise InputError(f"{name}: unknown {brief(value)}; allowed: {', '.join(allowed)}")
    return value


def check_text(value: Any, name: str) -> str:
    """A string (a name, a producer, a device request)."""
    if not isinstance(value, str):
        raise InputTypeError(f"{name}: must be a string, got {brief(value)}")
    return value


def check_path(value: Any, name: str) -> str | os.PathLike:
    """A file or folder name: a str or an os.PathLike (pathlib.Path). Its existence and kind are
    the reader's or the writer's checks; this one refuses None, a number or bytes, which the
    library calls below would meet as a bare TypeError (or, through str(), as a file "None")."""
    if not isinstance(value, (str, os.PathLike)):
        raise InputTypeError(
            f"{name}: must be a file name (a str or a pathlib.Path), got {brief(value)}"
        )
    if not isinstance(os.fspath(value), str):  # a PathLike of bytes
        raise InputTypeError(f"{name}: must be a file name as text, got {brief(value)}")
    return value


def check_mapping(value: Any, name: str, what: str = "a mapping (a dict)") -> Mapping:
    """A Mapping (a dict of names to values)."""
    if not isinstance(value, Mapping):
        raise InputTypeError(f"{name}: must be {what}, got {brief(value)}")
    return value


def check_instance(value: Any, name: str, kind: type, what: str) -> Any:
    """`value` when it is a `kind` (a TransformerConfig, say); InputTypeError naming `what`."""
    if not isinstance(value, kind):
        raise InputTypeError(f"{name}: must be {what}, got {brief(value)}")
    return value


def check_callable(value: Any, name: str, what: str) -> Any:
    """A function (a stepper factory, a progress callback)."""
    if not callable(value):
        raise InputTypeError(f"{name}: must be {what}, got {brief(value)}")
    return value
