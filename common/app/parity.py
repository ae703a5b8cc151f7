"""Cross-framework parity, framework-free: run each backend through the adapter on identical
weights and inputs, then compare every output with the float64 oracle and with each other.

`rosetta parity` prints what `run_parity` returns; the test suite asserts the same comparisons.
Adding a framework needs only a backend registered in common/adapter/backends.py.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from transformer_rosetta.adapter.backends import (
    FRAMEWORKS,
    REGISTRY,
    RUNTIMES,
    get_backend,
    unavailable_reason,
)
from transformer_rosetta.errors import InputError, InputTypeError, RosettaError
from transformer_rosetta.files.safe_read import brief
from transformer_rosetta.oracle import reference
from transformer_rosetta.spec.arguments import (
    check_choice,
    check_instance,
    check_path,
    check_seed,
    check_text,
)
from transformer_rosetta.spec.config import TransformerConfig
from transformer_rosetta.spec.mesh import MeshShape
from transformer_rosetta.spec.precision import DEFAULT_PRECISION, PRECISIONS
from transformer_rosetta.spec.results import ForwardOutput
from transformer_rosetta.spec.tolerances import atol_for

ORACLE = "numpy"
FUSED = " (fused)"  # the suffix of a quantity computed on the fused attention path


@dataclass(frozen=True)
class Comparison:
    """One compared array: max |a - b|, and that divided by max |b| (the scale of the reference,
    not elementwise, so that exact zeros in attention maps do not blow it up)."""

    quantity: str  # canonical output name, e.g. "logits", "decoder.layers.0.cross_attention"
    left: str  # a run label, e.g. "torch", "jax@gpu:0"
    right: str  # "numpy" (the oracle) or another run label
    max_abs: float
    max_rel: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return bool(self.max_abs <= self.tolerance)


@dataclass
class Run:
    """One framework on one device: its label and outputs (explicit path, plus the fused path's
    main output, fused_outputs)."""

    label: str
    framework: str
    device: str
    version: str
    outputs: dict[str, np.ndarray]
    seconds: float


@dataclass
class ParityReport:
    config: TransformerConfig
    dtype: str
    src: np.ndarray | None  # None for a decoder-only model (check_inputs)
    tgt_in: np.ndarray | None  # None for an encoder-only model
    runs: list[Run]
    skipped: dict[str, str]
    oracle: dict[str, np.ndarray]  # the float64 oracle's outputs, by the same names
    comparisons: list[Comparison] = field(default_factory=list)
    precision: str = DEFAULT_PRECISION  # float32 products (common/spec/precision.py)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.comparisons)

    @property
    def setting(self) -> str:
        """The dtype, and for float32 the products' precision when it is not full: "float32 (tf32)"."""
        return (
            f"{self.dtype} ({self.precision})"
            if self.dtype == "float32" and self.precision != DEFAULT_PRECISION
            else self.dtype
        )

    @property
    def batch(self) -> int:
        return batch_size(self.src, self.tgt_in)

    @property
    def quantities(self) -> list[str]:
        seen: dict[str, None] = {}
        for c in self.comparisons:
            seen.setdefault(c.quantity, None)
        return list(seen)

    @property
    def pairs(self) -> list[tuple[str, str]]:
        seen: dict[tuple[str, str], None] = {}
        for c in self.comparisons:
            seen.setdefault((c.left, c.right), None)
        return list(seen)

    def to_json(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "dtype": self.dtype,
            "precision": self.precision,
            "kind": self.config.kind,
            "batch": self.batch,
            "src_len": None if self.src is None else int(self.src.shape[1]),
            "tgt_len": None if self.tgt_in is None else int(self.tgt_in.shape[1]),
            "runs": [
                {
                    "label": r.label,
                    "framework": r.framework,
                    "device": r.device,
                    "version": r.version,
                    "seconds": round(r.seconds, 3),
                }
                for r in self.runs
            ],
            "skipped": self.skipped,
            "comparisons": [{**asdict(c), "passed": c.passed} for c in self.comparisons],
            "passed": self.passed,
        }


