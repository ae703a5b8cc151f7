"""What a wheel installs is what the repository holds: pyproject's explicit packages list names
every package folder, the wheel's only top-level package is transformer_rosetta, and mypy is
clean on the package as installed.

The whole round trip (sdist, wheel, a clean venv, the CLI run from outside the checkout) is
.ci/package; these are the checks fast enough for the test suite."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from parity_tests.conftest import import_or_skip
from parity_tests.installed_layout import (
    PACKAGE,
    ROOT,
    installed_layout,
    listed_packages,
    package_dirs,
    package_folders,
)


def test_the_packages_list_names_every_package_folder():
    # A folder with an __init__.py that the list lacks is left out of the wheel without a word
    # (the editable install finds it anyway); a listed name without a folder breaks the build.
    assert sorted(listed_packages()) == package_folders()


def test_every_package_dir_target_is_a_package_folder():
    dirs = package_dirs()
    assert PACKAGE in dirs
    for name, folder in dirs.items():
        assert name == PACKAGE or name.startswith(f"{PACKAGE}."), name
        assert (ROOT / folder / "__init__.py").is_file(), f"{name} -> {folder}/ has no __init__.py"
    assert (ROOT / dirs[PACKAGE] / "py.typed").is_file()


def test_the_wheel_installs_only_transformer_rosetta(tmp_path):
    """python -m build, as .ci/package runs it (sdist, then the wheel from the sdist, with the
    venv's setuptools): ~5 s. Its top level is one package, with py.typed and every folder."""
    import_or_skip("build", "the wheel check needs build (the test extra; .ci/install has it)")
    run = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (wheel,) = tmp_path.glob("*.whl")
    files = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in files if ".dist-info/" not in name}
    assert top == {PACKAGE}
    assert f"{PACKAGE}/py.typed" in files
    packages = {
        name[: -len("/__init__.py")].replace("/", ".")
        for name in files
        if name.endswith("/__init__.py")
    }
    assert packages == set(package_folders())


def test_mypy_is_clean_on_the_installed_package(tmp_path):
    """mypy (pyproject's [tool.mypy]) on transformer_rosetta as a wheel lays it out: mypy cannot
    follow setuptools' editable finder, so it reads the symlinked layout. The docs generator
    (tools/, run from a checkout, never installed) is checked beside it, as it imports the
    package. ~10 s with no cache."""
    import_or_skip("mypy", "the type check needs mypy (the test extra; .ci/install has it)")
    site = installed_layout(tmp_path / "site")
    (site / "tools").symlink_to(ROOT / "tools")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-error-summary",
            "-p",
            PACKAGE,
            "-p",
            "tools",
        ],
        capture_output=True,
        text=True,
        cwd=site,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


def test_mypy_is_not_blind(tmp_path):
    """The check bites: the same configuration, run the same way, reports a wrong type in a
    module of the package (so a clean run above is not mypy finding no files)."""
    import_or_skip("mypy", "the type check needs mypy (the test extra; .ci/install has it)")
    site = tmp_path / "site"
    (site / PACKAGE).mkdir(parents=True)
    (site / PACKAGE / "__init__.py").write_text("")
    (site / PACKAGE / "broken.py").write_text("def width() -> int:\n    return 'wide'\n")
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
        + ["--cache-dir", str(tmp_path / "cache"), "-p", PACKAGE],
        capture_output=True,
        text=True,
        cwd=site,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "broken.py:2: error: Incompatible return value type" in run.stdout


def test_ci_runs_the_packaging_smoke():
    """.ci/run calls .ci/package after the install (the wheel check above cannot see a module
    that imports but fails outside the checkout; the clean venv can)."""
    script = ROOT / ".ci" / "package"
    assert script.is_file() and script.stat().st_mode & 0o111, ".ci/package must be executable"
    assert "bash .ci/package" in (ROOT / ".ci" / "run").read_text()


def test_pre_commit_pins_the_constrained_ruff():
    """.pre-commit-config.yaml runs the ruff that constraints.txt pins, so the hook and CI agree."""
    pinned = next(
        line.split("==")[1].strip()
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.startswith("ruff==")
    )
    config = (ROOT / ".pre-commit-config.yaml").read_text()
    assert f"rev: v{pinned}" in config
    assert "id: ruff-check" in config and "id: ruff-format" in config
