"""What the engine tests share: the config, the ragged global batches, the step count, the
float64 bound, and the comparisons (torch's, jax's and the cross-framework test's).

The config is the pairwise grid's "shared" one without attention biases: one embedding table for
both stacks that is also the output projection (FSDP2 must keep it one parameter), and no key
bias, whose true gradient is exactly 0, so that its trained value is rounding noise that no two
summation orders share (docs/DISTRIBUTED.md)."""

from __future__ import annotations

import numpy as np

from parity_tests.grid import PAIRWISE_GRID
from transformer_rosetta.spec.inputs import ragged_batch

CONFIG = PAIRWISE_GRID["post-gelu_tanh-sin-interleaved-shared-nobias"]
STEPS, WARMUP, ROWS = 20, 10, 4
# float64 training parity over 20 Adam steps: the project's training bound (impl/test_training).
F64_ATOL = 1e-12
# The trap's gap must be this large to count as shown: far above float64 rounding (1e-12).
TRAP_MIN_GAP = 1e-6


def global_batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(src, tgt) of ROWS rows, ragged: 5, 3, 2 and 1 target tokens, so that replica 0 (rows 0
    and 1) holds 8 and replica 1 (rows 2 and 3) 3."""
    src, tgt_in = ragged_batch(CONFIG, batch=ROWS, src_len=6, tgt_len=5, seed=seed)
    tgt = np.concatenate([tgt_in[:, 1:], np.full((ROWS, 1), CONFIG.pad_id)], axis=1)
    tgt[0, -1] = CONFIG.eos_id
    return src, tgt


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def weight_diff(found: dict, prefix: str, want: dict) -> float:
    """The largest gap of the weights a worker wrote as PREFIX:w:NAME from `want`'s."""
    return max(max_diff(found[f"{prefix}:w:{name}"], want[name]) for name in want)
