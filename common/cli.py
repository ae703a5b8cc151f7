"""The whole `rosetta` command line: the application's commands (transformer_rosetta.app.cli) and
`rosetta bench` (transformer_rosetta.benchmarks.command). The benchmarks build on the application
(its argument types, tasks and device resolution), so the application cannot import them back;
this module, above both, joins them."""

from __future__ import annotations

from collections.abc import Sequence

from transformer_rosetta.app.cli.main import main as run_commands
from transformer_rosetta.benchmarks.command import add_bench


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `rosetta` command (argv without the program name; default: sys.argv[1:])."""
    return run_commands(argv, extra=(add_bench,))
