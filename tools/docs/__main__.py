"""`python -m tools.docs [--check] [--measure [parity|divergences]]`, from the checkout: regenerate
every generated doc (build.py says which), or with `--check` exit 1 naming the stale ones. Exit 2
with one line when the checkout or the package it imports is not the right one."""

from __future__ import annotations

import sys

from tools.docs.checkout import CheckoutError, check


def main(argv: list[str]) -> int:
    # Checked before build.py imports the package: a wrong one would fail there with a traceback.
    try:
        check()
    except CheckoutError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from tools.docs.build import main as build
    from transformer_rosetta.errors import RosettaError

    try:
        return build(argv)
    except RosettaError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