def batch_size(src: np.ndarray | None, tgt_in: np.ndarray | None) -> int:
    """The rows of whichever input the model takes (a half of the family takes one)."""
    given = [ids for ids in (src, tgt_in) if ids is not None]
    if not given:
        raise InputError("no input ids: every model takes src, tgt_in or both")
    return int(given[0].shape[0])


def describe_inputs(src: np.ndarray | None, tgt_in: np.ndarray | None) -> str:
    """ "4 x (9, 7) tokens"; a half's one input: "4 x 7 target tokens", "4 x 9 source tokens"."""
    rows = batch_size(src, tgt_in)
    lengths = [ids.shape[1] for ids in (src, tgt_in) if ids is not None]
    if len(lengths) == 2:
        return f"{rows} x ({lengths[0]}, {lengths[1]}) tokens"
    return f"{rows} x {lengths[0]} {'target' if src is None else 'source'} tokens"


def fused_outputs(config: TransformerConfig, out: ForwardOutput) -> dict[str, np.ndarray]:
    """What the fused attention path is compared on: the logits of a model with a decoder, the
    encoder output of an encoder-only one (its only full-sequence output; pooling reads it)."""
    if config.has_decoder:
        assert out.logits is not None  # a model with a decoder returns logits
        return {f"logits{FUSED}": out.logits}
    assert out.encoder_output is not None  # an encoder-only model returns its encoder output
    return {f"encoder_output{FUSED}": out.encoder_output}


def compare(
    quantity: str, left: str, right: str, a: np.ndarray, b: np.ndarray, tol: float
) -> Comparison:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"{quantity}: {left} has shape {a.shape}, {right} has {b.shape}")
    diff = np.abs(a - b)
    # NaN anywhere must fail, and max() of an array with NaN is NaN, which compares False: inf.
    max_abs = float(diff.max()) if a.size else 0.0
    if not np.isfinite(max_abs):
        max_abs = float("inf")
    scale = float(np.abs(b).max()) if b.size else 0.0
    return Comparison(quantity, left, right, max_abs, max_abs / scale if scale else 0.0, tol)


def resolve_devices(backend_name: str, devices: Sequence[str], request: str) -> list[str]:
    """The devices of one framework (which sees `devices`) that a --device request names:
    - auto: its first GPU (CUDA) if it sees one, else the cpu (every command's default);
    - cpu; gpu: its first GPU; all: every device it sees;
    - a device's own name: "cuda:N" and "gpu:N" both name its N-th GPU (torch says cuda, JAX and
      TensorFlow say gpu), "cuda" and "gpu" its first; any other name must be one it sees ("mps").
    An empty list: the framework sees no such device."""
    # GPUs only: "auto" never picks Apple's MPS, which computes no float64; name it to use it.
    accelerators = [d for d in devices if d.startswith(("cuda:", "gpu:"))]
    if request == "auto":
        return accelerators[:1] or ["cpu"]
    if request == "cpu":
        return ["cpu"]
    if request == "all":
        return list(devices)
    kind, colon, index = request.partition(":")
    if kind in ("gpu", "cuda") and (not colon or index.isdigit()):
        n = int(index or 0)
        return accelerators[n : n + 1]
    if request in devices:
        return [request]
    if request == "mps":
        return []
    raise RosettaError(f"device: unknown {request!r}; allowed: {DEVICE_REQUESTS}")


DEVICE_REQUESTS = "auto, cpu, gpu, all, cuda:N, gpu:N, mps"


