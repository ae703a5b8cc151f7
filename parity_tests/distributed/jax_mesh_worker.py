"""Runs jax_impl/distributed.py on several CPU devices for test_jax_distributed.py, in a process
of its own: the device count is fixed when JAX starts.

    python -m parity_tests.distributed.jax_mesh_worker local IN OUT
        (XLA_FLAGS=--xla_force_host_platform_device_count=2 in the environment): every case on
        2 forced host devices, and the one-device runs they are checked on, into OUT.
    python -m parity_tests.distributed.jax_mesh_worker dropout IN OUT
        (the same environment): training with dropout on, one device and 2 forced host devices.
    python -m parity_tests.distributed.jax_mesh_worker process IN OUT
        (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID in the environment): one of
        the processes of a multi-process run of 1 device each; every process writes OUT.<id>.npz.

IN holds the config (JSON), the canonical weights (w:NAME), the global batches (src:i, tgt:i),
the step count, the warmup, the forward's inputs and where to write the checkpoint. OUT holds,
per case, the losses (CASE:losses) and final weights (CASE:w:NAME), the forward's named outputs
(fwd:DTYPE:NAME), the local shard shapes (shard:...), the errors' messages (error:...), the
checkpoint's forward (ckpt:NAME) and the wall time of each case (time:CASE).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

import numpy as np

# Compile events, counted from the start: the error cases must raise before any compile.
COMPILES: list[str] = []


@contextlib.contextmanager
def timed(out: dict, name: str) -> Iterator[None]:
    """The wall time of the block, into out["time:NAME"] (the test prints them)."""
    started = time.perf_counter()
    yield
    out[f"time:{name}"] = np.array(time.perf_counter() - started)


def read_inputs(path: str) -> dict:
    from transformer_rosetta.spec.config import TransformerConfig

    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    steps = int(arrays["steps"])
    return {
        "config": TransformerConfig.from_json(str(arrays["config"])),
        "weights": {k[2:]: v for k, v in arrays.items() if k.startswith("w:")},
        "batches": [(arrays[f"src:{i}"], arrays[f"tgt:{i}"]) for i in range(steps)],
        "warmup": int(arrays["warmup"]),
        "fwd": (arrays["fwd_src"], arrays["fwd_tgt_in"]),
        "checkpoint": str(arrays["checkpoint"]),
    }


def save(out: dict, prefix: str, losses: list[float], weights: dict[str, np.ndarray]) -> None:
    out[f"{prefix}:losses"] = np.array(losses)
    for name, w in weights.items():
        out[f"{prefix}:w:{name}"] = np.asarray(w)


def errors(inp: dict, out: dict) -> None:
    """The bad meshes, first thing, before this process has compiled anything: each must raise
    InputError without a compile."""
    from transformer_rosetta.errors import InputError
    from transformer_rosetta.jax_impl import distributed
    from transformer_rosetta.spec.mesh import MeshShape

    config, weights, (src, tgt) = inp["config"], inp["weights"], inp["batches"][0]
    rows6 = ([(np.concatenate([src, src[:2]]), np.concatenate([tgt, tgt[:2]]))], MeshShape(3, 1))
    cases = {
        # 6 rows divide over 3 replicas; the 3 devices do not exist
        "devices": (config, *rows6),
        # one head cannot split over 2 model shards
        "heads": (config.replace(num_heads=1), [(src, tgt)], MeshShape(1, 2)),
        # 4 rows do not divide over 3 replicas (and 3 devices do not exist)
        "rows": (config, [(src, tgt)], MeshShape(3, 1)),
    }
    for name, (c, batches, mesh) in cases.items():
        try:
            distributed.train_on_mesh(c, weights, batches, mesh, dtype="float64", warmup=10)
        except InputError as exc:
            out[f"error:{name}"] = np.array(str(exc))
    try:
        distributed.forward_on_mesh(config, weights, src, tgt, MeshShape(3, 1), dtype="float64")
    except InputError as exc:
        out["error:forward"] = np.array(str(exc))
    out["error:compiles"] = np.array(len(COMPILES))


def local(inp: dict, out: dict) -> None:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from transformer_rosetta.adapter.backends import get_backend
    from transformer_rosetta.jax_impl import distributed, train
    from transformer_rosetta.jax_impl.weights import x64_scope
    from transformer_rosetta.spec.mesh import MeshShape

    config, weights, batches, warmup = (inp[k] for k in ("config", "weights", "batches", "warmup"))
    out["devices"] = np.array(jax.device_count())
    started = time.perf_counter()
    for dtype in ("float64", "float32"):
        with timed(out, f"one:{dtype}"):
            model = get_backend("jax").build(config, weights, dtype=dtype)
            save(out, f"one:{dtype}", model.train_steps(batches, warmup=warmup), model.export())
        for mesh in (MeshShape(2, 1), MeshShape(1, 2)):
            with timed(out, f"{mesh}:{dtype}"):
                run = distributed.train_on_mesh(
                    config, weights, batches, mesh, dtype=dtype, warmup=warmup
                )
            save(out, f"{mesh}:{dtype}", *run)
            if (str(mesh), dtype) == ("data=1,model=2", "float64"):
                checkpoint(inp, out, run[1])
        with timed(out, f"fwd:{dtype}"):
            fwd = distributed.forward_on_mesh(
                config, weights, *inp["fwd"], MeshShape(1, 2), dtype=dtype
            )
        for name, array in fwd.named().items():
            out[f"fwd:{dtype}:{name}"] = array
    for denominator in ("local", "global"):
        with timed(out, f"trap:{denominator}"):
            run = distributed.ragged_trap_train_on_mesh(
                config,
                weights,
                batches,
                MeshShape(2, 1),
                dtype="float64",
                warmup=warmup,
                denominator=denominator,
            )
        save(out, f"trap:{denominator}:float64", *run)
    # Where the arrays live: each device's own shard, placed and after one step of the compiled
    # step (the float64 model=2 run compiled it: no new compile).
    with x64_scope("float64"):
        for mesh in (MeshShape(2, 1), MeshShape(1, 2)):
            jmesh = distributed.make_mesh(mesh)
            _, split = distributed._sharded_split(config, weights, jmesh, "float64", training=True)
            shards = {"placed": _shard_shapes(split.params)}  # before the step donates them
            adam = distributed._sharded_adam(split, jmesh, warmup, 1.0)
            src, tgt = batches[0]
            batch = distributed._sharded_batch(config, src, tgt, jmesh)
            _, split, adam = train.train_step(split, adam, *batch)
            shards["stepped"] = _shard_shapes(split.params)
            for when, shapes in shards.items():
                for name, shape in shapes.items():
                    out[f"shard:{mesh}:{when}:{name}"] = shape
            # Adam's first moments (optax's ScaleByAdamState.mu), sharded as their params
            for name, shape in _shard_shapes(adam.state[0].mu).items():
                out[f"shard:{mesh}:mu:{name}"] = shape
            out[f"shard:{mesh}:batch"] = np.array(
                [s.data.shape for s in batch[2].addressable_shards]
            )
            assert isinstance(batch[2].sharding, NamedSharding) and batch[2].sharding.spec == P(
                "data"
            )
    out["seconds"] = np.array(time.perf_counter() - started)


def checkpoint(inp: dict, out: dict, trained: dict[str, np.ndarray]) -> None:
    """The model=2 run's weights written as the shared format, read back, and run at another
    device count (data=2): the forward's outputs into ckpt:NAME."""
    from transformer_rosetta.jax_impl import distributed
    from transformer_rosetta.spec.mesh import MeshShape
    from transformer_rosetta.weights.format import load_weights, save_weights

    save_weights(inp["checkpoint"], trained, inp["config"], "jax_impl.distributed (model=2)")
    loaded = dict(load_weights(inp["checkpoint"], inp["config"]).tensors)
    fwd = distributed.forward_on_mesh(
        inp["config"], loaded, *inp["fwd"], MeshShape(2, 1), dtype="float64"
    )
    for name, array in fwd.named().items():
        out[f"ckpt:{name}"] = array


