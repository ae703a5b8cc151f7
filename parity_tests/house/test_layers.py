"""The layering of docs/DESIGN.md holds: import-linter's contracts in pyproject.toml are kept, the
linter really catches a cycle, and every design note the code cites lives in the repository."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from parity_tests.installed_layout import installed_layout
from parity_tests.paths import ROOT

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONTRACTS = (
    "common/ is layered",
    "the entry points sit on top",
    "the testing API sits on top",
    "the framework-free core imports no framework",
    "each implementation is layered alike",
    "the three implementations are independent of each other",
    "an implementation builds on the core, never on the application",
    "no import cycles among the modules of any package",
)


def lint_imports(cwd: Path, config: Path, path: Path | None = None) -> subprocess.CompletedProcess:
    if not LINT_IMPORTS.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(config), "--no-cache", "--no-logo"],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={"PYTHONPATH": str(path or cwd), "PATH": "/usr/bin:/bin"},
    )


def test_every_layering_contract_is_kept(tmp_path):
    # import-linter walks the package's folder, so it reads the installed layout (the
    # implementations are subpackages of transformer_rosetta there, not folders of common/).
    result = lint_imports(tmp_path, ROOT / "pyproject.toml", installed_layout(tmp_path / "site"))
    assert result.returncode == 0, result.stdout + result.stderr
    # Each contract was checked, not skipped: its name is printed with KEPT.
    printed = " ".join(result.stdout.split())
    for name in CONTRACTS:
        assert f"{name}" in printed, name
    assert printed.count(" KEPT") == len(CONTRACTS)


def test_the_linter_catches_a_cycle_and_a_layer_inversion(tmp_path):
    """The check bites: a package with the two faults this project had (cli <-> cli_train, and
    a lower layer importing a higher one) fails both contracts."""
    pkg = tmp_path / "demo_pkg"
    for sub in ("", "low", "high"):
        (pkg / sub).mkdir(exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "high" / "cli.py").write_text("from demo_pkg.high import cli_train\n")
    (pkg / "high" / "cli_train.py").write_text("from demo_pkg.high import cli\n")
    (pkg / "low" / "core.py").write_text("from demo_pkg.high import cli\n")
    config = tmp_path / "contracts.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["demo_pkg"]\n\n'
        '[[tool.importlinter.contracts]]\nname = "layers"\ntype = "layers"\n'
        'layers = ["demo_pkg.high", "demo_pkg.low"]\n\n'
        '[[tool.importlinter.contracts]]\nname = "acyclic"\ntype = "acyclic_siblings"\n'
        'ancestors = ["demo_pkg"]\n'
    )
    result = lint_imports(tmp_path, config)
    assert result.returncode == 1, result.stdout + result.stderr
    printed = " ".join(result.stdout.split())
    assert "layers BROKEN" in printed and "acyclic BROKEN" in printed, printed


# A citation of a design note in code or a comment: a docs/ path, or a bare note name ending .md.
CITATION = re.compile(r"\b(?:docs/)?([A-Za-z_]+\.md)\b")


def cited_notes() -> list[tuple[str, str]]:
    cited = []
    folders = ("common", "torch_impl", "tf_impl", "jax_impl", "benchmarks", "parity_tests", "tools")
    for package in folders:
        for path in sorted((ROOT / package).rglob("*.py")):
            for note in CITATION.findall(path.read_text()):
                cited.append((str(path.relative_to(ROOT)), note))
    return cited


def test_every_design_note_the_code_cites_is_in_docs():
    notes = cited_notes()
    assert ("tools/docs/build.py", "FORMAT.md") in notes  # the scan finds citations at all
    missing = [
        (where, note)
        for where, note in notes
        if not (ROOT / note).is_file()
        and not (ROOT / "docs" / note).is_file()  # README, CONTRIBUTING
    ]
    assert missing == [], f"cited but not in docs/: {missing}"
