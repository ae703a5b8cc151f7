"""The installed package's layout, assembled from the repository's folders with symlinks.

pyproject.toml maps common/ to `transformer_rosetta` and each implementation folder to a
subpackage of it. An editable install imports through setuptools' finder, but tools that walk
the package's folder (import-linter's graph, a listing of the wheel's packages) see only common/.
This builds the tree a wheel installs, so they see what a user gets."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "transformer_rosetta"


def package_dirs() -> dict[str, str]:
    """pyproject's package-dir: installed package name -> repository folder."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return dict(setuptools["package-dir"])


def listed_packages() -> list[str]:
    return list(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )


def installed_layout(dest: Path) -> Path:
    """Make dest/transformer_rosetta/ as a wheel lays it out; returns dest (for PYTHONPATH)."""
    dirs = package_dirs()
    top = dest / PACKAGE
    top.mkdir(parents=True)
    for entry in (ROOT / dirs[PACKAGE]).iterdir():
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for name, folder in dirs.items():
        if name != PACKAGE:
            (dest / name.replace(".", "/")).symlink_to(ROOT / folder)
    return dest


def package_folders() -> list[str]:
    """Every package the repository's mapped folders hold, under its installed name."""
    found = []
    for name, folder in package_dirs().items():
        base = ROOT / folder
        for init in sorted(base.rglob("__init__.py")):
            rel = init.parent.relative_to(base)
            if "__pycache__" in rel.parts:
                continue
            sub = [name, *rel.parts] if rel.parts else [name]
            dotted = ".".join(sub)
            # A folder that another mapping owns is listed under that mapping's name.
            if any(dotted == other.replace(PACKAGE, name, 1) for other in ()):
                continue
            found.append(dotted)
    return sorted(set(found))
