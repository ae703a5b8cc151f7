"""Running a framework's distributed engine from the application: `rosetta train --mesh` and
`rosetta parity --mesh` (docs/DESIGN.md, "Distribution").

Each engine needs its process set up before its framework is imported: JAX (and Keras, which
runs keras.distribution on its JAX backend) sees N devices on a CPU only when XLA_FLAGS asks for
N host devices, and Keras picks its backend from KERAS_BACKEND at its first import. So a mesh run
happens in a process of its own: `python -m transformer_rosetta.app.distributed IN OUT`, started
with mesh_environment, reading its job from IN (a config, weights and batches, as JSON and .npz)
and writing its result to OUT. torch needs no such setup (its engine starts one process per
rank itself, or is one rank of torchrun), so its engine runs in this process.

A worker that fails reports one line: a RosettaError's message as it is (exit 2 at the command
line), anything else as the worker's last line of error output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.adapter.backends import mesh_engine
from transformer_rosetta.app.tasks import Task
from transformer_rosetta.app.trainer import TrainResult
from transformer_rosetta.errors import InputError, RosettaError
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.mesh import MeshShape, check_mesh, parse_mesh, target_tokens
from transformer_rosetta.spec.results import ForwardOutput

# The frameworks whose engine runs in a process of its own, with what it needs set first.
HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
NEEDS_OWN_PROCESS = ("jax", "tf")
_ERROR_FILE = "error.txt"


class MeshRunFailed(RosettaError):
    """A mesh run's worker stopped with an error; its message names what went wrong."""


def mesh_environment(framework: str, mesh: MeshShape) -> dict[str, str]:
    """The environment variables a process running `framework`'s engine on `mesh` needs, set
    before the framework is imported: JAX's host platform split into mesh.size devices (on a GPU
    machine the GPUs are the devices, and the flag changes nothing), and for Keras its JAX
    backend, the only one keras.distribution implements."""
    if framework not in NEEDS_OWN_PROCESS:
        return {}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if HOST_DEVICES_FLAG not in f]
    env = {"XLA_FLAGS": " ".join([*flags, f"{HOST_DEVICES_FLAG}={mesh.size}"])}
    if framework == "tf":
        env["KERAS_BACKEND"] = "jax"
    return env


def train_on_mesh(
    framework: str,
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    batches: Sequence[tuple[np.ndarray | None, np.ndarray]],
    mesh: MeshShape,
    *,
    dtype: str,
    warmup: int,
    factor: float = 1.0,
) -> tuple[list[float], dict[str, np.ndarray]]:
    """`framework`'s engine trains on `mesh` (adapter.backends.MeshEngine.train_on_mesh), in a
    process of its own where the framework needs one."""
    for rows in sorted({tgt.shape[0] for _, tgt in batches}):  # before any process starts
        check_mesh(mesh, config, batch=rows)
    kwargs = {"dtype": dtype, "warmup": warmup, "factor": factor}
    if framework not in NEEDS_OWN_PROCESS:
        return mesh_engine(framework).train_on_mesh(
            config, weights, batches, mesh, dtype=dtype, warmup=warmup, factor=factor
        )
    arrays = {f"w.{k}": np.asarray(v) for k, v in weights.items()}
    for i, (src, tgt) in enumerate(batches):
        arrays[f"tgt.{i}"] = tgt
        if src is not None:
            arrays[f"src.{i}"] = src
    job = {"task": "train", "steps": len(batches), **kwargs}
    out = _run_worker(framework, config, mesh, job, arrays)
    losses = [float(x) for x in out["losses"]]
    return losses, {k[2:]: out[k] for k in out if k.startswith("w.")}


def forward_on_mesh(
    framework: str,
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    src: np.ndarray | None,
    tgt_in: np.ndarray | None,
    mesh: MeshShape,
    *,
    dtype: str,
) -> ForwardOutput:
    """`framework`'s sharded forward (adapter.backends.MeshEngine.forward_on_mesh), attention
    maps included, in a process of its own where the framework needs one."""
    rows = next(a for a in (tgt_in, src) if a is not None).shape[0]
    check_mesh(mesh, config, batch=rows)  # before any process starts
    if framework not in NEEDS_OWN_PROCESS:
        return mesh_engine(framework).forward_on_mesh(
            config,
            weights,
            src,
            tgt_in,
            mesh,
            dtype=dtype,
        )
    arrays = {f"w.{k}": np.asarray(v) for k, v in weights.items()}
    for name, ids in (("tgt_in", tgt_in), ("src", src)):
        if ids is not None:
            arrays[name] = ids
    out = _run_worker(framework, config, mesh, {"task": "forward", "dtype": dtype}, arrays)
    return _forward_output(out)


