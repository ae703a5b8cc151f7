"""The Flax NNX Transformer on many devices: data parallelism and Megatron-style tensor
parallelism, both written as sharding annotations on one jax.sharding.Mesh (GSPMD).

The mesh (common/spec/mesh.py) has two axes, ("data", "model"), over the first data * model of
jax.devices(): on one CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N set before jax is
imported; across processes, initialize_processes first (jax.distributed with gloo collectives).
- The batch is placed with NamedSharding(mesh, P("data")): data replica r holds rows
  replica_rows(B, data, r), the contiguous block of the global batch.
- The parameters carry Megatron-style tensor-parallel annotations (Shoeybi et al. 2019, section
  3), as Flax's "Scale up on multiple devices" guide writes them: `out_sharding` metadata on each
  nnx.Param, read back by nnx.get_named_sharding. Attention's query, key and value kernels
  [d, h, d_k] and biases [h, d_k] split their heads over "model", and the output projection
  [h, d_k, d] its input (heads) axis, so each model shard computes Eq. (1) for h / model whole
  heads (grouped-query attention's key and value heads, [d, g, d_k], likewise: g / model whole
  key/value heads per shard, those its query heads read); the feed-forward's first kernel
  [d, d_ff] and bias (and a gated feed-forward's gate, whose product with it is per column)
  split d_ff (columns), the second [d_ff, d] its rows. The embeddings (a tied output projection
  included), the norms and the biases added after a row-split kernel (attention's and the
  feed-forward's output bias) are replicated: they are small, and the row-split products meet
  in one all-reduce before them.

The training step is train.py's compiled step, unchanged: the same jax.jit function of the same
loss, called on sharded arrays, so XLA (GSPMD) partitions it and inserts the collectives (the
all-reduce of the row-split products, the gradient reduction over "data"). Under jit a sharded
batch is ONE global array, so label_smoothed_loss's sum over it divided by its token count is the
one-device loss exactly, ragged or not: there is no per-replica mean to get wrong.

The ragged trap (section 5.4's loss is a mean over the global batch's non-pad tokens) appears
only in per-replica code, where each replica computes a loss of its own rows and the engine
reduces them (jax.shard_map with jax.lax.pmean, as pmap code did): mean_r(S_r / T_r) is not
sum_r(S_r) / T when replicas hold different token counts T_r. ragged_trap_train_on_mesh is that
per-replica code, kept only to measure the trap ("local") and its fix ("global": each replica's
token SUM, train.summed_loss, times transformer_rosetta.spec.mesh.replica_loss_scale).

Dropout: the parity tests run dropout 0. With dropout > 0, train_on_mesh draws its masks from
the one model's RNG keys under jit, and JAX's partitionable threefry (the default) gives the same
random bits whatever the sharding, so the masks are those of one device.

Float64 needs JAX's x64 mode, scoped to the call (transformer_rosetta.jax_impl.weights.x64_scope).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx import traversals
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer_rosetta.errors import InputError
from transformer_rosetta.jax_impl import train
from transformer_rosetta.jax_impl.model import Transformer
from transformer_rosetta.jax_impl.precision import matmul_precision
from transformer_rosetta.jax_impl.weights import from_canonical, param_paths, x64_scope
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.dtypes import COMPUTE_DTYPES
from transformer_rosetta.spec.inputs import check_inputs, check_trainable
from transformer_rosetta.spec.masks import shift_right
from transformer_rosetta.spec.mesh import (
    MESH_AXES,
    MeshShape,
    check_mesh,
    replica_loss_scale,
    replica_rows,
    target_tokens,
)
from transformer_rosetta.spec.results import ForwardOutput

_Tree = dict[str, Any]
_Batch = tuple[np.ndarray | None, np.ndarray]


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
    # idiom: train.py's compiled step on sharded params, batch and Adam moments (the moments
    # sharded as their params): GSPMD reduces the gradients, and the loss under jit is the
    # global mean (the module docstring); everything is checked before anything is compiled
    batches = _check_training(config, batches, mesh, dtype)
    with x64_scope(dtype), matmul_precision():
        jmesh = make_mesh(mesh)
        module, split = _sharded_split(config, weights, jmesh, dtype, training=True)
        optimizer = _sharded_adam(split, jmesh, warmup, factor)
        losses = []
        for src, tgt in batches:
            batch = _sharded_batch(config, src, tgt, jmesh)
            loss, split, optimizer = train.train_step(split, optimizer, *batch)
            # idiom: wait for each step on a mesh: with some 60-100 steps queued, XLA's CPU
            # collectives wait 40 s for an all-reduce one device never joins and abort (SIGABRT,
            # measured on 2 host devices at 101 and 151 steps; none when each step is awaited)
            losses.append(loss.block_until_ready())
        return [float(x) for x in _gather(losses)], _canonical(module, split.params)


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
    # idiom: the explicit path (return_attention) under jit; checked before anything compiles
    _check_dtype(dtype)
    src, tgt_in = check_inputs(config, src, tgt_in)
    given = tgt_in if tgt_in is not None else src  # check_inputs: at least one of them
    rows = None if given is None else given.shape[0]
    check_mesh(mesh, config, batch=rows, devices=jax.device_count())
    with x64_scope(dtype), matmul_precision():
        jmesh = make_mesh(mesh)
        _, split = _sharded_split(config, weights, jmesh, dtype, training=False)
        ids = _place((src, tgt_in), NamedSharding(jmesh, P("data")), np.int32)
        out = _compiled_forward(split.graphdef)(split.params, split.rest, *ids)
        return ForwardOutput.from_model(
            _gather(out), _host_float, attention=True, hidden_states=False
        )


def make_mesh(mesh: MeshShape) -> jax.sharding.Mesh:
    """The ("data", "model") jax.sharding.Mesh over the first mesh.size of jax.devices(), data
    major: the devices of one data replica are neighbours."""
    # idiom: Auto axes, the GSPMD mode of Flax's guide (jax.make_mesh defaults to Explicit
    # sharding, where every array's sharding is part of its type and each op must resolve it)
    return jax.make_mesh(
        mesh.shape,
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
        devices=jax.devices()[: mesh.size],
    )


# Megatron-style tensor parallelism by canonical name: (pattern, the axes of the tensor that the
# "model" mesh axis splits). Everything else is replicated.
_TENSOR_PARALLEL: tuple[tuple[re.Pattern[str], tuple[str | None, ...]], ...] = (
    # column-parallel: the heads of q, k and v ([d, h, d_k], biases [h, d_k])
    (re.compile(r"attention\.(query|key|value)\.kernel$"), (None, "model", None)),
    (re.compile(r"attention\.(query|key|value)\.bias$"), ("model", None)),
    # row-parallel: W^O's input axis is the heads ([h, d_k, d]); its bias is added after the sum
    (re.compile(r"attention\.output\.kernel$"), ("model", None, None)),
    # column-parallel W_1 [d, d_ff] and b_1 [d_ff] (and W_gate, b_gate); row-parallel W_2 [d_ff, d]
    (re.compile(r"feed_forward\.(gate|intermediate)\.kernel$"), (None, "model")),
    (re.compile(r"feed_forward\.(gate|intermediate)\.bias$"), ("model",)),
    (re.compile(r"feed_forward\.output\.kernel$"), ("model", None)),
)


def tensor_parallel_axes(name: str) -> tuple[str | None, ...]:
    """The mesh axis each axis of canonical tensor `name` is split over: "model" on the heads or
    d_ff axis of the tensors that Megatron-style tensor parallelism splits, () (replicated) for
    the rest."""
    for pattern, axes in _TENSOR_PARALLEL:
        if pattern.search(name):
            return axes
    return ()


# idiom: the annotations go on after the build, where nnx.with_partitioning would set them at
# init: model.py builds one module for every device count, and Flax shards an annotated
# Variable eagerly at creation, which needs the mesh there
def annotate_tensor_parallel(model: Transformer) -> None:
    """Set each nnx.Param's `out_sharding` metadata (what nnx.with_partitioning sets) to
    tensor_parallel_axes of its canonical name, in place, for nnx.get_named_sharding."""
    state = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for name, path in param_paths(model).items():
        axes = tensor_parallel_axes(name)
        state[path].set_metadata(out_sharding=axes or None)


# How long the other processes wait for a lost one before JAX's coordination service stops them
# with its error (JAX's default is 100 s): a run's steps take well under a second each, and a
# lost process must not hold the others much longer than torch's ranks wait (60 s). A survivor
# in a collective stops sooner, at gloo's socket error (within a second; docs/DISTRIBUTED.md);
# the heartbeat bounds the rest (a process lost outside any collective, as at the shutdown).
HEARTBEAT_TIMEOUT_SECONDS = 60


def initialize_processes(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """Join a multi-process launch (one process per host or device group) before any other JAX
    call: jax.distributed.initialize with CPU collectives over gloo. Arguments left out come from
    the environment, JAX_COORDINATOR_ADDRESS ("host:port"), JAX_NUM_PROCESSES, JAX_PROCESS_ID;
    what neither gives, jax.distributed's own cluster detection (SLURM, Open MPI, ...) finds.
    Then jax.devices() lists every process's devices, and train_on_mesh and forward_on_mesh run
    the same on each process (every process passes the same global batches)."""
    num_processes = _env_int("JAX_NUM_PROCESSES") if num_processes is None else num_processes
    process_id = _env_int("JAX_PROCESS_ID") if process_id is None else process_id
    # idiom: cross-process collectives on CPU need an implementation named before the backend
    # starts; gloo is the one that needs nothing installed (JAX's default here; said anyway)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_SECONDS,
    )


def ragged_trap_train_on_mesh(
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    batches: Sequence[tuple[np.ndarray | None, np.ndarray]],
    mesh: MeshShape,
    *,
    dtype: str = "float32",
    warmup: int,
    factor: float = 1.0,
    denominator: Literal["local", "global"],
) -> tuple[list[float], dict[str, np.ndarray]]:
    """train_on_mesh written per replica, kept only to show the ragged-batch trap: each data
    replica computes its loss and gradients on its own rows inside jax.shard_map, and
    jax.lax.pmean averages them (what pmap code did; DDP averages the same way).

    Each replica's loss is its token SUM (train.summed_loss) times a factor of its own.
    denominator "local" is the trap: 1 / its OWN non-pad token count, so each replica takes its
    own mean and the step follows mean_r(S_r / T_r), not the one-device sum_r S_r / T. "global"
    is the fix: replica_loss_scale(T, replicas, engine_averages=True) = replicas / T, T counted
    on the global batch, so the average is the one-device loss. Returns what train_on_mesh
    returns (the losses are the pmean'd ones the replicas report). Data parallelism only
    (mesh.model 1); with dropout > 0 every replica would draw the same masks from its copy of
    the keys."""
    if mesh.model != 1:
        raise InputError(f"--mesh {mesh}: the per-replica demonstration is data-parallel only")
    batches = _check_training(config, batches, mesh, dtype)
    with x64_scope(dtype), matmul_precision():
        jmesh = make_mesh(mesh)
        module, split = _sharded_split(config, weights, jmesh, dtype, training=True)
        tx = train._noam_adam(config.d_model, warmup, factor)
        state = _init_adam(tx, split.params, jmesh)
        step = _per_replica_step(config, split.graphdef, tx, jmesh)
        params, losses = split.params, []
        for src, tgt in batches:
            rows = tgt.shape[0]
            if denominator == "local":  # the trap: each replica's own token count
                counts = [
                    target_tokens(tgt[replica_rows(rows, mesh.data, r)], config.pad_id)
                    for r in range(mesh.data)
                ]
                scales = [1.0 / max(count, 1) for count in counts]
            else:  # the fix: the global count, and the engine's average undone
                total = target_tokens(tgt, config.pad_id)
                scales = [replica_loss_scale(total, mesh.data, engine_averages=True)] * mesh.data
            batch = _sharded_batch(config, src, tgt, jmesh)
            # the factors in the loss sum's dtype: float64, or float32 (bfloat16's statistics)
            wide = np.float64 if dtype == "float64" else np.float32
            scale = _global(np.array(scales), NamedSharding(jmesh, P("data")), wide)
            loss, params, state = step(params, split.rest, state, *batch, scale)
            losses.append(loss.block_until_ready())  # see train_on_mesh: never many steps queued
        return [float(x) for x in _gather(losses)], _canonical(module, params)


# -- checks ---------------------------------------------------------------------------------------


def _check_dtype(dtype: str) -> None:
    if dtype not in COMPUTE_DTYPES:
        raise InputError(f"dtype: unknown {dtype!r}; allowed: {', '.join(COMPUTE_DTYPES)}")


def _check_training(
    config: TransformerConfig, batches: Sequence[_Batch], mesh: MeshShape, dtype: str
) -> list[_Batch]:
    """Every batch validated (check_inputs) and the mesh checked against each batch's rows and
    the devices there are (check_mesh), all before anything is compiled."""
    _check_dtype(dtype)
    check_trainable(config)  # an encoder-only model has no logits to train
    checked: list[_Batch] = []
    for src, tgt in batches:
        src, tgt = check_inputs(config, src, tgt)
        if tgt is None:  # a model with a decoder: check_inputs has refused it already
            raise InputError("train: the batches need targets")
        checked.append((src, tgt))
    for rows in sorted({tgt.shape[0] for _, tgt in checked}) or [None]:
        check_mesh(mesh, config, batch=rows, devices=jax.device_count())
    return checked


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    if not value.strip().isdecimal():
        raise InputError(f"{name}={value!r}: must be a whole number")
    return int(value)


# -- placement ------------------------------------------------------------------------------------


def _global(host: Any, sharding: jax.sharding.Sharding, dtype: Any = None) -> jax.Array:
    """A global jax.Array of `host`'s value (every process holds the whole value), laid out by
    `sharding`: each device receives its own slice only. An RNG key array goes through its raw
    key data."""
    if isinstance(host, jax.Array) and jnp.issubdtype(host.dtype, jax.dtypes.prng_key):
        data = _global(jax.random.key_data(host), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(host))
    array = np.asarray(host) if dtype is None else np.asarray(host).astype(dtype)
    # idiom: make_array_from_callback, not jax.device_put: it builds the array from each
    # process's addressable slices, so one call serves one process and many
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _place(tree: Any, sharding: jax.sharding.Sharding, dtype: Any = None) -> Any:
    """Every array of `tree` as a global array laid out by `sharding`; None stays None."""
    return jax.tree.map(lambda x: _global(x, sharding, dtype), tree)


def _sharded_split(
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    jmesh: jax.sharding.Mesh,
    dtype: str,
    *,
    training: bool,
) -> tuple[Transformer, train._Split]:
    """The module holding `weights` (kept for its canonical names) and its split (graphdef,
    params, rest) with the params placed by their tensor-parallel annotations and the rest
    (dropout's RNG state) replicated. training: dropout as the config sets it
    (train._split_for_training); otherwise eval mode, as the backend runs forward."""
    module = from_canonical(config, weights, dtype)
    annotate_tensor_parallel(module)
    shardings = nnx.to_pure_dict(nnx.get_named_sharding(nnx.state(module, nnx.Param), jmesh))
    if training:
        split = train._split_for_training(module)
    else:
        module.eval()
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        pure = nnx.to_pure_dict
        split = train._Split(config, graphdef, pure(params), pure(rest), ())
    params = jax.tree.map(_global, split.params, shardings)
    rest = _place(split.rest, NamedSharding(jmesh, P()))
    return module, split._replace(params=params, rest=rest)


def _init_adam(
    tx: optax.GradientTransformation, params: _Tree, jmesh: jax.sharding.Mesh
) -> optax.OptState:
    """tx's state made on the mesh: each Adam moment sharded as its parameter (optax's
    tree_map_params), the step counts replicated."""
    shardings = jax.tree.map(lambda p: p.sharding, params)
    state_shardings = optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        jax.eval_shape(tx.init, params),
        shardings,
        transform_non_params=lambda _: NamedSharding(jmesh, P()),
    )
    return jax.jit(tx.init, out_shardings=state_shardings)(params)


def _sharded_adam(
    split: train._Split, jmesh: jax.sharding.Mesh, warmup: int, factor: float
) -> train._Adam:
    """train.make_optimizer's Adam (the same schedule and compiled step) with its state on the
    mesh (_init_adam) rather than on one device."""
    tx = train._noam_adam(split.config.d_model, warmup, factor)
    return train._Adam(
        _init_adam(tx, split.params, jmesh), train._compiled_train_step(split.graphdef, tx)
    )


def _sharded_batch(
    config: TransformerConfig, src: np.ndarray | None, tgt: np.ndarray, jmesh: jax.sharding.Mesh
) -> tuple[jax.Array | None, ...]:
    """(src, tgt_in, tgt) as int32 global arrays, rows split over "data"; tgt_in is tgt shifted
    right behind BOS, on the host by the common rule."""
    batch = (src, shift_right(tgt, config.bos_id), tgt)
    return _place(batch, NamedSharding(jmesh, P("data")), np.int32)


# -- gathering ------------------------------------------------------------------------------------


def _gather(tree: Any) -> Any:
    """Every array of `tree` whole, as numpy, on every process (an array spread over other
    processes' devices included): one compiled copy to replicated layouts, not one per array."""
    if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return jax.tree.map(np.asarray, tree)
    # idiom: what multihost_utils.process_allgather does per array, for the whole tree at once
    whole = jax.tree.map(lambda x: x.sharding.update(spec=P()), tree)
    replicated = jax.jit(lambda t: t, out_shardings=whole)(tree)
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), replicated)


