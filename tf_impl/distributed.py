"""The Keras model on many devices: keras.distribution on Keras's JAX backend, for both mesh axes.

Which engine, and why. Keras offers two: `keras.distribution` (DataParallel, ModelParallel with a
LayoutMap), which only its JAX backend implements, and TensorFlow's own `tf.distribute`
(MirroredStrategy over logical CPU devices), which has data parallelism but no Keras LayoutMap.
Sharded parameters therefore need keras.distribution on JAX whatever data parallelism uses, and a
JAX-backend training step to go with them (Keras's "custom train step in JAX": `stateless_call`,
`jax.value_and_grad`, `optimizer.stateless_apply`). Doing data parallelism on tf.distribute as
well would mean two engines, two training steps and two kinds of subprocess for one mesh; with
keras.distribution a `data=2,model=2` mesh is one DeviceMesh and one step. So:
- data axis: `keras.distribution.DataParallel` (a 1-D mesh) when model=1, the `data` axis of
  `ModelParallel`'s 2-D mesh otherwise; the global batch is placed row-sharded over it with the
  distribution's `get_data_layout` (contiguous rows: spec.mesh.replica_rows);
- model axis: `ModelParallel` with the LayoutMap of `layout_map`, Megatron-style tensor
  parallelism, as jax_impl and torch_impl split: the attention's query/key/value kernels split
  over heads (column parallel) and its output kernel over its input heads (row parallel); the
  feed-forward's first kernel over its columns, its second over its rows. Everything else (the
  embeddings, the norms, the output biases) is replicated. XLA (GSPMD) inserts the collectives.

The model (tf_impl/model.py) and the optimizer (tf_impl/train.py's Adam, with the reference
epsilon placement, its Noam schedule) are the ones the TensorFlow backend trains; Keras's
optimizer API runs the same `update_step` under `stateless_apply`. Only the gradient step differs:
`jax.value_and_grad` instead of `tf.GradientTape` (# idiom below). Keras's backend is fixed when
keras is first imported, so this module needs KERAS_BACKEND=jax in the process (a subprocess in
the tests; XLA_FLAGS=--xla_force_host_platform_device_count=N for N CPU devices). JAX's 64-bit
mode is switched on while these functions run: a float64 model needs it, and the Noam rate is
computed in float64 for every dtype, as on TensorFlow.

The ragged-batch trap. JAX runs one global program over the sharded batch, so the loss is
written per data replica here, explicitly: replica r's rows (replica_rows) give its token sum
S_r (train.summed_loss), divided by the GLOBAL token count T of the batch, and the replicas' terms
are added, sum_r S_r / T, which is the one-device loss; XLA turns the sum over r into the
all-reduce of the data axis. `denominator="local"` (train_with_denominator) is the trap kept for
the tests: each replica divides by its own count T_r and the replicas are averaged, as an engine
that averages per-replica means does, mean_r(S_r / T_r), which differs on a ragged batch.

Dropout: the parity tests use dropout 0. With dropout > 0 the step runs (Keras's seed generator
state travels as a non-trainable variable through stateless_call), but the random stream is
JAX's, not TensorFlow's, and depends on the sharding, so no run is comparable with another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import keras
import numpy as np

from transformer_rosetta.errors import BackendUnavailable
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.inputs import check_inputs, check_trainable
from transformer_rosetta.spec.masks import shift_right
from transformer_rosetta.spec.mesh import (
    MeshShape,
    check_mesh,
    replica_loss_scale,
    replica_rows,
    target_tokens,
)
from transformer_rosetta.spec.precision import DEFAULT_PRECISION
from transformer_rosetta.spec.results import ForwardOutput
from transformer_rosetta.tf_impl.model import Transformer
from transformer_rosetta.tf_impl.precision import matmul_precision
from transformer_rosetta.tf_impl.train import make_optimizer, summed_loss
from transformer_rosetta.tf_impl.weights import (
    export_canonical,
    load_canonical,
    new_model,
    variables_by_name,
)

# Megatron-style tensor parallelism as a keras.distribution LayoutMap: a regex on the variable's
# path (re.fullmatch) -> the mesh axis of each of its dimensions (None: whole). Kernels are in
# the canonical layouts: attention [d, h, d_k] and [h, d_k, d], Dense [in, out].
TENSOR_PARALLEL: dict[str, tuple[str | None, ...]] = {
    # column parallel: each shard computes its own heads
    r".*attention/(query|key|value)/kernel": (None, "model", None),
    r".*attention/(query|key|value)/bias": ("model", None),
    # row parallel: each shard's heads give a partial sum of the output, all-reduced
    r".*attention/output/kernel": ("model", None, None),
    # the feed-forward: W_1's and W_gate's columns (and their biases), then W_2's rows
    r".*feed_forward/(gate|intermediate)/kernel": (None, "model"),
    r".*feed_forward/(gate|intermediate)/bias": ("model",),
    r".*feed_forward/output/kernel": ("model", None),
}


def _require_jax() -> None:
    if keras.backend.backend() != "jax":
        raise BackendUnavailable(
            "keras.distribution runs on Keras's JAX backend only; set KERAS_BACKEND=jax before "
            f"keras is imported (this process runs {keras.backend.backend()!r})"
        )


# idiom: two switches make float64 real on Keras's JAX backend: JAX's x64 mode, and Keras's own
# type promotion, which caps every float64 result at float32 on JAX (result_type's
# BIT64_TO_BIT32_DTYPE, "aligned with JAX's default"), with no public switch in Keras 3.15
# (keras-team/keras#21604 leaves one as a TODO). Without the second, LayerNormalization's
# variance, ops.sin/cos/tanh and ops.dot_product_attention compute a float64 model in float32:
# logits 5e-7 from the oracle instead of 2e-15 (measured on the tiny config).
@contextlib.contextmanager
def _x64(dtype: str) -> Iterator[None]:
    """JAX's 64-bit mode for the block (a float64 model; the Noam rate in float64 for every
    dtype, as on TensorFlow), and for a float64 model Keras's float64 results uncapped; both
    restored on exit."""
    import jax
    from keras.src.backend.common import dtypes

    was = jax.config.jax_enable_x64
    cap = dtypes.BIT64_TO_BIT32_DTYPE.get("float64")
    jax.config.update("jax_enable_x64", True)
    if dtype == "float64":
        dtypes.BIT64_TO_BIT32_DTYPE["float64"] = "float64"
    try:
        yield
    finally:
        if cap is not None:
            dtypes.BIT64_TO_BIT32_DTYPE["float64"] = cap
        jax.config.update("jax_enable_x64", was)


def layout_map(mesh: MeshShape) -> keras.distribution.LayoutMap:
    """TENSOR_PARALLEL on a ("data", "model") DeviceMesh of `mesh`'s shape."""
    device_mesh = keras.distribution.DeviceMesh(
        mesh.shape, ("data", "model"), keras.distribution.list_devices()[: mesh.size]
    )
    layouts = keras.distribution.LayoutMap(device_mesh)
    for pattern, axes in TENSOR_PARALLEL.items():
        layouts[pattern] = axes
    return layouts


