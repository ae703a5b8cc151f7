"""The house rules that a linter can check: ruff is clean over the whole tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parity_tests.paths import ROOT


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    result = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_common_imports_no_deep_learning_framework():
    code = (
        "import sys, transformer_rosetta.app.cli.main, transformer_rosetta.oracle.reference, transformer_rosetta.weights.format, transformer_rosetta.adapter.backends, tools.docs.build; "
        "print(sorted(m for m in ('torch', 'tensorflow', 'jax', 'flax', 'keras') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
