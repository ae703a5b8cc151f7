"""Weak and strong scaling of data-parallel training, per framework, on the devices this machine
has: each framework's own distributed engine against itself on one device and against the plain
one-device training loop.

    .venv/bin/python -m transformer_rosetta.benchmarks.bench_scale [--frameworks torch,jax,keras]
        [--devices 1,2] [--model numbers|tiny|base] [--batch N] [--per-device-batch 32]
        [--steps 40] [--repeats 3] [--seed 0] [--out scale.json] [--markdown TABLE] [--json]
        [--force]

The engines are the three `train_on_mesh` (data=N, model=1), each in a child process of its own,
so that the device count is fixed before the framework starts:
- torch: torch_impl.distributed.train_on_mesh, DDP with one process per device (gloo between CPU
  processes, NCCL between GPUs), the child started by torchrun (`python -m torch.distributed.run
  --standalone --nproc-per-node N`), as a training job is: every rank runs the child's calls, and
  train_on_mesh runs each call in the ranks that are there (launched without torchrun it would
  start N processes at every call). Each rank gets cores / N threads on a CPU, the engine's own
  rule (OMP_NUM_THREADS);
- jax: jax_impl.distributed.train_on_mesh, the batch sharded over a jax.sharding.Mesh's "data"
  axis, in a child with XLA_FLAGS=--xla_force_host_platform_device_count=N on a CPU;
- keras: tf_impl.distributed.train_on_mesh, keras.distribution.DataParallel on Keras's JAX
  backend (KERAS_BACKEND=jax), with the same XLA_FLAGS.
The plain loop is the framework's backend (`get_backend(...).build(...).train_steps`) on one
device: torch, jax, and for keras the tf backend (Keras on TensorFlow: the Keras engine runs on
JAX, so that ratio holds the change of backend as well as the engine's own cost).

Two workloads, on the "numbers" task's batches (common/app/tasks.py: real, ragged targets):
- strong scaling: a fixed global batch (--batch rows; by default --per-device-batch x the
  largest N, which every N divides), split over N devices;
- weak scaling: a fixed batch per device (--per-device-batch rows), N x that globally.

How a step is timed. train_on_mesh returns only after its last step, and each call has a fixed
cost that is not the steps' (torch builds DDP and makes its device mesh, Keras traces its step
again, every engine places the weights and gathers them back), so a call is timed whole and the
fixed cost is taken off by difference: after a warm-up call of 2 steps (it compiles), a call of
1 step and a call of 1 + K steps (--steps K) alternate --repeats times, and one step's time is
(T(1 + K) - T(1)) / K, the median over the pairs. Every call's first step (and with it any
compilation the call repeats) is in both and cancels; what is left is K steady steps. The same is
done to the plain loop (one model, train_steps called with 1 and with 1 + K batches). A per-step
median inside the loop would need a per-step callback in train_on_mesh (torch's train_rank has
one, `on_step`; the JAX and Keras loops have none): not there, so not used.

Target tokens per second are the timed steps' non-pad target tokens (the tokens the loss counts)
over their time. Speed-up is the row's target tokens/s over the same engine's at N=1 (strong: the
same batches, so the ratio of step times; weak: the throughput ratio), efficiency = speed-up / N,
and "vs plain" the row's target tokens/s over the plain loop's at the same global batch (strong)
or per-device batch (weak). At N=1 the engine's own overhead is the plain loop's tokens/s over
the engine's.

Start-up is reported apart: each child's process start and imports (to its framework listing its
devices), its warm-up call (building, compiling, 2 steps) and a call's fixed cost (T(1) minus
one step). JAX's persistent compilation cache is on in the JAX and Keras children (a temporary
folder, removed at the end): the Keras engine traces and compiles its step afresh at every call,
and with the cache a call after the first reads the compiled program back.

Honestly labelled: on a CPU the N devices are the same cores shared out (XLA's forced host devices
split one process; torch runs N gloo processes on them), and N=1 already uses every core, so a
figure there is the engine's overhead, not a speed-up; the report says so under the table. N above
the cores is marked "oversubscribed" (JAX and Keras; torch's engine refuses more processes than
cores). On a GPU machine each N runs on the first N GPUs, up to every GPU present.

On a machine that other processes share, a stall in one call moves that pair's figure: the table
gives the pairs' range beside the median, and the JSON every call's time.

A limit of the JAX and Keras engines on forced host devices, measured here (2 devices on 2
cores): one call that queues more than about 60 to 100 steps without waiting for any aborts the
process (XLA's CPU all-reduce: "Termination timeout ... of 40 seconds exceeded", SIGABRT), while
the same steps waited for one by one run. So --steps stays at 40 by default; a child that aborts
is a failed row with XLA's line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.adapter.backends import unavailable_reason
from transformer_rosetta.app.cli.args import UsageError, positive_int, repeats_int, seed_int
from transformer_rosetta.app.tasks import get_task
from transformer_rosetta.benchmarks.harness import (
    cli_main,
    cpu_name,
    parser,
    to_stderr,
    write_results,
)
from transformer_rosetta.errors import RosettaError
from transformer_rosetta.files.outputs import check_output_file
from transformer_rosetta.spec.config import TransformerConfig, preset

PROG = "python -m transformer_rosetta.benchmarks.bench_scale"
FRAMEWORKS = ("torch", "jax", "keras")
ALIASES = {"tf": "keras"}  # the Keras engine lives in tf_impl/
KINDS = ("strong", "weak")
MODELS = ("numbers", "tiny", "base")
TASK = "numbers"
DTYPE = "float32"
WARMUP_CALL_STEPS = 2  # the warm-up call: it compiles, and runs a step after the compiled one
CHILD_TIMEOUT_S = 3600  # a child that runs longer is stopped and its rows reported as failed
# A row whose pairs spread by more than this fraction of their median is marked "noisy": a stall
# (another process, the OS) hit some of its calls, and the median is the figure to trust.
NOISY_SPREAD = 0.5
STDERR_TAIL = 4000  # characters of each child's stderr kept in the JSON

ENGINES = {
    "torch": "torch_impl.distributed.train_on_mesh: DDP, one process per device "
    "(gloo on a CPU, NCCL on GPUs)",
    "jax": "jax_impl.distributed.train_on_mesh: the batch over a jax.sharding.Mesh's data axis",
    "keras": "tf_impl.distributed.train_on_mesh: keras.distribution.DataParallel on Keras's JAX "
    "backend",
}
# The plain one-device loop of each framework: (adapter backend, what it is).
PLAIN = {
    "torch": ("torch", "the torch backend's train_steps"),
    "jax": ("jax", "the jax backend's train_steps"),
    "keras": ("tf", "the tf backend's train_steps (Keras on TensorFlow)"),
}
MODULES = {
    "torch": "transformer_rosetta.torch_impl.distributed",
    "jax": "transformer_rosetta.jax_impl.distributed",
    "keras": "transformer_rosetta.tf_impl.distributed",
}

CPU_LABEL = (
    "On a CPU the N devices are this machine's {cores} cores shared out (XLA's forced host "
    "devices split one process; torch runs N gloo processes on them), and N=1 already uses every "
    "core: these figures are the engine's overhead, not a speed-up."
)
OVERSUBSCRIBED = "oversubscribed: more devices than the {cores} cores"

WORKER_CODE = (
    "import sys; from transformer_rosetta.benchmarks.bench_scale import worker; "
    "sys.exit(worker(sys.argv[1:]))"
)
PROBE_CODE = (
    "import sys; from transformer_rosetta.benchmarks.bench_scale import probe; "
    "sys.exit(probe(sys.argv[1:]))"
)

Batch = tuple[np.ndarray, np.ndarray]
Progress = Callable[[str], None]


# -- the workload ---------------------------------------------------------------------------------


def model_config(name: str) -> TransformerConfig:
    """The numbers task's model ("numbers": d_model 64, 4 heads, d_ff 256, 2 + 2 layers), or the
    sizes of preset `name` ("tiny", "base") on the task's vocabularies; no dropout (each engine's
    random stream is its own, and the throughput of the same function is what is compared)."""
    config = get_task(TASK).config()
    if name != "numbers":
        sizes = preset(name)
        config = config.replace(
            d_model=sizes.d_model,
            num_heads=sizes.num_heads,
            d_ff=sizes.d_ff,
            num_encoder_layers=sizes.num_encoder_layers,
            num_decoder_layers=sizes.num_decoder_layers,
        )
    return config.replace(dropout=0.0, attention_dropout=0.0)


def task_batches(rows: int, count: int, seed: int) -> list[Batch]:
    """The first `count` batches of `rows` rows of the numbers task's training stream (seed
    `seed`): every batch has the task's fixed widths, so no call compiles twice."""
    task = dataclasses.replace(get_task(TASK), batch_size=rows)
    stream = task.train_batches(seed)
    return [stream.next_batch() for _ in range(count)]


