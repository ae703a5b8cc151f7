"""Where the repository's checkout is, for the tools that write its docs/ (docs.py, idioms.py,
rosetta_page.py, divergences.py).

Those tools read the implementations' source files and write docs/. An installed package has
neither (its files live in site-packages under other names), so the checkout is found from the
working directory, never from this file's location: the nearest directory, the working one or
above, whose pyproject.toml names this project."""

from __future__ import annotations

from pathlib import Path

from transformer_rosetta.errors import RosettaError

PROJECT_LINE = 'name = "transformer-rosetta"'


def find_checkout(start: Path | None = None) -> Path | None:
    """The checkout that holds `start` (default: the working directory), or None outside one."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file() and PROJECT_LINE in pyproject.read_text(errors="replace"):
            return folder
    return None


def checkout(start: Path | None = None) -> Path:
    """The checkout that holds `start`; a RosettaError naming the fix outside one."""
    found = find_checkout(start)
    if found is None:
        where = (start or Path.cwd()).resolve()
        raise RosettaError(
            f"{where} is not inside a checkout of transformer-rosetta: the docs tools read its "
            "source files and write its docs/, so run them from the repository"
        )
    return found


def checkout_or_cwd() -> Path:
    """For module-level default paths: the checkout when there is one, else the working directory
    (a tool's main() calls checkout() first, so it stops with the reason before any work)."""
    return find_checkout() or Path.cwd()
