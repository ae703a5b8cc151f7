"""Memory and time of the weight-file commands against model size: `rosetta convert` to every
format, `rosetta inspect` and the loading of `rosetta forward`, beside a plain safetensors read
and a file copy of the same bytes.

    .venv/bin/python -m transformer_rosetta.benchmarks.bench_convert [--sizes tiny,base,big,huge]
        [--operations OP,OP,...] [--huge-gb 3] [--seed 0] [--shard-size 500MB]
        [--generate-shard-size 1GB] [--forward-framework torch] [--workdir DIR]
        [--interval 0.01] [--out results.json] [--markdown TABLE] [--plot memory.png] [--json] [--force]

Every operation runs as the real command line (`python -m transformer_rosetta ...`) in a child
process, so what is measured is what a user's command costs, start-up included. The parent
samples /proc/PID/status of the child and of its children every `--interval` seconds: RssAnon
(the anonymous memory: the heap, the arrays a command builds, what a reader copies out of a
file) and VmRSS (which also counts file pages mapped in, which the kernel can drop at will: a
memory-mapped read of a 3 GB file shows 3 GB there without needing it). The peak of each sum,
the wall time and the throughput (the model's bytes per second) are reported; the kernel's
high-water mark of the child's RSS (wait4's ru_maxrss) comes with them as a cross-check.

The fixed cost is measured the same way: a child that imports the command line and the framework
the operation needs, then exits (the "baseline"). What an operation holds above its baseline is
what its work costs; what stays flat as the model grows is the fixed cost.

The sizes are the presets tiny, base and big (Table 3 of the paper), each written as one
.safetensors file, and "huge": the big layer stacked until the weights pass --huge-gb * 10^9 bytes
(25 + 25 layers, 3.09 GB, for 3), written as a sharded folder (benchmarks/generate_model.py:
generated tensor by tensor, in bounded memory). Each model is generated afresh in a temporary
folder (the "generate" row measures that too), every output is removed after its row, and the
folder is removed at the end.

Targets (the benchmarks README, "Conversions: memory and time against model size"):
- every conversion, inspect, the safetensors read and the generator hold at most 0.5 GB plus the
  largest single tensor of anonymous memory, flat as the model grows (the acceptance line for big,
  857 MB: peak RssAnon <= 700 MB, is printed for that size);
- loading for forward holds one copy of the weights: at most the model's bytes + 0.5 GB + the
  largest tensor;
- a conversion moves the bytes at least half as fast as cp (and `sync`) does, once what it
  costs at any size is taken off: judged on the slope from tiny to the size (add_speed), or
  where tiny did not run on the wall less its baseline's (the start-up).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from transformer_rosetta.adapter.backends import unavailable_reason
from transformer_rosetta.app.cli.args import UsageError, seed_int, size_arg
from transformer_rosetta.benchmarks.generate_model import (
    GB,
    largest_tensor_bytes,
    model_bytes,
    stacked_config,
)
from transformer_rosetta.benchmarks.harness import (
    cli_main,
    cpu_name,
    parser,
    to_stderr,
    write_results,
)
from transformer_rosetta.files.outputs import atomic_write, check_output_file
from transformer_rosetta.spec.config import TransformerConfig, preset

PROG = "python -m transformer_rosetta.benchmarks.bench_convert"
MB = 10**6  # decimal megabytes, as big's file is quoted (857 MB)
SIZES = ("tiny", "base", "big", "huge")
FIXED_ALLOWANCE = GB // 2  # the 0.5 GB every target allows beyond what the model needs
ACCEPTANCE_LINE = {"big": 700 * MB}  # the acceptance line: big's conversions under 700 MB
SPEED_TARGET = 0.5  # a conversion's throughput at least half of cp's
FORWARD_LENGTH = 8  # tokens of the forward row's source and target: the load is what is measured


@dataclass(frozen=True)
class Operation:
    """One row kind: how it is labelled, which baseline its fixed cost is, whose target it has."""

    key: str
    label: str
    # a BASELINE_CODE key (the interpreter with what the command imports), "forward" for the
    # forward framework's, None for cp's
    baseline: str | None
    memory: str | None  # "flat", "one copy" or None (no target: the reference)
    speed: bool = False  # whether the cp target applies
    framework: str | None = None  # the backend it needs installed


OPERATIONS = {
    op.key: op
    for op in (
        Operation("generate", "generate the model (the source)", "generator", "flat"),
        Operation("cp", "cp + sync (the reference)", None, None),
        Operation("safe_open", "safetensors.safe_open, every tensor", "safetensors", "flat"),
        Operation("inspect", "rosetta inspect", "rosetta", "flat"),
        Operation("to_sharded", "convert -> sharded folder", "rosetta", "flat", speed=True),
        Operation("to_pt", "convert -> .pt", "torch", "flat", speed=True, framework="torch"),
        Operation(
            "pt_to_safetensors",
            "convert .pt -> .safetensors",
            "torch",
            "flat",
            speed=True,
            framework="torch",
        ),
        Operation("to_h5", "convert -> .weights.h5", "tf", "flat", speed=True, framework="tf"),
        Operation("to_msgpack", "convert -> .msgpack", "jax", "flat", speed=True, framework="jax"),
        Operation("forward", "forward (load + 1x8 tokens)", "forward", "one copy"),
        Operation(
            "verify_pt", "convert -> .pt --verify", "torch", None, framework="torch"
        ),  # not in the default set: it runs the model twice
    )
}
DEFAULT_OPERATIONS = tuple(k for k in OPERATIONS if k != "verify_pt")

# What each baseline child imports: the interpreter with what the operation's command imports
# before it touches a file.
_BACKEND = (
    "import transformer_rosetta.cli; from transformer_rosetta.adapter.backends import get_backend; "
)
BASELINE_CODE = {
    "safetensors": "import numpy, safetensors",
    "generator": "import transformer_rosetta.benchmarks.generate_model",
    "rosetta": "import transformer_rosetta.cli",
    **{name: f"{_BACKEND}get_backend({name!r})" for name in ("torch", "tf", "jax")},
}

# The plain read the commands are compared with: every tensor of every file, one at a time.
SAFE_OPEN_CODE = """
import sys
from safetensors import safe_open
total = 0
for path in sys.argv[1:]:
    with safe_open(path, framework="np") as f:
        for name in f.keys():
            total += f.get_tensor(name).nbytes