def distribution(mesh: MeshShape) -> keras.distribution.Distribution:
    """DataParallel for a data-only mesh; ModelParallel with layout_map's tensor parallelism and
    the batch over "data" otherwise."""
    devices = keras.distribution.list_devices()[: mesh.size]
    if mesh.model == 1:
        return keras.distribution.DataParallel(devices=devices)
    return keras.distribution.ModelParallel(layout_map=layout_map(mesh), batch_dim_name="data")


def build_on_mesh(
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    mesh: MeshShape,
    *,
    dtype: str = "float32",
    batch: int | None = None,
) -> tuple[Transformer, keras.distribution.Distribution]:
    """The Keras model for `config` holding `weights`, its variables laid out on `mesh` (each
    device holds its shard: `variable.value.addressable_shards`). check_mesh first: the mesh must
    divide `batch`, the heads and d_ff, and fit the devices there are."""
    _require_jax()
    check_mesh(mesh, config, batch=batch, devices=len(keras.distribution.list_devices()))
    spread = distribution(mesh)
    # idiom: variables take their layout from the distribution in scope when they are created
    with spread.scope():
        model = new_model(config, dtype)
        load_canonical(model, weights)  # assign re-lays each value out to its variable's layout
    return model, spread


def _place_rows(spread: keras.distribution.Distribution, ids: np.ndarray | None) -> Any:
    """A global batch of ids, its rows sharded over the data axis (None stays None)."""
    if ids is None:
        return None
    return keras.distribution.distribute_tensor(ids, spread.get_data_layout(ids.shape))


