"""The checkout that the docs tools read and write: the folder that holds tools/.

tools/ is never installed (pyproject's packages list leaves it out), so this file's own location
names the checkout. The tools read the implementations' source files there and write its docs/;
the tables they print come from the code of the `transformer_rosetta` they import, so that must
be the same checkout's common/ (an editable install), or the pages would describe other code
than the one they cite. `check()` says which of the two is wrong, in one line, before any work.
This module imports nothing of the package, so the check runs even when the package that would
be imported is another one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT_LINE = 'name = "transformer-rosetta"'
FIX = "pip install -e . in the checkout, then run python -m tools.docs from it"


class CheckoutError(Exception):
    """The tools run where they cannot read or describe one checkout; the message says why."""


def check(root: Path = ROOT) -> Path:
    """`root` if it is a checkout of this project whose common/ is the `transformer_rosetta` that
    Python imports; CheckoutError naming what is wrong otherwise."""
    pyproject = root / "pyproject.toml"
    if not (pyproject.is_file() and PROJECT_LINE in pyproject.read_text(errors="replace")):
        raise CheckoutError(
            f"{root} is not a checkout of transformer-rosetta: the docs tools read its source "
            "files and write its docs/, so run them from the repository (python -m tools.docs)"
        )
    spec = importlib.util.find_spec("transformer_rosetta")
    origin = spec.origin if spec is not None else None
    package = Path(origin).resolve().parent if origin else None
    if package != (root / "common").resolve():
        raise CheckoutError(
            f"transformer_rosetta is imported from {package or 'nowhere'}, not from {root}/common: "
            f"the docs would describe other code than this checkout's ({FIX})"
        )
    return root
