"""`rosetta train --framework jax --data-parallel N` run as a JAX multi-process run: the same
command in each process, the run named by JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID (torchrun's MASTER_ADDR, WORLD_SIZE and RANK in JAX's words), two processes on
localhost joined by jax.distributed over gloo (common/app/distributed.py, docs/DISTRIBUTED.md).

- Two processes of one host device each train as the one-device command does: the weights
  within FLOAT64_TRAINING_BOUND (parity_tests/cli/test_mesh.py derives it, and says why the
  attention key biases, whose true gradient is exactly 0, are compared apart), and process 0
  alone prints and writes.
- A process lost mid-training (SIGKILL of its `rosetta` command; its worker follows through
  the closed stdin pipe) stops the other at its next collective: gloo's socket error, one line
  naming the lost process, exit 2, nothing written. The kill waits for a real trigger, not a
  sleep: both workers holding a gloo connection to each other (a TCP connection beside the
  coordinator's), which exists from the first cross-process collective on.
  Measured on 2 CPU cores: the survivor stops 0.2 to 1.3 s after the kill, from gloo's socket
  error; when process 0, the coordinator, is lost, JAX's coordination service may abort the
  survivor first (0.5 s, measured), and the command translates its log line into the same one.
  LOST_WITHIN is 15 s: over 10x that on a loaded CI machine, and under what a timeout would
  take (gloo's rendezvous 30 s, the heartbeat 60 s).
- An environment that cannot name a run, or a mesh that does not divide over the processes, is
  refused in one line before anything starts (in this process: nothing imports JAX).

Each multi-process test starts three or two CLI processes that compile the train step
(XLA_COMPILE_FLAGS from test_jax_distributed.py, in every process and in the one-device run
compared with them); the file takes about 40 s on 2 cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from parity_tests.cli.command_line import one_line_error, run
from parity_tests.cli.test_mesh import FLOAT64_TRAINING_BOUND
from parity_tests.conftest import backend_or_skip
from parity_tests.distributed.test_jax_distributed import free_port, worker_env
from parity_tests.paths import ROOT
from transformer_rosetta.weights.format import load_weights

TRAIN = ("train", "--framework", "jax", "--task", "numbers", "--dtype", "float64", "--seed", "0")
LOST_WITHIN = 15.0  # seconds from the kill to the survivor's exit (the module docstring)
STARTUP_LIMIT = 300.0  # seconds for the processes to compile and reach their first collective


def rosetta(argv: tuple[str, ...], log: Path, **env: str) -> subprocess.Popen:
    """`rosetta ARGV` in a process of its own, stdout to LOG.out and stderr to LOG.err (files:
    a pipe nobody reads could fill and block)."""
    with log.with_suffix(".out").open("w") as out, log.with_suffix(".err").open("w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "transformer_rosetta", *argv],
            cwd=ROOT,
            env=worker_env(**env),
            stdout=out,
            stderr=err,
        )


def processes_env(address: str, index: int) -> dict[str, str]:
    return {
        "JAX_COORDINATOR_ADDRESS": address,
        "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": str(index),
    }


def ended(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Every process's exit code, each killed if the time runs out."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def read(log: Path, suffix: str) -> str:
    return log.with_suffix(suffix).read_text()


def test_two_processes_write_the_one_device_weights(tmp_path):
    """The issue's command in two processes (data=2, one host device each) and without a mesh
    (one device): the same weights, within the float64 bound; process 0 alone prints and
    writes."""
    backend_or_skip("jax")
    address = f"127.0.0.1:{free_port()}"
    outs = [tmp_path / f"dp{i}.safetensors" for i in range(2)]
    logs = [tmp_path / f"process{i}" for i in range(2)]
    steps = ("--steps", "20")
    procs = [
        rosetta(
            (*TRAIN, *steps, "--data-parallel", "2", "--out", str(outs[i])),
            logs[i],
            **processes_env(address, i),
        )
        for i in range(2)
    ]
    one_log = tmp_path / "one"
    procs.append(rosetta((*TRAIN, *steps, "--out", str(tmp_path / "one.safetensors")), one_log))
    codes = ended(procs, timeout=600)
    assert codes == [0, 0, 0], [read(log, ".err")[-3000:] for log in [*logs, one_log]]
    out0 = read(logs[0], ".out")
    assert "training on the mesh data=2,model=1 (jax's engine): 20 steps" in out0
    assert f"wrote {outs[0]}" in out0
    assert read(logs[1], ".out") == "" and read(logs[1], ".err") == ""
    assert not outs[1].exists()
    dp, one = load_weights(outs[0]), load_weights(tmp_path / "one.safetensors")
    assert dp.config == one.config and dp.metadata["task"] == "numbers"
    gaps = {k: float(np.abs(dp.tensors[k] - one.tensors[k]).max()) for k in one.tensors}
    weights_gap = max(v for k, v in gaps.items() if "key.bias" not in k)
    key_bias_gap = max(v for k, v in gaps.items() if "key.bias" in k)
    print(
        f"2 processes vs one device, float64: weights {weights_gap:.3g}, key biases {key_bias_gap:.3g}"
    )
    assert weights_gap <= FLOAT64_TRAINING_BOUND
    assert key_bias_gap <= 1e-10  # rounding noise around 0 (test_mesh.py)


def children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux's /proc)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def holds_peer_connection(pid: int, coordinator_port: int) -> bool:
    """Whether process `pid` holds an established TCP connection other than to or from the
    coordinator's port: gloo's connection to its peer, made at the first collective (Linux's
    /proc: the process's socket inodes, looked up in its network namespace's TCP tables)."""
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:  # it ended, or a descriptor closed while listed
        return False
    inodes = {link[len("socket:[") : -1] for link in links if link.startswith("socket:[")}
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            return False
        for row in rows:
            fields = row.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            ports = {int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)}
            if inode in inodes and state == "01" and coordinator_port not in ports:
                return True  # "01": ESTABLISHED
    return False


@pytest.mark.parametrize("lost", [1, 0])
def test_a_lost_process_stops_the_other_in_one_line(tmp_path, lost):
    """SIGKILL of one process's `rosetta` command once both are training: its worker ends with
    it, and the other stops within LOST_WITHIN with one line naming the lost process, exit 2,
    and nothing written. Process 0 is the coordinator: the survivor may learn of its loss from
    JAX's coordination service aborting it, or from gloo as of process 1's."""
    backend_or_skip("jax")
    if not Path("/proc/self/net/tcp").exists():
        pytest.skip("the trigger reads Linux's /proc")
    port = free_port()
    out = tmp_path / "out" / "w.safetensors"
    out.parent.mkdir()
    logs = [tmp_path / f"process{i}" for i in range(2)]
    argv = (*TRAIN, "--steps", "1000", "--data-parallel", "2", "--out", str(out))
    # the job folders in tmp_path: the killed command cannot remove its own
    env = {"TMPDIR": str(tmp_path)}
    procs = [
        rosetta(argv, logs[i], **processes_env(f"127.0.0.1:{port}", i), **env) for i in range(2)
    ]
    survivor = procs[1 - lost]
    try:
        deadline = time.monotonic() + STARTUP_LIMIT
        workers: list[list[int]] = [[], []]
        while time.monotonic() < deadline:
            workers = [children(p.pid) for p in procs]
            if all(w and holds_peer_connection(w[0], port) for w in workers):
                break
            if any(p.poll() is not None for p in procs):
                pytest.fail(f"a process ended first: {[read(log, '.err') for log in logs]}")
            time.sleep(0.1)
        else:
            pytest.fail("the processes did not connect to each other")
        procs[lost].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = survivor.wait(timeout=LOST_WITHIN)
        took = time.monotonic() - killed
        procs[lost].wait(timeout=10)
    finally:
        ended(procs, timeout=1)
    err = read(logs[1 - lost], ".err")
    print(f"lost process {lost}: the survivor stopped {took:.2f} s after the kill: {err.strip()}")
    one_line_error(code, err, f"jax process {lost} of 2 was lost (")
    assert err.rstrip().endswith("; the run stopped and nothing was written")
    assert list(out.parent.iterdir()) == []
    # the survivor removed its job folder; the killed command's alone is left
    assert len(list(tmp_path.glob("rosetta-mesh-*"))) == 1
    orphan = workers[lost][0]  # the lost command's worker, ended with it
    for _ in range(100):
        if not Path(f"/proc/{orphan}").exists() or "Z" in proc_state(orphan):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the lost command's worker {orphan} still runs")


def proc_state(pid: int) -> str:
    """The process's state letter from /proc (Z: ended, not yet reaped); "" once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


