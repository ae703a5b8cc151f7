"""The NumPy oracle behind the adapter, as backend "numpy" (float64, CPU, eager only)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from common import reference
from common.backends import ForwardOutput, check_build_request, check_mode
from common.config import TransformerConfig
from common.inputs import check_inputs
from common.names import canonical_shapes


class NumpyModel:
    def __init__(self, config: TransformerConfig, weights: Mapping[str, np.ndarray]) -> None:
        self.config = config
        self.dtype = "float64"
        self.device = "cpu"
        self.weights = {
            name: np.array(weights[name], dtype=np.float64) for name in canonical_shapes(config)
        }

    def export(self) -> dict[str, np.ndarray]:
        return {name: t.copy() for name, t in self.weights.items()}

    def forward(
        self,
        src: np.ndarray,
        tgt_in: np.ndarray,
        *,
        attention: bool = False,
        hidden_states: bool = False,
        mode: str = "eager",
    ) -> ForwardOutput:
        check_mode(NumpyBackend.modes, mode)
        src, tgt_in = check_inputs(self.config, src, tgt_in)
        out = reference.forward(self.weights, self.config, src, tgt_in, hidden_states=hidden_states)
        if not attention:
            out.encoder_self_attention = out.decoder_self_attention = out.cross_attention = None
        return out


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
    ) -> NumpyModel:
        check_build_request(self, dtype, device)
        missing = [n for n in canonical_shapes(config) if n not in weights]
        if missing:
            raise ValueError(f"missing tensors: {', '.join(missing)}")
        return NumpyModel(config, weights)
