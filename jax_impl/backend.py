"""The Flax NNX implementation behind the adapter (transformer_rosetta.adapter.backends.Backend), numpy in and out."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path

import flax
import jax
import numpy as np
from flax import nnx

from transformer_rosetta.adapter.backends import check_build_request, check_mode
from transformer_rosetta.decoding.search import (
    check_row_ids,
    check_step_budget,
    check_stepper_request,
    prompt_prefix,
)
from transformer_rosetta.jax_impl import decode, train
from transformer_rosetta.jax_impl.model import Transformer
from transformer_rosetta.jax_impl.precision import matmul_precision
from transformer_rosetta.jax_impl.weights import (
    export_canonical,
    from_canonical,
    read_native,
    write_native,
    x64_scope,
)
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.dtypes import COMPUTE_DTYPES
from transformer_rosetta.spec.inputs import check_inputs, check_trainable
from transformer_rosetta.spec.masks import shift_right
from transformer_rosetta.spec.precision import DEFAULT_PRECISION
from transformer_rosetta.spec.results import ForwardOutput, LossOutput
from transformer_rosetta.weights.format import check_tensors


def _forward(
    model: Transformer,
    src: jax.Array | None,
    tgt_in: jax.Array | None,
    return_attention: bool,
    hidden_states: bool,
) -> dict:
    out = model(src, tgt_in, return_attention=return_attention)
    if not hidden_states:
        # The model always returns them; left out of the outputs here, XLA drops them under jit.
        out = {**out, "encoder_hidden_states": None, "decoder_hidden_states": None}
    return out


# One compiled function for every model: nnx.jit keys its cache on the graphdef (the config,
# dtype and structure) and on the static flags, so each (model kind, shapes) compiles once.
_forward_compiled = nnx.jit(_forward, static_argnames=("return_attention", "hidden_states"))


# idiom: JAX places arrays on jax.Device objects (jax.device_put)
def jax_device(device: str) -> jax.Device:
    """'cpu' or 'gpu:N' as a jax.Device; ValueError naming the devices there are otherwise."""
    platform, _, index = device.partition(":")
    try:
        return jax.devices(platform)[int(index or 0)]
    except (RuntimeError, ValueError, IndexError):
        known = ", ".join(FlaxBackend().devices())
        raise ValueError(f"device: unknown {device!r}; this machine has {known}") from None


def _device_ids(ids: tuple[np.ndarray | None, ...], device: jax.Device) -> tuple:
    """Token ids on `device` as int32 (JAX's default integer without x64; every vocabulary
    fits); None, the input a half of the family does not take, stays None."""
    return jax.device_put(tuple(None if a is None else a.astype(np.int32) for a in ids), device)


def to_numpy(x: jax.Array) -> np.ndarray:
    """float64/float32 stay as they are; bfloat16 goes to float32 so numpy can compare it."""
    a = np.asarray(x)
    return a if a.dtype in (np.float64, np.float32) else a.astype(np.float32)


def _to_device(model: Transformer, device: jax.Device) -> Transformer:
    """The model with every array placed on `device` (a jax.Device)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, device))


