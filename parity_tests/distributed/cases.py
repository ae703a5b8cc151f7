"""What the engine tests share: the config, the ragged global batches, the step count, the
float64 bound, and the comparisons (torch's, jax's and the cross-framework test's).

The config is the pairwise grid's "shared" one without attention biases: one embedding table for
both stacks that is also the output projection (FSDP2 must keep it one parameter), and no key
bias, whose true gradient is exactly 0, so that its trained value is rounding noise that no two
summation orders share (docs/DISTRIBUTED.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from parity_tests.grid import PAIRWISE_GRID
from transformer_rosetta.spec.inputs import ragged_batch
from transformer_rosetta.weights.init import init_weights

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


def write_worker_inputs(folder: Path, **paths: Path) -> dict:
    """What an engine's worker reads, written to FOLDER/in.npz: the config, the step count and
    warm-up, perturbed float64 weights, STEPS ragged global batches, a ragged forward batch, and
    `paths` (a checkpoint each worker writes there). Returns the case: tmp (the folder), inputs,
    weights, batches, fwd (src, tgt_in)."""
    weights = init_weights(CONFIG, seed=0, scheme="perturbed", dtype="float64")
    batches = [global_batch(seed) for seed in range(STEPS)]
    fwd_src, fwd_tgt_in = ragged_batch(CONFIG, batch=ROWS, src_len=7, tgt_len=5, seed=1)
    arrays = {
        "config": np.array(CONFIG.to_json()),
        "steps": np.array(STEPS),
        "warmup": np.array(WARMUP),
        "fwd_src": fwd_src,
        "fwd_tgt_in": fwd_tgt_in,
        **{name: np.array(str(path)) for name, path in paths.items()},
        **{f"w:{k}": v for k, v in weights.items()},
    }
    for i, (src, tgt) in enumerate(batches):
        arrays[f"src:{i}"], arrays[f"tgt:{i}"] = src, tgt
    np.savez(folder / "in.npz", **arrays)
    return {
        "tmp": folder,
        "inputs": folder / "in.npz",
        "weights": weights,
        "batches": batches,
        "fwd": (fwd_src, fwd_tgt_in),
    }