def _run_worker(
    framework: str,
    config: TransformerConfig,
    mesh: MeshShape,
    job: dict,
    arrays: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """Run the job in a worker process set up by mesh_environment; its result arrays."""
    with tempfile.TemporaryDirectory(prefix="rosetta-mesh-") as tmp:
        folder = Path(tmp)
        spec = {"framework": framework, "mesh": str(mesh), "config": config.to_dict(), **job}
        (folder / "job.json").write_text(json.dumps(spec))
        np.savez(folder / "in.npz", **_npz(arrays))
        env = {**os.environ, **mesh_environment(framework, mesh), "TF_CPP_MIN_LOG_LEVEL": "2"}
        done = subprocess.run(
            [sys.executable, "-m", "transformer_rosetta.app.distributed", str(folder)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        error = folder / _ERROR_FILE
        if error.exists():
            raise MeshRunFailed(error.read_text().strip())
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            last = lines[-1] if lines else f"exit code {done.returncode}"
            raise MeshRunFailed(f"the {framework} mesh worker failed: {last}")
        with np.load(folder / "out.npz") as out:
            return {k: out[k] for k in out.files}


def _work(folder: Path) -> None:
    """The worker's side: read the job, run the engine, write the result (or the one-line
    error of a RosettaError)."""
    spec = json.loads((folder / "job.json").read_text())
    config = TransformerConfig.from_dict(spec["config"])
    mesh = parse_mesh(spec["mesh"])
    with np.load(folder / "in.npz") as data:
        arrays = {k: data[k] for k in data.files}
    weights = {k[2:]: v for k, v in arrays.items() if k.startswith("w.")}
    try:
        engine = mesh_engine(spec["framework"])
        if spec["task"] == "train":
            batches = [(arrays.get(f"src.{i}"), arrays[f"tgt.{i}"]) for i in range(spec["steps"])]
            losses, trained = engine.train_on_mesh(
                config,
                weights,
                batches,
                mesh,
                dtype=spec["dtype"],
                warmup=spec["warmup"],
                factor=spec["factor"],
            )
            result = {"losses": np.asarray(losses), **{f"w.{k}": v for k, v in trained.items()}}
        else:
            out = engine.forward_on_mesh(
                config,
                weights,
                arrays.get("src"),
                arrays.get("tgt_in"),
                mesh,
                dtype=spec["dtype"],
            )
            result = _forward_arrays(out)
    except RosettaError as exc:
        (folder / _ERROR_FILE).write_text(str(exc))
        return
    np.savez(folder / "out.npz", **_npz(result))


def _npz(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """np.savez's keywords: array names (its stubs type **kwds as if one could be allow_pickle)."""
    return dict(arrays)


def _forward_arrays(out: ForwardOutput) -> dict[str, np.ndarray]:
    """A ForwardOutput as flat arrays for an .npz: FIELD for an array, FIELD.i for a list's."""
    arrays = {}
    for f in fields(out):
        value = getattr(out, f.name)
        if isinstance(value, list):
            arrays.update({f"{f.name}.{i}": a for i, a in enumerate(value)})
            arrays[f"{f.name}.count"] = np.asarray(len(value))
        elif value is not None:
            arrays[f.name] = value
    return arrays


def _forward_output(arrays: Mapping[str, np.ndarray]) -> ForwardOutput:
    """The inverse of _forward_arrays."""
    values: dict[str, object] = {}
    for f in fields(ForwardOutput):
        if f"{f.name}.count" in arrays:
            count = int(arrays[f"{f.name}.count"])
            values[f.name] = [arrays[f"{f.name}.{i}"] for i in range(count)]
        else:
            values[f.name] = arrays.get(f.name)
    return ForwardOutput(**values)  # type: ignore[arg-type]


def is_main_process() -> bool:
    """Whether this process speaks for the run: always, except under torchrun, where only rank 0
    prints and writes (every rank runs the whole command; RANK is torchrun's)."""
    return os.environ.get("RANK", "0") == "0"


def train_task_on_mesh(
    framework: str,
    task: Task,
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    steps: int,
    mesh: MeshShape,
    *,
    seed: int,
    dtype: str,
) -> tuple[TrainResult, dict[str, np.ndarray]]:
    """What transformer_rosetta.app.trainer.train does on one device, on `mesh`: the same batches
    of the task's training stream (so the run is comparable with the one-device run, within the
    parity bounds), at the task's Noam rate. Returns (the losses and throughput, the trained
    weights). The engine runs all steps in one call, so no per-step progress comes back."""
    stream = task.train_batches(seed)
    batches = [stream.next_batch() for _ in range(steps)]
    start = time.perf_counter()
    losses, trained = train_on_mesh(
        framework,
        config,
        weights,
        batches,
        mesh,
        dtype=dtype,
        warmup=task.warmup,
        factor=task.lr_factor,
    )
    result = TrainResult(losses=losses, seconds=time.perf_counter() - start)
    result.target_tokens = sum(target_tokens(tgt, config.pad_id) for _, tgt in batches)
    return result, trained


def check_mesh_framework(framework: str) -> None:
    """A one-line InputError for a framework without a distributed engine (numpy, onnx)."""
    if framework not in ("torch", "tf", "jax"):
        raise InputError(f"--mesh: {framework} has no distributed engine; use torch, tf or jax")


if __name__ == "__main__":
    _work(Path(sys.argv[1]))
