"""Matmul precision (common/spec/precision.py) in PyTorch's own switches.

A mode is set for a block, never at import: the backend (backend.py) runs every call of a model
under the model's precision, and code that calls the modules directly (a test, a benchmark)
enters the block itself. Without it, a framework's own default rules: TF32 products on an Ampere
or later GPU in JAX, in TensorFlow, and in torch's cuDNN.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from transformer_rosetta.spec.precision import DEFAULT_PRECISION, check_precision


@contextlib.contextmanager
def matmul_precision(precision: str = DEFAULT_PRECISION) -> Iterator[None]:
    """float32 products in `precision` (common/spec/precision.py) for what runs inside the
    block: full float32 for "highest", TF32 for "tf32". The switch is process-wide, so the
    previous setting is restored on exit: two models of one process keep their own modes."""
    # idiom: torch's switches are process-wide, one for cuBLAS matmuls and one for cuDNN. Only
    # the fp32_precision API is used: torch refuses to read a precision set through a mix of it
    # and the legacy allow_tf32 flags.
    mode = "tf32" if check_precision(precision) == "tf32" else "ieee"
    switches = (torch.backends.cuda.matmul, torch.backends.cudnn)
    saved = [s.fp32_precision for s in switches]
    for switch in switches:
        switch.fp32_precision = mode
    try:
        yield
    finally:
        for switch, value in zip(switches, saved, strict=True):
            switch.fp32_precision = value
