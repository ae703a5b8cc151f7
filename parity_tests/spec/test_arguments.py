"""The one set of argument checks behind the API and the command line (common/spec/arguments.py),
at every edge of each rule: an integer's range is closed at both ends (the end itself taken, one
past it refused), a seed is 0 to 2**32 - 1 (JAX's uint32 keys: the widest every framework's
generator takes), a flag is a bool and nothing truthy, a choice is one of the names given, a path
is text. Each refusal is one line naming the argument as its caller spells it: InputTypeError (an
InputError and a TypeError) for a wrong type, InputError for a value out of range.

Expected values are the documented rules worked by hand, never the checks' own output."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import numpy as np
import pytest

from transformer_rosetta.errors import InputError, InputTypeError
from transformer_rosetta.spec import arguments as a


def refused(kind, call):
    """The error `call` raises, of exactly `kind` (an InputError that is no TypeError when
    InputError is asked for), its message one line."""
    with pytest.raises(InputError) as info:
        call()
    assert type(info.value) is kind, type(info.value)
    assert "\n" not in str(info.value)
    return str(info.value)


# -- check_int ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("minimum", "maximum", "taken", "out_of_range"),
    [
        (1, None, [1, 2, 10**30], [0, -1]),
        (None, 5, [5, 4, -(10**30)], [6, 10**30]),
        (0, 3, [0, 1, 3], [-1, 4]),
        (7, 7, [7], [6, 8]),
        (None, None, [0, -5, 2**70], []),
    ],
)
def test_an_integers_range_is_closed_at_both_ends(minimum, maximum, taken, out_of_range):
    for value in taken:
        got = a.check_int(value, "n", minimum=minimum, maximum=maximum)
        assert got == value and type(got) is int
    for value in out_of_range:
        message = refused(
            InputError, lambda v=value: a.check_int(v, "n", minimum=minimum, maximum=maximum)
        )
        assert message.startswith("n: must be ") and message.endswith(f", got {value}")


def test_an_integer_without_bounds_given_takes_any_integer():
    """The defaults leave both ends open: a negative count is the caller's to refuse (a shard
    size's check names its own rule, "a shard holds at least 1 byte")."""
    assert a.check_int(-(10**30), "n") == -(10**30)
    assert a.check_int(-1, "n", maximum=3) == -1
    assert a.check_int(10**30, "n", minimum=-1) == 10**30
    assert refused(InputTypeError, lambda: a.check_int(None, "n")) == (
        "n: must be an integer, got None"
    )


@pytest.mark.parametrize(
    ("minimum", "maximum", "wanted"),
    [
        (1, None, "an integer >= 1"),
        (None, 5, "an integer <= 5"),
        (0, 3, "an integer from 0 to 3"),
        (None, None, "an integer"),
    ],
)
def test_an_integers_message_says_its_range(minimum, maximum, wanted):
    message = refused(
        InputTypeError, lambda: a.check_int("3", "beam", minimum=minimum, maximum=maximum)
    )
    assert message == f"beam: must be {wanted}, got '3'"


def test_numpy_integers_are_integers_and_come_back_as_int():
    for value in (np.int8(3), np.uint64(3), np.int64(3)):
        got = a.check_int(value, "n", minimum=3, maximum=3)
        assert got == 3 and type(got) is int
    message = refused(InputError, lambda: a.check_int(np.int64(0), "n", minimum=1))
    assert message == "n: must be an integer >= 1, got 0"


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, 2.5, "1", None, [1], 1 + 0j])
def test_a_non_integer_is_a_type_error(value):
    message = refused(InputTypeError, lambda: a.check_int(value, "steps", minimum=0))
    assert message == f"steps: must be an integer >= 0, got {value!r}"
    assert isinstance(pytest.raises(TypeError, a.check_int, value, "steps").value, InputError)


# -- check_seed ---------------------------------------------------------------------------------


def test_a_seed_is_0_to_2_to_the_32_minus_1():
    assert a.SEED_MAX == 2**32 - 1
    for value in (0, 1, 2**31, 2**32 - 1, np.uint32(2**32 - 1)):
        assert a.check_seed(value) == int(value)
    for value in (-1, 2**32, 2**64):
        message = refused(InputError, lambda v=value: a.check_seed(v))
        assert message == f"seed: must be an integer from 0 to 4294967295, got {value}"
    assert refused(InputTypeError, lambda: a.check_seed(1.5, "--seed")).startswith("--seed: ")
    assert refused(InputTypeError, lambda: a.check_seed(True)).startswith("seed: ")


