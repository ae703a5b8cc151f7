"""Matmul precision modes: how a float32 model's matrix products are computed.

A GPU's tensor cores can multiply float32 matrices with their inputs rounded to TF32 (10 explicit
mantissa bits, unit roundoff 2^-11, against float32's 2^-24). Each framework has its own switch and
its own default, and the defaults have changed between releases (JAX's default on GPUs is TF32,
torch's has been both), so nothing here trusts a default:

- "highest": full float32 products. Parity's float32 bounds (common/spec/tolerances.py) assume it.
- "tf32": TF32 products where the hardware has them (NVIDIA Ampere and later); on a CPU it is the
  same as "highest". Parity bounds it separately (tolerances.ATOL["tf32"]).

bfloat16 is a dtype, not a matmul precision: `--dtype bfloat16`, or `--precision bf16` in
`rosetta bench`, which has no `--dtype` (BENCH_PRECISIONS).

Each implementation maps a mode to its framework's switch in its precision.py
(`matmul_precision`), and each model applies its own mode around every call, so two models of one
process may differ. Nothing is switched at import.
"""

from __future__ import annotations

PRECISIONS = ("highest", "tf32")
DEFAULT_PRECISION = "highest"

# `rosetta bench`: a precision names the whole numeric setting, the dtype included.
BENCH_PRECISIONS = ("highest", "tf32", "bf16")


def check_precision(precision: str) -> str:
    """`precision` if it is a mode (PRECISIONS); ValueError naming the modes otherwise."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: unknown {precision!r}; allowed: {', '.join(PRECISIONS)}")
    return precision


def bench_setting(name: str) -> tuple[str, str]:
    """(dtype, precision) of a `rosetta bench --precision` name: bf16 is bfloat16 tensors (whose
    products are bfloat16 whatever the mode), the others float32 at that matmul precision."""
    if name not in BENCH_PRECISIONS:
        raise ValueError(f"precision: unknown {name!r}; allowed: {', '.join(BENCH_PRECISIONS)}")
    return ("bfloat16", "highest") if name == "bf16" else ("float32", name)
