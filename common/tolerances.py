"""Tolerances for comparing an implementation with the float64 oracle, and why each is what it is.

max |ours - oracle| <= atol, per compared array. Justified in docs/PARITY.md:
- float64: both sides compute in float64; what differs is summation order (BLAS blocking, fused
  kernels), which for tiny configs costs ~1e-15 relative. 1e-10 leaves five orders of headroom and
  still catches any real bug, which shows up at 1e-3 or more.
- float32: unit roundoff 6e-8, times a few dozen accumulated operations on O(1) values in tiny
  configs, gives ~1e-6; 1e-5 is the bound Hugging Face found every real bug above.
"""

from __future__ import annotations

ATOL: dict[str, float] = {
    "float64": 1e-10,
    "float32": 1e-5,
}


def atol_for(dtype: str) -> float:
    try:
        return ATOL[dtype]
    except KeyError:
        raise ValueError(
            f"no tolerance is set for dtype {dtype!r}; known: {', '.join(ATOL)}"
        ) from None