def _to_numpy(x: Any) -> np.ndarray:
    array = keras.ops.convert_to_numpy(x)  # gathers a sharded array whole
    return array.astype(np.float32) if array.dtype.name == "bfloat16" else array


def mesh_loss(
    config: TransformerConfig, logits: Any, tgt: Any, data: int, scale: Any | None
) -> Any:
    """The step's loss from the global (B, T, V) logits, written per data replica (see the
    module docstring). `scale` is replica_loss_scale(T, data, engine_averages=False) = 1 / T for
    the batch's global token count T: the loss is sum_r S_r * scale, the one-device loss. None is
    the trap: mean_r(S_r / T_r), each replica dividing by its own count."""
    rows = tgt.shape[0]
    parts = [
        summed_loss(logits[s], tgt[s], config.pad_id, config.label_smoothing)
        for s in (replica_rows(rows, data, r) for r in range(data))
    ]
    if scale is None:
        means = [total / keras.ops.cast(keras.ops.maximum(n, 1), total.dtype) for total, n in parts]
        return sum(means) / data
    # idiom: XLA adds the replicas' terms (an all-reduce over "data" under GSPMD): a summing
    # engine, so each replica's sum is scaled by 1 / T (replica_loss_scale)
    return sum(total * keras.ops.cast(scale, total.dtype) for total, _ in parts)


def train_with_denominator(
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    batches: Sequence[tuple[np.ndarray | None, np.ndarray]],
    mesh: MeshShape,
    *,
    denominator: Literal["global", "local"],
    dtype: str = "float32",
    warmup: int,
    factor: float = 1.0,
) -> tuple[list[float], dict[str, np.ndarray]]:
    """train_on_mesh with the replicas' denominator chosen: "global" (train_on_mesh) or "local",
    the ragged-batch trap (mesh_loss)."""
    _require_jax()
    import jax

    check_trainable(config)
    checked = [check_inputs(config, src, tgt) for src, tgt in batches]
    with _x64(dtype), matmul_precision(DEFAULT_PRECISION):
        devices = len(keras.distribution.list_devices())
        for _, tgt in checked:  # every problem of the mesh, named, before anything is built
            check_mesh(mesh, config, batch=tgt.shape[0], devices=devices)
        rows = checked[0][1].shape[0] if checked else None
        model, spread = build_on_mesh(config, weights, mesh, dtype=dtype, batch=rows)
        with spread.scope():
            optimizer = make_optimizer(model, warmup, factor)
        # make_optimizer builds Adam on the canonical order; stateless_call takes the model's.
        canonical = list(variables_by_name(model).values())
        order = {id(v): i for i, v in enumerate(canonical)}
        to_model = [order[id(v)] for v in model.trainable_variables]

        # idiom: on JAX, ops.dot_product_attention is jax.nn.dot_product_attention, whose softmax
        # runs in float32 whatever the inputs' dtype (jax/_src/nn/functions.py); a float64 step
        # takes the explicit attention path instead (its maps are unused, and XLA drops them)
        explicit = dtype == "float64"

        # idiom: Keras's JAX training step is a pure function of the variables' values
        # (stateless_call, stateless_apply) under jax.value_and_grad, where TensorFlow's runs
        # a GradientTape over the variables themselves
        def step(state: tuple, src: Any, tgt_in: Any, tgt: Any, scale: Any) -> tuple[Any, tuple]:
            trainable, non_trainable, optimizer_vars = state

            def loss_fn(values: list) -> tuple[Any, list]:
                out, updated = model.stateless_call(
                    [values[i] for i in to_model],
                    non_trainable,
                    src,
                    tgt_in,
                    training=True,
                    return_attention=explicit,
                )
                return mesh_loss(config, out["logits"], tgt, mesh.data, scale), updated

            (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
            trainable, optimizer_vars = optimizer.stateless_apply(optimizer_vars, grads, trainable)
            return loss, (trainable, non_trainable, optimizer_vars)

        state = (
            [v.value for v in canonical],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in optimizer.variables],
        )
        # Each value keeps its layout from step to step (XLA would otherwise choose).
        replicated = jax.sharding.NamedSharding(
            spread.device_mesh.backend_mesh, jax.sharding.PartitionSpec()
        )
        shardings = jax.tree.map(lambda a: a.sharding, state)
        compiled = jax.jit(step, out_shardings=(replicated, shardings))
        losses = []
        for src, tgt in checked:
            tgt_in = shift_right(tgt, config.bos_id)
            # The global token count: every replica reads the whole batch, so each knows it.
            tokens = target_tokens(tgt, config.pad_id)
            scale = (
                np.float64(replica_loss_scale(tokens, mesh.data, engine_averages=False))
                if denominator == "global"
                else None
            )
            placed = (_place_rows(spread, a) for a in (src, tgt_in, tgt))
            loss, state = compiled(state, *placed, scale)
            # idiom: wait for each step on a mesh: with some 60-100 steps queued, XLA's CPU
            # collectives wait 40 s for an all-reduce one device never joins and abort (SIGABRT,
            # measured on 2 host devices at 101 and 151 steps; none when each step is awaited)
            losses.append(jax.block_until_ready(loss))
        for variable, value in zip(canonical, state[0], strict=True):
            variable.assign(value)
        return [float(loss) for loss in losses], export_canonical(model)