def dropout(inp: dict, out: dict) -> None:
    """The config with dropout 0.3 and attention dropout 0.2, 5 steps: the one-device backend and
    train_on_mesh at data=2 and model=2, float64 (the masks come from the same keys)."""
    from transformer_rosetta.adapter.backends import get_backend
    from transformer_rosetta.jax_impl import distributed
    from transformer_rosetta.spec.mesh import MeshShape

    config = inp["config"].replace(dropout=0.3, attention_dropout=0.2)
    weights, batches, warmup = inp["weights"], inp["batches"][:5], inp["warmup"]
    model = get_backend("jax").build(config, weights, dtype="float64")
    save(out, "one:float64", model.train_steps(batches, warmup=warmup), model.export())
    undropped = get_backend("jax").build(inp["config"], weights, dtype="float64")
    out["undropped:float64:losses"] = np.array(undropped.train_steps(batches, warmup=warmup))
    for mesh in (MeshShape(2, 1), MeshShape(1, 2)):
        run = distributed.train_on_mesh(
            config, weights, batches, mesh, dtype="float64", warmup=warmup
        )
        save(out, f"{mesh}:float64", *run)


def _shard_shapes(params: dict) -> dict[str, np.ndarray]:
    """{canonical name: the shape of each device's shard} of a split's params."""
    from flax.nnx import traversals

    return {
        ".".join(map(str, path)): np.array([s.data.shape for s in array.addressable_shards])
        for path, array in traversals.flatten_mapping(params).items()
    }


def process(inp: dict, out: dict) -> None:
    from transformer_rosetta.jax_impl import distributed

    distributed.initialize_processes()  # from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, ...
    import jax

    from transformer_rosetta.spec.mesh import MeshShape

    out["processes"] = np.array(jax.process_count())
    out["devices"] = np.array(jax.device_count())
    out["local_devices"] = np.array(jax.local_device_count())
    run = distributed.train_on_mesh(
        inp["config"],
        inp["weights"],
        inp["batches"],
        MeshShape(2, 1),
        dtype="float64",
        warmup=inp["warmup"],
    )
    save(out, "data=2,model=1:float64", *run)


def main() -> None:
    mode, inputs, output = sys.argv[1:4]
    import jax

    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _seconds, **_: COMPILES.append(event) if "compile" in event else None
    )
    inp, out = read_inputs(inputs), {}
    if mode in ("local", "dropout"):
        if mode == "local":
            errors(inp, out)
            local(inp, out)
        else:
            dropout(inp, out)
        np.savez(output, **out)
    else:
        process(inp, out)
        np.savez(f"{output}.{jax.process_index()}.npz", **out)


if __name__ == "__main__":
    main()