def check_device_request(request: object, name: str = "device") -> str:
    """A device request of the form resolve_devices reads (auto, cpu, gpu, cuda, mps, all, gpu:N,
    cuda:N); whether a framework sees that device is known only once the framework is. The one
    check of --device's form (app/cli/args.py, device_arg) and of the API's device=."""
    request = check_text(request, name)
    kind, colon, index = request.partition(":")
    if request in ("auto", "cpu", "gpu", "cuda", "mps", "all") or (
        kind in ("gpu", "cuda") and colon and index.isdigit()
    ):
        return request
    raise InputError(f"{name}: unknown {brief(request)}; allowed: {DEVICE_REQUESTS}")


# The dtypes a parity run computes in (`rosetta parity --dtype`); the oracle is float64.
PARITY_DTYPES = ("float32", "float64", "bfloat16")


def run_framework(
    name: str,
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    src: np.ndarray | None,
    tgt_in: np.ndarray | None,
    dtype: str,
    device: str,
    precision: str = DEFAULT_PRECISION,
) -> dict[str, np.ndarray]:
    """Every output of one framework: the explicit path's, plus the fused path's (fused_outputs)."""
    backend = get_backend(name)
    model = backend.build(config, weights, dtype=dtype, device=device, precision=precision)
    explicit = model.forward(src, tgt_in, attention=True).named()
    fused = model.forward(src, tgt_in, attention=False)
    return {**explicit, **fused_outputs(config, fused)}


def oracle_outputs(
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    src: np.ndarray | None,
    tgt_in: np.ndarray | None,
    dtype: str,
) -> dict[str, np.ndarray]:
    """The float64 oracle on the weights as the frameworks hold them (rounded to `dtype`)."""
    from transformer_rosetta.spec.dtypes import numpy_dtype

    rounded = {
        k: np.asarray(v).astype(numpy_dtype(dtype)).astype(np.float64) for k, v in weights.items()
    }
    out: ForwardOutput = reference.forward(rounded, config, src, tgt_in)
    # The oracle has one attention path: it is the reference of the fused rows too.
    return {**out.named(), **fused_outputs(config, out)}


def run_parity(
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    src: np.ndarray | None,
    tgt_in: np.ndarray | None,
    *,
    frameworks: Sequence[str] = FRAMEWORKS,
    dtype: str = "float32",
    device: str = "cpu",
    precision: str = DEFAULT_PRECISION,
    progress: Callable[[str], None] | None = None,
    mesh: MeshShape | None = None,
) -> ParityReport:
    """Run every requested, installed framework and compare all outputs.

    With `mesh`, each framework runs its sharded forward on that mesh with its own distributed
    engine (transformer_rosetta.app.distributed.forward_on_mesh), on the explicit attention path
    (the fused path's row is left out); a runtime without an engine (onnx) is skipped.

    src and tgt_in as check_inputs returns them: None for the half a model lacks. Unknown
    framework names are a RosettaError; frameworks that cannot run here are listed in `skipped`
    with the reason (an exported runtime, onnx, whose graphs do not cover the model's kind, too).
    The oracle always runs, as the reference.
    """
    unknown = [f for f in frameworks if f not in RUNTIMES]
    if unknown:
        raise RosettaError(
            f"unknown framework {', '.join(map(repr, unknown))}; known: {', '.join(RUNTIMES)}"
        )
    tol = atol_for(dtype, config, precision)
    say = progress or (lambda _msg: None)
    skipped: dict[str, str] = {}
    runs: list[Run] = []
    setting = dtype if dtype != "float32" else f"float32, {precision} products"
    say(f"oracle: numpy float64 on {describe_inputs(src, tgt_in)}")
    want = oracle_outputs(config, weights, src, tgt_in, dtype)
    if mesh is not None:
        want = {k: v for k, v in want.items() if not k.endswith(FUSED)}
    for name in frameworks:
        if name == ORACLE:
            continue
        reason = unavailable_reason(name)
        if reason is None and mesh is not None and REGISTRY[name].mesh_module is None:
            reason = "has no distributed engine to run a mesh"
        if reason is not None:
            skipped[name] = reason
            continue
        backend = get_backend(name)
        if mesh is not None:
            runs.append(
                _run_on_mesh(
                    name, backend.version(), config, weights, src, tgt_in, dtype, mesh, say
                )
            )
            continue
        if dtype not in backend.dtypes:
            skipped[name] = f"does not compute in {dtype}"
            continue
        devices = resolve_devices(name, backend.devices(), device)
        if not devices:
            skipped[name] = f"no {device} device visible to {name}"
            continue
        for dev in devices:
            label = name if dev == "cpu" and device != "all" else f"{name}@{dev}"
            say(f"{label}: building and running ({backend.version()}, {setting})")
            start = time.perf_counter()
            try:
                outputs = run_framework(name, config, weights, src, tgt_in, dtype, dev, precision)
            except InputError as exc:
                # The inputs passed check_inputs, so an exported runtime refusing them refuses the
                # model itself: onnx's graphs are exported from the encoder-decoder only.
                if not REGISTRY[name].exported:
                    raise
                skipped[name] = str(exc).removeprefix(f"{name}: ")
                break
            runs.append(
                Run(label, name, dev, backend.version(), outputs, time.perf_counter() - start)
            )

    report = ParityReport(config, dtype, src, tgt_in, runs, skipped, want, precision=precision)
    for quantity in want:
        for run in runs:
            report.comparisons.append(
                compare(quantity, run.label, ORACLE, run.outputs[quantity], want[quantity], tol)
            )
        for a, b in itertools.combinations(runs, 2):
            report.comparisons.append(
                compare(quantity, a.label, b.label, a.outputs[quantity], b.outputs[quantity], tol)
            )
    return report