class FlaxStepper:
    """transformer_rosetta.decoding.search.Stepper over jax_impl/decode.py. It holds the explicit state between steps:
    the module split once into (graphdef, state), the compiled step for that graphdef, and the
    cache (uncached: the prefix, on the host, with the memory). A decoder-only model's src is
    the prompt (B, P): the cache is prefilled with its first P - 1 tokens, and the uncached
    prefix starts as them, with no memory.

    Per step, only arrays go to the compiled step: its graphdef is closed over (decode.py says
    why) and the state is a pure dict of arrays, taken once here."""

    def __init__(
        self, model: FlaxModel, src: np.ndarray, beams: int, max_steps: int, cached: bool
    ) -> None:
        self.model, self.max_steps, self.cached = model, max_steps, cached
        self.steps, self.rows = 0, src.shape[0] * beams
        self.vocab = model.config.tgt_vocab_size
        with model._scope():
            graphdef, state = nnx.split(model.module)
            self.state = nnx.to_pure_dict(state)
            src_j = jax.device_put(src.astype(np.int32), model._device)
            if cached:
                # A decoder-only model's prefill runs inside the compiled init_cache.
                init_cache = decode.init_cache_compiled(graphdef)
                self.cache = init_cache(self.state, src_j, beams=beams, max_steps=max_steps)
                self._step = decode.decode_step_compiled(graphdef)
            else:
                self._step = decode.prefix_step_compiled(graphdef)
                if model.config.has_encoder:
                    encode_rows = decode.encode_rows_compiled(graphdef)
                    memory, src_rows = encode_rows(self.state, src_j, beams)
                    self.memory_rows = {"memory": memory, "src": src_rows}  # what reorder gathers
                    self.prefix = np.zeros((src.shape[0] * beams, 0), np.int32)
                else:  # decoder-only: no memory; the prompt but its last token, per beam
                    self.memory_rows = {"memory": None, "src": None}
                    self.prefix = prompt_prefix(src, beams).astype(np.int32)  # (N, P - 1)

    def _logits(self, tokens: np.ndarray) -> jax.Array:
        """One step's logits (N, V), left on the device."""
        check_step_budget(self.steps, self.max_steps)
        tokens = check_row_ids(tokens, "tokens", self.rows, self.vocab).astype(np.int32)  # (N,)
        # The model's scope every step: jax.jit keys its cache on x64 and the matmul precision.
        # The ids go in as numpy, no jax.device_put (a quarter of a tiny model's step on a CPU):
        # jax.jit moves an uncommitted input to the device its committed ones (state, cache) are on.
        with self.model._scope():
            if self.cached:
                logits, self.cache = self._step(self.state, tokens, self.cache)
            else:
                self.prefix = np.concatenate([self.prefix, tokens[:, None]], axis=1)  # (N, t)
                memory_rows = self.memory_rows
                logits = self._step(
                    self.state, self.prefix, memory_rows["memory"], memory_rows["src"]
                )
        self.steps += 1
        return logits

    def step(self, tokens: np.ndarray) -> np.ndarray:
        return to_numpy(self._logits(tokens))

    def step_top(self, tokens: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """transformer_rosetta.decoding.search.TopStepper: only (N, k) values and ids leave the device."""
        logits = self._logits(tokens)
        with self.model._scope():
            values, ids = decode.top_k_log_probs_compiled(logits, k)
        return to_numpy(values), np.asarray(ids, dtype=np.int64)

    def reorder(self, rows: np.ndarray) -> None:
        rows = check_row_ids(rows, "rows", self.rows, self.rows)
        rows = rows.astype(np.int32)  # numpy into jax.jit, as in step
        with self.model._scope():
            if self.cached:
                self.cache = decode.reorder_cache_compiled(self.cache, rows)
            else:
                if self.model.config.has_encoder:
                    self.memory_rows = decode.reorder_cache_compiled(self.memory_rows, rows)
                self.prefix = self.prefix[rows]


class FlaxModel:
    """A Transformer module in eval mode, on one device, in one dtype."""

    def __init__(
        self,
        config: TransformerConfig,
        module: Transformer,
        dtype: str,
        device: str,
        precision: str = DEFAULT_PRECISION,
    ):
        self.config = config
        self.module = module
        self.dtype = dtype
        self.device = device
        self.precision = precision  # every call runs under matmul_precision(precision)
        self._device = jax_device(device)
        # The training state (train.py's functional loop), made on first use and kept for the
        # model's lifetime: the module split once in training mode, Adam's moments and step
        # counts (made on the first step) and the (warmup, factor) its schedule was made for.
        self._training: train._Split | None = None
        self._optimizer: train._Adam | None = None
        self._schedule: tuple[int, float] | None = None

    @contextlib.contextmanager
    def _scope(self):  # noqa: ANN202
        # x64 for float64 models only; float32 products in the model's precision (JAX's own
        # default on a GPU would be TF32).
        with x64_scope(self.dtype), matmul_precision(self.precision):
            yield

    def export(self) -> dict[str, np.ndarray]:
        with self._scope():
            return export_canonical(self.module)

    def forward(
        self,
        src: np.ndarray | None,
        tgt_in: np.ndarray | None,
        *,
        attention: bool = False,
        hidden_states: bool = False,
        mode: str = "eager",
    ) -> ForwardOutput:
        src, tgt_in = check_inputs(self.config, src, tgt_in)  # on the host, before any jit
        check_mode(FlaxBackend.modes, mode)
        run = _forward_compiled if mode == "compiled" else _forward
        with self._scope():
            src_j, tgt_j = _device_ids((src, tgt_in), self._device)
            out = run(self.module, src_j, tgt_j, attention, hidden_states)
            return ForwardOutput.from_model(
                out, to_numpy, attention=attention, hidden_states=hidden_states
            )

    def stepper(
        self, src: np.ndarray, beams: int, max_steps: int, *, cached: bool = True
    ) -> FlaxStepper:
        src = check_stepper_request(self.config, src, beams, max_steps)
        return FlaxStepper(self, src, beams, max_steps, cached)

    def _batch(self, src: np.ndarray | None, tgt: np.ndarray) -> tuple[jax.Array | None, ...]:
        """(src, tgt_in, tgt) on the device as int32 (src None for a decoder-only model); tgt_in
        is tgt shifted right behind BOS, on the host by the common rule."""
        src, tgt = check_inputs(self.config, src, tgt)
        return _device_ids((src, shift_right(tgt, self.config.bos_id), tgt), self._device)

    def loss_and_grads(self, src: np.ndarray | None, tgt: np.ndarray) -> LossOutput:
        check_trainable(self.config)  # an encoder-only model has no logits to train
        with self._scope():
            if self._training is None:  # dropout as the config says, in the split only
                self._training = train._split_for_training(self.module)
            batch = self._batch(src, tgt)
            loss, accuracy, tokens, grads = train.loss_and_grads(self._training, *batch)
            return LossOutput(
                loss=float(loss),
                accuracy=float(accuracy),
                tokens=int(tokens),
                grads=train.canonical_grads(self.module, grads),
            )

    def train_steps(
        self,
        batches: list[tuple[np.ndarray | None, np.ndarray]],
        *,
        warmup: int,
        factor: float = 1.0,
    ) -> list[float]:
        check_trainable(self.config)  # an encoder-only model has no logits to train
        losses = []
        with self._scope():
            if self._training is None:  # dropout as the config says, in the split only
                self._training = train._split_for_training(self.module)
            if self._schedule != (warmup, factor):
                self._optimizer = train.make_optimizer(
                    self._training, warmup, factor, device=self._device, previous=self._optimizer
                )
                self._schedule = (warmup, factor)
            try:
                for src, tgt in batches:
                    batch = self._batch(src, tgt)  # an InputError here leaves the steps so far
                    loss, self._training, self._optimizer = train.train_step(
                        self._training, self._optimizer, *batch
                    )
                    losses.append(loss)
            finally:
                # The steps donated the arrays the module held: it takes the new params (read by
                # forward, export and stepper). The dropout RNG state stays in self._training.
                train._write_back(self._training)
            # One transfer at the end: the steps queue on the device without waiting for the host.
            return [float(x) for x in losses]


class FlaxBackend:
    name = "jax"
    dtypes = COMPUTE_DTYPES  # float32, float64 (in a scoped x64 mode), bfloat16
    modes = ("eager", "compiled")
    native_suffixes = (".msgpack",)
    transposing_copy = None  # idiom: Flax stores the canonical layout: every view is contiguous

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
        precision: str = DEFAULT_PRECISION,
    ) -> FlaxModel:
        check_build_request(self, dtype, device, precision)
        target = jax_device(device)
        with x64_scope(dtype):
            module = _to_device(from_canonical(config, weights, dtype), target)
        module.eval()  # deterministic dropout
        return FlaxModel(config, module, dtype, device, precision)

    def save_native(
        self, path: str | Path, config: TransformerConfig, weights: Mapping[str, np.ndarray]
    ) -> None:
        """The nnx.Param state of a model holding canonical `weights` as msgpack (bit-exact in
        their dtype), written atomically, streamed one array at a time (weights.write_native)."""
        check_tensors(path, config, weights)
        write_native(path, config, weights)

    def load_native(self, path: str | Path, config: TransformerConfig) -> dict[str, np.ndarray]:
        """Canonical tensors from save_native's msgpack for `config`, bit-exact: read-only views
        of the mapped file."""
        return read_native(path, config)
