"""Running a framework's distributed engine from the application: `rosetta train --mesh` and
`rosetta parity --mesh` (docs/DESIGN.md, "Distribution").

Each engine needs its process set up before its framework is imported: JAX (and Keras, which
runs keras.distribution on its JAX backend) sees N devices on a CPU only when XLA_FLAGS asks for
N host devices, and Keras picks its backend from KERAS_BACKEND at its first import. So a mesh run
happens in a process of its own: `python -m transformer_rosetta.app.distributed IN OUT`, started
with mesh_environment, reading its job from IN (a config, weights and batches, as JSON and .npz)
and writing its result to OUT. torch needs no such setup (its engine starts one process per
rank itself, or is one rank of torchrun), so its engine runs in this process.

Across processes (hosts), JAX's engine runs as torch's does under torchrun: every process runs the
same command, and the environment names the run, JAX_COORDINATOR_ADDRESS ("host:port" of process
0), JAX_NUM_PROCESSES and JAX_PROCESS_ID (jax_processes). Each process's worker then joins the
others (jax.distributed, gloo collectives) before any other JAX call, holds mesh.size / P of the
mesh's devices, and trains on the same global batches; process 0 alone prints, evaluates and
writes (is_main_process).

A worker that fails reports one line: a RosettaError's message as it is (exit 2 at the command
line), a lost peer process as one line naming it (lost_process_message), anything else as the
worker's last line of error output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
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


# The variables that name a JAX multi-process run (jax_impl.distributed.initialize_processes
# reads them): torchrun's MASTER_ADDR:MASTER_PORT, WORLD_SIZE and RANK, in JAX's words.
PROCESS_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


@dataclass(frozen=True)
class JaxProcesses:
    """A JAX multi-process run as the environment names it: `count` processes, this one
    `index`, joined through process 0's coordination service at `coordinator` (host:port)."""

    coordinator: str
    count: int
    index: int


def jax_processes(environ: Mapping[str, str] | None = None) -> JaxProcesses | None:
    """The multi-process run PROCESS_VARIABLES name (None: none, this process is the whole run),
    checked: all three or none, whole numbers, the index below the count, a host:port address.
    A one-line InputError otherwise, before anything starts (a partial setting would otherwise
    surface minutes later as a hang or a peer's timeout)."""
    environ = os.environ if environ is None else environ
    given = {name: environ[name].strip() for name in PROCESS_VARIABLES if environ.get(name)}
    if not given:
        return None
    missing = [name for name in PROCESS_VARIABLES if name not in given]
    if missing:
        raise InputError(
            f"{', '.join(given)} set without {', '.join(missing)}: a JAX multi-process run needs "
            f"all of {', '.join(PROCESS_VARIABLES)}"
        )
    count_text, index_text = given["JAX_NUM_PROCESSES"], given["JAX_PROCESS_ID"]
    if not count_text.isdecimal() or int(count_text) < 1:
        raise InputError(f"JAX_NUM_PROCESSES={count_text!r}: must be a whole number, 1 or more")
    count = int(count_text)
    if not index_text.isdecimal() or int(index_text) >= count:
        raise InputError(
            f"JAX_PROCESS_ID={index_text!r}: must be a whole number from 0 to {count - 1} "
            f"(JAX_NUM_PROCESSES={count})"
        )
    address = given["JAX_COORDINATOR_ADDRESS"]
    host, _, port = address.rpartition(":")
    if not host or not port.isdecimal() or not 0 < int(port) < 65536:
        raise InputError(
            f"JAX_COORDINATOR_ADDRESS={address!r}: must be host:port, process 0's address and "
            "a free port"
        )
    return JaxProcesses(address, count, int(index_text))


def check_processes(framework: str, mesh: MeshShape) -> JaxProcesses | None:
    """The multi-process run the environment names (jax_processes), refused in one line where
    it cannot run `framework` on `mesh`: only JAX's engine runs across processes started this
    way (torch's under torchrun; Keras's in one process), and each process holds an equal share
    of the mesh's devices."""
    processes = jax_processes()
    if processes is None:
        return None
    if framework != "jax":
        how = "torch's run under torchrun" if framework == "torch" else "Keras runs in one process"
        raise InputError(
            f"JAX_NUM_PROCESSES={processes.count}: multi-process runs: torch (torchrun) and jax; "
            f"{how} (unset {', '.join(PROCESS_VARIABLES)})"
        )
    if mesh.size % processes.count:
        devices = f"{mesh.size} device{'s' if mesh.size > 1 else ''}"
        raise InputError(
            f"--mesh {mesh}: JAX_NUM_PROCESSES={processes.count} processes cannot hold equal "
            f"shares of its {devices} (each process holds mesh size / processes devices)"
        )
    return processes