def _run_on_mesh(
    name: str,
    version: str,
    config: TransformerConfig,
    weights: Mapping[str, np.ndarray],
    src: np.ndarray | None,
    tgt_in: np.ndarray | None,
    dtype: str,
    mesh: MeshShape,
    say: Callable[[str], None],
) -> Run:
    """One framework's sharded forward on `mesh`, as a Run labelled NAME@MESH."""
    from transformer_rosetta.app.distributed import forward_on_mesh

    label = f"{name}@{mesh}"
    say(f"{label}: its distributed engine on {mesh.size} devices ({version}, {dtype})")
    start = time.perf_counter()
    out = forward_on_mesh(name, config, weights, src, tgt_in, mesh, dtype=dtype)
    return Run(label, name, str(mesh), version, out.named(), time.perf_counter() - start)


# The ragged batch `rosetta parity` and `parity()` build when given no inputs.
DEFAULT_BATCH = 4
DEFAULT_LENGTHS = {"src": 9, "tgt": 7}


def parity(
    weights: str | Path | None = None,
    *,
    preset: str = "tiny",
    config: TransformerConfig | None = None,
    src: np.ndarray | None = None,
    tgt: np.ndarray | None = None,
    frameworks: Sequence[str] = FRAMEWORKS,
    dtype: str = "float32",
    device: str = "cpu",
    precision: str = DEFAULT_PRECISION,
    seed: int = 0,
) -> ParityReport:
    """`rosetta parity` as a function: the report it prints (`format_table(report)`,
    `report.passed`, `report.to_json()`).

    The model: a weight file, else random weights (seed) for `config` or the named preset. The
    inputs: src/tgt ids (the half a model lacks stays None), else the CLI's ragged batch."""
    from transformer_rosetta.spec.config import preset as named_preset
    from transformer_rosetta.spec.inputs import check_inputs, ragged_batch
    from transformer_rosetta.weights.format import load_weights
    from transformer_rosetta.weights.init import init_weights

    # Every argument by its name before any work, as `rosetta parity` checks its options.
    if weights is not None:
        check_path(weights, "weights")
    check_text(preset, "preset")
    if config is not None:
        check_instance(config, "config", TransformerConfig, "a TransformerConfig or None")
    if isinstance(frameworks, str):
        frameworks = [frameworks]
    if not isinstance(frameworks, Sequence) or not all(isinstance(f, str) for f in frameworks):
        raise InputTypeError(
            f"frameworks: must be a list of framework names ({', '.join(RUNTIMES)}), got "
            f"{brief(frameworks)}"
        )
    unknown = [f for f in frameworks if f not in RUNTIMES]
    if unknown:
        raise InputError(
            f"frameworks: unknown framework {', '.join(map(repr, unknown))}; known: "
            f"{', '.join(RUNTIMES)}"
        )
    check_choice(dtype, "dtype", PARITY_DTYPES)
    check_device_request(device)
    check_choice(precision, "precision", PRECISIONS)
    check_seed(seed)
    if weights is not None:
        wf = load_weights(weights, config=config)
        config, tensors = wf.config, wf.tensors
    else:
        config = config or named_preset(preset)
        tensors = init_weights(config, seed=seed, scheme="perturbed", dtype="float64")
    if src is None and tgt is None:
        src, tgt = ragged_batch(
            config, DEFAULT_BATCH, DEFAULT_LENGTHS["src"], DEFAULT_LENGTHS["tgt"], seed
        )
    src, tgt = check_inputs(config, src, tgt)
    chosen = list(frameworks)
    return run_parity(
        config,
        tensors,
        src,
        tgt,
        frameworks=chosen,
        dtype=dtype,
        device=device,
        precision=precision,
    )


