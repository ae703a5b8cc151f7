"""The floating dtypes the project knows, by name, as numpy dtypes (bfloat16 from ml_dtypes)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
# The dtypes a model computes in (float16 weights are stored and converted, not computed in).
COMPUTE_DTYPES = ("float32", "float64", "bfloat16")


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype called `name`, with an error listing the known names."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: unknown {name!r}; allowed: {', '.join(DTYPES)}") from None


def dtype_name(dtype: np.dtype) -> str:
    """Inverse of numpy_dtype; raises for a dtype the format does not store."""
    for name, dt in DTYPES.items():
        if np.dtype(dtype) == dt:
            return name
    raise ValueError(f"dtype {np.dtype(dtype)} is not one of {', '.join(DTYPES)}")
