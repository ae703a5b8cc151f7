"""Deterministic random canonical weights from (config, seed), identical on every machine.

Each tensor draws from its own generator, seeded by (seed, crc32 of its name), so adding a tensor
to the spec never changes the numbers of the others, and numpy's PCG64 gives the same bits
everywhere.
"""

from __future__ import annotations

import zlib

import numpy as np

from transformer_rosetta.spec.arguments import check_choice, check_instance, check_seed
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.dtypes import DTYPES, numpy_dtype
from transformer_rosetta.spec.names import TensorSpec, canonical_specs

SCHEMES = ("paper", "perturbed")


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([int(seed), zlib.crc32(name.encode())])


def init_tensor(spec: TensorSpec, c: TransformerConfig, seed: int, scheme: str) -> np.ndarray:
    """One tensor in float64.

    "paper": the initialisation of the paper's reference code (tensor2tensor): xavier-uniform
    kernels, U(-a, a) with a = sqrt(6 / (fan_in + fan_out)); embeddings N(0, d_model^-0.5), so
    that after the sqrt(d_model) scale of section 3.4 they have unit variance; zero biases and
    unit LayerNorm gains.

    "perturbed": the same kernels and embeddings, but biases N(0, 0.1^2) and LayerNorm gains
    1 + N(0, 0.1^2). Parity tests use it, so that a bias or gain that an implementation drops or
    misplaces changes the output instead of hiding behind a zero or a one.
    """
    rng = _rng(seed, spec.name)
    if spec.role == "kernel":
        limit = np.sqrt(6.0 / (spec.fan_in + spec.fan_out))
        return rng.uniform(-limit, limit, size=spec.shape)
    if spec.role == "embedding":
        return rng.normal(0.0, c.d_model**-0.5, size=spec.shape)
    if scheme == "paper":
        fill = 1.0 if spec.role == "scale" else 0.0
        return np.full(spec.shape, fill)
    offset = 1.0 if spec.role == "scale" else 0.0
    return offset + rng.normal(0.0, 0.1, size=spec.shape)


def init_weights(
    c: TransformerConfig, seed: int = 0, *, scheme: str = "paper", dtype: str = "float32"
) -> dict[str, np.ndarray]:
    """Every canonical tensor of `c`, drawn in float64 and then cast to `dtype`. The seed runs
    from 0 to SEED_MAX, as --seed does (transformer_rosetta.spec.arguments)."""
    check_instance(c, "c", TransformerConfig, "a TransformerConfig")
    check_seed(seed)
    check_choice(scheme, "scheme", SCHEMES)
    target = numpy_dtype(check_choice(dtype, "dtype", tuple(DTYPES)))
    return {s.name: init_tensor(s, c, seed, scheme).astype(target) for s in canonical_specs(c)}