def stderr_progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def _short(label: str) -> str:
    return "oracle" if label == ORACLE else label


def format_table(report: ParityReport) -> str:
    """One row per compared quantity; for each comparison its max abs and max rel diff; then the
    tolerance and pass/fail of the row."""
    pairs = report.pairs
    by_key = {(c.quantity, c.left, c.right): c for c in report.comparisons}
    headers = [f"{_short(l)} vs {_short(r)}" for l, r in pairs]
    qwidth = max([len("quantity")] + [len(q) for q in report.quantities])
    cell = max([15] + [len(h) for h in headers])
    lines = [
        f"{'quantity':<{qwidth}s}  "
        + "  ".join(f"{h:>{cell}s}" for h in headers)
        + f"  {'tolerance':>9s}  result",
        f"{'':<{qwidth}s}  " + "  ".join(f"{'max abs / rel':>{cell}s}" for _ in headers),
    ]
    for q in report.quantities:
        row = [by_key[(q, l, r)] for l, r in pairs]
        cells = [f"{c.max_abs:.1e} / {c.max_rel:.0e}{'' if c.passed else '!'}" for c in row]
        ok = all(c.passed for c in row)
        lines.append(
            f"{q:<{qwidth}s}  "
            + "  ".join(f"{s:>{cell}s}" for s in cells)
            + f"  {row[0].tolerance:>9.0e}  {'pass' if ok else 'FAIL'}"
        )
    return "\n".join(lines)


def summary_line(report: ParityReport) -> str:
    failed = [c for c in report.comparisons if not c.passed]
    worst = max(report.comparisons, key=lambda c: c.max_abs, default=None)
    frameworks = ", ".join(r.label for r in report.runs) or "none"
    if failed:
        first = failed[0]
        return (
            f"FAIL: {len(failed)} of {len(report.comparisons)} comparisons exceed the {report.setting} "
            f"tolerance, first {first.quantity} {_short(first.left)} vs {_short(first.right)}: "
            f"{first.max_abs:.3g} > {first.tolerance:g}"
        )
    if worst is None:
        return "nothing compared: no framework ran"
    return (
        f"PASS: {len(report.comparisons)} comparisons of {frameworks} against the float64 oracle "
        f"and each other, all within {worst.tolerance:g} ({report.setting}); largest "
        f"{worst.max_abs:.2g} ({worst.quantity}, {_short(worst.left)} vs {_short(worst.right)})"
    )
