"""The errors a user can cause. The CLI turns each into one line and exit code 2."""

from __future__ import annotations


class RosettaError(Exception):
    """Base for every user-facing error: bad config, bad weights, bad inputs, missing framework."""


class ConfigError(RosettaError, ValueError):
    """A config that breaks the spec. `problems` lists each one as 'field: what is wrong'."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            super().__init__(f"invalid config: {self.problems[0]}")
        else:
            super().__init__("invalid config: " + "; ".join(self.problems))


class WeightFileError(RosettaError, ValueError):
    """A weight file that cannot be used. `problems` holds every problem found, not just the first."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = str(path)
        self.problems = list(problems)
        joined = "; ".join(self.problems)
        super().__init__(f"{self.path}: {joined}")


class InputError(RosettaError, ValueError):
    """Token ids that the model cannot take (wrong rank, dtype, range, batch or length), or an
    argument out of its range; the message names the argument."""


class InputTypeError(InputError, TypeError):
    """An argument of the wrong Python type (None for a path, a string for a seed). It is an
    InputError, so the CLI prints it in one line like any other, and a TypeError, as Python's own
    type errors are, so that `except TypeError` still catches it; the message names the
    argument."""


class BackendUnavailable(RosettaError, ImportError):
    """A framework backend that cannot run here; the message says why and how to install it."""
