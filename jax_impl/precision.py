"""Matmul precision (common/spec/precision.py) in JAX's own switch.

A mode is set for a block, never at import: the backend (backend.py) runs every call of a model
under the model's precision, and code that calls the modules directly (a test, a benchmark)
enters the block itself. Without it, a framework's own default rules: TF32 products on an Ampere
or later GPU in JAX, in TensorFlow, and in torch's cuDNN.
"""

from __future__ import annotations

import contextlib

import jax

from transformer_rosetta.spec.precision import DEFAULT_PRECISION, check_precision

# JAX's names for the modes of common/spec/precision.py.
_JAX_PRECISIONS = {"highest": "highest", "tf32": "tensorfloat32"}


def matmul_precision(precision: str = DEFAULT_PRECISION) -> contextlib.AbstractContextManager:
    """float32 products in `precision` (common/spec/precision.py) for what runs inside the
    block: full float32 for "highest", TF32 for "tf32". The switch is process-wide, so the
    previous setting is restored on exit: two models of one process keep their own modes."""
    # idiom: JAX's switch is a config context of its own, read when a program is traced; it is
    # part of jax.jit's cache key, so each mode compiles its own program.
    return jax.default_matmul_precision(_JAX_PRECISIONS[check_precision(precision)])