def target_tokens(batches: Sequence[Batch], pad_id: int) -> int:
    """The non-pad target tokens of `batches`: what the loss counts, and tokens/s counts."""
    return int(sum(int((tgt != pad_id).sum()) for _, tgt in batches))


def default_devices(count: int) -> list[int]:
    """1, 2, 4, ... below `count`, and `count` itself: every device present, at the end."""
    found, n = [], 1
    while n < count:
        found.append(n)
        n *= 2
    return [*found, count]


# -- a child's part: one framework, one device count ----------------------------------------------


def probe(frameworks: Sequence[str]) -> int:
    """Print {framework: {"platform", "count", "names"}} as JSON: the GPUs the framework sees, or
    the CPU (its cores, as the devices a data-parallel run may use)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = {"platform": "cpu", "count": cores or 1, "names": [cpu_name()]}
    found: dict[str, Any] = {}
    for name in frameworks:
        if name == "torch":
            import torch

            if torch.cuda.is_available():
                n = torch.cuda.device_count()
                names = [torch.cuda.get_device_name(i) for i in range(n)]
                found[name] = {"platform": "gpu", "count": n, "names": names}
            else:
                found[name] = cpu
        else:  # jax, and keras on its JAX backend: JAX's devices
            import jax

            gpus = [d for d in jax.devices() if d.platform != "cpu"]
            if gpus:
                kinds = [d.device_kind for d in gpus]
                found[name] = {"platform": gpus[0].platform, "count": len(gpus), "names": kinds}
            else:
                found[name] = cpu
    print(json.dumps(found))
    return 0


def _mesh_call(framework: str, devices: int) -> Callable[..., list[float]]:
    """train_on_mesh of `framework` on data=devices, as a function of (config, weights, batches,
    warmup, factor) that returns the losses."""
    import importlib

    from transformer_rosetta.spec.mesh import MeshShape

    module = importlib.import_module(MODULES[framework])
    mesh = MeshShape(data=devices, model=1)

    def call(
        config: TransformerConfig, weights: Any, batches: Any, warmup: int, factor: float
    ) -> list[float]:
        losses, _ = module.train_on_mesh(
            config, weights, batches, mesh, dtype=DTYPE, warmup=warmup, factor=factor
        )
        return losses

    return call


def _plain_call(framework: str, config: TransformerConfig, weights: Any) -> Callable[..., Any]:
    """The backend's one-device train_steps on one model built here (the first GPU it sees, else
    the CPU), as a function of (config, weights, batches, warmup, factor); the model keeps
    training from call to call, as it would in a loop."""
    from transformer_rosetta.adapter.backends import get_backend
    from transformer_rosetta.app.parity import resolve_devices

    backend = get_backend(PLAIN[framework][0])
    device = resolve_devices(backend.name, backend.devices(), "auto")[0]
    model = backend.build(config, weights, dtype=DTYPE, device=device)

    def call(
        config: TransformerConfig, weights: Any, batches: Any, warmup: int, factor: float
    ) -> list[float]:
        return model.train_steps(batches, warmup=warmup, factor=factor)

    return call


def _time_case(
    call: Callable[..., Any],
    config: TransformerConfig,
    weights: Any,
    batches: Sequence[Batch],
    job: Mapping[str, Any],
) -> dict[str, Any]:
    """The warm-up call, then --repeats pairs of a 1-step and a (1 + K)-step call, alternating;
    the wall seconds of each, and the last loss."""
    steps = job["steps"]

    def timed(n: int) -> tuple[float, list[float]]:
        started = time.perf_counter()
        losses = call(config, weights, list(batches[:n]), job["warmup"], job["factor"])
        return time.perf_counter() - started, [float(x) for x in losses]

    first, _ = timed(WARMUP_CALL_STEPS)
    short, long, losses = [], [], []
    for _ in range(job["repeats"]):
        seconds, _ = timed(1)
        short.append(seconds)
        seconds, losses = timed(1 + steps)
        long.append(seconds)
    return {
        "status": "ok",
        "first_call_s": first,
        "short_call_s": short,
        "long_call_s": long,
        "last_loss": losses[-1] if losses else None,
    }


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def worker(argv: Sequence[str]) -> int:
    """A child: JOB.json DATA.npz OUT.json. Imports the framework (the time from the parent's
    launch to here is the child's start-up), then times each of the job's cases and writes
    OUT.json; a case that raises is recorded as failed, with its one line, and the rest run."""
    job_path, data_path, out_path = argv
    job = json.loads(Path(job_path).read_text())
    framework, devices = job["framework"], job["devices"]
    config = TransformerConfig.from_dict(job["config"])
    with np.load(data_path) as npz:
        weights = {k.removeprefix("w/"): npz[k] for k in npz.files if k.startswith("w/")}
        sets = {
            name: [(npz[f"{name}/src/{i}"], npz[f"{name}/tgt/{i}"]) for i in range(count)]
            for name, count in job["sets"].items()
        }
    out: dict[str, Any] = {"cases": {}}
    engines = {case["engine"] for case in job["cases"]}
    mesh = _mesh_call(framework, devices) if "mesh" in engines else None
    if "plain" in engines:  # the backend's framework imported here, in the start-up
        from transformer_rosetta.adapter.backends import get_backend

        get_backend(PLAIN[framework][0]).version()
    out["seen"] = _devices_seen(framework, job["engine_env"])
    out["ready_monotonic"] = time.monotonic()
    for case in job["cases"]:
        try:
            if case["engine"] == "mesh":
                assert mesh is not None
                call = mesh
            else:
                started = time.perf_counter()
                call = _plain_call(framework, config, weights)
                out.setdefault("plain_build_s", {})[case["name"]] = time.perf_counter() - started
            result = _time_case(call, config, weights, sets[case["set"]], job)
        except Exception as exc:  # recorded as the row's failure; the other cases still run
            result = {"status": "failed", "reason": _one_line(exc)}
        out["cases"][case["name"]] = result
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, every rank timed the same calls
        Path(out_path).write_text(json.dumps(out))
    return 0


def _devices_seen(framework: str, engine_env: bool) -> dict[str, Any]:
    """What the child's engine runs on: its platform and device count (the forced host devices
    on a CPU), to check the child got the devices it was started for."""
    if not engine_env:
        return {}
    if framework == "torch":
        import torch

        from transformer_rosetta.torch_impl.distributed import available_devices

        platform = "gpu" if torch.cuda.is_available() else "cpu"
        # the devices a mesh may use, and the ranks torchrun started
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        return {"platform": platform, "count": available_devices(), "processes": processes}
    if framework == "keras":
        import keras

        found = keras.distribution.list_devices()
        return {"platform": found[0].split(":")[0], "count": len(found)}
    import jax

    return {"platform": jax.devices()[0].platform, "count": jax.device_count()}


# -- the parent: planning, children, summaries ----------------------------------------------------


@dataclasses.dataclass
class Child:
    """One child process: a framework at N devices, the cases it times, its environment."""

    framework: str
    devices: int
    cases: list[dict[str, Any]]  # {"name", "engine": "mesh" | "plain", "kind", "set"}
    env: dict[str, str]
    engine_env: bool  # the engine's environment (False: the Keras plain loop's TensorFlow)
    launcher: list[str] = dataclasses.field(default_factory=list)  # torchrun, for torch

    @property
    def tag(self) -> str:
        return f"{self.framework}-{self.devices}-{'engine' if self.engine_env else 'plain'}"


def child_env(cache: Path) -> dict[str, str]:
    """What every child inherits: TensorFlow's start-up chatter off, JAX and TensorFlow not taking
    a GPU's memory when they start, and JAX's persistent compilation cache in `cache`."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    return env


