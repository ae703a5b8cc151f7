"""Parity on every device a framework sees, CPU against GPU, and proof that TF32 is off.

Each test is parametrised over a device slot: "cpu" (always there) and "gpu" (every accelerator
the backend's devices() lists: "cuda:N" for torch, "gpu:N" for Keras and JAX). The slot is
resolved when the test runs, so collection imports no framework; with no GPU the "gpu" variants
are skipped with "no GPU visible to <framework>", never passed silently.

TF32 (10 explicit mantissa bits, unit roundoff 2^-11 = 4.9e-4) is what Ampere and later GPUs use
for float32 matmuls unless told not to; it would move float32 results by ~1e-3 and break the
1e-5 bound. docs/DESIGN.md ("Devices") turns it off everywhere. Two kinds of test hold that in place:
- the switch each model runs its calls under (its precision.matmul_precision), read from inside a
  forward on any machine: impl/test_precision.py;
- on a GPU, a 1024 x 1024 float32 matmul of standard normals, which must match the float64
  product of the same float32 numbers to 1e-5 normwise relative error. float32 accumulation gives
  3.0e-7 there and TF32-rounded operands 2.9e-4 (measured on the CPU by
  test_the_tf32_detector_has_teeth), so the check misses each by more than an order of magnitude.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from parity_tests.conftest import IMPLEMENTATIONS, backend_or_skip
from parity_tests.grid import FULL_GRID, input_cases
from parity_tests.paths import VECTORS
from parity_tests.vectors.make_vectors import VECTOR_CONFIGS
from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.dtypes import numpy_dtype
from transformer_rosetta.spec.tolerances import atol_for
from transformer_rosetta.weights.format import load_weights
from transformer_rosetta.weights.init import init_weights

GRID_CONFIG = "post-relu-sin-interleaved-untied-bias"
CASES = [f"vector:{name}" for name in VECTOR_CONFIGS] + [f"grid:{GRID_CONFIG}"]
SLOTS = ("cpu", "gpu")
MATMUL_SIZE = 1024
MATMUL_RTOL = 1e-5  # normwise; float32 gives 3.0e-7 at this size, TF32 2.9e-4


def devices_or_skip(backend, slot: str) -> list[str]:
    """The devices of `backend` in `slot`; skips, naming the framework, when there are none."""
    if slot == "cpu":
        return ["cpu"]
    found = [d for d in backend.devices() if d != "cpu"]
    if not found:
        pytest.skip(f"no GPU visible to {backend.name} (it sees: {', '.join(backend.devices())})")
    return found


def build_or_skip(backend, config, weights, dtype: str, device: str):
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} does not compute in {dtype}")
    if device == "mps" and dtype == "float64":
        pytest.skip("Apple's MPS has no float64")
    return backend.build(config, weights, dtype=dtype, device=device)


def case_inputs(case: str):
    """(config, float64 weights, src, tgt_in) for a stored vector or the grid config."""
    kind, _, name = case.partition(":")
    if kind == "vector":
        stored = load_weights(VECTORS / f"{name}.safetensors")
        with np.load(VECTORS / f"{name}.npz", allow_pickle=False) as npz:
            # A half of the family stores only the input it takes.
            src, tgt_in = (npz[k] if k in npz else None for k in ("src", "tgt_in"))
        return stored.config, stored.tensors, src, tgt_in
    config = FULL_GRID[name]
    src, tgt_in = input_cases(config)["ragged"]
    return config, init_weights(config, seed=0, scheme="perturbed", dtype="float64"), src, tgt_in


def compare(got: dict[str, np.ndarray], want: dict[str, np.ndarray], atol: float, where: str):
    """Every output `got` has, against the same name in `want`, within `atol`."""
    for name, value in got.items():
        value, ref = np.asarray(value, np.float64), np.asarray(want[name], np.float64)
        assert value.shape == ref.shape, f"{name}: shape {value.shape} != {ref.shape} ({where})"
        assert np.all(np.isfinite(value)), f"{name}: non-finite values ({where})"
        diff = float(np.max(np.abs(value - ref))) if value.size else 0.0
        assert diff <= atol, f"{name} off by {diff:.3g} > {atol:g} ({where})"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("slot", SLOTS)
@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_forward_on_each_device_matches_the_oracle(framework, slot, dtype, case):
    backend = backend_or_skip(framework)
    devices = devices_or_skip(backend, slot)
    config, weights, src, tgt_in = case_inputs(case)
    rounded = {k: v.astype(numpy_dtype(dtype)).astype(np.float64) for k, v in weights.items()}
    want = reference.forward(rounded, config, src, tgt_in).named()
    for device in devices:
        model = build_or_skip(backend, config, weights, dtype, device)
        for attention in (True, False):
            got = model.forward(src, tgt_in, attention=attention).named()
            where = f"{framework} on {device}, {dtype}, attention={attention}"
            compare(got, want, atol_for(dtype), where)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_gpu_matches_cpu_within_each_framework(framework, dtype):
    """The same framework on its CPU and on each GPU, every output on both attention paths and in
    every mode: the devices differ only in summation order, so the dtype's bound holds."""
    backend = backend_or_skip(framework)
    gpus = devices_or_skip(backend, "gpu")
    config, weights, src, tgt_in = case_inputs(f"grid:{GRID_CONFIG}")
    cpu = build_or_skip(backend, config, weights, dtype, "cpu")
    for device in gpus:
        gpu = build_or_skip(backend, config, weights, dtype, device)
        for mode in backend.modes:
            for attention in (True, False):
                want = cpu.forward(src, tgt_in, attention=attention, mode=mode).named()
                got = gpu.forward(src, tgt_in, attention=attention, mode=mode).named()
                assert got.keys() == want.keys()
                where = f"{framework} {device} vs cpu, {dtype}, {mode}, attention={attention}"
                compare(got, want, atol_for(dtype), where)