print(total)
"""


# -- measuring a child ------------------------------------------------------------------------


@dataclass
class Measured:
    """What one child cost: wall seconds, the peaks of the sampled sums over its process tree,
    the kernel's high-water mark of its RSS, its exit code and the tail of its stderr."""

    wall_s: float
    peak_rss_anon: int
    peak_rss: int
    hwm_rss: int
    returncode: int
    samples: int
    stderr: str = ""
    stdout: str = ""


def median_run(runs: Sequence[Measured]) -> Measured:
    """One figure for a command run several times: the run of the median wall time (of an
    even count, the faster middle one), with the highest memory peaks of all of them; a run
    that failed stands for them all."""
    failed = [r for r in runs if r.returncode]
    if failed:
        return failed[0]
    middle = sorted(runs, key=lambda r: r.wall_s)[(len(runs) - 1) // 2]
    return dataclasses.replace(
        middle,
        peak_rss_anon=max(r.peak_rss_anon for r in runs),
        peak_rss=max(r.peak_rss for r in runs),
        hwm_rss=max(r.hwm_rss for r in runs),
    )


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc's children lists (one per thread)."""
    found, i = [pid], 0
    while i < len(found):
        p = found[i]
        i += 1
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    with open(f"/proc/{p}/task/{task}/children") as f:
                        found.extend(int(c) for c in f.read().split())
    return found


def memory_of(pid: int) -> tuple[int, int]:
    """(RssAnon, VmRSS) in bytes of one process; (0, 0) once it has exited."""
    anon = rss = 0
    with contextlib.suppress(OSError, ValueError):
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
    return anon, rss


def run_measured(
    argv: Sequence[str],
    *,
    interval: float = 0.01,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> Measured:
    """Run `argv`, sampling the memory of its process tree every `interval` seconds until it
    exits. The child is reaped with wait4, which also gives the kernel's high-water mark."""
    with tempfile.TemporaryFile("w+") as err, tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=None if env is None else dict(env),
            cwd=cwd,
        )
        peaks = [0, 0, 0]  # RssAnon, VmRSS, samples
        done = threading.Event()

        def sample() -> None:
            while True:
                anon = rss = 0
                for p in process_tree(proc.pid):
                    a, r = memory_of(p)
                    anon, rss = anon + a, rss + r
                peaks[0], peaks[1] = max(peaks[0], anon), max(peaks[1], rss)
                peaks[2] += 1
                if done.wait(interval):
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:  # Ctrl-C: stop the child we started, then pass it on
            proc.kill()
            proc.wait()
            raise
        wall = time.perf_counter() - start
        done.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        err.seek(0)
        out.seek(0)
        return Measured(
            wall_s=wall,
            peak_rss_anon=peaks[0],
            peak_rss=peaks[1],
            hwm_rss=usage.ru_maxrss * 1024,  # kilobytes on Linux
            returncode=proc.returncode,
            samples=peaks[2],
            stderr=err.read()[-4000:],
            stdout=out.read()[-4000:],
        )


def last_line(text: str) -> str:
    """The last non-empty line: a failed command's one-line error."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


# -- the plan ---------------------------------------------------------------------------------


@dataclass
class Size:
    """One model of the benchmark: its config and how the generator writes it."""

    name: str
    config: TransformerConfig
    shard_size: int | None  # None: one .safetensors file

    @property
    def nbytes(self) -> int:
        return model_bytes(self.config)

    @property
    def largest_tensor(self) -> int:
        return largest_tensor_bytes(self.config)


def plan_size(name: str, huge_gb: float, generate_shard_size: int) -> Size:
    if name == "huge":
        return Size(name, stacked_config(huge_gb), generate_shard_size)
    return Size(name, preset(name), None)


def memory_target(op: Operation, size: Size) -> int | None:
    """The most RssAnon the operation may hold on `size`, or None where there is no target."""
    if op.memory == "flat":
        return FIXED_ALLOWANCE + size.largest_tensor
    if op.memory == "one copy":
        return size.nbytes + FIXED_ALLOWANCE + size.largest_tensor
    return None


def disk_needed(sizes: Iterable[Size]) -> int:
    """Bytes of free disk the run needs at once: the source, the .pt kept for the way back, one
    other output and the cp copy of the largest model, plus a margin for headers and HDF5."""
    return int(max(s.nbytes for s in sizes) * 4 + FIXED_ALLOWANCE)


@dataclass
class Context:
    """Where one run works and what it found out about this installation."""

    python: str
    workdir: Path
    interval: float
    env: dict[str, str]
    forward_framework: str
    shard_size: int
    seed: int
    has_max_shard_size: bool
    progress: Callable[[str], None]
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)
    warm: bool = True  # warm the free memory before each command (warm_free_memory)
    repeats: int = 1  # runs of each operation's command; the median's figures (median_run)
    warm_bytes: int = 0  # how much, for the size being measured (warm_bytes_for)

    def rosetta(self, *args: str) -> list[str]:
        return [self.python, "-m", "transformer_rosetta", *args]

    def measure(self, argv: Sequence[str]) -> Measured:
        warm_free_memory(self.warm_bytes)
        return run_measured(argv, interval=self.interval, env=self.env, cwd=self.workdir)


def warm_bytes_for(size: Size, warm: bool) -> int:
    """What warm_free_memory touches before each command on `size`: what a conversion takes
    of fresh memory (its output's page cache, its arrays), the model and 0.5 GB, at most half
    of the memory free now (never so much that the kernel would drop the model's own pages from
    its cache to find it); 0 with --no-warm."""
    if not warm:
        return 0
    return min(size.nbytes + GB // 2, free_memory() // 2)


def free_memory() -> int:
    """MemFree from /proc/meminfo, in bytes (0 where it cannot be read)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemFree:"):
                return int(line.split()[1]) * 1024
    return 0


def warm_free_memory(nbytes: int) -> None:
    """Touch `nbytes` of memory a page at a time and free it, just before a command runs, so
    that the pages the command takes (its output's page cache, its arrays) are in the guest's
    free lists rather than handed back to the host. On a virtual machine with free page
    reporting (virtio-balloon), memory freed a few seconds earlier is returned to the host, and
    the first touch of it costs ten times a warm one (measured here: 400 MB written in 0.84 s
    after 15 s idle, 0.08 s right after the same amount was freed). Without this, a row pays
    for whatever the rows before it left cold, and cp's reference pays least."""
    if nbytes <= 0:
        return
    block = np.empty(nbytes, dtype=np.uint8)
    block[:: os.sysconf("SC_PAGE_SIZE")] = 1
    del block


def child_env() -> dict[str, str]:
    """The children's environment: TensorFlow's start-up chatter off, and JAX and TensorFlow not
    taking a GPU's memory when they start (no framework runs on a GPU here)."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    return env


def convert_has_max_shard_size(ctx: Context) -> bool:
    """Whether this installation's `rosetta convert` writes a sharded folder."""
    done = subprocess.run(
        ctx.rosetta("convert", "--help"), capture_output=True, text=True, env=ctx.env
    )
    return "--max-shard-size" in done.stdout


def baseline_of(ctx: Context, op: Operation) -> str | None:
    """The BASELINE_CODE key of `op`'s fixed cost (forward's is its framework's)."""
    if op.baseline != "forward":
        return op.baseline
    return ctx.forward_framework if ctx.forward_framework in BASELINE_CODE else "rosetta"


def measure_baseline(ctx: Context, name: str) -> dict[str, Any]:
    """The fixed cost: a child that imports what the operations of `name` import, then exits
    (measured once a run)."""
    if name in ctx.baselines:
        return ctx.baselines[name]
    code = BASELINE_CODE[name]
    ctx.progress(f"baseline {name}: {code}")
    m = ctx.measure([ctx.python, "-c", code])
    result = {
        "code": code,
        "status": "ok" if m.returncode == 0 else "failed",
        "wall_s": m.wall_s,
        "peak_rss_anon_bytes": m.peak_rss_anon,
        "peak_rss_bytes": m.peak_rss,
        "hwm_rss_bytes": m.hwm_rss,
    }
    if m.returncode != 0:
        result["reason"] = last_line(m.stderr)
        ctx.progress(f"baseline {name}: failed ({result['reason']}); its rows have no net figures")
    ctx.baselines[name] = result
    return result


# -- the rows ---------------------------------------------------------------------------------


def files_of(path: Path) -> list[Path]:
    """The .safetensors files of a model: the file itself, or a folder's shards."""
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.name.endswith(".safetensors"))
    return [path]


def bytes_on_disk(path: Path) -> int:
    """Bytes of a file, or of every file in a folder."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def forward_inputs(ctx: Context, config: TransformerConfig) -> tuple[Path, Path]:
    """A 1 x FORWARD_LENGTH source and decoder input of ordinary ids (no pad, BOS or EOS but the
    decoder's leading BOS): the forward row measures the load, not the compute."""
    rng = np.random.default_rng(ctx.seed)
    special = {config.pad_id, config.bos_id, config.eos_id}
    ordinary = np.array([i for i in range(min(config.src_vocab_size, 1000)) if i not in special])
    src = rng.choice(ordinary, size=(1, FORWARD_LENGTH)).astype(np.int64)
    tgt = rng.choice(ordinary, size=(1, FORWARD_LENGTH)).astype(np.int64)
    tgt[:, 0] = config.bos_id
    paths = ctx.workdir / "src.npy", ctx.workdir / "tgt.npy"
    np.save(paths[0], src)
    np.save(paths[1], tgt)
    return paths


def command(
    ctx: Context, op: str, source: Path, config_file: Path, pt: Path
) -> tuple[list[str], Path | None]:
    """The command line of operation `op` on `source`, and the output it writes (removed after)."""
    out = ctx.workdir / "out"
    no_verify = "--no-verify"
    if op == "cp":
        # cp, then fsync of what it wrote: every command writes through atomic_write, which
        # fsyncs before the rename, so the reference pays the same.
        script = 'cp -r -- "$1" "$2" && find "$2" -type f -exec sync -- {} +'
        return ["sh", "-c", script, "sh", str(source), str(out)], out
    if op == "safe_open":
        return [ctx.python, "-c", SAFE_OPEN_CODE, *map(str, files_of(source))], None
    if op == "inspect":
        return ctx.rosetta("inspect", str(source)), None
    if op == "to_sharded":
        shard = str(ctx.shard_size)
        return ctx.rosetta(
            "convert", str(source), str(out), "--max-shard-size", shard, no_verify
        ), out
    if op == "to_pt":
        return ctx.rosetta(
            "convert", str(source), str(pt), no_verify
        ), None  # kept for the way back
    if op == "verify_pt":
        out = out.with_name("verified.pt")
        return ctx.rosetta("convert", str(source), str(out), "--verify"), out
    if op == "pt_to_safetensors":
        out = out.with_name("back.safetensors")
        return ctx.rosetta(
            "convert", str(pt), str(out), "--config", str(config_file), no_verify
        ), out
    if op == "to_h5":
        out = out.with_name("out.weights.h5")
        return ctx.rosetta("convert", str(source), str(out), no_verify), out
    if op == "to_msgpack":
        out = out.with_name("out.msgpack")
        return ctx.rosetta("convert", str(source), str(out), no_verify), out
    if op == "forward":
        src, tgt = ctx.workdir / "src.npy", ctx.workdir / "tgt.npy"
        out = out.with_name("forward.npz")
        args = ["forward", "--framework", ctx.forward_framework, "--weights", str(source)]
        args += ["--src", str(src), "--tgt", str(tgt), "--out", str(out), "--no-attention"]
        return ctx.rosetta(*args, "--device", "cpu"), out
    raise ValueError(f"unknown operation {op!r}")


def unavailable(ctx: Context, op: Operation) -> str | None:
    """Why `op` cannot run in this installation, or None."""
    framework = ctx.forward_framework if op.key == "forward" else op.framework
    if framework is not None:
        reason = unavailable_reason(framework)
        if reason is not None:
            return f"{framework}: {reason}"
    if op.key == "to_sharded" and not ctx.has_max_shard_size:
        return "rosetta convert has no --max-shard-size in this installation"
    return None


def row(
    ctx: Context,
    op: Operation,
    size: Size,
    measured: Measured | None,
    *,
    nbytes: int,
    status: str = "ok",
    reason: str | None = None,
    argv: Sequence[str] = (),
    walls_s: Sequence[float] = (),
) -> dict[str, Any]:
    """One row of the result: the figures, the baseline they sit on, and the targets
    (`walls_s`: every run's wall time, where the command ran more than once)."""
    r: dict[str, Any] = {
        "operation": op.key,
        "label": op.label,
        "size": size.name,
        "model_bytes": size.nbytes,
        "bytes": nbytes,
        "status": status,
    }
    if reason is not None:
        r["reason"] = reason
    if argv:
        r["command"] = [Path(a).name if a == ctx.python else a for a in argv]
    if len(walls_s) > 1:
        r["walls_s"] = list(walls_s)
    if measured is None:
        return r
    name = baseline_of(ctx, op)
    base = ctx.baselines.get(name) if name else None
    r.update(
        wall_s=measured.wall_s,
        peak_rss_anon_bytes=measured.peak_rss_anon,
        peak_rss_bytes=measured.peak_rss,
        hwm_rss_bytes=measured.hwm_rss,
        samples=measured.samples,
        rss_anon_over_size=measured.peak_rss_anon / nbytes if nbytes else None,
        throughput_bytes_per_s=nbytes / measured.wall_s if measured.wall_s > 0 else None,
        baseline=name,
    )
    if base is not None and base["status"] == "ok":
        net = measured.wall_s - base["wall_s"]
        r.update(
            baseline_rss_anon_bytes=base["peak_rss_anon_bytes"],
            baseline_wall_s=base["wall_s"],
            rss_anon_above_baseline_bytes=measured.peak_rss_anon - base["peak_rss_anon_bytes"],
            net_wall_s=net,
            # Start-up is a fixed cost: past half the wall, the bytes/s would say little.
            net_throughput_bytes_per_s=nbytes / net if net > 0.5 * measured.wall_s else None,
        )
    target = memory_target(op, size)
    if status != "ok":  # a command that failed has no verdict: it did not do the work
        return r
    if target is not None:
        r["memory_target_bytes"] = target
        r["memory_target_met"] = measured.peak_rss_anon <= target
    if size.name in ACCEPTANCE_LINE and op.memory == "flat" and op.key.startswith(("to_", "pt_")):
        r["acceptance_line_bytes"] = ACCEPTANCE_LINE[size.name]
        r["acceptance_line_met"] = measured.peak_rss_anon <= ACCEPTANCE_LINE[size.name]
    return r


def add_speed(rows: list[dict[str, Any]]) -> None:
    """Each row's throughput against cp's on the same size, and the speed target.

    Three figures, each against cp's: the raw one (the model's bytes over the wall, start-up
    included); the net one (the baseline's start-up taken off: the imports alone); and the
    marginal one, the slope between this size and tiny, the same command at 0.07 MB: (bytes -
    tiny's bytes) / (wall - tiny's wall), which takes off everything a command costs whatever
    the size (the interpreter, the imports, the lazy imports of its own path, the checks), and
    leaves what moving the bytes costs. cp's is taken the same way. The target is judged on the
    marginal figure where tiny ran, else on the net one."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("wall_s")]
    tiny = {r["operation"]: r for r in ok if r["size"] == "tiny"}
    for r in ok:
        small = tiny.get(r["operation"])
        if small is not None and r is not small and r["wall_s"] > small["wall_s"]:
            r["marginal_throughput_bytes_per_s"] = (r["bytes"] - small["bytes"]) / (
                r["wall_s"] - small["wall_s"]
            )
    cp = {r["size"]: r for r in ok if r["operation"] == "cp"}
    for r in ok:
        ref = cp.get(r["size"])
        if ref is None or not r.get("throughput_bytes_per_s"):
            continue
        reference = ref["throughput_bytes_per_s"]
        r["throughput_vs_cp"] = r["throughput_bytes_per_s"] / reference
        net = r.get("net_throughput_bytes_per_s")
        if net is not None:
            r["net_throughput_vs_cp"] = net / reference
        marginal, cp_marginal = (
            r.get("marginal_throughput_bytes_per_s"),
            ref.get("marginal_throughput_bytes_per_s"),
        )
        if marginal is not None and cp_marginal:
            r["marginal_throughput_vs_cp"] = marginal / cp_marginal
        if OPERATIONS[r["operation"]].speed:
            r["speed_target"] = SPEED_TARGET
            judged = r.get("marginal_throughput_vs_cp", r.get("net_throughput_vs_cp"))
            r["speed_target_met"] = None if judged is None else judged >= SPEED_TARGET


def generate_command(ctx: Context, size: Size, source: Path) -> list[str]:
    """The generator's command line for `size` (benchmarks/generate_model.py)."""
    argv = [ctx.python, "-m", "transformer_rosetta.benchmarks.generate_model", str(source)]
    argv += ["--seed", str(ctx.seed)]
    if size.name == "huge":
        argv += ["--layers", str(size.config.num_encoder_layers)]
    else:
        argv += ["--preset", size.name]
    if size.shard_size:
        argv += ["--max-shard-size", str(size.shard_size)]
    return argv


def run_size(
    ctx: Context, size: Size, operations: Sequence[str], say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Generate the model of `size`, then every operation on it, one after another; every
    output is removed after its row, and the model at the end."""
    rows: list[dict[str, Any]] = []

    def add(op: Operation, measured: Measured | None, nbytes: int, **kw: Any) -> None:
        rows.append(row(ctx, op, size, measured, nbytes=nbytes, **kw))
        say(summary(rows[-1]))

    folder = ctx.workdir
    ctx.warm_bytes = warm_bytes_for(size, ctx.warm)
    source = folder / ("model" if size.shard_size else "model.safetensors")
    config_file, pt = folder / "config.json", folder / "model.pt"
    config_file.write_text(size.config.to_json())  # the way back from .pt needs it
    forward_inputs(ctx, size.config)
    try:
        say(f"{size.name}: generating {_mb(size.nbytes)} MB ({source.name}) ...")
        measure_baseline(ctx, "generator")
        gen = generate_command(ctx, size, source)
        m = ctx.measure(gen)
        if m.returncode != 0 or not source.exists():
            reason = f"the model could not be generated: {last_line(m.stderr)}"
            add(OPERATIONS["generate"], m, size.nbytes, status="failed", reason=reason, argv=gen)
            gone = {"status": "not available", "reason": "the model could not be generated"}
            rows += [
                row(ctx, OPERATIONS[key], size, None, nbytes=size.nbytes, **gone)
                for key in operations
                if key != "generate"
            ]
            return rows
        total = bytes_on_disk(source)  # every file of the model: a folder's index too
        if "generate" in operations:
            add(OPERATIONS["generate"], m, total, argv=gen)
        for key in operations:
            if key == "generate":
                continue
            op = OPERATIONS[key]
            why = unavailable(ctx, op)
            if why is not None:
                add(op, None, total, status="not available", reason=why)
                continue
            name = baseline_of(ctx, op)
            if name is not None:
                measure_baseline(ctx, name)
            if key == "pt_to_safetensors" and not pt.exists():
                why = make_pt(ctx, source, config_file, pt, "to_pt" in operations, say)
                if why is not None:
                    add(op, None, total, status="not available", reason=why)
                    continue
            argv, out = command(ctx, key, source, config_file, pt)
            say(f"{size.name}: {op.label} ...")
            written = pt if key == "to_pt" else out  # what a repeat must find gone
            runs: list[Measured] = []
            for _ in range(ctx.repeats):
                if runs and written is not None:
                    remove(written)
                runs.append(ctx.measure(argv))
                if runs[-1].returncode:
                    break
            m = median_run(runs)
            nbytes = total
            if key == "cp" and out is not None and out.exists():
                nbytes = bytes_on_disk(out)  # what cp copied: the same bytes, checked
            elif key == "pt_to_safetensors":
                nbytes = pt.stat().st_size
            failed = {"status": "failed", "reason": last_line(m.stderr)} if m.returncode else {}
            add(op, m, nbytes, argv=argv, walls_s=[r.wall_s for r in runs], **failed)
            if out is not None:
                remove(out)
            if key == "pt_to_safetensors" or (
                key == "to_pt" and "pt_to_safetensors" not in operations
            ):
                remove(pt)
    finally:
        for path in (source, pt, config_file, folder / "src.npy", folder / "tgt.npy"):
            remove(path)
    return rows


def make_pt(
    ctx: Context,
    source: Path,
    config_file: Path,
    pt: Path,
    measured_row: bool,
    say: Callable[[str], None],
) -> str | None:
    """The .pt that the way back reads, when the convert -> .pt row did not leave one; why not,
    or None once it is there."""
    if measured_row:
        return "no .pt: the convert -> .pt row failed"
    say("writing the .pt to read back (not measured) ...")
    setup = ctx.measure(command(ctx, "to_pt", source, config_file, pt)[0])
    return None if setup.returncode == 0 else f"no .pt: {last_line(setup.stderr)}"


def summary(r: Mapping[str, Any]) -> str:
    """One progress line for a finished row."""
    head = f"{r['size']}: {r['label']}: {r['status']}"
    if "wall_s" not in r:
        return f"{head} ({r.get('reason', '')})"
    text = (
        f"{head}, {r['wall_s']:.2f} s, peak RssAnon {r['peak_rss_anon_bytes'] / MB:,.0f} MB, "
        f"peak RSS {r['peak_rss_bytes'] / MB:,.0f} MB"
    )
    if r.get("reason"):
        text += f" ({r['reason']})"
    return text


# -- the whole run ----------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """CPU, cores, memory, the interpreter and the versions of what the commands use."""
    ram = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    ram = int(line.split()[1]) * 1024
    versions = {}
    for dist in (
        "transformer-rosetta",
        "numpy",
        "safetensors",
        "torch",
        "tensorflow",
        "keras",
        "h5py",
        "jax",
        "flax",
        "msgpack",
    ):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_bytes": ram,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
    }


def measure_all(
    sizes: Sequence[Size],
    operations: Sequence[str],
    *,
    workdir: Path,
    interval: float = 0.01,
    forward_framework: str = "torch",
    shard_size: int = 500 * MB,
    seed: int = 0,
    warm: bool = True,
    repeats: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every operation on every size, in a temporary folder under `workdir` removed at the end;
    `warm`: warm_free_memory before each command. Returns the JSON's object: machine,
    settings, baselines, sizes, rows, targets."""
    say = progress or (lambda message: None)
    operations = [key for key in OPERATIONS if key in operations]  # .pt before the way back
    work = Path(tempfile.mkdtemp(prefix="rosetta-bench-convert-", dir=workdir))
    try:
        ctx = Context(
            python=sys.executable,
            workdir=work,
            interval=interval,
            env=child_env(),
            forward_framework=forward_framework,
            shard_size=shard_size,
            seed=seed,
            has_max_shard_size=False,
            progress=say,
            warm=warm,
            repeats=repeats,
        )
        if "to_sharded" in operations:
            ctx.has_max_shard_size = convert_has_max_shard_size(ctx)
        rows = []
        for size in sizes:
            rows += run_size(ctx, size, operations, say)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    add_speed(rows)
    return {
        "machine": machine_info(),
        "settings": {
            "sizes": [s.name for s in sizes],
            "operations": list(operations),
            "interval_s": interval,
            "forward_framework": forward_framework,
            "shard_size_bytes": shard_size,
            "seed": seed,
            "workdir": str(workdir),
            "warm_free_memory": warm,
            "repeats": repeats,
        },
        "baselines": ctx.baselines,
        "sizes": {
            s.name: {
                "model_bytes": s.nbytes,
                "largest_tensor_bytes": s.largest_tensor,
                "layers": [s.config.num_encoder_layers, s.config.num_decoder_layers],
                "d_model": s.config.d_model,
                "heads": s.config.num_heads,
                "d_ff": s.config.d_ff,
                "vocab": [s.config.src_vocab_size, s.config.tgt_vocab_size],
                "sharded": s.shard_size,
            }
            for s in sizes
        },
        "rows": rows,
        "targets": {
            "memory_flat": "peak RssAnon <= 0.5 GB + the largest tensor (conversions, inspect, "
            "the safetensors read, the generator)",
            "memory_one_copy": "peak RssAnon <= model + 0.5 GB + the largest tensor (forward)",
            "acceptance_line": {k: v for k, v in ACCEPTANCE_LINE.items()},
            "speed": f"net throughput >= {SPEED_TARGET} x cp's (conversions)",
        },
    }


# -- reports ----------------------------------------------------------------------------------


def _mb(value: float | None) -> str:
    """Megabytes, whole from 10 MB up, with three decimals below (tiny's 0.047 MB)."""
    if value is None:
        return ""
    return f"{value / MB:,.0f}" if value >= 10 * MB else f"{value / MB:.3f}"


def _verdict(value: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "n/a"}[value]


def markdown(result: Mapping[str, Any]) -> str:
    """The report: the machine, the baselines, one row per operation and size, and the peak
    RssAnon of each operation against the size (what stays flat)."""
    m = result["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {(m['ram_bytes'] or 0) / 2**30:.0f} GiB; "
        f"Python {m['python']}; " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
        "",
        "MB = 10^6 bytes. Peak RssAnon: anonymous memory (heap, arrays); peak RSS adds mapped file "
        "pages. Throughput: the model's bytes / wall s; vs cp: against cp + sync of the same "
        "bytes; net: with the baseline's start-up taken off; marginal: the slope from tiny to this "
        "size, the same command's fixed cost taken off (the speed target is judged on it).",
        "",
        "| baseline (start-up) | imports | wall s | peak RssAnon MB | peak RSS MB |",
        "|---|---|---:|---:|---:|",
    ]
    for name, b in result["baselines"].items():
        if b["status"] != "ok":
            lines.append(f"| {name} | `{b['code']}` | failed: {b['reason']} |  |  |")
            continue
        lines.append(
            f"| {name} | `{b['code']}` | {b['wall_s']:.2f} | {_mb(b['peak_rss_anon_bytes'])} | "
            f"{_mb(b['peak_rss_bytes'])} |"
        )
    lines += [
        "",
        "| operation | size | size MB | wall s | peak RssAnon MB | peak RSS MB | RssAnon/size "
        "| MB/s | vs cp: raw / net / marginal | memory target MB | memory met | speed met |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in result["rows"]:
        if "wall_s" not in r:
            lines.append(
                f"| {r['label']} | {r['size']} | {_mb(r['bytes'])} | {r['status']}: "
                f"{r.get('reason', '')} |  |  |  |  |  |  |  |  |"
            )
            continue
        vs = ""
        if "throughput_vs_cp" in r:
            net, marginal = r.get("net_throughput_vs_cp"), r.get("marginal_throughput_vs_cp")
            vs = " / ".join(
                "-" if x is None else f"{x:.2f}" for x in (r["throughput_vs_cp"], net, marginal)
            )
        failed = "" if r["status"] == "ok" else f" ({r['status']}: {r.get('reason', '')})"
        tput = r.get("throughput_bytes_per_s")
        lines.append(
            f"| {r['label']}{failed} | {r['size']} | {_mb(r['bytes'])} | {r['wall_s']:.2f} | "
            f"{_mb(r['peak_rss_anon_bytes'])} | {_mb(r['peak_rss_bytes'])} | "
            f"{r['rss_anon_over_size']:.2f} | {_mb(tput)} | "
            f"{vs} | {_mb(r.get('memory_target_bytes'))} | "
            f"{_verdict(r.get('memory_target_met')) if 'memory_target_met' in r else ''} | "
            f"{_verdict(r.get('speed_target_met')) if 'speed_target' in r else ''} |"
        )
    accepted = [r for r in result["rows"] if "acceptance_line_met" in r]
    if accepted:
        lines += [
            "",
            "The acceptance line: big (857 MB), every conversion's peak RssAnon <= 700 MB:",
            "",
        ]
        for r in accepted:
            lines.append(
                f"- {r['label']}: {_mb(r['peak_rss_anon_bytes'])} MB: "
                f"{'met' if r['acceptance_line_met'] else '**not met**'}"
            )
    sizes = list(result["sizes"])
    ops = list(dict.fromkeys(r["operation"] for r in result["rows"]))
    lines += [
        "",
        "Peak RssAnon MB against model size (flat is the target for all but forward):",
        "",
        "| operation | "
        + " | ".join(f"{s} ({_mb(result['sizes'][s]['model_bytes'])} MB)" for s in sizes)
        + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    for key in ops:
        cells = []
        for s in sizes:
            found = [r for r in result["rows"] if r["operation"] == key and r["size"] == s]
            if not found or found[0]["status"] == "ok":
                cells.append(_mb(found[0]["peak_rss_anon_bytes"]) if found else "")
            else:
                cells.append(found[0]["status"])
        lines.append(f"| {OPERATIONS[key].label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: Mapping[str, Any], path: Path) -> None:
    """Peak RssAnon against model size, one line per operation, the flat target dashed (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for key in dict.fromkeys(r["operation"] for r in result["rows"]):
        points = [
            (r["model_bytes"] / MB, r["peak_rss_anon_bytes"] / MB)
            for r in result["rows"]
            if r["operation"] == key and "peak_rss_anon_bytes" in r and r["status"] == "ok"
        ]
        if points:
            ax.plot(
                [x for x, _ in points],
                [y for _, y in points],
                marker="o",
                label=OPERATIONS[key].label,
            )
    sizes = sorted(result["sizes"].values(), key=lambda s: s["model_bytes"])
    ax.plot(
        [s["model_bytes"] / MB for s in sizes],
        [(FIXED_ALLOWANCE + s["largest_tensor_bytes"]) / MB for s in sizes],
        "k--",
        label="target: 0.5 GB + largest tensor",
    )
    ax.set_xscale("log")
    ax.set_xlabel("model size (MB, float32)")
    ax.set_ylabel("peak RssAnon (MB)")
    ax.set_title(f"rosetta's weight-file commands on {result['machine']['cpu']}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- command line -----------------------------------------------------------------------------


def names_arg(known: Sequence[str], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}"
            )
        return list(dict.fromkeys(names))

    return parse


def run(argv: Sequence[str] | None = None) -> int:
    p = parser(PROG, __doc__)
    p.add_argument(
        "--sizes",
        type=names_arg(SIZES, "size"),
        default=["tiny", "base"],
        help="default tiny,base; the full run: tiny,base,big,huge",
    )
    p.add_argument(
        "--operations",
        type=names_arg(list(OPERATIONS), "operation"),
        default=list(DEFAULT_OPERATIONS),
        help=f"default {','.join(DEFAULT_OPERATIONS)}; also verify_pt",
    )
    p.add_argument(
        "--huge-gb", type=float, default=3.0, help="huge's weights pass this many GB (3)"
    )
    p.add_argument(
        "--generate-shard-size",
        type=size_arg,
        default=GB,
        metavar="SIZE",
        help="huge is generated as a folder of shards of at most SIZE (1GB)",
    )
    p.add_argument(
        "--shard-size",
        type=size_arg,
        default=500 * MB,
        metavar="SIZE",
        help="convert -> sharded folder's --max-shard-size (500MB)",
    )
    p.add_argument("--forward-framework", choices=["torch", "tf", "jax", "numpy"], default="torch")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where the temporary folder goes (default: the system's temp folder)",
    )
    p.add_argument(
        "--interval", type=float, default=0.01, help="seconds between memory samples (0.01)"
    )
    p.add_argument(
        "--no-warm",
        action="store_true",
        help="do not touch and free memory before each command (by default it does, so that a "
        "virtual machine's free page reporting does not charge each command for the pages it "
        "takes first; see warm_free_memory)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="run each operation's command N times and report the median run's wall time (and "
        "the highest memory peak of the N); the generator runs once (1)",
    )
    p.add_argument("--out", type=Path, metavar="FILE.json", help="write the JSON there")
    p.add_argument("--markdown", type=Path, metavar="TABLE", help="write the markdown table there")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="peak RssAnon against size")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    p.add_argument("--force", action="store_true", help="overwrite --out, --markdown, --plot")
    args = p.parse_args(None if argv is None else list(argv))
    if not os.path.exists("/proc/self/status"):
        raise UsageError("the memory is read from /proc/PID/status: Linux only")
    if not 0 < args.interval <= 1:
        raise UsageError(f"--interval: between 0 and 1 s, got {args.interval}")
    if not 1 <= args.repeats <= 99:
        raise UsageError(f"--repeats: from 1 to 99, got {args.repeats}")
    if not args.huge_gb > 0:
        raise UsageError(f"--huge-gb: must be > 0, got {args.huge_gb}")
    if not args.workdir.is_dir():
        raise UsageError(f"--workdir: {args.workdir} is not a folder")
    outputs = {"--out": args.out, "--markdown": args.markdown, "--plot": args.plot}
    for what, path in outputs.items():
        if path is not None:  # refused now, not after an hour of measuring
            check_output_file(path, what=what, force=args.force)
    sizes = [plan_size(n, args.huge_gb, args.generate_shard_size) for n in args.sizes]
    needed, free = disk_needed(sizes), shutil.disk_usage(args.workdir).free
    if needed > free:
        raise UsageError(
            f"not enough free disk in {args.workdir}: the run needs about {needed / GB:.1f} GB "
            f"(4 x the largest model, {max(s.nbytes for s in sizes) / GB:.2f} GB, + 0.5 GB), "
            f"{free / GB:.1f} GB are free; give --workdir on a larger disk"
        )
    to_stderr(
        f"{PROG}: sizes {','.join(args.sizes)}; {len(args.operations)} operations; "
        f"needs {needed / GB:.1f} GB of the {free / GB:.1f} GB free in {args.workdir}"
    )
    result = measure_all(
        sizes,
        args.operations,
        workdir=args.workdir,
        interval=args.interval,
        forward_framework=args.forward_framework,
        shard_size=args.shard_size,
        seed=args.seed,
        warm=not args.no_warm,
        repeats=args.repeats,
        progress=to_stderr,
    )
    table = markdown(result)
    text = write_results(result, table, args.out, args.markdown)
    if args.plot is not None:
        atomic_write(args.plot, lambda tmp: plot(result, Path(tmp)))
    print(text if args.json else table, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(PROG, lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
