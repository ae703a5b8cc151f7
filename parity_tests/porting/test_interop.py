"""Porting reaches a framework by declared routes only: what it asks of a backend beyond
`Backend` is a protocol of the adapter (TensorReader, OnnxExporter, NativeBackend) with a typed
accessor, and transformers' own models run in one module, common/porting/transformers_models.py,
which the import contract names as the framework-free core's one exception and which nothing
imports until a verification runs one."""

from __future__ import annotations

import subprocess
import sys

import pytest
import tomllib

from parity_tests.conftest import backend_or_skip
from parity_tests.paths import ROOT
from transformer_rosetta.adapter import backends
from transformer_rosetta.errors import BackendUnavailable, WeightFileError
from transformer_rosetta.porting.sources import read_source_tensors

INTEROP = "transformer_rosetta.porting.transformers_models"


def test_porting_imports_no_framework():
    code = (
        "import sys, transformer_rosetta.porting.verify, transformer_rosetta.porting.convert, "
        "transformer_rosetta.porting.hf_folder, transformer_rosetta.porting.marian_export; "
        "print(sorted(m for m in ('torch', 'transformers', 'tensorflow', 'jax') if m in "
        "sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_contract_names_one_exception():
    """The framework-free core's contract forbids transformers too, and excuses the interop
    module alone, for torch and transformers."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [
        c
        for c in config["tool"]["importlinter"]["contracts"]
        if c["name"].startswith("the framework-free core imports no framework")
    ]
    assert {"torch", "transformers"} <= set(contract["forbidden_modules"])
    assert sorted(contract["ignore_imports"]) == [
        f"{INTEROP} -> torch",
        f"{INTEROP} -> transformers",
    ]


class Bare:
    """A backend that offers nothing beyond its name."""

    name = "torch"


def test_a_backend_without_the_capability_is_refused_by_name(monkeypatch, tmp_path):
    monkeypatch.setitem(backends._INSTANCES, "torch", Bare())
    with pytest.raises(BackendUnavailable, match="torch: reads no outside .pt/.bin checkpoint"):
        backends.tensor_reader()
    with pytest.raises(BackendUnavailable, match="torch: exports no ONNX graph"):
        backends.onnx_exporter()
    with pytest.raises(BackendUnavailable, match="torch: reads and writes no native checkpoint"):
        backends.native_backend("torch")
    path = tmp_path / "model.pt"
    path.write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(WeightFileError, match="reading a torch file needs torch") as err:
        read_source_tensors(path)
    assert "\n" not in str(err.value)


def test_the_torch_backend_offers_what_porting_asks():
    torch_backend = backend_or_skip("torch")
    assert isinstance(torch_backend, backends.TensorReader)
    assert isinstance(torch_backend, backends.OnnxExporter)
    assert isinstance(torch_backend, backends.NativeBackend)
    assert backends.tensor_reader() is torch_backend
    assert backends.native_backend("torch") is torch_backend
