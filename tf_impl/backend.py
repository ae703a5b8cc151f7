"""The Keras 3 / TensorFlow implementation behind the adapter (common/adapter/backends.py), backend "tf"."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from collections.abc import Callable, Mapping  # noqa: E402
from pathlib import Path  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from transformer_rosetta.adapter.backends import check_build_request, check_mode  # noqa: E402
from transformer_rosetta.decoding.search import (  # noqa: E402
    check_row_ids,
    check_step_budget,
    check_stepper_request,
    prompt_prefix,
)
from transformer_rosetta.spec.config import TransformerConfig  # noqa: E402
from transformer_rosetta.spec.dtypes import COMPUTE_DTYPES  # noqa: E402
from transformer_rosetta.spec.inputs import check_inputs, check_trainable  # noqa: E402
from transformer_rosetta.spec.masks import shift_right  # noqa: E402
from transformer_rosetta.spec.precision import DEFAULT_PRECISION  # noqa: E402
from transformer_rosetta.spec.results import ForwardOutput, LossOutput  # noqa: E402
from transformer_rosetta.tf_impl.decode import (  # noqa: E402
    encode_rows,
    init_cache,
    prefix_function,
    reorder_function,
    step_function,
    top_k_log_probs,
)
from transformer_rosetta.tf_impl.model import Transformer  # noqa: E402
from transformer_rosetta.tf_impl.precision import matmul_precision  # noqa: E402
from transformer_rosetta.tf_impl.train import (  # noqa: E402
    Adam,
    canonical_grads,
    loss_and_grads,
    make_optimizer,
    noam_schedule,
    train_step,
)
from transformer_rosetta.tf_impl.weights import (  # noqa: E402
    KERAS_SUFFIX,
    export_canonical,
    load_canonical,
    new_model,
    read_native,
    write_native,
)
from transformer_rosetta.weights.format import check_tensors  # noqa: E402


# idiom: TensorFlow places work by device name in a tf.device scope
def tf_device(device: str) -> str:
    """'cpu' -> '/CPU:0', 'gpu:N' -> '/GPU:N'."""
    kind, _, index = device.partition(":")
    return f"/{kind.upper()}:{index or 0}"


def to_numpy(x: tf.Tensor) -> np.ndarray:
    array = keras.ops.convert_to_numpy(x)
    # numpy cannot compute in bfloat16; float32 holds every bfloat16 value exactly.
    return array.astype(np.float32) if array.dtype.name == "bfloat16" else array


def _tensor(ids: np.ndarray | None) -> tf.Tensor | None:
    """Validated ids as a tensor; None (the input a half of the family does not take) stays None."""
    return None if ids is None else tf.constant(ids)


class KerasStepper:
    """transformer_rosetta.decoding.search.Stepper over tf_impl/decode.py: numpy in and out, the cache (or, uncached,
    the prefix) held between steps. Made by KerasModel.stepper. A decoder-only model's src is the
    prompt (B, P): cached, init_cache prefills its first P - 1 tokens; uncached, the prefix
    starts as them, with no memory."""

    def __init__(
        self, model: KerasModel, src: np.ndarray, beams: int, max_steps: int, cached: bool
    ) -> None:
        self.model, self.max_steps, self.cached, self.steps = model, max_steps, cached, 0
        self.rows = src.shape[0] * beams
        fns = model.decode_functions()
        with tf.device(tf_device(model.device)), matmul_precision(model.precision):
            src_tensor = tf.constant(src)
            if cached:
                self.cache = init_cache(model.module, src_tensor, beams, max_steps)
            elif model.config.has_encoder:
                # Uncached, the memory is still encoded once: it is the decoder prefix that every
                # step recomputes.
                self.memory, self.src = encode_rows(model.module, src_tensor, beams)
                self.prefix = np.zeros((self.rows, 0), dtype=np.int64)
            else:
                self.memory = self.src = None
                self.prefix = prompt_prefix(src, beams)  # (N, P - 1)
        self._step, self._reorder, self._prefix = fns["step"], fns["reorder"], fns["prefix"]

    def _logits(self, tokens: np.ndarray) -> tf.Tensor:
        """One step's logits (N, V), left on the device."""
        check_step_budget(self.steps, self.max_steps)
        tokens = check_row_ids(tokens, "tokens", self.rows, self.model.config.tgt_vocab_size)
        with tf.device(tf_device(self.model.device)), matmul_precision(self.model.precision):
            if self.cached:
                logits, self.cache = self._step(tf.constant(tokens), self.cache)
            else:
                self.prefix = np.concatenate([self.prefix, tokens[:, None]], axis=1)
                memory = () if self.memory is None else (self.memory, self.src)
                logits = self._prefix(tf.constant(self.prefix), *memory)
        self.steps += 1
        return logits

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed tokens (N,) at the next position; that position's logits (N, V)."""
        return to_numpy(self._logits(tokens))

    def step_top(self, tokens: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """transformer_rosetta.decoding.search.TopStepper: only (N, k) values and ids leave the device."""
        logits = self._logits(tokens)
        with tf.device(tf_device(self.model.device)):
            values, ids = top_k_log_probs(logits, k)
        return to_numpy(values), to_numpy(ids).astype(np.int64)

    def reorder(self, rows: np.ndarray) -> None:
        """Row i continues as the old row rows[i] from now on (beam search)."""
        rows = check_row_ids(rows, "rows", self.rows, self.rows)
        with tf.device(tf_device(self.model.device)):
            if self.cached:
                self.cache = self._reorder(self.cache, tf.constant(rows))
            else:
                self.prefix = self.prefix[rows]
                if self.memory is not None:
                    self.memory = tf.gather(self.memory, rows)
                    self.src = tf.gather(self.src, rows)


class KerasModel:
    """A built Keras Transformer on one device, in one dtype (the adapter's Model)."""

    def __init__(
        self,
        config: TransformerConfig,
        module: Transformer,
        dtype: str,
        device: str,
        precision: str = DEFAULT_PRECISION,
        jit_compile: bool = False,  # idiom: XLA or not is a tf.function argument
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.precision = precision  # every call runs under matmul_precision(precision)
        self.module = module
        self.jit_compile = jit_compile
        self._compiled: dict[bool, Callable] = {}
        # Training state (tf_impl/train.py), made on first use. One optimizer for the model's
        # lifetime, so that Adam's moments and its step count (Noam's step) carry across calls;
        # one compiled step per (warmup, factor), the schedule being baked into its trace.
        self._loss_and_grads: Callable | None = None
        self._optimizer: Adam | None = None
        self._train_fns: dict[tuple[int, float], Callable] = {}
        # The XLA switch of training (train_steps, and loss_and_grads, which must round as a step
        # does), on whatever jit_compile says (that one is for the forward and decoding, whose
        # shapes change from call to call): training repeats one batch shape thousands of times
        # (tasks.batch_ids(width=)), and on the numbers task (2 CPU cores) XLA runs a step in
        # ~22 ms where the graph takes ~40 ms (TensorFlow's small-matrix kernels, thousands of
        # ops) and torch ~26 ms, for ~4 s more compile, once. Set it False before the first
        # call to train on many shapes.
        self.train_jit_compile = True
        # Decoding (tf_impl/decode.py): one tf.function each, made on first use, so that their
        # traces are kept across steppers.
        self._decode_fns: dict[str, Callable] | None = None

    def export(self) -> dict[str, np.ndarray]:
        return export_canonical(self.module)

    def _compiled_forward(self, attention: bool) -> Callable:
        """A tf.function eval forward, one per attention path (traced again per input shape;
        a None input, the half a model lacks, is a constant of the trace); XLA-compiled when
        jit_compile is set."""
        if attention not in self._compiled:
            model = self.module

            @tf.function(jit_compile=self.jit_compile)
            def forward(src: tf.Tensor | None, tgt_in: tf.Tensor | None) -> dict:
                return model(src, tgt_in, return_attention=attention, training=False)

            self._compiled[attention] = forward
        return self._compiled[attention]

    def forward(
        self,
        src: np.ndarray | None,
        tgt_in: np.ndarray | None,
        *,
        attention: bool = False,
        hidden_states: bool = False,
        mode: str = "eager",
    ) -> ForwardOutput:
        src, tgt_in = check_inputs(self.config, src, tgt_in)
        check_mode(KerasBackend.modes, mode)
        # rosetta: device
        with tf.device(tf_device(self.device)), matmul_precision(self.precision):
            # rosetta: end
            if mode == "compiled":
                out = self._compiled_forward(attention)(_tensor(src), _tensor(tgt_in))
            else:
                out = self.module(src, tgt_in, return_attention=attention, training=False)
        return ForwardOutput.from_model(
            out, to_numpy, attention=attention, hidden_states=hidden_states
        )

    # idiom: tf.function traces live with their function; the tests count them
    def decode_functions(self) -> dict[str, Callable]:
        """The compiled decoding functions of this model: "step" (cached; XLA when jit_compile
        is set), "reorder" and "prefix" (uncached; a graph, never XLA)."""
        if self._decode_fns is None:
            self._decode_fns = {
                "step": step_function(self.module, self.jit_compile),
                "reorder": reorder_function(),
                "prefix": prefix_function(self.module),
            }
        return self._decode_fns

    def stepper(
        self, src: np.ndarray, beams: int, max_steps: int, *, cached: bool = True
    ) -> KerasStepper:
        """Encode src (B, S) once; a Stepper over B * beams rows for at most max_steps steps
        (transformer_rosetta.adapter.backends.DecodingModel). cached=False recomputes the decoder prefix each step.
        A decoder-only model takes the prompt (B, P) as src."""
        src = check_stepper_request(self.config, src, beams, max_steps)
        return KerasStepper(self, src, beams, max_steps, cached)

    def _training_inputs(
        self, src: np.ndarray | None, tgt: np.ndarray
    ) -> tuple[tf.Tensor | None, tf.Tensor, tf.Tensor]:
        """(src, tgt_in, tgt) as tensors: the decoder reads tgt shifted right behind BOS. A
        decoder-only model's src is None."""
        src, tgt = check_inputs(self.config, src, tgt)
        tgt_in = shift_right(tgt, self.config.bos_id)
        return _tensor(src), tf.constant(tgt_in), tf.constant(tgt)

    def loss_and_grads(self, src: np.ndarray | None, tgt: np.ndarray) -> LossOutput:
        """Label-smoothed loss over non-pad targets and its gradient for every canonical tensor
        (a tf.GradientTape in a tf.function; see tf_impl/train.py). src None for a decoder-only
        model; an encoder-only one has no objective here (InputError)."""
        check_trainable(self.config)
        with tf.device(tf_device(self.device)), matmul_precision(self.precision):
            if self._loss_and_grads is None:
                model = self.module

                # idiom: one tf.function per model, its trace relaxed to any shape once a second
                # shape comes; no autograph (see train_steps). Compiled as the training step is
                # (train_jit_compile), so that these are the gradients a step takes: XLA and the
                # graph round differently, and Adam's first step turns even rounding noise in a
                # zero gradient (the key bias's) into a ~lr * 1e-8 move.
                @tf.function(
                    jit_compile=self.train_jit_compile, autograph=False, reduce_retracing=True
                )
                def compiled(src: tf.Tensor | None, tgt_in: tf.Tensor, tgt: tf.Tensor) -> tuple:
                    return loss_and_grads(model, src, tgt_in, tgt)

                self._loss_and_grads = compiled
            loss, accuracy, tokens, grads = self._loss_and_grads(*self._training_inputs(src, tgt))
        return LossOutput(
            loss=float(loss),
            accuracy=float(accuracy),
            tokens=int(tokens),
            grads={n: to_numpy(g) for n, g in canonical_grads(self.module, grads).items()},
        )

    def train_steps(
        self,
        batches: list[tuple[np.ndarray | None, np.ndarray]],
        *,
        warmup: int,
        factor: float = 1.0,
    ) -> list[float]:
        """One Adam step (eps on sqrt(v_hat), as transformer_rosetta.oracle.training.adam_step) per (src, tgt) batch
        at the Noam rate; steps count from 1 over the model's lifetime. Returns each step's loss,
        taken before its update.

        The step is one tf.function per schedule, XLA-compiled (train_jit_compile, see __init__).
        Its trace is plain Python over config values, with no tensor-dependent control flow, so
        autograph is off: converting the model's and Keras's code costs ~3 s per trace and
        changes nothing. The steps are queued one after another and their losses read back
        only at the end, so no step waits on the host. src None for a decoder-only model."""
        check_trainable(self.config)
        key = (warmup, factor)
        with tf.device(tf_device(self.device)), matmul_precision(self.precision):
            if self._optimizer is None:
                self._optimizer = make_optimizer(self.module, warmup, factor)
            if key not in self._train_fns:
                self._optimizer.learning_rate = noam_schedule(self.config.d_model, warmup, factor)
                model, optimizer = self.module, self._optimizer

                # idiom: one tf.function per schedule, baked into its trace (relaxed to any
                # shape once a second shape comes); XLA per concrete shape with train_jit_compile
                @tf.function(
                    jit_compile=self.train_jit_compile, autograph=False, reduce_retracing=True
                )
                def compiled(src: tf.Tensor | None, tgt_in: tf.Tensor, tgt: tf.Tensor) -> tf.Tensor:
                    return train_step(model, optimizer, src, tgt_in, tgt)

                self._train_fns[key] = compiled
            step = self._train_fns[key]
            losses = [step(*self._training_inputs(src, tgt)) for src, tgt in batches]
        return [float(loss) for loss in losses]


class KerasBackend:
    """Keras 3 on TensorFlow. Modes: "eager", and "compiled", a `tf.function` graph.

    `jit_compile=True` makes "compiled" an XLA program instead, as the benchmark runs it. It is
    not the default because XLA compiles each (model, input shape, attention path) anew, ~3 s
    on a CPU for even the tiny parity configs (a graph traces in ~0.5 s); parity_tests/impl/test_tf_impl.py
    checks the XLA path against the oracle on its own. Training steps are XLA programs either
    way (KerasModel.train_jit_compile): one batch shape, thousands of steps, repays the compile.
    """

    name = "tf"
    dtypes = COMPUTE_DTYPES
    modes = ("eager", "compiled")
    native_suffixes = (KERAS_SUFFIX,)
    transposing_copy = None  # idiom: Keras stores the canonical layout: every view is contiguous

    def __init__(self, jit_compile: bool = False) -> None:  # idiom: tf.function's XLA switch
        self.jit_compile = jit_compile

    def version(self) -> str:
        return f"keras {keras.__version__} / tensorflow {tf.__version__}"

    def devices(self) -> list[str]:
        gpus = tf.config.list_logical_devices("GPU")
        return ["cpu", *(f"gpu:{i}" for i in range(len(gpus)))]

    def build(
        self,
        config: TransformerConfig,
        weights: Mapping[str, np.ndarray],
        *,
        dtype: str = "float32",
        device: str = "cpu",
        precision: str = DEFAULT_PRECISION,
    ) -> KerasModel:
        check_build_request(self, dtype, device, precision)
        with tf.device(tf_device(device)):
            model = new_model(config, dtype)
            load_canonical(model, weights)
        return KerasModel(config, model, dtype, device, precision, self.jit_compile)

    def save_native(
        self, path: str | Path, config: TransformerConfig, weights: Mapping[str, np.ndarray]
    ) -> None:
        """Keras's own checkpoint (the file `model.save_weights` writes, a .weights.h5) for
        canonical `weights`, bit-exact in their dtype, written atomically, one dataset at a time
        with no model built (weights.write_native)."""
        check_tensors(path, config, weights)
        with tf.device("/CPU:0"):  # the one small model that tells Keras's layout
            write_native(path, config, weights)

    def load_native(self, path: str | Path, config: TransformerConfig) -> dict[str, np.ndarray]:
        """Canonical tensors from the .weights.h5 of a model for `config`, bit-exact: read-only
        views of the mapped file."""
        return read_native(path, config)