JAX_ENV = {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "2"}


@pytest.mark.parametrize(
    ("env", "flags", "needle"),
    [
        (
            {"JAX_NUM_PROCESSES": "2"},
            ("--data-parallel", "2"),
            "JAX_NUM_PROCESSES set without JAX_COORDINATOR_ADDRESS, JAX_PROCESS_ID: a JAX "
            "multi-process run needs all of",
        ),
        (
            {**JAX_ENV, "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
            ("--data-parallel", "2"),
            "JAX_NUM_PROCESSES='two': must be a whole number, 1 or more",
        ),
        (
            {**JAX_ENV, "JAX_PROCESS_ID": "2"},
            ("--data-parallel", "2"),
            "JAX_PROCESS_ID='2': must be a whole number from 0 to 1 (JAX_NUM_PROCESSES=2)",
        ),
        (
            {**JAX_ENV, "JAX_COORDINATOR_ADDRESS": "host0", "JAX_PROCESS_ID": "0"},
            ("--data-parallel", "2"),
            "JAX_COORDINATOR_ADDRESS='host0': must be host:port",
        ),
        (
            {**JAX_ENV, "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "0"},
            ("--mesh", "data=2"),
            "--mesh data=2,model=1: JAX_NUM_PROCESSES=4 processes cannot hold equal shares of its 2 devices",
        ),
        (
            {**JAX_ENV, "JAX_PROCESS_ID": "1"},
            ("--data-parallel", "2", "--framework", "tf"),
            "multi-process runs: torch (torchrun) and jax; Keras runs in one process",
        ),
        (
            {**JAX_ENV, "JAX_PROCESS_ID": "0"},
            ("--data-parallel", "2", "--framework", "torch"),
            "multi-process runs: torch (torchrun) and jax; torch's run under torchrun",
        ),
    ],
)
def test_a_run_the_environment_cannot_name_is_refused_before_it_starts(
    capsys, monkeypatch, tmp_path, env, flags, needle
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "w.safetensors"
    code, _, err = run(capsys, *TRAIN, "--steps", "2", "--out", out, *flags)
    one_line_error(code, err, needle)
    assert list(tmp_path.iterdir()) == []


def test_parity_across_processes_is_jaxs_alone(capsys, monkeypatch):
    for name, value in {**JAX_ENV, "JAX_PROCESS_ID": "0"}.items():
        monkeypatch.setenv(name, value)
    code, _, err = run(capsys, "parity", "--mesh", "model=2", "--dtype", "float64")
    one_line_error(code, err, "a multi-process parity run is jax's alone; name --frameworks jax")
    code, _, err = run(
        capsys, "parity", "--frameworks", "jax", "--mesh", "data=1", "--dtype", "float64"
    )
    one_line_error(
        code, err, "JAX_NUM_PROCESSES=2 processes cannot hold equal shares of its 1 device"
    )
