"""What a missing part of the test set-up does: a skip that says why on a user's machine, a
failure in CI (CI=true), where .ci/install installs everything and a skip would hide that the
real-weights tests (all-MiniLM-L6-v2) or a framework's tests stopped running."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from parity_tests import conftest
from parity_tests.paths import ROOT

MISSING = "no_such_module_for_rosetta_tests"


@pytest.mark.parametrize(
    ("ci", "outcome"), [(False, pytest.skip.Exception), (True, pytest.fail.Exception)]
)
def test_a_missing_setup_part_skips_outside_ci_and_fails_in_ci(monkeypatch, ci, outcome):
    monkeypatch.setattr(conftest, "IN_CI", ci)
    with pytest.raises(outcome, match=f"{MISSING} is missing"):
        conftest.setup_missing(f"{MISSING} is missing")
    with pytest.raises(outcome, match="the reason given"):
        conftest.import_or_skip(MISSING, "the reason given")
    assert conftest.import_or_skip("json", "never") is __import__("json")


@pytest.mark.parametrize(("ci", "want"), [("", "1 skipped"), ("true", "1 failed")])
def test_a_whole_run_reports_it_that_way(tmp_path, ci, want):
    """A test file that needs an absent module, run by pytest with and without CI=true."""
    (tmp_path / "test_needs.py").write_text(
        textwrap.dedent(f"""
        from parity_tests.conftest import import_or_skip

        def test_needs():
            import_or_skip("{MISSING}", "needs {MISSING}")
        """)
    )
    env = {**__import__("os").environ, "CI": ci}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            "-o",
            "addopts=",
            str(tmp_path / "test_needs.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=conftest.__file__.rsplit("/parity_tests", 1)[0],
    )
    assert want in run.stdout, run.stdout[-2000:]


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        ({}, ["bogus"], "usage: bash .ci/gpu [tests] [keras] [parity] [bench]  (unknown: bogus)"),
        ({"TIER_SECONDS": "8m"}, [], "TIER_SECONDS=8m: not a whole number of seconds"),
    ],
)
def test_the_gpu_tier_refuses_bad_input_in_one_line_before_any_work(tmp_path, env, args, message):
    """.ci/gpu checks its groups and its time budget before it installs, probes or runs anything
    (nothing is written under OUT)."""
    out = tmp_path / "out"
    run = subprocess.run(
        ["bash", str(ROOT / ".ci" / "gpu"), *args],
        env={"PATH": "/usr/bin:/bin", "OUT": str(out), "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (run.returncode, run.stdout, run.stderr) == (2, "", message + "\n")
    assert not out.exists()
