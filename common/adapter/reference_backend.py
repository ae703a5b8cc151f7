"""The NumPy oracle behind the adapter, as backend "numpy" (float64, CPU, eager only)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from transformer_rosetta.adapter.backends import check_build_request, check_mode
from transformer_rosetta.decoding.search import check_stepper_request, prompt_prefix
from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.inputs import check_inputs
from transformer_rosetta.spec.names import canonical_shapes
from transformer_rosetta.spec.precision import DEFAULT_PRECISION
from transformer_rosetta.spec.results import ForwardOutput


class PrefixStepper:
    """The oracle's Stepper (transformer_rosetta.decoding.search): it re-runs reference.decode over the whole prefix at
    every step, the plainest correct decoder, against which every cache is tested. A decoder-only
    model's src is the prompt: the prefix starts as its first P - 1 tokens, and there is no
    memory."""

    def __init__(
        self, weights: dict[str, np.ndarray], c: TransformerConfig, src: np.ndarray, beams: int
    ) -> None:
        self.weights, self.config = weights, c
        # The encoder's side, repeated per beam: src (N, S) and memory (N, S, d), or None for a
        # decoder-only model.
        self.src: np.ndarray | None = None
        self.memory: np.ndarray | None = None
        if c.has_encoder:
            memory, _, _ = reference.encode(weights, c, src)
            self.src = np.repeat(src, beams, axis=0)  # (N, S), row r from source r // beams
            self.memory = np.repeat(memory, beams, axis=0)  # (N, S, d)
            self.prefix = np.zeros((self.src.shape[0], 0), dtype=np.int64)
        else:
            self.prefix = prompt_prefix(src, beams)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        self.prefix = np.concatenate([self.prefix, np.asarray(tokens, np.int64)[:, None]], axis=1)
        y, _, _, _ = reference.decode(self.weights, self.config, self.prefix, self.memory, self.src)
        return reference.output_logits(self.weights, self.config, y[:, -1])  # (N, V)

    def reorder(self, rows: np.ndarray) -> None:
        self.prefix = self.prefix[rows]
        if self.memory is not None and self.src is not None:  # both set, or neither (__init__)
            self.memory, self.src = self.memory[rows], self.src[rows]


class NumpyModel:
    def __init__(self, config: TransformerConfig, weights: Mapping[str, np.ndarray]) -> None:
        self.config = config
        self.dtype = "float64"
        self.device = "cpu"
        self.precision = DEFAULT_PRECISION  # float64 products: the mode has nothing to change
        self.weights = {
            name: np.array(weights[name], dtype=np.float64) for name in canonical_shapes(config)
        }

    def export(self) -> dict[str, np.ndarray]:
        return {name: t.copy() for name, t in self.weights.items()}

    def forward(
        self,
        src: np.ndarray | None,
        tgt_in: np.ndarray | None,
        *,
        attention: bool = False,
        hidden_states: bool = False,
        mode: str = "eager",
    ) -> ForwardOutput:
        check_mode(NumpyBackend.modes, mode)
        src, tgt_in = check_inputs(self.config, src, tgt_in)
        out = reference.forward(self.weights, self.config, src, tgt_in, hidden_states=hidden_states)
        # The oracle's arrays are numpy already: the one conversion keeps only what was asked for.
        return ForwardOutput.from_model(
            vars(out), np.asarray, attention=attention, hidden_states=hidden_states
        )

    def stepper(
        self, src: np.ndarray, beams: int, max_steps: int, *, cached: bool = True
    ) -> PrefixStepper:
        """The oracle has no cache: `cached` is accepted and ignored."""
        src = check_stepper_request(self.config, src, beams, max_steps)
        return PrefixStepper(self.weights, self.config, src, beams)


class NumpyBackend:
    name = "numpy"
    dtypes = ("float64",)
    modes = ("eager",)

    def version(self) -> str:
        return f"numpy {np.__version__}"

    def devices(self) -> list[str]:
        return ["cpu"]

    def build(
        self,
        config: TransformerConfig,
        weights: Mapping[str, np.ndarray],
        *,
        dtype: str = "float64",
        device: str = "cpu",
        precision: str = DEFAULT_PRECISION,
    ) -> NumpyModel:
        check_build_request(self, dtype, device, precision)
        missing = [n for n in canonical_shapes(config) if n not in weights]
        if missing:
            raise ValueError(f"missing tensors: {', '.join(missing)}")
        return NumpyModel(config, weights)