def mesh_environment(framework: str, mesh: MeshShape) -> dict[str, str]:
    """The environment variables a process running `framework`'s engine on `mesh` needs, set
    before the framework is imported: JAX's host platform split into the mesh's devices (on a
    GPU machine the GPUs are the devices, and the flag changes nothing), mesh.size of them, or
    mesh.size / P on each of the P processes of a multi-process run (check_processes); and for
    Keras its JAX backend, the only one keras.distribution implements."""
    if framework not in NEEDS_OWN_PROCESS:
        return {}
    processes = check_processes(framework, mesh)
    devices = mesh.size // (processes.count if processes else 1)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if HOST_DEVICES_FLAG not in f]
    env = {"XLA_FLAGS": " ".join([*flags, f"{HOST_DEVICES_FLAG}={devices}"])}
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
    processes = check_processes(framework, mesh)
    with tempfile.TemporaryDirectory(prefix="rosetta-mesh-") as tmp:
        folder = Path(tmp)
        spec = {"framework": framework, "mesh": str(mesh), "config": config.to_dict(), **job}
        (folder / "job.json").write_text(json.dumps(spec))
        np.savez(folder / "in.npz", **_npz(arrays))
        env = {**os.environ, **mesh_environment(framework, mesh), "TF_CPP_MIN_LOG_LEVEL": "2"}
        log = folder / "stderr.txt"  # a file: a pipe nobody reads while waiting could fill
        with log.open("w") as stderr:
            # stdin a pipe held open for the worker's life: if this process dies (a SIGKILL
            # included) the pipe closes and the worker stops too (_stop_with_parent), so no
            # orphan keeps training, nor holds a multi-process run's peers
            with subprocess.Popen(
                [sys.executable, "-m", "transformer_rosetta.app.distributed", str(folder)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            ) as worker:
                returncode = worker.wait()
        error = folder / _ERROR_FILE
        if error.exists():
            raise MeshRunFailed(error.read_text().strip())
        if returncode != 0:
            lines = [line for line in log.read_text().splitlines() if line.strip()]
            if processes is not None and any(_PEER_FAILED in line for line in lines):
                # JAX's coordination service aborts the process (LOG(FATAL)) when it finds a
                # peer gone before Python sees an error: the lost process 0, the coordinator
                raise MeshRunFailed(lost_process_message(processes, _PEER_FAILED))
            last = lines[-1] if lines else f"exit code {returncode}"
            raise MeshRunFailed(f"the {framework} mesh worker failed: {last}")
        with np.load(folder / "out.npz") as out:
            return {k: out[k] for k in out.files}


# What JAX's coordination service logs as it aborts a process whose peer was lost.
_PEER_FAILED = "the JAX distributed service detected fatal errors"
# The errors of a collective whose peer is gone: gloo's socket errors ("Connection reset by
# peer", "Connection closed by peer"), its rendezvous's timeout through the coordination service
# (DEADLINE_EXCEEDED), the service's own (a heartbeat missed, UNAVAILABLE).
_PEER_ERROR = re.compile(
    r"gloo|connection|heartbeat|coordination|DEADLINE_EXCEEDED|UNAVAILABLE", re.I
)


def lost_process_message(processes: JaxProcesses, detail: str) -> str:
    """The one line for a multi-process run that lost a peer, from the survivor `processes`
    names: which process was lost (of two, the other; of more, this one cannot tell which),
    what the survivor saw, and that nothing was written."""
    if processes.count == 2:
        lost = f"jax process {1 - processes.index} of 2 was lost"
    else:
        lost = f"a jax process of {processes.count} (not this one, {processes.index}) was lost"
    detail = detail.splitlines()[0] if detail else ""
    detail = re.sub(r"\[[\w/.-]+:\d+\] ", "", detail)  # gloo's source file and line
    detail = re.sub(r"\s*\[type\.googleapis\.com/[^\]]*\]", "", detail)  # the status's payload
    detail = re.sub(r"^[A-Z_]+: ", "", detail)  # the status code of XLA's error
    return f"{lost} ({detail}); the run stopped and nothing was written"


def _stop_with_parent() -> None:
    """End this worker when its parent's end of stdin closes (the parent ended, however), from
    a daemon thread: os._exit, not sys.exit, which would wait for the main thread's work. The
    worker's stdin must be that pipe (_run_worker starts it so; /dev/null would end it)."""

    # A duplicate of the descriptor, read unbuffered: a thread blocked in sys.stdin's buffered
    # reader holds its lock, and the interpreter's shutdown would stop fatally on that lock.
    pipe = os.dup(sys.stdin.fileno())

    def watch() -> None:
        while os.read(pipe, 4096):  # b"" at end of file: the parent is gone
            pass
        os._exit(1)

    threading.Thread(target=watch, name="stop-with-parent", daemon=True).start()


def _work(folder: Path) -> None:
    """The worker's side: read the job, run the engine, write the result (or the one-line
    error of a RosettaError). In a multi-process run, an error ends the worker at once with its
    line: JAX's exit would otherwise wait at jax.distributed's shutdown barrier for the peer
    the error came from, until the heartbeat timeout, and then abort."""
    spec = json.loads((folder / "job.json").read_text())
    config = TransformerConfig.from_dict(spec["config"])
    mesh = parse_mesh(spec["mesh"])
    with np.load(folder / "in.npz") as data:
        arrays = {k: data[k] for k in data.files}
    weights = {k[2:]: v for k, v in arrays.items() if k.startswith("w.")}
    processes = jax_processes()
    try:
        engine = mesh_engine(spec["framework"])
        if processes is not None:  # JAX's engine (check_processes refused the others)
            from transformer_rosetta.jax_impl.distributed import initialize_processes

            initialize_processes()  # before any other JAX call (importing the engine makes none)
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
    except Exception as exc:
        if isinstance(exc, RosettaError):
            message = str(exc)
        elif processes is not None and _PEER_ERROR.search(str(exc)):
            message = lost_process_message(processes, str(exc))  # a collective lost its peer
        elif processes is not None:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            message = f"the jax mesh worker failed: {type(exc).__name__}: {first}"
        else:
            raise
        (folder / _ERROR_FILE).write_text(message)
        if processes is not None:
            os._exit(1)  # the docstring says why
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
    """Whether this process speaks for the run: always, except under torchrun or in a JAX
    multi-process run, where only rank 0 / process 0 prints and writes (every process runs the
    whole command; RANK is torchrun's, JAX_PROCESS_ID JAX's, jax_processes)."""
    jax_index = os.environ.get("JAX_PROCESS_ID", "").strip() or "0"
    return os.environ.get("RANK", "0") == "0" and jax_index == "0"


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
    _stop_with_parent()
    _work(Path(sys.argv[1]))
