"""Shared fixtures: the backends to test, each skipped with its reason when it cannot run here."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before anything imports TensorFlow

import pytest  # noqa: E402

from common.adapter.backends import FRAMEWORKS, get_backend, unavailable_reason  # noqa: E402

IMPLEMENTATIONS = [name for name in FRAMEWORKS if name != "numpy"]


def backend_or_skip(name: str):
    reason = unavailable_reason(name)
    if reason is not None:
        pytest.skip(f"backend {name}: {reason}")
    return get_backend(name)


@pytest.fixture(params=IMPLEMENTATIONS)
def backend(request):
    """Each framework implementation (not the oracle)."""
    return backend_or_skip(request.param)


@pytest.fixture(params=list(FRAMEWORKS))
def any_backend(request):
    """Every backend, the oracle included."""
    return backend_or_skip(request.param)