def train_on_mesh(
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    batches: Sequence[tuple[np.ndarray | None, np.ndarray]],
    mesh: MeshShape,
    *,
    dtype: str = "float32",
    warmup: int,
    factor: float = 1.0,
) -> tuple[list[float], dict[str, np.ndarray]]:
    """Adam steps on `mesh` with the framework's own engine, as train.py's train_step takes them
    (the paper's Adam, the Noam rate of each step counted from 1): every data replica takes
    replica_rows of each GLOBAL batch and divides its token sum by the batch's global token count
    (transformer_rosetta.spec.mesh), and the model shards split the parameters. The mesh and every
    batch are checked before anything starts. Returns (each step's global loss, taken before its
    update; the final weights as canonical numpy arrays, gathered whole): the one-device run's
    within the parity bounds (docs/DISTRIBUTED.md). Dropout: see the module docstring."""
    # idiom: keras.distribution runs on Keras's JAX backend only (KERAS_BACKEND=jax)
    return train_with_denominator(
        config,
        weights,
        batches,
        mesh,
        denominator="global",
        dtype=dtype,
        warmup=warmup,
        factor=factor,
    )


def forward_on_mesh(
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    src: np.ndarray | None,
    tgt_in: np.ndarray,
    mesh: MeshShape,
    *,
    dtype: str = "float32",
) -> ForwardOutput:
    """The model's forward on `mesh` (eval mode, the explicit attention path), its parameters
    sharded over mesh.model and the batch's rows over mesh.data, gathered to numpy: the logits,
    the encoder output and every attention map, no hidden states."""
    # idiom: keras.distribution runs on Keras's JAX backend only (KERAS_BACKEND=jax)
    _require_jax()
    import jax

    src, tgt_in = check_inputs(config, src, tgt_in)
    rows = (tgt_in if tgt_in is not None else src).shape[0]
    with _x64(dtype), matmul_precision(DEFAULT_PRECISION):
        model, spread = build_on_mesh(config, weights, mesh, dtype=dtype, batch=rows)

        @jax.jit
        def forward(trainable: list, non_trainable: list, src: Any, tgt_in: Any) -> dict:
            out, _ = model.stateless_call(
                trainable, non_trainable, src, tgt_in, training=False, return_attention=True
            )
            return out

        out = forward(
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            _place_rows(spread, src),
            _place_rows(spread, tgt_in),
        )
        return ForwardOutput.from_model(out, _to_numpy, attention=True, hidden_states=False)