def _host_float(a: np.ndarray) -> np.ndarray:
    """float64/float32 stay as they are; bfloat16 goes to float32 so numpy can compare it."""
    a = np.asarray(a)
    return a if a.dtype in (np.float64, np.float32) else a.astype(np.float32)


def _canonical(module: Transformer, params: _Tree) -> dict[str, np.ndarray]:
    """{canonical name: the whole tensor, numpy, in the model's dtype} of sharded `params`."""
    flat = traversals.flatten_mapping(_gather(params))
    return {name: np.asarray(flat[path]) for name, path in param_paths(module).items()}


# -- compiled functions ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _compiled_forward(graphdef: nnx.GraphDef) -> Callable[..., dict]:
    """The explicit-attention forward of the module `graphdef` describes, as a pure jax.jit
    function of (params, rest, src, tgt_in); the graphdef is closed over (train.py says why)."""

    def run(params: _Tree, rest: _Tree, src: jax.Array | None, tgt_in: jax.Array | None) -> dict:
        out = nnx.merge(graphdef, params, rest)(src, tgt_in, return_attention=True)
        # Not returned, so XLA drops them.
        return {**out, "encoder_hidden_states": None, "decoder_hidden_states": None}

    return jax.jit(run)


@functools.lru_cache(maxsize=16)
def _per_replica_step(
    config: TransformerConfig,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    jmesh: jax.sharding.Mesh,
) -> Callable[..., tuple[jax.Array, _Tree, optax.OptState]]:
    """ragged_trap_train_on_mesh's step: each replica's token sum times its own factor (`scale`,
    one per replica, split over "data"), its loss and gradients under jax.shard_map, averaged by
    jax.lax.pmean; then train.py's Adam update on the averaged gradients. One compiled step
    serves the trap and the fix: they differ only in the factors."""
    pad, smoothing = config.pad_id, config.label_smoothing

    def replica(
        params: _Tree,
        rest: _Tree,
        src: jax.Array | None,
        tgt_in: jax.Array,
        tgt: jax.Array,
        scale: jax.Array,
    ) -> tuple[jax.Array, _Tree]:
        def loss_fn(params: _Tree) -> jax.Array:
            logits = nnx.merge(graphdef, params, rest)(src, tgt_in)["logits"]
            total, _ = train.summed_loss(logits, tgt, pad, smoothing)
            return total * scale[0]  # this replica's factor: (1,) of the (replicas,) array

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.lax.pmean(loss, "data"), jax.lax.pmean(grads, "data")

    data = P("data")
    # check_vma off: the gradients of the replicated params stay per replica until the explicit
    # pmean (with it on, shard_map's autodiff would sum them over "data" itself)
    per_replica = jax.shard_map(
        replica,
        mesh=jmesh,
        in_specs=(P(), P(), data, data, data, data),
        out_specs=(P(), P()),
        check_vma=False,
    )

    def run(
        params: _Tree,
        rest: _Tree,
        state: optax.OptState,
        src: jax.Array | None,
        tgt_in: jax.Array,
        tgt: jax.Array,
        scale: jax.Array,
    ) -> tuple[jax.Array, _Tree, optax.OptState]:
        loss, grads = per_replica(params, rest, src, tgt_in, tgt, scale)
        updates, state = tx.update(grads, state, params)
        return loss, optax.apply_updates(params, updates), state

    return jax.jit(run)
