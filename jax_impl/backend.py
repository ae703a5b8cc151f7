"""The Flax NNX implementation behind the adapter (common.backends.Backend), numpy in and out."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path

import flax
import jax
import numpy as np
from flax import nnx

from common.backends import ForwardOutput, check_build_request, check_mode
from common.config import TransformerConfig
from common.dtypes import COMPUTE_DTYPES
from common.format import check_tensors
from common.inputs import check_inputs
from jax_impl.model import Transformer
from jax_impl.weights import (
    from_canonical,
    read_native,
    to_canonical,
    to_device,
    write_native,
    x64_scope,
)

MODES = ("eager", "compiled")


def _forward(
    model: Transformer, src: jax.Array, tgt_in: jax.Array, return_probs: bool, hidden_states: bool
) -> dict:
    return model(src, tgt_in, return_probs=return_probs, hidden_states=hidden_states)


# One compiled function for every model: nnx.jit keys its cache on the graphdef (the config,
# dtype and structure) and on the static flags, so each (model kind, shapes) compiles once.
_forward_compiled = nnx.jit(_forward, static_argnames=("return_probs", "hidden_states"))


def jax_device(device: str) -> jax.Device:
    """'cpu' or 'gpu:N' as a jax.Device; ValueError naming the devices there are otherwise."""
    platform, _, index = device.partition(":")
    try:
        return jax.devices(platform)[int(index or 0)]
    except (RuntimeError, ValueError, IndexError):
        known = ", ".join(FlaxBackend().devices())
        raise ValueError(f"device: unknown {device!r}; this machine has {known}") from None


def _to_numpy(x: jax.Array) -> np.ndarray:
    """float64/float32 stay as they are; bfloat16 goes to float32 so numpy can compare it."""
    a = np.asarray(x)
    return a if a.dtype in (np.float64, np.float32) else a.astype(np.float32)


class FlaxModel:
    """A Transformer module in eval mode, on one device, in one dtype."""

    def __init__(self, config: TransformerConfig, module: Transformer, dtype: str, device: str):
        self.config = config
        self.module = module
        self.dtype = dtype
        self.device = device
        self._device = jax_device(device)

    @contextlib.contextmanager
    def _scope(self):  # noqa: ANN202
        # x64 for float64 models only; full-precision float32 matmuls (no TF32 on a GPU).
        with x64_scope(self.dtype), jax.default_matmul_precision("highest"):
            yield

    def export(self) -> dict[str, np.ndarray]:
        with self._scope():
            return to_canonical(self.module)

    def forward(
        self,
        src: np.ndarray,
        tgt_in: np.ndarray,
        *,
        attention: bool = False,
        hidden_states: bool = False,
        mode: str = "eager",
    ) -> ForwardOutput:
        src, tgt_in = check_inputs(self.config, src, tgt_in)  # on the host, before any jit
        check_mode(MODES, mode)
        run = _forward_compiled if mode == "compiled" else _forward
        with self._scope():
            # int32 ids: JAX's default integer without x64, and every vocabulary fits.
            src_j, tgt_j = jax.device_put(
                (src.astype(np.int32), tgt_in.astype(np.int32)), self._device
            )
            out = run(self.module, src_j, tgt_j, attention, hidden_states)
            out = jax.tree.map(_to_numpy, out)
        return ForwardOutput(**out)


class FlaxBackend:
    name = "jax"
    dtypes = COMPUTE_DTYPES  # float32, float64 (in a scoped x64 mode), bfloat16
    modes = MODES
    native_suffixes = (".msgpack",)

    def version(self) -> str:
        return f"jax {jax.__version__}, flax {flax.__version__}"

    def devices(self) -> list[str]:
        names = ["cpu"]
        with contextlib.suppress(RuntimeError):  # raised when JAX has no GPU backend
            names += [f"gpu:{i}" for i in range(len(jax.devices("gpu")))]
        return names

    def build(
        self,
        config: TransformerConfig,
        weights: Mapping[str, np.ndarray],
        *,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> FlaxModel:
        check_build_request(self, dtype, device)
        target = jax_device(device)
        with x64_scope(dtype):
            module = to_device(from_canonical(config, weights, dtype), target)
        module.eval()  # deterministic dropout
        return FlaxModel(config, module, dtype, device)

    def save_native(
        self, path: str | Path, config: TransformerConfig, weights: Mapping[str, np.ndarray]
    ) -> None:
        """The nnx.Param state of a model holding canonical `weights` as msgpack (bit-exact in
        their dtype), written atomically."""
        check_tensors(path, config, weights)
        write_native(path, config, {n: np.asarray(w) for n, w in weights.items()})

    def load_native(self, path: str | Path, config: TransformerConfig) -> dict[str, np.ndarray]:
        """Canonical tensors from save_native's msgpack for `config`, bit-exact."""
        return read_native(path, config)