def test_the_command_lines_seed_is_the_apis():
    """--seed's option type reads the text and makes the same check (argparse puts the
    option's name in front: "argument --seed: must be ...")."""
    import argparse

    from transformer_rosetta.app.cli.args import seed_int

    assert seed_int("4294967295") == 2**32 - 1 and seed_int("0") == 0
    for text in ("4294967296", "-1"):
        with pytest.raises(argparse.ArgumentTypeError) as info:
            seed_int(text)
        assert str(info.value) == f"must be an integer from 0 to 4294967295, got {text}"


# -- check_flag ---------------------------------------------------------------------------------


def test_a_flag_is_a_bool():
    for value, want in ((True, True), (False, False), (np.bool_(True), True), (np.False_, False)):
        got = a.check_flag(value, "cached")
        assert got is want
    for value in (0, 1, "no", "", None, 1.0, [True]):
        assert refused(InputTypeError, lambda v=value: a.check_flag(v, "cached")) == (
            f"cached: must be True or False, got {value!r}"
        )


# -- check_choice, check_text -------------------------------------------------------------------


def test_a_choice_is_one_of_the_names_given():
    allowed = ("highest", "tf32")
    assert a.check_choice("tf32", "precision", allowed) == "tf32"
    assert a.check_choice("highest", "precision", allowed) == "highest"
    assert refused(InputError, lambda: a.check_choice("TF32", "precision", allowed)) == (
        "precision: unknown 'TF32'; allowed: highest, tf32"
    )
    # the names are those given this call, not another call's
    assert a.check_choice("b", "x", ["a", "b"]) == "b"
    assert refused(InputError, lambda: a.check_choice("tf32", "x", ["a", "b"])) == (
        "x: unknown 'tf32'; allowed: a, b"
    )
    assert refused(InputTypeError, lambda: a.check_choice(None, "precision", allowed)) == (
        "precision: must be one of highest, tf32, got None"
    )


def test_text_is_a_str():
    assert a.check_text("", "producer") == ""
    for value in (b"me", None, 3):
        assert refused(InputTypeError, lambda v=value: a.check_text(v, "producer")) == (
            f"producer: must be a string, got {value!r}"
        )


# -- check_path ---------------------------------------------------------------------------------


class BytesPath:
    """An os.PathLike whose path is bytes: os.fspath gives b'...'."""

    def __fspath__(self) -> bytes:
        return b"model.safetensors"


def test_a_path_is_text_or_a_pathlike_of_text():
    for value in ("m.safetensors", "", Path("m.safetensors"), PurePosixPath("x")):
        assert a.check_path(value, "path") is value
    for value in (None, 3, b"m.safetensors", ["m.safetensors"]):
        assert refused(InputTypeError, lambda v=value: a.check_path(v, "path")) == (
            f"path: must be a file name (a str or a pathlib.Path), got {value!r}"
        )
    assert isinstance(BytesPath(), os.PathLike)
    message = refused(InputTypeError, lambda: a.check_path(BytesPath(), "out"))
    assert message.startswith("out: must be a file name as text, got ")


# -- check_mapping, check_instance, check_callable ----------------------------------------------


def test_mappings_instances_and_callables():
    assert a.check_mapping({}, "weights") == {}
    assert refused(InputTypeError, lambda: a.check_mapping([("a", 1)], "weights")) == (
        "weights: must be a mapping (a dict), got [('a', 1)]"
    )
    assert refused(InputTypeError, lambda: a.check_mapping(None, "w", "tensors by name")) == (
        "w: must be tensors by name, got None"
    )
    assert a.check_instance(3, "n", int, "an int") == 3
    assert refused(InputTypeError, lambda: a.check_instance("3", "c", int, "a config")) == (
        "c: must be a config, got '3'"
    )
    assert a.check_callable(len, "start", "a factory") is len
    assert refused(InputTypeError, lambda: a.check_callable(3, "start", "a factory")) == (
        "start: must be a factory, got 3"
    )
