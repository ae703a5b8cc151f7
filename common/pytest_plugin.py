"""The pytest plugin of transformer_rosetta (registered as a pytest11 entry point): test your own
port against the float64 oracle from a pytest suite.

- `--rosetta-device DEVICE`: auto (the default: the first GPU a framework sees, else the cpu),
  cpu, gpu or cuda (the first GPU), gpu:N or cuda:N (the N-th). Any other value is a usage error
  before any test runs.
- `rosetta_device` fixture: that request resolved to one device, "cpu" or "cuda:N" / "gpu:N"
  (spelled as requested; auto spells a GPU "cuda:N"). A GPU requested where none is visible
  skips the test with the reason, never passes it.
- `rosetta_reference` fixture: a factory, `rosetta_reference(weights, src=..., tgt=...,
  dtype=None, hidden_states=True)` -> transformer_rosetta.testing.reference_outputs(...), cached
  for the session per weight file (path, size and modification time) or tensors, and inputs.

Every pytest run in an environment that has the package installed loads this module, so it
imports nothing but pytest and the standard library at start-up: numpy, the oracle and any
framework are imported when a test first asks for a fixture.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import pytest

DEVICE_HELP = (
    "the device your port's tests run on: auto (the default: the first GPU a framework sees, "
    "else the cpu), cpu, gpu or cuda (the first GPU), gpu:N or cuda:N (the N-th)"
)
_DEVICE = re.compile(r"(auto|cpu|gpu|cuda)|(gpu|cuda):(\d+)")
# Which framework is asked for the GPUs it sees: one the tests imported already costs nothing.
_ASK_ORDER = (("torch", "torch"), ("jax", "jax"), ("tensorflow", "tf"))


def device_request(text: str) -> str:
    """An argparse type for --rosetta-device: the request when its form is known."""
    if _DEVICE.fullmatch(text):
        return text
    raise argparse.ArgumentTypeError(
        f"unknown device {text!r}; allowed: auto, cpu, gpu, cuda, gpu:N, cuda:N"
    )


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("transformer_rosetta", "transformer_rosetta: test your own port")
    group.addoption(
        "--rosetta-device",
        type=device_request,
        default="auto",
        metavar="DEVICE",
        help=DEVICE_HELP,
    )


def visible_gpus() -> tuple[list[str], str]:
    """(the GPUs a framework sees, in its own names, and which framework was asked). A framework
    the tests imported already is asked first; otherwise torch, jax, then TensorFlow, the first
    installed. No framework installed: no GPU, only the cpu."""
    from transformer_rosetta.adapter.backends import get_backend, unavailable_reason

    installed = [(m, b) for m, b in _ASK_ORDER if unavailable_reason(b) is None]
    installed.sort(key=lambda mb: mb[0] not in sys.modules)
    if not installed:
        return [], "no framework installed"
    _, name = installed[0]
    seen = get_backend(name).devices()
    return [d for d in seen if d.startswith(("cuda:", "gpu:"))], name


def resolve_device(request: str) -> str:
    """The one device `request` names, or pytest.skip saying which GPUs are visible."""
    if request == "cpu":
        return "cpu"
    gpus, asked = visible_gpus()
    if request == "auto":
        return "cuda:0" if gpus else "cpu"
    kind, _, index = request.partition(":")
    n = int(index or 0)
    if n >= len(gpus):
        pytest.skip(
            f"--rosetta-device {request}: no such GPU visible ({asked} sees "
            f"{', '.join(['cpu', *gpus])})"
        )
    return f"{kind}:{n}"


@pytest.fixture(scope="session")
def rosetta_device(pytestconfig: pytest.Config) -> str:
    """The device --rosetta-device names, resolved: "cpu", "cuda:N" or "gpu:N"."""
    return resolve_device(pytestconfig.getoption("rosetta_device"))


def _digest(arrays: Any) -> str:
    """A key for tensors or ids: names, dtypes, shapes and bytes (tiny models hash in
    microseconds; a base model's 250 MB in about a second, once per session)."""
    import numpy as np

    from transformer_rosetta.testing import host_array

    h = hashlib.sha256()
    items = arrays.items() if hasattr(arrays, "items") else [("", arrays)]
    for name, a in items:
        a = np.ascontiguousarray(host_array(a))
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _weights_key(weights: Any) -> tuple:
    if isinstance(weights, (str, os.PathLike)):
        path = os.path.realpath(weights)
        try:
            st = os.stat(path)
        except OSError:
            return ("path", path, None)  # reference_outputs reports it
        return ("path", path, st.st_size, st.st_mtime_ns)
    if hasattr(weights, "tensors") and hasattr(weights, "config"):  # a WeightFile
        return ("tensors", _digest(weights.tensors), weights.config.to_dict().__repr__())
    return ("tensors", _digest(weights))


@pytest.fixture(scope="session")
def rosetta_reference() -> Callable[..., dict]:
    """A factory: rosetta_reference(weights, src=None, tgt=None, *, config=None, dtype=None,
    hidden_states=True) gives transformer_rosetta.testing.reference_outputs(...), the float64
    oracle's outputs under canonical names, computed once per session for each weight file and
    inputs. Each call returns a fresh dict of read-only arrays."""
    cache: dict[tuple, Any] = {}

    def reference(
        weights: Any,
        src: Any = None,
        tgt: Any = None,
        *,
        config: Any = None,
        dtype: str | None = None,
        hidden_states: bool = True,
    ) -> dict:
        from transformer_rosetta.testing import ReferenceOutputs, reference_outputs

        config_key = None if config is None else repr(config.to_dict())
        key = (
            _weights_key(weights),
            None if src is None else _digest(src),
            None if tgt is None else _digest(tgt),
            config_key,
            dtype,
            hidden_states,
        )
        if key not in cache:
            out = reference_outputs(
                weights, src, tgt, config=config, dtype=dtype, hidden_states=hidden_states
            )
            for a in out.values():
                a.flags.writeable = False
            cache[key] = out
        hit = cache[key]
        return ReferenceOutputs(hit, hit.config, hit.dtype)

    return reference