def forced_devices(env: Mapping[str, str], n: int) -> dict[str, str]:
    """`env` with XLA_FLAGS asking for n host (CPU) devices, any earlier count replaced."""
    flag = "--xla_force_host_platform_device_count"
    kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
    return {**env, "XLA_FLAGS": " ".join([*kept, f"{flag}={n}"])}


def torchrun(n: int) -> list[str]:
    """torchrun's command line for n processes on this machine, running the argv that follows
    as it is (--no-python: the worker is `python -c ...`)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        "--no-python",
    ]


def plan_children(
    framework: str,
    devices: Sequence[int],
    platform: str,
    cores: int,
    base_env: Mapping[str, str],
) -> list[Child]:
    """The children of one framework: N=1 (the plain loop, where it runs in the engine's
    environment, and the engine), then each N > 1. Keras's plain loop runs on TensorFlow, in a
    child of its own. torch's children are torchrun jobs of N processes, each with cores / N
    threads on a CPU (the engine's rule; torchrun alone would give each one)."""
    children = []
    for n in devices:
        env, launcher = dict(base_env), []
        if framework in ("jax", "keras") and platform == "cpu":
            env = forced_devices(env, n)
        if framework == "keras":
            env["KERAS_BACKEND"] = "jax"
        if framework == "torch":
            launcher = torchrun(n)
            if platform == "cpu" and "OMP_NUM_THREADS" not in base_env:
                env["OMP_NUM_THREADS"] = str(max(1, cores // n))
        cases = []
        for kind in KINDS:
            group = "strong" if kind == "strong" else f"weak{n}"
            if n == 1 and framework != "keras":
                cases.append(
                    {"name": f"plain-{kind}", "engine": "plain", "kind": kind, "set": group}
                )
            cases.append({"name": f"mesh-{kind}", "engine": "mesh", "kind": kind, "set": group})
        children.append(Child(framework, n, cases, env, engine_env=True, launcher=launcher))
    if framework == "keras":
        env = {**base_env, "KERAS_BACKEND": "tensorflow"}
        plain = [
            {
                "name": f"plain-{kind}",
                "engine": "plain",
                "kind": kind,
                "set": "strong" if kind == "strong" else "weak1",
            }
            for kind in KINDS
        ]
        children.insert(0, Child(framework, 1, plain, env, engine_env=False))
    return children


def run_child(
    child: Child, job: Mapping[str, Any], data: Path, folder: Path
) -> tuple[dict[str, Any], float | None, str, str]:
    """Run one child; (its OUT.json, its start-up seconds, the line of its stderr that says why
    when it failed as a whole, else "", the tail of its stderr)."""
    job_path, out_path = folder / f"{child.tag}.json", folder / f"{child.tag}.out.json"
    job_path.write_text(
        json.dumps(
            {
                **job,
                "framework": child.framework,
                "devices": child.devices,
                "cases": child.cases,
                "engine_env": child.engine_env,
            }
        )
    )
    argv = [*child.launcher, sys.executable, "-c", WORKER_CODE, str(job_path), str(data)]
    argv.append(str(out_path))
    launched = time.monotonic()
    try:
        done = subprocess.run(
            argv,
            env=child.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {}, None, f"the child ran past {CHILD_TIMEOUT_S} s and was stopped", ""
    tail = done.stderr[-STDERR_TAIL:]
    if done.returncode != 0 or not out_path.is_file():
        why = failure_line(done.stderr) or f"exit code {done.returncode}"
        return {}, None, f"the child failed (exit {done.returncode}): {why}"[:400], tail
    out = json.loads(out_path.read_text())
    return out, out["ready_monotonic"] - launched, "", tail


def wrong_devices(child: Child, platform: str, seen: Mapping[str, Any]) -> str:
    """Why the child's engine did not run on the N devices it was started for, or "": torchrun
    must have started N processes; on a CPU, JAX (and Keras on it) must see N forced host
    devices (on GPUs it sees them all and the engine takes the first N)."""
    if not child.engine_env or not seen:
        return ""
    n = child.devices
    if child.framework == "torch" and seen.get("processes") != n:
        return f"torchrun started {seen.get('processes')} processes, not {n}"
    if child.framework != "torch" and platform == "cpu" and seen.get("count") != n:
        return f"the child saw {seen.get('count')} {seen.get('platform')} devices, not {n}"
    return ""


def failure_line(stderr: str) -> str:
    """The line of a failed child's stderr that says why: the last `SomeError: ...` line (or an
    abort's: absl's fatal `F1126 ...` line, CPython's "Fatal Python error") that is not
    torchrun's own summary of a failed rank, else the last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [
        line
        for line in lines
        if re.match(r"^([\w.]*(Error|Exception|Interrupt)\b|F\d{4} |Fatal Python error)", line)
        and "ChildFailedError" not in line
    ]
    return (errors or lines or [""])[-1]


def summarise_case(raw: Mapping[str, Any], steps: int, timed_tokens: int) -> dict[str, Any]:
    """A case's timings as figures: one step's seconds (the median over the pairs of (T(1 + K) -
    T(1)) / K), target tokens/s, a call's fixed cost (the median 1-step call less one step)."""
    pairs = [
        (long - short) / steps
        for short, long in zip(raw["short_call_s"], raw["long_call_s"], strict=True)
    ]
    step = statistics.median(pairs)
    figures: dict[str, Any] = {
        "step_s": step,
        "step_s_pairs": pairs,
        "short_call_s": raw["short_call_s"],
        "long_call_s": raw["long_call_s"],
        "first_call_s": raw["first_call_s"],
        "last_loss": raw["last_loss"],
    }
    if not step > 0:
        figures["status"] = "failed"
        figures["reason"] = (
            f"the {steps} timed steps took less than the noise in a call's fixed cost "
            f"(median {step * 1e3:.2f} ms a step): raise --steps"
        )
        return figures
    figures["status"] = "ok"
    figures["noisy"] = (max(pairs) - min(pairs)) > NOISY_SPREAD * step
    figures["tokens_per_s"] = timed_tokens / (steps * step)
    figures["call_overhead_s"] = statistics.median(raw["short_call_s"]) - step
    return figures


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Speed-up against the same engine's N=1 (same kind), efficiency = speed-up / N, the ratio
    to the plain loop's tokens/s, and at N=1 the engine's overhead (plain tokens/s over the
    engine's)."""

    def find(framework: str, engine: str, kind: str, n: int) -> dict[str, Any] | None:
        for r in rows:
            if (r["framework"], r["engine"], r["kind"], r["devices"]) == (
                framework,
                engine,
                kind,
                n,
            ):
                return r if r["status"] == "ok" else None
        return None

    for r in rows:
        if r["status"] != "ok":
            continue
        plain = find(r["framework"], "plain", r["kind"], 1)
        if plain is not None:
            r["vs_plain"] = r["tokens_per_s"] / plain["tokens_per_s"]
        if r["engine"] != "mesh":
            continue
        one = find(r["framework"], "mesh", r["kind"], 1)
        if one is not None:
            r["speedup"] = r["tokens_per_s"] / one["tokens_per_s"]
            r["efficiency"] = r["speedup"] / r["devices"]
        if r["devices"] == 1 and plain is not None:
            r["overhead_vs_plain"] = plain["tokens_per_s"] / r["tokens_per_s"]


# -- the whole run --------------------------------------------------------------------------------


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def machine_info(found: Mapping[str, Any]) -> dict[str, Any]:
    """bench_convert's machine (CPU, cores, RAM, versions) and the GPUs the frameworks see."""
    from transformer_rosetta.benchmarks.bench_convert import machine_info as base

    info = base()
    gpus = {name: p["names"] for name, p in found.items() if p["platform"] != "cpu"}
    info["gpus"] = gpus
    return info


def unavailable(frameworks: Sequence[str]) -> dict[str, str]:
    """{framework: why it cannot run here} (the Keras engine needs keras and jax; only its plain
    loop needs TensorFlow, whose absence skips that loop's rows alone)."""
    skipped = {}
    for name in frameworks:
        why = unavailable_reason("jax" if name == "keras" else name)
        if why is None and name == "keras" and importlib.util.find_spec("keras") is None:
            why = "keras not installed"
        if why is not None:
            skipped[name] = why
    return skipped


def probe_devices(frameworks: Sequence[str], env: Mapping[str, str]) -> dict[str, Any]:
    """`probe` in a child (no framework is imported here): each framework's platform, device
    count and device names."""
    if not frameworks:
        return {}
    done = subprocess.run(
        [sys.executable, "-c", PROBE_CODE, *frameworks],
        env=dict(env),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise RosettaError(f"could not list the devices: {failure_line(done.stderr)}")
    return dict(json.loads(done.stdout.splitlines()[-1]))


def plan_devices(found: Mapping[str, Any], devices: Sequence[int] | None) -> dict[str, list[int]]:
    """{framework: its N}: `devices` (default_devices of what it sees when None), with 1 always.
    UsageError, before any work, for an N above the GPUs present."""
    plans = {}
    for name, p in found.items():
        wanted = sorted({1, *(devices or default_devices(p["count"]))})
        if p["platform"] != "cpu" and wanted[-1] > p["count"]:
            raise UsageError(
                f"--devices {wanted[-1]}: {name} sees {p['count']} GPU(s) ({', '.join(p['names'])})"
            )
        plans[name] = wanted
    return plans


def strong_batch(plans: Mapping[str, Sequence[int]], batch: int | None, per_device: int) -> int:
    """The strong workload's global rows: --batch, or --per-device-batch x the largest N (which
    every N of default_devices divides). UsageError, before any work, for an N it does not
    divide."""
    largest = max((max(ns) for ns in plans.values()), default=1)
    rows = per_device * largest if batch is None else batch
    for name, wanted in plans.items():
        bad = [n for n in wanted if rows % n]
        if bad:
            raise UsageError(
                f"--batch {rows}: strong scaling splits it over N devices, and it does not "
                f"divide over N = {', '.join(map(str, bad))} ({name}'s devices)"
            )
    return rows


def write_inputs(
    path: Path, config: TransformerConfig, sets: Mapping[str, Sequence[Batch]], seed: int
) -> None:
    """The children's inputs in one .npz: the canonical float32 weights (w/NAME) and every set's
    batches (SET/src/i, SET/tgt/i)."""
    from transformer_rosetta.weights.init import init_weights

    weights = init_weights(config, seed=seed, scheme="paper")
    arrays = {f"w/{k}": np.asarray(v, dtype=np.float32) for k, v in weights.items()}
    for name, batches in sets.items():
        for i, (src, tgt) in enumerate(batches):
            arrays[f"{name}/src/{i}"], arrays[f"{name}/tgt/{i}"] = src, tgt
    np.savez(path, **arrays)


def refused(child: Child, platform: str, cores: int | None) -> str:
    """Why `child` is not run here at all, or "": torch on a CPU with N above the cores (its
    engine refuses them), or Keras's plain loop without TensorFlow."""
    if child.framework == "torch" and platform == "cpu" and cores and child.devices > cores:
        return (
            f"torch's engine runs one gloo process per core and refuses more than the {cores} "
            "cores (torch_impl.distributed.check_request)"
        )
    if child.framework == "keras" and not child.engine_env and unavailable_reason("tf"):
        return f"tf: {unavailable_reason('tf')}"
    return ""


def measure(
    frameworks: Sequence[str],
    devices: Sequence[int] | None,
    *,
    model: str = "numbers",
    batch: int | None = None,
    per_device_batch: int = 32,
    steps: int = 40,
    repeats: int = 3,
    seed: int = 0,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Every framework's engine at every N, both kinds, and its plain loop; the JSON's object.
    `devices` None: every framework's default_devices; `batch` None: per_device_batch x the
    largest N. The arguments' own checks are `run`'s; the ones that need the devices are made
    here, before any timing."""
    say = progress or (lambda message: None)
    load_start = load_average()
    config, task = model_config(model), get_task(TASK)
    skipped = unavailable(frameworks)
    runnable = [name for name in frameworks if name not in skipped]
    rows: list[dict[str, Any]] = []
    children: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="rosetta-bench-scale-"))
    try:
        env = child_env(work / "jax-cache")
        if runnable:
            say(f"probing the devices of {', '.join(runnable)}")
        found = probe_devices(runnable, env)
        plans = plan_devices(found, devices)
        batch = strong_batch(plans, batch, per_device_batch)
        # The batches: the strong set (1 + K of --batch rows) and a weak set per N; the first
        # of each is the 1-step call's, the K after it are the timed ones.
        sets = {"strong": task_batches(batch, 1 + steps, seed)}
        for n in sorted({n for ns in plans.values() for n in ns}):
            sets[f"weak{n}"] = task_batches(n * per_device_batch, 1 + steps, seed)
        data = work / "data.npz"
        write_inputs(data, config, sets, seed)
        job = {
            "config": config.to_dict(),
            "sets": {name: len(b) for name, b in sets.items()},
            "steps": steps,
            "repeats": repeats,
            "warmup": task.warmup,
            "factor": task.lr_factor,
        }
        timed = {name: target_tokens(b[1:], config.pad_id) for name, b in sets.items()}
        for name in runnable:
            p = found[name]
            cores = p["count"] if p["platform"] == "cpu" else None
            for child in plan_children(name, plans[name], p["platform"], p["count"], env):
                rows_of = _child_rows(child, p, cores, batch, per_device_batch, steps)
                rows += rows_of
                why = refused(child, p["platform"], cores)
                if why:
                    for r in rows_of:
                        r.update(status="skipped", reason=why)
                    continue
                what = "plain loop" if not child.engine_env else f"engine at N={child.devices}"
                say(f"{name}: {what} ({', '.join(c['name'] for c in child.cases)})")
                out, startup, failure, tail = run_child(child, job, data, work)
                failure = failure or wrong_devices(child, p["platform"], out.get("seen", {}))
                children.append(
                    {
                        "framework": name,
                        "devices": child.devices,
                        "engine_env": child.engine_env,
                        "startup_s": startup,
                        "seen": out.get("seen", {}),
                        "plain_build_s": out.get("plain_build_s", {}),
                        "status": "failed" if failure else "ok",
                        "reason": failure,
                        "stderr_tail": tail,
                    }
                )
                for r, case in zip(rows_of, child.cases, strict=True):
                    r["startup_s"] = startup
                    raw = out.get("cases", {}).get(case["name"])
                    if failure or raw is None:
                        r.update(status="failed", reason=failure or "no result")
                    elif raw["status"] != "ok":
                        r.update(status="failed", reason=raw["reason"])
                    else:
                        tokens = timed[case["set"]]
                        r["timed_target_tokens"] = tokens
                        r["target_tokens_per_step"] = tokens / steps
                        r.update(summarise_case(raw, steps, tokens))
                    say(row_line(r))
        add_ratios(rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_end = load_average()
    return {
        "machine": machine_info(found),
        "settings": {
            "frameworks": list(frameworks),
            "devices": plans,
            "model": model,
            "config": config.to_dict(),
            "task": TASK,
            "dtype": DTYPE,
            "batch": batch,
            "per_device_batch": per_device_batch,
            "steps": steps,
            "repeats": repeats,
            "warmup_call_steps": WARMUP_CALL_STEPS,
            "seed": seed,
            "step_time": "(T(1 + steps) - T(1)) / steps, median over `repeats` pairs of calls, "
            f"after a warm-up call of {WARMUP_CALL_STEPS} steps",
            "engines": {name: ENGINES[name] for name in frameworks},
            "plain": {name: PLAIN[name][1] for name in frameworks},
        },
        "devices_seen": found,
        "load_average": {"start": load_start, "end": load_end},
        "children": children,
        "results": rows,
        "skipped": skipped,
        "notes": honest_notes(found, rows, load_start, load_end),
    }


def _child_rows(
    child: Child,
    found: Mapping[str, Any],
    cores: int | None,
    batch: int,
    per_device_batch: int,
    steps: int,
) -> list[dict[str, Any]]:
    """One row per case of `child`, before it runs: what it is and where."""
    rows = []
    for case in child.cases:
        n = child.devices
        strong = case["kind"] == "strong"
        mesh = case["engine"] == "mesh"
        rows.append(
            {
                "framework": child.framework,
                "engine": case["engine"],
                "engine_name": ENGINES[child.framework] if mesh else PLAIN[child.framework][1],
                "kind": case["kind"],
                "devices": n,
                "mesh": f"data={n},model=1" if mesh else "one device",
                "global_batch": batch if strong else n * per_device_batch,
                "per_device_batch": (batch // n if strong else per_device_batch),
                "device": found["platform"],
                "device_name": found["names"][0] if found["names"] else "",
                "oversubscribed": cores is not None and n > cores,
                "steps": steps,
                "status": "pending",
            }
        )
    return rows


def row_line(r: Mapping[str, Any]) -> str:
    """One progress line for a finished row."""
    head = f"  {r['framework']} {r['engine']} {r['kind']} N={r['devices']}"
    if r["status"] != "ok":
        return f"{head}: {r['status']} ({r.get('reason', '')})"
    return (
        f"{head}: {r['step_s'] * 1e3:.2f} ms a step, {r['tokens_per_s']:,.0f} target tok/s "
        f"(pairs {_ms(min(r['step_s_pairs']))}-{_ms(max(r['step_s_pairs']))} ms; start-up "
        f"{r['startup_s']:.1f} s, first call {r['first_call_s']:.1f} s)"
    )


def honest_notes(
    found: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    load_start: list[float] | None,
    load_end: list[float] | None,
) -> list[str]:
    """The lines printed under the table: what the figures mean on this machine."""
    notes = []
    cpus = {p["count"] for name, p in found.items() if p["platform"] == "cpu"}
    if cpus:
        notes.append(CPU_LABEL.format(cores=max(cpus)))
    over = sorted({r["devices"] for r in rows if r.get("oversubscribed")})
    if over:
        notes.append(
            f"N = {', '.join(map(str, over))}: "
            + OVERSUBSCRIBED.format(cores=max(cpus) if cpus else "?")
            + " (XLA's forced host devices; torch refuses it)."
        )
    if "keras" in {r["framework"] for r in rows}:
        notes.append(
            "keras: the engine runs on Keras's JAX backend and the plain loop on TensorFlow, so "
            "'vs plain' holds the change of backend as well as the engine's cost."
        )
    if load_start and load_end:
        notes.append(
            f"Load average (1 min) {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the "
            f"end on {os.cpu_count()} cores: other processes shared the machine, and every "
            "figure is slower by what they took."
        )
        torch_cpu = found.get("torch", {}).get("platform") == "cpu"
        if torch_cpu and max(load_start[0], load_end[0]) >= 0.5 * (os.cpu_count() or 1):
            notes.append(
                "torch: on cores that other processes hold, its OpenMP threads spin, so its rows "
                "with several threads a process (N=1 and the plain loop take every core) slow "
                "the most; OMP_NUM_THREADS, when set, is kept for every torch child."
            )
    return notes


# -- reports --------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value * 1e3:.2f}"


def _x(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _s(value: float) -> str:
    """Seconds, 2 decimals; a fixed cost that the differencing puts a hair below 0 shows 0.00."""
    return f"{value:.2f}" if abs(value) >= 0.005 else "0.00"


def markdown(result: Mapping[str, Any]) -> str:
    """The report: the machine and the workload, one line per row, the start-up of each child,
    and the honest lines."""
    m, s = result["machine"], result["settings"]
    c = s["config"]
    gpus = "; ".join(f"{k}: {', '.join(v)}" for k, v in m.get("gpus", {}).items()) or "none"
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {(m['ram_bytes'] or 0) / 2**30:.0f} GiB; "
        f"GPUs: {gpus}; Python {m['python']}; "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
        "",
        f"Workload: the {s['task']} task's batches, model {s['model']} (d_model {c['d_model']}, "
        f"{c['num_heads']} heads, d_ff {c['d_ff']}, {c['num_encoder_layers']} + "
        f"{c['num_decoder_layers']} layers), {s['dtype']}, Adam at the Noam rate. Strong: global "
        f"batch {s['batch']}; weak: {s['per_device_batch']} rows a device. One step: "
        f"(T({1 + s['steps']} steps) - T(1 step)) / {s['steps']}, median over {s['repeats']} "
        f"pairs of calls, after a warm-up call of {s['warmup_call_steps']} steps (every call's "
        "fixed cost, its first step and any compiling cancel; shown under start-up).",
        "",
        "| framework | engine | kind | N | global batch | per device | step ms | pairs ms | "
        "target tok/s | speed-up vs N=1 | efficiency | vs plain | note |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in result["results"]:
        engine = "train_on_mesh" if r["engine"] == "mesh" else "plain train_steps"
        note = []
        if r.get("oversubscribed"):
            note.append("oversubscribed")
        if r.get("noisy"):
            note.append("noisy: pairs spread > 50% of the median")
        if "overhead_vs_plain" in r:
            note.append(f"engine overhead {r['overhead_vs_plain']:.2f}x the plain loop")
        head = (
            f"| {r['framework']} | {engine} | {r['kind']} | {r['devices']} | {r['global_batch']} "
            f"| {r['per_device_batch']} |"
        )
        if r["status"] != "ok":
            lines.append(f"{head} {r['status']}: {r.get('reason', '')} | | | | | | | |")
            continue
        pairs = r["step_s_pairs"]
        lines.append(
            f"{head} {_ms(r['step_s'])} | {_ms(min(pairs))}-{_ms(max(pairs))} | "
            f"{r['tokens_per_s']:,.0f} | {_x(r.get('speedup'))} | {_x(r.get('efficiency'))} | "
            f"{_x(r.get('vs_plain'))} | {'; '.join(note)} |"
        )
    lines += [
        "",
        "Start-up (left out of the figures above): the child's process start and imports, its "
        "warm-up call (build, compile, "
        f"{s['warmup_call_steps']} steps) and a call's fixed cost (the 1-step call less a step: "
        "torch builds DDP, Keras traces its step again). torch's start-up includes torchrun's.",
        "",
        "| framework | engine | kind | N | start-up s | warm-up call s | a call's fixed cost s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in result["results"]:
        if r["status"] != "ok":
            continue
        lines.append(
            f"| {r['framework']} | {r['engine']} | {r['kind']} | {r['devices']} | "
            f"{_s(r['startup_s'])} | {_s(r['first_call_s'])} | {_s(r['call_overhead_s'])} |"
        )
    for name, why in result["skipped"].items():
        lines.append(f"\n{name}: skipped ({why})")
    lines.append("")
    lines += [f"**{note}**" if i == 0 else note for i, note in enumerate(result["notes"])]
    return "\n".join(lines) + "\n"


# -- command line ---------------------------------------------------------------------------------


def frameworks_arg(text: str) -> list[str]:
    names = [ALIASES.get(n.strip(), n.strip()) for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown framework {', '.join(unknown) or '(none given)'}; known: "
            f"{', '.join(FRAMEWORKS)} (tf is keras)"
        )
    return list(dict.fromkeys(names))


def devices_arg(text: str) -> list[int]:
    try:
        counts = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: device counts, e.g. 1,2") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: device counts are whole numbers >= 1")
    return sorted(set(counts))


def run(argv: Sequence[str] | None = None) -> int:
    p = parser(PROG, __doc__)
    p.add_argument(
        "--frameworks",
        type=frameworks_arg,
        default=list(FRAMEWORKS),
        metavar="LIST",
        help="comma-separated, from torch,jax,keras (default all three; tf is keras)",
    )
    p.add_argument(
        "--devices",
        type=devices_arg,
        metavar="LIST",
        help="device counts N, comma-separated; 1 always runs (the baseline). Default: 1, 2, "
        "4, ... up to the GPUs present, else the CPU's cores",
    )
    p.add_argument(
        "--model",
        choices=MODELS,
        default="numbers",
        help="numbers (default): the task's model; tiny, base: the preset's sizes",
    )
    p.add_argument(
        "--batch",
        type=positive_int,
        help="strong: global rows (default --per-device-batch x the largest N: 64 on 2 cores)",
    )
    p.add_argument(
        "--per-device-batch", type=positive_int, default=32, help="weak: rows a device (32)"
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=40,
        help="timed steps K (40): enough that K steps outweigh the jitter of a call's fixed "
        "cost; on a CPU, JAX and Keras calls of much more than 60 steps can abort (see --help)",
    )
    p.add_argument(
        "--repeats", type=repeats_int, default=3, help="pairs of calls, median taken (3)"
    )
    p.add_argument("--seed", type=seed_int, default=0, help="weights and batches (0)")
    p.add_argument("--out", type=Path, metavar="FILE.json", help="write the JSON there")
    p.add_argument("--markdown", type=Path, metavar="TABLE", help="write the markdown there")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    p.add_argument("--force", action="store_true", help="overwrite --out and --markdown")
    args = p.parse_args(None if argv is None else list(argv))
    if args.devices is not None and args.batch is not None:
        bad = [n for n in args.devices if args.batch % n]
        if bad:
            raise UsageError(
                f"--batch {args.batch}: strong scaling splits it over N devices, and it does not "
                f"divide over N = {', '.join(map(str, bad))}"
            )
    if args.out is not None and args.markdown is not None and args.out == args.markdown:
        raise UsageError("--out and --markdown name the same file")
    for what, path in {"--out": args.out, "--markdown": args.markdown}.items():
        if path is not None:  # refused now, not after minutes of measuring
            check_output_file(path, what=what, force=args.force)
    strong = "per device x the largest N" if args.batch is None else args.batch
    to_stderr(
        f"{PROG}: {','.join(args.frameworks)}; model {args.model}; strong batch {strong}, "
        f"weak {args.per_device_batch} a device; {args.steps} timed steps x {args.repeats}"
    )
    result = measure(
        args.frameworks,
        args.devices,
        model=args.model,
        batch=args.batch,
        per_device_batch=args.per_device_batch,
        steps=args.steps,
        repeats=args.repeats,
        seed=args.seed,
        progress=to_stderr,
    )
    table = markdown(result)
    text = write_results(result, table, args.out, args.markdown)
    print(text if args.json else table, flush=True)
    return 1 if any(r["status"] == "failed" for r in result["results"]) else 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(PROG, lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