# -- TF32 ------------------------------------------------------------------------------------


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """||got - want||_F / ||want||_F: normwise, so that no near-zero entry dominates."""
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def matmul_operands() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two float32 standard-normal matrices and their product in float64 (exact up to 1e-16)."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((MATMUL_SIZE, MATMUL_SIZE)).astype(np.float32) for _ in "ab")
    return a, b, a.astype(np.float64) @ b.astype(np.float64)


def round_to_tf32(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest TF32 value (8-bit exponent, 10 explicit mantissa bits), kept in
    float32: what a tensor core reads when TF32 is on. Round half away from zero on the bits."""
    bits = x.astype(np.float32).view(np.uint32)
    dropped = 23 - 10
    rounded = (bits + np.uint32(1 << (dropped - 1))) & np.uint32(~((1 << dropped) - 1) & 0xFFFFFFFF)
    return rounded.view(np.float32)


def test_the_tf32_detector_has_teeth():
    """The GPU matmul check tells float32 from TF32, shown on the CPU: float32 accumulation is an
    order below MATMUL_RTOL (3.0e-7), TF32-rounded operands an order above it (2.9e-4).

    The float32 side depends on the CPU's BLAS kernel (its blocking decides the summation order),
    so its bound is the worst order any kernel may take: one plain sequential sum per entry, whose
    n = 1024 roundings of partial sums ~sqrt(k) add in quadrature to ~0.28 u sqrt(n) = 5.4e-7
    normwise (u = 2^-24); measured 5.7e-7 (np.cumsum in float32), and 2.1e-7 to 4.1e-7 over
    OpenBLAS's Prescott, Nehalem, SandyBridge, Haswell, Zen and SkylakeX kernels. The TF32 side
    is computed in float64 on bit-rounded operands: the same on every CPU."""
    a, b, exact = matmul_operands()
    full = relative_error((a @ b).astype(np.float64), exact)
    tf32 = relative_error(
        (round_to_tf32(a).astype(np.float64) @ round_to_tf32(b).astype(np.float64)), exact
    )
    assert full < MATMUL_RTOL / 10, f"float32 matmul error {full:.3g}"
    assert tf32 > MATMUL_RTOL * 10, f"TF32 matmul error {tf32:.3g} would pass the check"


# Each matmul runs under the implementation's own switch for "highest" (its precision.py's
# matmul_precision), the one its models run every call under (impl/test_precision.py reads it from
# inside a forward).


def _torch_matmul(a: np.ndarray, b: np.ndarray, device: str) -> np.ndarray:
    import torch

    from transformer_rosetta.torch_impl.precision import matmul_precision

    with matmul_precision("highest"):
        c = torch.from_numpy(a).to(device) @ torch.from_numpy(b).to(device)
    return c.cpu().numpy()


def _tf_matmul(a: np.ndarray, b: np.ndarray, device: str) -> np.ndarray:
    import tensorflow as tf

    from transformer_rosetta.tf_impl.precision import matmul_precision

    kind, _, index = device.partition(":")
    with tf.device(f"/{kind.upper()}:{index or 0}"), matmul_precision("highest"):
        return tf.linalg.matmul(tf.constant(a), tf.constant(b)).numpy()


def _jax_matmul(a: np.ndarray, b: np.ndarray, device: str) -> np.ndarray:
    # JAX's default on a GPU would be TF32.
    import jax

    from transformer_rosetta.jax_impl.backend import jax_device
    from transformer_rosetta.jax_impl.precision import matmul_precision

    target = jax_device(device)
    with matmul_precision("highest"):
        return np.asarray(jax.numpy.matmul(jax.device_put(a, target), jax.device_put(b, target)))


MATMULS: dict[str, Callable[[np.ndarray, np.ndarray, str], np.ndarray]] = {
    "torch": _torch_matmul,
    "tf": _tf_matmul,
    "jax": _jax_matmul,
}


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_gpu_float32_matmul_is_not_tf32(framework):
    backend = backend_or_skip(framework)  # imported: TensorFlow's flag is set by the backend
    gpus = devices_or_skip(backend, "gpu")
    if framework not in MATMULS:
        pytest.skip(f"no TF32 matmul check is written for {framework}")
    a, b, exact = matmul_operands()
    for device in gpus:
        error = relative_error(MATMULS[framework](a, b, device).astype(np.float64), exact)
        assert error <= MATMUL_RTOL, (
            f"{framework} float32 matmul on {device} is off by {error:.3g} (normwise relative) "
            f"> {MATMUL_RTOL:g}: TF32 or another reduced precision is on"
        )
