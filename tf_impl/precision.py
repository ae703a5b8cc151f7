"""Matmul precision (common/spec/precision.py) in the switch of whichever backend Keras runs on.

Keras has no switch of its own, so the one of the framework below it is set (under
KERAS_BACKEND=jax on an H100, float32 logits were 1.7e-3 from the oracle without it, 7.7e-7 with
it).

A mode is set for a block, never at import: the backend (backend.py) runs every call of a model
under the model's precision, and code that calls the layers directly (a test, a benchmark)
enters the block itself. Without it, a framework's own default rules: TF32 products on an Ampere
or later GPU in JAX, in TensorFlow, and in torch's cuDNN.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import keras

from transformer_rosetta.spec.precision import DEFAULT_PRECISION, check_precision


# idiom: Keras has no matmul precision of its own; the framework below it has one, so this sets
# that framework's switch itself, on every Keras backend.
def _set_matmul_precision(precision: str) -> Callable[[], None]:
    """Set the Keras backend's float32 product precision (common/spec/precision.py); returns
    what restores the previous setting."""
    tf32 = check_precision(precision) == "tf32"
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        saved = jax.config.jax_default_matmul_precision
        jax.config.update("jax_default_matmul_precision", "tensorfloat32" if tf32 else "highest")
        return lambda: jax.config.update("jax_default_matmul_precision", saved)
    if backend == "torch":
        import torch

        switches = (torch.backends.cuda.matmul, torch.backends.cudnn)
        saved_modes = [s.fp32_precision for s in switches]
        for switch in switches:
            switch.fp32_precision = "tf32" if tf32 else "ieee"

        def restore() -> None:
            for switch, mode in zip(switches, saved_modes, strict=True):
                switch.fp32_precision = mode

        return restore
    if backend == "tensorflow":
        import tensorflow as tf

        was = tf.config.experimental.tensor_float_32_execution_enabled()
        tf.config.experimental.enable_tensor_float_32_execution(tf32)
        return lambda: tf.config.experimental.enable_tensor_float_32_execution(was)
    return lambda: None  # numpy/openvino backends: no reduced-precision float32 products


@contextlib.contextmanager
def matmul_precision(precision: str = DEFAULT_PRECISION) -> Iterator[None]:
    """float32 products in `precision` (common/spec/precision.py) for what runs inside the
    block: full float32 for "highest", TF32 for "tf32". The switch is process-wide, so the
    previous setting is restored on exit: two models of one process keep their own modes."""
    restore = _set_matmul_precision(precision)
    try:
        yield
    finally:
        restore()
