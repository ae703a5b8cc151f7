"""Tolerances for comparing an implementation with the float64 oracle, and why each is what it is.

max |ours - oracle| <= atol, per compared array. Justified in docs/PARITY.md:
- float64: both sides compute in float64; what differs is summation order (BLAS blocking, fused
  kernels), which for tiny configs costs ~1e-15 relative. 1e-10 leaves five orders of headroom and
  still catches any real bug, which shows up at 1e-3 or more.
- float32: unit roundoff 6e-8, times a few dozen accumulated operations on O(1) values in tiny
  configs, gives ~1e-6; 1e-5 is the bound Hugging Face found every real bug above.
- float32_base: float32 at the paper's base sizes (d_model 512, d_ff 2048, 6 + 6 layers). The
  inner products are 512 and 2048 long instead of 12 and 20, and the depth is 6 * 2 + 6 * 3 + 1 =
  31 rounding stages instead of 8, so the error may grow by sqrt(2048 / 20) * sqrt(31 / 8) ~ 20
  over the tiny configs' ~1e-6 (LayerNorm keeps the values O(1), so it does not compound).
  Measured (CPU, vocabulary cut to 4000, batch 3 of 24 source / 20 target tokens, perturbed init,
  both attention paths): torch 2.8e-6, Keras/TF 3.8e-6, Flax/JAX 5.1e-6 on the logits; attention
  probabilities <= 8.4e-7. The growth stays far below the worst case, and 2e-5 is four times the
  largest measured value: room for other inputs and for GPU reduction orders, while a real bug
  (a dropped bias, a wrong mask, TF32 matmuls at ~1e-3 relative) is still two orders above it.
- bfloat16: 8 significant bits, unit roundoff u = 2^-8 = 3.9e-3 (float32 has 2^-24). Every
  sublayer's output is rounded to bfloat16 at least once, on values up to |x| ~ 4 (a LayerNorm
  output is at most sqrt(d_model - 1) ~ 3.3 times its gain ~ 1.1, plus its bias; the oracle's
  largest logit on the tiny grid is 4.4). The tiny grid (2 encoder + 1 decoder layers) has
  2 * 2 + 1 * 3 + 1 = 8 such stages (two sublayers per encoder layer, three per decoder layer,
  and the embedding sum); one full rounding of the largest value per stage, added up, is
  8 * u * 4 = 2^-3 = 0.125. Measured on the whole 108-config tiny grid (both input cases) against
  the oracle on the bfloat16-rounded weights: torch 0.052 (logits) / 0.046 (encoder output) /
  0.011 (attention); Keras/TF 0.071 / 0.103 / 0.014; Flax/JAX 0.046 / 0.041 / 0.0078 (9-config
  pairwise subset). It is a tracking bound, for the tiny depth only: bfloat16 cannot tell a
  0.1-sized bias bug from rounding; float32 and float64 are the tiers that catch bugs.
- bfloat16 attention probabilities, relative: BF16_PROBABILITY_RTOL. The 0.125 above is about 3x
  the measured error, loose enough to hide a softmax computed in bfloat16 (it moved the worst
  difference from 0.036 to 0.043). So the probabilities get their own bound, on a model whose
  first-layer attention scores are exact in bfloat16 (small dyadic weights and inputs, d_k = 4:
  impl/test_dtypes.py checks the premise). There the only error left is the softmax's: in float32,
  exp, sum and quotient cost at most (keys + 3) * 2^-24 < 2^-20 relative (keys <= 7), and one
  rounding to bfloat16 costs at most u = 2^-8 relative. So |p - p_oracle| <= (2^-8 + 2^-20) * p,
  which also pins every masked probability at exactly 0. Measured: torch and Keras/TF 0.95 u
  (rounded once), Flax/JAX 4e-5 u (it returns the float32 probabilities). The softmax computed in
  bfloat16 instead (exp, sum and quotient each rounded) measured 1.7 u to 2.0 u, in each of the
  three frameworks, and fails.
- tf32 (float32 tensors, products in TF32: common/spec/precision.py): a tensor core rounds each
  product's operands to 10 explicit mantissa bits, unit roundoff u = 2^-11 = 4.9e-4, and
  accumulates in float32. A product of two rounded operands is off by at most 2u relative, so by
  the bfloat16 reasoning (one full error of the largest value, |x| <= 4, per rounding stage) the
  tiny grid's 8 stages give 8 * 2u * 4 = 2^-5 = 0.031. At the base sizes (31 stages) the
  roundings have random signs and add in quadrature, sqrt(31 / 8) ~ 2, so tf32_base is 2^-4.
  Measured on the CPU by emulation (the oracle with every matmul operand rounded to TF32, in
  float64): tiny grid, all 108 configs and both input cases, 4.8e-3 (logits) / 4.6e-3 (encoder
  output) / 8.4e-4 (attention); base sizes (vocabulary 4000, batch 3 of 24/20 tokens, perturbed
  init) 3.6e-3 on the logits, consistent with the 1.7e-3 to 2.7e-3 measured on an H100 between
  TF32 and full float32. Like bfloat16's, it is a tracking bound: "highest" is the tier that
  catches bugs, and TF32's own error is 300x the float32 bound, so "highest" cannot pass by
  accident when TF32 is on.
"""

from __future__ import annotations

from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.precision import check_precision

ATOL: dict[str, float] = {
    "float64": 1e-10,
    "float32": 1e-5,
    # The paper's base sizes in float32 (see the docstring): 4x the largest measured 5.1e-6.
    "float32_base": 2e-5,
    # The tiny grid in bfloat16 (see the docstring): depth 8 stages x u = 2^-8 x |x| <= 4.
    "bfloat16": 2.0**-3,
    # float32 with TF32 products (see the docstring): 8 stages x 2u (u = 2^-11) x |x| <= 4.
    "tf32": 2.0**-5,
    # The same at the base sizes: 31 stages, random-sign roundings, sqrt(31 / 8) ~ 2.
    "tf32_base": 2.0**-4,
}


# Attention probabilities of a bfloat16 model with exact scores (see the docstring): one rounding
# (u = 2^-8) of a float32 softmax (< 2^-20), relative to each probability.
BF16_PROBABILITY_RTOL = 2.0**-8 + 2.0**-20

# Configs up to this size are "tiny" for the float32 bound; larger ones get float32_base.
TINY_LIMITS = {"d_model": 64, "d_ff": 256, "num_encoder_layers": 3, "num_decoder_layers": 3}


def atol_for(
    dtype: str, config: TransformerConfig | None = None, precision: str = "highest"
) -> float:
    """The bound for `dtype` (and, for float32, its matmul `precision`: common/spec/precision.py);
    for float32, the base-size bound when `config` is past tiny sizes."""
    if dtype == "float32":
        tier = "tf32" if check_precision(precision) == "tf32" else "float32"
        return ATOL[f"{tier}_base" if config is not None and is_large(config) else tier]
    try:
        return ATOL[dtype]
    except KeyError:
        raise ValueError(
            f"no tolerance is set for dtype {dtype!r}; known: {', '.join(ATOL)}"
        ) from None


def is_large(config: TransformerConfig) -> bool:
    """True when any size of `config` exceeds the tiny configs the float32 bound was set on."""
    return any(getattr(config, field) > limit for field, limit in TINY_LIMITS.items())
