"""What the command-line tests share: running `rosetta` in-process, and the check of a refusal
(one line on stderr, exit 2)."""

from __future__ import annotations

from transformer_rosetta.cli import main


def run(capsys, *argv: object) -> tuple[int, str, str]:
    """`rosetta ARGV...` in this process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, *needles: str) -> None:
    """A refusal: exit 2 and exactly one line, "rosetta: error: ...", holding every needle."""
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("rosetta: error: "), err
    for needle in needles:
        assert needle in err, err
